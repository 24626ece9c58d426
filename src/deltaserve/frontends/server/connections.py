"""What `deltaserve serve` does about connections, below HTTP: slow and idle clients, a flood of connections, the
open-file limit, and the log lines a flood would write.

uvicorn times out only a keep-alive connection between two requests: a connection that never sends a whole
request head (half its headers, then nothing) is held forever, and so is one that trickles a byte every few
seconds. `GuardedH11Protocol` is uvicorn's h11 protocol with a deadline on that: a request head has
`request_timeout` seconds from its first byte (a new connection: from its opening) to arrive whole, and a body
the server no longer reads (answered early, an error before the body came) as long again; past it the
connection is closed, with a 408 when a head had begun. A body the application reads is timed by the
application (app.py's `read_json`, a 408 with an OpenAI error object).

Every connection holds a file descriptor. Past `max_connections` (by default what the open-file limit leaves
room for, less a reserve for the process's own files), each new connection closes the oldest one whose client
has not sent a whole request (idle, half a head, a stalled body), at accept (`ConnectionGuard.accept`): a flood
of idle connections churns itself, and a client that sends its request at once is answered during it. Which one:
first the oldest that was never answered (a flood's), then the oldest kept alive after an answer (a client's pool
may send its next request on it at any moment: a reset there is a failed request, 1 in ~3,000 of a keep-alive
client's under a flood at a cap of 8, before), and never one whose bytes wait in its socket unread (a request the
loop has not read yet is not idle). Where the
process runs out of descriptors all the same (a cap set past the limit, other files), the guard keeps under what
it held from then on; and asyncio, which logs `socket.accept() out of system resource` with a traceback for each
of up to 2,048 queued connections at every try (CPython 3.11 goes on looping after the error), writes one line
per try at most (the guard stops the loop) and `FloodLogFilter` one per window, with the count of the others.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import termios
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_REQUEST_TIMEOUT = 30.0
MAX_CONNECTIONS_CEILING = 4096  # the default's ceiling, whatever the open-file limit: a few KiB of memory each


def open_files() -> int | None:
    """How many file descriptors the process holds now (None where the platform does not say)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # less the one listdir itself opened
        except OSError:
            continue
    return None


def raise_open_file_limit() -> tuple[int | None, int | None]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; (the soft limit before, the soft limit now). (None, None)
    where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    target = hard
    if hard == inf:  # Linux caps RLIMIT_NOFILE at fs.nr_open, macOS at OPEN_MAX
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != inf and soft < target:
        for want in (target, min(target, 10240)):  # macOS refuses more than OPEN_MAX for an unlimited hard limit
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                break
            except (ValueError, OSError):
                continue
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft, (None if now == inf else now)


def connection_room(limit: int | None, held: int | None) -> int | None:
    """The connections the open-file limit leaves room for: the limit less the descriptors the process holds
    now and a reserve for the files it opens while serving (the state store's, a log) -- None: no limit."""
    if limit is None:
        return None
    reserve = max(32, limit // 16)
    return max(1, limit - (held or 0) - reserve)


class ConnectionGuard:
    """The deadline and the connection cap, shared by one server's connections; counts what it did.

    The cap is kept at accept: asyncio accepts up to the listen backlog (2,048) connections in one go before
    any of them reaches a protocol, so a check in the protocol comes too late to keep the process under its
    open-file limit. `listening_socket` wraps the listening socket so that each accept first makes room (closes
    the oldest connection whose client has not sent a whole request) and, where there is none to close, or the
    process is out of descriptors all the same, pauses accepting for a second through asyncio's own retry, with
    one log record per pause rather than one per queued connection."""

    OVERSHOOT = 8  # connections accepted past the cap on one turn of the loop, while those closed to make room go

    def __init__(self, request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_connections: int | None = None,
                 say=None, log_window: float = 10.0):
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.unfinished: dict = {}  # connections whose client has not sent a whole request, oldest first
        self.connections: set = set()  # uvicorn's set of open HTTP connections, once the first one is made
        self.pending = 0  # accepted, not yet made into a connection
        self.pending_at = float("-inf")
        self.paused_until = float("-inf")
        self.evicted = 0
        self.timed_out = 0
        self.say = say or (lambda line: print(f"[deltaserve] {line}", file=sys.stderr, flush=True))
        self.log_window = log_window
        self._evict_said = (float("-inf"), 0)  # (when the last line about evictions was written, the count then)

    def protocol(self) -> type:
        """The protocol class for uvicorn.Config(http=...), bound to this guard."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})

    def listening_socket(self, sock: socket.socket) -> socket.socket:
        """`sock` (listening, not yet served) as a socket whose accept keeps the cap; the old object is detached."""
        cls = type("GuardedSocket", (GuardedSocket,), {"__slots__": (), "guard": self})
        return cls(sock.family, sock.type, sock.proto, fileno=sock.detach())

    @property
    def open(self) -> int:
        return len(self.connections) + self.pending

    def snapshot(self) -> dict:
        """For /health: the connections open, the cap, and what the guard closed."""
        return {"open": len(self.connections), "max": self.max_connections,
                "request_timeout_s": self.request_timeout, "closed_to_make_room": self.evicted,
                "timed_out": self.timed_out}

    def victim(self, kept_alive: bool = True):
        """The connection to close to make room (see the module's notes), or None: the oldest never answered, else
        (`kept_alive`) the oldest kept alive after an answer, never one with bytes unread in its socket."""
        answered = None
        for conn in self.unfinished:
            if conn.unread():
                continue
            if not conn.answered:
                return conn
            if answered is None:
                answered = conn
        return answered if kept_alive else None

    def make_room(self, kept_alive: bool = True) -> bool:
        """Close a connection whose client has not sent a whole request (`victim`); False when there is none."""
        victim = self.victim(kept_alive)
        if victim is None:
            return False
        victim.close(abort=True)
        self.evicted += 1
        now = time.monotonic()
        if now - self._evict_said[0] >= self.log_window:
            self.say(f"{self.max_connections} connections open, the most this server keeps (--max-connections): "
                     f"closing the oldest that have not sent a whole request, to make room ({self.evicted} so "
                     f"far) [at most one such line per {self.log_window:g} s]")
            self._evict_said = (now, self.evicted)
        return True

    def accept(self, real_accept):
        """One accept for asyncio's accept loop (see the class)."""
        now = time.monotonic()
        if now < self.paused_until:
            raise BlockingIOError()  # asyncio's loop: nothing more to accept on this turn
        cap = self.max_connections
        if cap is not None and self.open >= cap:
            # those just accepted become connections (never answered: the first candidates) in a turn; until then
            # a connection kept alive after its answer is not closed for them
            recent = self.pending and now - self.pending_at < 1.0
            if not self.make_room(kept_alive=not recent):
                if recent:
                    raise BlockingIOError()
                self.paused_until = now + 0.5
                raise OSError(errno.EMFILE, f"{self.open} connections open, the most this server keeps "
                                            f"(--max-connections {cap}), and each has a whole request in")
            if self.open >= cap + self.OVERSHOOT:
                raise BlockingIOError()  # the connections just closed free their descriptors on the next turn
        try:
            conn, address = real_accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self.out_of_descriptors(now)
            raise  # asyncio logs it (once: see FloodLogFilter) and tries again in a second
        self.pending += 1
        self.pending_at = now
        return conn, address

    def out_of_descriptors(self, now: float) -> None:
        """The process ran out of descriptors before the cap: keep the cap under what it could hold, from now on,
        and close the oldest unfinished connections down to it, so that asyncio's retry finds room."""
        self.paused_until = now + 0.5  # the rest of this turn's accepts wait for asyncio's retry too
        held = self.open
        if self.max_connections is None or held <= self.max_connections:
            lower = max(1, held * 8 // 10)
            self.say(f"out of file descriptors with {held} connections open (the open-file limit counts every "
                     f"file): keeping at most {lower} connections from now on")
            self.max_connections = lower
        for _ in range(held - self.max_connections):
            if not self.make_room():
                break


class GuardedSocket(socket.socket):
    """A listening socket whose accept goes through a ConnectionGuard (`guard`, set on a subclass)."""

    __slots__ = ()
    guard: ConnectionGuard

    def accept(self):
        return self.guard.accept(super().accept)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on an unfinished request and a place in the guard's cap."""

    guard: ConnectionGuard

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = None  # asyncio.TimerHandle while a deadline runs
        self.answered = False  # a response was sent on it (kept alive since: a client's pool holds it)

    def unread(self) -> bool:
        """Bytes wait in the socket that the loop has not read yet (the kernel's count, FIONREAD)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            n = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return False
        return int.from_bytes(n, sys.byteorder, signed=True) > 0

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.connections = self.connections
        self.guard.pending = max(0, self.guard.pending - 1)
        self.guard.unfinished[self] = None
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.guard.unfinished.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.answered = True
        if self.transport.is_closing():
            return
        if self._unfinished():  # idle for the next request (uvicorn's keep-alive timer watches it), or a body left
            self.guard.unfinished.pop(self, None)
            self.guard.unfinished[self] = None  # the newest now
        self._watch(idle_is_keep_alive=True)

    # -- the deadline -------------------------------------------------------------------------------
    def _unfinished(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _watch(self, idle_is_keep_alive: bool = False) -> None:
        their, ours = self.conn.their_state, self.conn.our_state
        if their not in (h11.IDLE, h11.SEND_BODY):
            self.guard.unfinished.pop(self, None)  # a whole request is in
        head = their is h11.IDLE and not idle_is_keep_alive
        unread_body = their is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE)
        if head or unread_body:
            if self.deadline is None and not self.transport.is_closing():
                self._arm()  # from the first byte of a head (a new connection: from its opening), not per byte
        elif their is not h11.IDLE:
            self._disarm()  # a head is in: a body the application reads is the application's to time

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.guard.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        self.guard.timed_out += 1
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
            t = self.guard.request_timeout
            body = json.dumps({"error": {
                "message": f"the request's head did not arrive whole within {t:g} s (--request-timeout); "
                           "the connection is closed", "type": "invalid_request_error", "param": None,
                "code": "request_timeout"}}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.close()

    def close(self, abort: bool = False) -> None:
        """Close the connection (connection_lost follows, on the next turn of the loop: an application reading
        the body sees a disconnect); `abort`: at once, whatever is left unsent."""
        self._disarm()
        self.guard.unfinished.pop(self, None)
        if abort:
            self.transport.abort()
        elif not self.transport.is_closing():
            self.transport.close()


class FloodLogFilter(logging.Filter):
    """At most one record per `window` seconds for each message a flood of connections repeats (asyncio's
    `socket.accept() out of system resource`, uvicorn's `Invalid HTTP request received.`), as one line with
    no traceback and the count of those left out; every other record passes untouched."""

    NOISY = {
        "socket.accept() out of system resource":
            "new connections wait in the listen queue until some close",
        "Invalid HTTP request received.": None,
        "Exceeded concurrency limit.": None,
    }

    def __init__(self, window: float = 10.0, limit: int | None = None):
        super().__init__()
        self.window = window
        self.limit = limit
        self.last: dict[str, float] = {}
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 -- a record that does not format is not ours to judge
            return True
        key = next((k for k in self.NOISY if message.startswith(k)), None)
        if key is None:
            return True
        now = time.monotonic()
        if now - self.last.get(key, float("-inf")) < self.window:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self.last[key] = now
        n = self.dropped.pop(key, 0)
        exc = record.exc_info[1] if record.exc_info else None
        text = key.rstrip(".") + (f": {exc}" if exc is not None else "")
        if key.startswith("socket.accept()") and self.limit is not None:
            text += f" (the open-file limit is {self.limit})"
        if self.NOISY[key]:
            text += f"; {self.NOISY[key]}"
        text += f" [{n} more like it in the last {self.window:g} s]" if n else \
            f" [at most one such line per {self.window:g} s]"
        record.msg, record.args, record.exc_info, record.exc_text, record.stack_info = text, None, None, None, None
        return True


def install_log_filter(window: float = 10.0, limit: int | None = None) -> FloodLogFilter:
    """Put one FloodLogFilter on the loggers a flood writes to (asyncio's, uvicorn's)."""
    f = FloodLogFilter(window, limit)
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        for old in [x for x in logger.filters if isinstance(x, FloodLogFilter)]:
            logger.removeFilter(old)
        logger.addFilter(f)
    return f
