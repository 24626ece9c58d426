"""Shared fixtures: small random Qwen3.5 models (built once, cached under .fixtures/), loaded once per test run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every test gets a private guard-verdict cache, so a verdict from a developer's machine never leaks in
os.environ.setdefault("DELTASERVE_CACHE_DIR", str(ROOT / ".fixtures" / "cache"))
os.environ.setdefault("DELTASERVE_DATA_DIR", str(ROOT / ".fixtures" / "data"))  # saved chats: never the user's own

from tests.fixtures import models as fx  # noqa: E402
from deltaserve import settings  # noqa: E402


def _reloading(method):
    """deltaserve reads its environment once (deltaserve.settings); a test that changes it through monkeypatch
    (setenv, delenv, undo) gets settings read again, as a new process would read them."""
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            settings.reload()
    return wrapped


for _name in ("setenv", "delenv", "undo"):
    setattr(pytest.MonkeyPatch, _name, _reloading(getattr(pytest.MonkeyPatch, _name)))


@pytest.fixture(autouse=True)
def _settings_as_the_environment_says():
    settings.reload()
    yield


@pytest.fixture
def batch_invariant(monkeypatch):
    """DELTASERVE_BATCH_INVARIANT=on for the test: every decode row on the same kernels whatever the rows beside it
    (the native library's threshold set again from the route table before and after)."""
    from deltaserve.kernels import routes

    monkeypatch.setenv("DELTASERVE_BATCH_INVARIANT", "on")
    routes.apply()
    yield
    monkeypatch.undo()
    routes.apply()


@pytest.fixture(scope="session")
def hybrid_hf_dir() -> Path:
    return fx.hf_dir("hybrid")


@pytest.fixture(scope="session")
def hybrid_gguf() -> Path:
    return fx.gguf_path("hybrid", "f32")


@pytest.fixture(scope="session")
def hybrid_model(hybrid_gguf):
    import deltaserve

    from tests.server_proc import TEST_DEVICE

    return deltaserve.load(hybrid_gguf, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def hybrid_oracle():
    return fx.load_hf_model("hybrid")
