"""Where deltaserve keeps what it computes once per machine (parity-guard verdicts, the native kernel)."""

from __future__ import annotations

import os
from pathlib import Path

from deltaserve import settings


def cache_root() -> Path:
    """$DELTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/deltaserve (XDG_CACHE_HOME defaults to ~/.cache)."""
    s = settings.current()
    return Path(s.cache_dir or os.path.join(s.xdg_cache_home, "deltaserve"))
