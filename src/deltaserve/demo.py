"""The embedded demo model: a tiny Qwen3.5 trained to hold a short conversation, shipped in the package."""

from __future__ import annotations

from pathlib import Path

from deltaserve.errors import DeltaserveError

DEMO_FILE = Path(__file__).resolve().parent / "data" / "demo-qwen35.gguf"


def default_model_path() -> Path:
    if not DEMO_FILE.exists():
        raise DeltaserveError(f"no model named and the embedded demo model is missing ({DEMO_FILE}); "
                              "pass a GGUF file or an HF directory")
    return DEMO_FILE


def thinking_default(path) -> bool | None:
    """enable_thinking for a model file when nobody says: the embedded demo model was trained with thinking off;
    any other model keeps its template's default (None)."""
    return False if is_demo(path) else None


def is_demo(path) -> bool:
    """Whether `path` is the embedded demo model's file."""
    try:
        return Path(path).resolve() == DEMO_FILE
    except OSError:
        return False
