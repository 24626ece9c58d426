"""Schema compiles in a process of their own, so that one can be stopped.

xgrammar's compile is a C++ call that cannot be interrupted from Python: a schema of 3,000 properties took 43 s, and
a thread running it goes on after its client has left and after any deadline. The server therefore compiles in a
child process (`CompileProcess`): the compiled grammar comes back serialized (xgrammar's `serialize_json`; its
tokenizer info is sent to the child once per grammar engine) and is read against the server's own tokenizer info.
A compile whose client has gone, or that runs past the time bound, is stopped by killing the child; the next compile
starts a new one (started at once, in the background). The child imports only xgrammar (and the torch it imports:
about 260 MiB resident, most of it the shared libraries' pages), and only once a server compiles a schema.

Messages are JSON, each preceded by its length (4 bytes, big-endian), on the child's stdin and stdout:
  {"op": "info", "key": K, "info": <TokenizerInfo.serialize_json()>}           -> {"ok": true}
  {"op": "schema", "key": K, "schema": <json text>, "strict": bool}            -> {"ok": <CompiledGrammar json>}
  {"op": "object", "key": K}                                                   -> the same, any JSON object
  {"op": "tag", "key": K, "tag": <structural tag json>}                        -> the same
and {"error": message} where xgrammar refuses.

Run as `python -m deltaserve.session.compile_worker` (the child); this module imports nothing of deltaserve's
beyond what the child needs, so the child starts in the time xgrammar takes to import.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Callable

_HEADER = struct.Struct(">I")
START_S = 120.0  # the bound on a child's start and on reading a tokenizer info (248K tokens: 9 MB, under a second)


def _send(stream, message: dict) -> None:
    body = json.dumps(message).encode("utf-8")
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _read_exact(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(n - len(out))
        if not chunk:
            raise EOFError("the stream closed")
        out += chunk
    return bytes(out)


def _receive(stream) -> dict:
    (n,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return json.loads(_read_exact(stream, n))


def main() -> None:  # the child
    import xgrammar as xgr

    compilers: dict[str, object] = {}
    read, write = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            msg = _receive(read)
        except EOFError:
            return
        try:
            if msg["op"] == "info":
                info = xgr.TokenizerInfo.deserialize_json(msg["info"])
                compilers[msg["key"]] = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                _send(write, {"ok": True})
                continue
            compiler = compilers[msg["key"]]
            if msg["op"] == "schema":
                compiled = compiler.compile_json_schema(msg["schema"], any_whitespace=False,
                                                        strict_mode=bool(msg["strict"]))
            elif msg["op"] == "tag":
                compiled = compiler.compile_structural_tag(msg["tag"])
            else:
                raise ValueError(f"unknown op {msg['op']!r}")
            _send(write, {"ok": compiled.serialize_json()})
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own errors
            _send(write, {"error": " ".join(str(e).split()) or type(e).__name__})


class Stopped(Exception):
    """A compile stopped before it ended: `why` is "gone" (its client left) or "time" (past the bound)."""

    def __init__(self, why: str, seconds: float):
        super().__init__(why)
        self.why, self.seconds = why, seconds


class Refused(Exception):
    """xgrammar refused the schema (its message)."""


class CompileProcess:
    """The child that compiles, one compile at a time (callers queue on a lock), stopped by a kill.

    `compile(key, info_json, request, timeout_s, cancelled)` sends `key`'s tokenizer info first where this child has
    not had it, then the request, and returns the compiled grammar's JSON; `cancelled()` is polled while it waits
    (every 20 ms) and the deadline is `timeout_s` from the request's sending (the child's start and its tokenizer
    info, a second or two once per child, are bounded apart, by START_S). Counters:
    `compiled`, `stopped` (client gone), `timed_out`, `started` (children started)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._has: set[str] = set()
        self._lock = threading.Lock()
        self.compiled = self.stopped = self.timed_out = self.started = 0

    # -- the child's life ---------------------------------------------------------------------------
    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.started += 1
        self._has = set()
        return subprocess.Popen([sys.executable, "-m", "deltaserve.session.compile_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._kill()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- one compile --------------------------------------------------------------------------------
    def _await_reply(self, proc: subprocess.Popen, t0: float, timeout_s: float,
                     cancelled: Callable[[], bool] | None) -> dict:
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 0.02)
            if ready:
                return _receive(proc.stdout)
            if cancelled is not None and cancelled():
                self.stopped += 1
                raise Stopped("gone", time.monotonic() - t0)
            if time.monotonic() - t0 > timeout_s:
                self.timed_out += 1
                raise Stopped("time", time.monotonic() - t0)
            if proc.poll() is not None:
                raise EOFError(f"the compile process ended (exit status {proc.returncode})")

    def compile(self, key: str, info_json: Callable[[], str], request: dict, timeout_s: float,
                cancelled: Callable[[], bool] | None = None) -> str:
        with self._lock:
            for attempt in (0, 1):  # a child that died on its own (not killed by us) is started again once
                if self._proc is None:
                    self._proc = self._spawn()
                proc = self._proc
                try:
                    if key not in self._has:
                        _send(proc.stdin, {"op": "info", "key": key, "info": info_json()})
                        reply = self._await_reply(proc, time.monotonic(), max(START_S, timeout_s), cancelled)
                        if "error" in reply:
                            raise Refused(reply["error"])
                        self._has.add(key)
                    _send(proc.stdin, dict(request, key=key))
                    reply = self._await_reply(proc, time.monotonic(), timeout_s, cancelled)
                except Stopped:
                    self._kill()
                    self._proc = self._spawn()  # the next compile's child, importing while nobody waits
                    raise
                except (EOFError, BrokenPipeError, OSError):
                    self._kill()
                    if attempt:
                        raise
                    continue
                if "error" in reply:
                    raise Refused(reply["error"])
                self.compiled += 1
                return reply["ok"]
        raise AssertionError("unreachable")


if __name__ == "__main__":
    main()
