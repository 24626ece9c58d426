"""The chat page at `/` (frontends/webui/: plain HTML, CSS and JavaScript, no build step): served from the package's
own files, everything it loads from this origin (a Content-Security-Policy says so to the browser), so it works
offline and the server's Host check and JSON-only POSTs stay as they are. `serve --no-webui` leaves it out."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

PAGE_DIR = Path(__file__).resolve().parents[1] / "webui"
TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "app.css": "text/css; charset=utf-8"}
# scripts, styles and requests to this origin only; images also as data: URLs (the ones a user attaches)
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
          "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def add_webui(app: FastAPI) -> None:
    """GET / (the page) and GET /webui/{app.js, app.css}, read once from the package."""
    files = {name: (PAGE_DIR / name).read_bytes() for name in TYPES}

    def answer(name: str) -> Response:
        return Response(files[name], media_type=TYPES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def page():
        return answer("index.html")

    @app.get("/webui/app.js", include_in_schema=False)
    async def script():
        return answer("app.js")

    @app.get("/webui/app.css", include_in_schema=False)
    async def style():
        return answer("app.css")


def has_vision(host) -> bool:
    """Whether the model reads images (the page offers attaching them), without loading the encoder: a projector
    GGUF given, or an HF directory whose config names a vision tower and whose safetensors hold its weights."""
    if "vision" in host.__dict__:  # loaded already: its own answer
        return host.__dict__["vision"] is not None
    if host.mmproj is not None:
        return True
    config = host.metadata.get("config.json") if host.format == "hf" else None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return False
    from safetensors import safe_open

    from deltaserve.api import PREFIX

    try:
        for path in sorted(Path(host.path).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                if any(name.startswith(PREFIX) for name in f.keys()):
                    return True
    except Exception:  # noqa: BLE001 - an unreadable file is the loader's to report, not the page's
        return False
    return False
