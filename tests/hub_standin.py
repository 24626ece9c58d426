"""A local stand-in for the Hugging Face Hub's HTTP API, as much of it as huggingface_hub asks of a model download:
the repository listing (`/api/models/OWNER/REPO`), `resolve` (HEAD for the metadata, GET for the bytes; the large
files redirected to a CDN path as the Hub does for its LFS files) with ranged GETs, and the Hub's error answers
(401 RepoNotFound, 401 GatedRepo, 404 EntryNotFound, each with its X-Error-Code). It logs every request and can cut
a file's first transfer partway, the way a dropped connection does."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS = (".gguf", ".safetensors")


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    claimed: dict[str, int] = field(default_factory=dict)  # sizes the listing claims in place of the real ones
    sha: str = ""

    def __post_init__(self):
        self.sha = self.sha or hashlib.sha1(json.dumps(sorted(self.files)).encode()).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes sent


class StandInHub:
    def __init__(self, token: str = "hf_test_token"):
        self.repos: dict[str, Repo] = {}
        self.log: list[Request] = []
        self.cut: dict[str, int] = {}  # file path -> bytes its next full GET sends before the connection drops
        self.token = token
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, head=True)

            def do_GET(self):
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # the CDN the large files redirect to: another host name for the same server (the Hub's is another host)
        self.cdn = f"http://localhost:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, name: str, files: dict[str, bytes | Path], **kw) -> Repo:
        repo = Repo({k: (v.read_bytes() if isinstance(v, Path) else v) for k, v in files.items()}, **kw)
        self.repos[name] = repo
        return repo

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def requests(self, filename: str, method: str = "GET") -> list[Request]:
        return [r for r in self.log if r.method == method and r.path.endswith("/" + filename)]

    # -- answers -----------------------------------------------------------------------------------------------
    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        req = Request(h.command, path, h.headers.get("Range"))
        self.log.append(req)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self.info(h, "/".join(parts[2:4]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(h, "/".join(parts[:2]), "/".join(parts[4:]), head, req)
        if parts[0] == "cdn" and len(parts) >= 4:
            repo = self.repos.get("/".join(parts[1:3]))
            data = repo.files.get("/".join(parts[3:])) if repo else None
            if data is None:
                return self.error(h, 404, "EntryNotFound", "no such blob")
            return self.body(h, "/".join(parts[3:]), data, head, req)
        return self.error(h, 404, None, "no such route")

    def error(self, h, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def info(self, h, name: str) -> None:
        repo = self.repos.get(name)
        if repo is None:  # the Hub answers a missing (or private) repository with a 401
            return self.error(h, 401, "RepoNotFound", "Repository not found")
        siblings = [{"rfilename": f, "size": repo.claimed.get(f, len(d)),
                     **({"lfs": {"sha256": hashlib.sha256(d).hexdigest(), "size": repo.claimed.get(f, len(d)),
                                 "pointerSize": 134}} if f.endswith(LFS) else {})}
                    for f, d in sorted(repo.files.items())]
        body = json.dumps({"id": name, "modelId": name, "sha": repo.sha, "private": False,
                           "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings,
                           "tags": ["gguf"] if any(f.endswith(".gguf") for f in repo.files) else []}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def resolve(self, h, name: str, filename: str, head: bool, req: Request) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self.error(h, 401, "RepoNotFound", "Repository not found")
        if repo.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self.error(h, 401, "GatedRepo", f"Access to model {name} is restricted. You must have access to "
                                                   "it and be authenticated to access it. Please log in.")
        data = repo.files.get(filename)
        if data is None:
            return self.error(h, 404, "EntryNotFound", f"{filename} does not exist on main", repo.sha)
        if filename.endswith(LFS):  # the Hub's LFS files: a redirect to the CDN, the blob's hash and size linked
            h.send_response(302)
            h.send_header("Location", f"{self.cdn}/cdn/{name}/{filename}")
            h.send_header("X-Repo-Commit", repo.sha)
            h.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            h.wfile.write(data)
            req.sent = len(data)

    def body(self, h, filename: str, data: bytes, head: bool, req: Request) -> None:
        start, end = 0, len(data) - 1
        ranged = h.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            lo, _, hi = ranged[6:].partition("-")
            start = int(lo or 0)
            end = min(int(hi), len(data) - 1) if hi else len(data) - 1
        chunk = data[start:end + 1]
        h.send_response(206 if ranged else 200)
        h.send_header("Content-Length", str(len(chunk)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        if ranged:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.end_headers()
        if head:
            return
        cut = self.cut.pop(filename, None) if not ranged else None
        if cut is not None:  # the connection drops partway: headers said the whole length, part of it came
            h.wfile.write(chunk[:cut])
            h.wfile.flush()
            req.sent = cut
            h.connection.shutdown(socket.SHUT_RDWR)
            h.close_connection = True
            return
        h.wfile.write(chunk)
        req.sent = len(chunk)
