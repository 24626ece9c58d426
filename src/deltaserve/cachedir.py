"""Where deltaserve keeps what it computes once per machine (parity-guard verdicts, the native kernel)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$DELTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/deltaserve (XDG_CACHE_HOME defaults to ~/.cache)."""
    return Path(os.environ.get("DELTASERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "deltaserve"))
