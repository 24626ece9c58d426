"""Who a request is: the API key it carries, as a tenant, and the partition of the caches it may reuse.

A prefix cache shared by clients is an oracle: a client who sends guesses of another's prompt learns from
`cached_tokens` (and from the time to the first token) which guess was cached. So the caches are partitioned:

- **Tenants.** `serve --api-key` may be given several times, and `--api-keys-file FILE` lists more (one key a line, or
  `NAME KEY`; blank lines and `#` comments skipped). Each key is a tenant (its NAME, else a digest of the key: the key
  itself is never written anywhere). With one key or none the server is single-tenant: its tenant is None.
- **cache_salt** (vLLM's name), a request field: a further partition within a tenant (a client that shares its key
  with others keeps its own conversations apart by a salt of its own).
- **Partition** = a digest of (tenant, salt); None for a single-tenant request without a salt, which keeps the
  state files of a single-tenant server as they were. Slots (frontends/server/slots.py), the sessions and the state
  store (session/store.py) reuse a state only within its partition; stored responses belong to their tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

from deltaserve.errors import DeltaserveError


@dataclass(frozen=True)
class Key:
    tenant: str | None
    secret: bytes


def tenant_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def read_keys_file(path: str, say=None) -> list[tuple[str | None, str]]:
    """(name or None, key) for each key a keys file lists."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DeltaserveError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise DeltaserveError(f"--api-keys-file {path}: not UTF-8 text") from None
    if stat.S_IMODE(st.st_mode) & 0o077 and say is not None:
        say(f"warning: --api-keys-file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "anyone who can read it can use every key in it (chmod 600)")
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) > 2:
            raise DeltaserveError(f"--api-keys-file {path}, line {n}: expected KEY or NAME KEY, got {len(fields)} "
                                  "fields")
        out.append((fields[0], fields[1]) if len(fields) == 2 else (None, fields[0]))
    if not out:
        raise DeltaserveError(f"--api-keys-file {path}: lists no key")
    return out


class Keys:
    """The keys a server accepts and their tenants. `required`: a key is needed at all; `tenants`: how many."""

    def __init__(self, keys: list[tuple[str | None, str]]):
        seen: dict[str, str | None] = {}
        for name, key in keys:
            if not key:
                continue
            if key in seen:
                raise DeltaserveError("the same API key is given twice")
            seen[key] = name
        multi = len(seen) > 1
        names = [name or tenant_name(key) for key, name in seen.items()]
        if len(set(names)) != len(names):
            raise DeltaserveError("two API keys have the same tenant name in --api-keys-file")
        self.keys = [Key(tenant if multi else None, key.encode("utf-8")) for key, tenant in zip(seen, names)]
        self.required = bool(self.keys)
        self.tenants = max(len(self.keys), 1)

    @classmethod
    def of(cls, api_key, keys_file: str | None = None, say=None) -> "Keys":
        """From `--api-key` (a string, a list of them, or None) and `--api-keys-file`."""
        given = [api_key] if isinstance(api_key, str) else list(api_key or [])
        keys = [(None, k) for k in given if k]
        if keys_file:
            keys += read_keys_file(keys_file, say)
        return cls(keys)

    def match(self, token: bytes) -> Key | None:
        """The key `token` is (compared in constant time with every key, whichever matches), or None."""
        found = None
        for k in self.keys:
            if hmac.compare_digest(token, k.secret):
                found = k
        return found


def partition(tenant: str | None, cache_salt: str | None) -> str | None:
    """The cache partition of a tenant's request with a salt (None: the single-tenant default, unsalted)."""
    if tenant is None and cache_salt is None:
        return None
    text = f"{tenant or ''}\x00{cache_salt or ''}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
