"""Image links fetched for `serve --allow-image-urls`, without making the server a client of its own network.

A server that fetches what a request names reaches what its host reaches: its loopback services, the cloud's
metadata address (169.254.169.254), the machines of its private network. So a fetch:

- resolves the link's host and refuses it where any of its addresses is not a public one (loopback, private,
  link-local, unspecified, multicast, reserved; IPv4 inside IPv6 too) unless `allow_private`
  (`--allow-private-image-urls`); it then connects to the address it checked, not to a name resolved again (a
  DNS answer that changes between the check and the connection cannot move it);
- follows at most `MAX_REDIRECTS` redirects, each one checked (scheme, address) before it is followed;
- has one deadline for the whole transfer (resolution, connection, every read: a host that sends a byte every two
  seconds is cut off at the deadline, not served for as long as it keeps sending) and a cap on the bytes;
- fails with one message whatever went wrong (`FETCH_FAILED`): a refused connection, a 404, a timeout and a private
  address read the same, so the server's answers map nobody's network.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 3
DEADLINE_S = 10.0
FETCH_FAILED = ("the image link could not be fetched (a link must be http(s), to a public address, and answer with "
                "the image within the time and size this server allows)")


class FetchFailed(Exception):
    """Any failure of a fetch; `detail` says which (for the operator's log and the tests, never the client)."""

    def __init__(self, detail: str):
        super().__init__(FETCH_FAILED)
        self.detail = detail


def public(address: str) -> bool:
    """Whether an IP address is one a fetch may reach without --allow-private-image-urls."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast and not ip.is_reserved and not ip.is_unspecified


def _resolve(host: str, port: int, left: float) -> list[tuple]:
    """getaddrinfo within `left` seconds (it blocks in the resolver; a thread bounds it)."""
    out: list = []
    err: list = []

    def look() -> None:
        try:
            out.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            err.append(e)

    t = threading.Thread(target=look, name="deltaserve-resolve", daemon=True)
    t.start()
    t.join(max(left, 0.0))
    if t.is_alive():
        raise FetchFailed(f"resolving {host} took longer than the deadline")
    if err or not out:
        raise FetchFailed(f"{host} does not resolve")
    return out


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to the address that was checked (the Host header still names the link's host)."""

    def __init__(self, host: str, port: int, address: tuple, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection(self._address[:2], self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: tuple, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection(self._address[:2], self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch_image(url: str, limit: int, deadline_s: float = DEADLINE_S, allow_private: bool = False) -> bytes:
    """The bytes an http(s) image link answers with, or FetchFailed (see the module's notes)."""
    deadline = time.monotonic() + deadline_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchFailed("the deadline passed")
        return remaining

    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchFailed(f"not an http(s) link: {url[:100]!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise FetchFailed("the link's port is not a number") from None
        infos = _resolve(parts.hostname, port, left())
        if not allow_private and not all(public(info[4][0]) for info in infos):
            raise FetchFailed(f"{parts.hostname} resolves to an address that is not public")
        kind = _PinnedTLS if parts.scheme == "https" else _Pinned
        conn = kind(parts.hostname, port, infos[0][4], left())
        sock = r = None
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"User-Agent": "deltaserve", "Accept": "image/*",
                                               "Connection": "close"})
            sock = conn.sock  # (the response keeps it; the connection lets go of it, Connection: close)
            sock.settimeout(left())
            r = conn.getresponse()
            if r.status in (301, 302, 303, 307, 308):
                target = r.getheader("Location")
                if not target:
                    raise FetchFailed(f"a redirect ({r.status}) without a Location")
                url = urljoin(url, target)  # checked at the top of the loop before it is followed
                continue
            if r.status != 200:
                raise FetchFailed(f"the link answered {r.status}")
            size = r.getheader("Content-Length")
            if size is not None and size.strip().isdigit() and int(size) > limit:
                raise FetchFailed(f"the link's body is {size} bytes, over {limit}")
            data = bytearray()
            while len(data) <= limit:
                sock.settimeout(left())  # no read outlasts the deadline
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not chunk:
                    break
                data += chunk
                left()
            if len(data) > limit:
                raise FetchFailed(f"the link's body is over {limit} bytes")
            return bytes(data)
        except FetchFailed:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise FetchFailed(f"{type(e).__name__}: {str(e)[:200]}") from None
        finally:  # the response holds the socket once the connection lets go of it: both closed here
            if r is not None:
                r.close()
            if sock is not None:
                sock.close()
            conn.close()
    raise FetchFailed(f"more than {MAX_REDIRECTS} redirects")
