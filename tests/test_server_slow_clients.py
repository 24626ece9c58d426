"""Slow and idle clients, and floods of connections (issue 16, item 5): an incomplete request times out (a 408, and
the connection closed), a flood of connections past the open-file limit neither locks new clients out nor writes a
traceback per accept, and the server says its open-file limit (raised to the hard limit) at startup."""

from __future__ import annotations

import io
import json
import logging
import resource
import select
import socket
import time

import httpx
import pytest

from deltaserve.frontends.server.connections import FloodLogFilter
from tests.server_proc import ServerProcess

TIMEOUT = 2  # --request-timeout for the slow-client server: short, so that these tests are fast
PROMPT = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(hybrid_gguf):
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--request-timeout", str(TIMEOUT))
    yield s
    s.stop()


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    return s


def until_closed(s: socket.socket, within: float = 60) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    t0 = time.monotonic()
    got = b""
    s.settimeout(within)
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - t0


def error_of(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    return json.loads(body)["error"]


def still_answers(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json=PROMPT, timeout=60)
    assert r.status_code == 200, r.text


def test_a_body_that_stalls_gets_a_408_and_the_connection_closed_within_the_request_timeout(server):
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 200\r\n\r\n{\"prompt\": \"hel")
    got, _ = until_closed(s)
    assert got.startswith(b"HTTP/1.1 408 "), got
    err = error_of(got)
    assert err["code"] == "request_timeout" and "body" in err["message"] and f"{TIMEOUT} s" in err["message"]
    still_answers(server)  # (closed by the server: until_closed fails on its own deadline if the server never closes)
    conns = httpx.get(server.url + "/health", timeout=30).json()["connections"]
    assert conns["timed_out"] >= 1 and conns["request_timeout_s"] == TIMEOUT


def test_half_a_head_that_stalls_gets_a_408_and_is_closed(server):
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    got, _ = until_closed(s)
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert error_of(got)["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(server):
    got, _ = until_closed(connect(server))
    assert got == b""  # closed by the server, with nothing sent


def test_a_head_trickled_a_byte_at_a_time_is_closed_at_its_deadline_not_held(server):
    """A deadline from the head's first byte: a client that sends a byte every quarter second (each byte would
    reset a per-read timeout) is closed all the same."""
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < TIMEOUT + 30:
        readable, _, _ = select.select([s], [], [], 0.25)
        if readable:
            got, _ = until_closed(s)
            closed = True
            break
        try:
            s.sendall(b"a")
        except OSError:
            closed = True
            break
    assert closed, "the trickling connection was still open"


def test_after_a_request_half_a_head_on_the_same_connection_is_closed_too(server):
    """uvicorn times out an idle keep-alive connection, but a byte of a next request stops that timer; the
    deadline takes over."""
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
        first += s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    s.sendall(b"GET /health HTTP/1.1\r\nHo")
    got, _ = until_closed(s)
    assert got.startswith(b"HTTP/1.1 408 "), got


def test_a_client_that_leaves_mid_body_writes_no_traceback(server):
    before = server.stderr
    for _ in range(3):
        s = connect(server)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.2)
        s.close()
    time.sleep(0.5)
    still_answers(server)
    new = server.stderr[len(before):]
    assert "Traceback" not in new and "Exception" not in new, new


# -- floods -----------------------------------------------------------------------------------------------
def low_file_limit():  # in the server's process, before it starts: soft 128, hard 256 (serve raises it to 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 256))


def flood(server, n: int) -> list[socket.socket]:
    """n connections that never finish a request: idle, half a head, a head and half a body, in turn."""
    held = []
    for i in range(n):
        s = socket.socket()
        s.settimeout(30)
        s.connect(("127.0.0.1", server.port))  # the kernel's listen queue takes it, accepted or not
        kind = i % 3
        if kind == 1:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-")
        elif kind == 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"prompt\": ")
        held.append(s)
    return held


def lines_after_startup(server) -> list[str]:
    lines = server.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "listening on http://" in line)
    return lines[start + 1:]


@pytest.mark.parametrize("extra", [[], ["--max-connections", "1000"]], ids=["default cap", "cap past the file limit"])
def test_a_flood_of_idle_connections_past_the_file_limit_writes_a_few_lines_and_locks_nobody_out(hybrid_gguf,
                                                                                                  extra):
    """300 connections that never finish a request, against a server whose open-file limit is 256. With the
    default cap (what the limit leaves room for) the oldest unfinished connections are closed to make room; with
    a cap past the limit the process runs out of descriptors once, says so, and keeps under it from then on. A
    normal request is answered while the flood is held (the flood's own deadline, 30 s, is far off), and again
    once it ends; the log holds a few lines, no traceback."""
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", *extra, preexec_fn=low_file_limit)
    held = []
    try:
        assert "open files: limit 256 (raised from 128)" in s.stderr
        held = flood(s, 300)
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json=PROMPT, timeout=60)
        during = time.monotonic() - t0
        assert r.status_code == 200, r.text
        more = flood(s, 100)  # a second wave: the first one's oldest make room for it
        held += more
        conns = httpx.get(s.url + "/health", timeout=60).json()["connections"]
        assert conns["closed_to_make_room"] >= 100 and conns["open"] <= conns["max"] + 8, conns
        # answered while the flood was held: none of its connections had reached its 30 s deadline yet
        assert conns["timed_out"] == 0, conns
        for c in held:
            c.close()
        held = []
        t0 = time.monotonic()
        still_answers(s)
        after = time.monotonic() - t0
        time.sleep(1.5)  # whatever the flood would log has been written
        lines = lines_after_startup(s)
        assert "Traceback" not in s.stderr
        assert len(lines) <= 4, "\n".join(lines[:20])
        if extra:
            assert any("out of file descriptors" in line for line in lines), lines
        assert any("closing the oldest that have not sent a whole request" in line for line in lines), lines
        print(f"flood: a request during it took {during:.2f} s, after it {after:.2f} s; log: {lines}")
    finally:
        for c in held:
            c.close()
        s.stop()


def _get(sock: socket.socket, path: str) -> bytes:
    """One keep-alive GET on `sock`, its whole response (read by its content-length)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    sock.settimeout(60)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_connection_kept_alive_after_an_answer_is_closed_to_make_room_only_after_the_never_answered_ones(
        hybrid_gguf):
    """Issue 32, item 6: during a flood past the cap, 1 in ~150 well-behaved requests got a closed connection. One
    way (reproduced: 1 request in ~3,000 of a keep-alive client, a reset, under a flood at a cap of 8): the guard
    closed the oldest connection without a whole request in, and a client's pooled connection, idle after its
    answer, was often the oldest, just as the client sent its next request on it. The guard now closes the flood's
    never-answered connections first. Here: a client's connection answered once, three idle connections opened after
    it fill the cap of 4, a fifth arrives: the oldest idle one is closed, not the client's, whose next request on
    the same connection is answered."""
    s = ServerProcess(hybrid_gguf, "--slots", "1", "--think", "off", "--max-connections", "4")
    idle = []
    try:
        client = connect(s)
        assert b" 200 " in _get(client, "/v1/models").split(b"\r\n")[0]
        idle = [connect(s) for _ in range(3)]
        idle.append(connect(s))  # past the cap: one is closed to make room
        got, _ = until_closed(idle[0], within=60)  # the oldest never-answered connection
        assert got == b""
        health = _get(client, "/health")  # the client's connection: still open, and answered
        assert b" 200 " in health.split(b"\r\n")[0]
        conns = json.loads(health.partition(b"\r\n\r\n")[2])["connections"]
        assert conns["closed_to_make_room"] >= 1, conns
    finally:
        for c in idle:
            c.close()
        s.stop()


def test_the_flood_log_filter_lets_one_line_through_per_window_without_its_traceback():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("deltaserve.test.flood")
    logger.propagate = False
    logger.addHandler(handler)
    flt = FloodLogFilter(window=3600, limit=256)
    logger.addFilter(flt)
    try:
        err = OSError(24, "Too many open files")
        for _ in range(5000):  # what asyncio's accept loop writes under a flood, a traceback each
            logger.error("socket.accept() out of system resource\nsocket: <socket fd=5>",
                         exc_info=(OSError, err, None))
        for _ in range(100):
            logger.warning("Invalid HTTP request received.")
        try:
            raise ValueError("a real bug")
        except ValueError:
            logger.exception("Exception in ASGI application")
        text = stream.getvalue()
        lines = text.splitlines()
        accept = [line for line in lines if "socket.accept()" in line]
        assert len(accept) == 1 and "Too many open files" in accept[0] and "256" in accept[0]
        assert len([line for line in lines if "Invalid HTTP request" in line]) == 1
        assert "ValueError: a real bug" in text  # anything else passes whole, traceback and all
        assert text.count("Traceback") == 1
        assert flt.dropped["socket.accept() out of system resource"] == 4999
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(flt)
