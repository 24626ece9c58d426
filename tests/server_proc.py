"""A real `deltaserve serve` process on loopback, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the device of the test servers and of the shared fixture model: the CPU, unless a GPU run asks for another
# (scripts/gpu_check.sh sets DELTASERVE_TEST_DEVICE=cuda); a test's own --device comes later on the command line and wins
TEST_DEVICE = os.environ.get("DELTASERVE_TEST_DEVICE", "cpu")


class ServerProcess:
    def __init__(self, model: Path, *args: str, env: dict | None = None, preexec_fn=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"deltaserve-{self.port}.log"
        cmd = [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(model), "--port", str(self.port),
               "--device", TEST_DEVICE, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     env=dict(os.environ, **(env or {})), preexec_fn=preexec_fn)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not come up in 120 s")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def stderr(self) -> str:
        return self.log.read_text()

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
