"""Building deltaserve's C sources into a shared library, once per machine, in its cache directory.

The native kernels (kernels/library.py) and the compact tokenizer (text/bpe.py) are compiled by the system C
compiler (`cc`, or `$CC`) into `cache_root()/native`, under a name keyed by everything that decides the build
(the sources, the compiler, the flags, and whatever the caller adds, e.g. this CPU's flags): a cached library is
used as it is, a changed source builds a new one. The sources compile in parallel, one compiler a core; builds go
through a temporary directory and a rename, so processes that build at once never load a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deltaserve import settings
from deltaserve.cachedir import cache_root


def compiler() -> str | None:
    """The C compiler's path ($CC, else cc), None if there is none."""
    return shutil.which(settings.current().compiler)


def source_key(sources: list[Path], headers: list[Path] = (), extra: str = "") -> str:
    """A short hash of what the sources and headers say, and `extra` (the flags): a build of them is found by it
    without a compiler."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *headers]) + extra.encode()).hexdigest()[:12]


def build_library(stem: str, sources: list[Path], flags: list[str], *, cc: str, headers: list[Path] = (),
                  source_flags: dict[str, list[str]] | None = None, link: list[str] = (), key_extra: str = "",
                  what: str = "the native library", out_dir: Path | None = None, note: str = "") -> Path:
    """The shared library `stem-<key>.so` built from `sources` into `out_dir` (default: the cache's native/),
    compiled now unless there already (`note`: said after what is compiled). Raises RuntimeError (the compiler's
    first line of error) or OSError."""
    source_flags = source_flags or {}
    src = b"".join(s.read_bytes() for s in [*sources, *headers])
    key = hashlib.sha256(src + cc.encode() + " ".join([*flags, *link, key_extra]).encode()
                         + repr(sorted(source_flags.items())).encode()).hexdigest()[:16]
    out = (out_dir or cache_root() / "native") / f"{stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[deltaserve] compiling {what} (once per machine){note} into {out.parent} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        includes = sorted({f"-I{h.parent}" for h in headers})
        objects = [str(Path(tmp) / (s.stem + ".o")) for s in sources]
        jobs = [([cc, *flags, *source_flags.get(s.name, []), *includes, "-c", str(s), "-o", obj], s.name)
                for s, obj in zip(sources, objects)]
        with ThreadPoolExecutor(max(1, min(len(jobs), len(os.sched_getaffinity(0))))) as pool:
            for f in [pool.submit(run_cc, *job) for job in jobs]:
                f.result()
        part = Path(tmp) / out.name
        run_cc([cc, "-shared", *objects, "-o", str(part), *link], "the link")
        part.replace(out)
    return out


def run_cc(cmd: list[str], what: str) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.SubprocessError as e:
        raise RuntimeError(f"{Path(cmd[0]).name} failed on {what}: {e}") from None
    if r.returncode != 0:
        first = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[0]
        raise RuntimeError(f"{Path(cmd[0]).name} failed on {what}: {first}")
