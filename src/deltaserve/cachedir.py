"""Where deltaserve keeps what it computes once per machine (parity-guard verdicts, the native kernel), and, apart
from it, the user's own data (saved chats): clearing a cache must never delete a conversation."""

from __future__ import annotations

import os
from pathlib import Path

from deltaserve import settings


def cache_root() -> Path:
    """$DELTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/deltaserve (XDG_CACHE_HOME defaults to ~/.cache)."""
    s = settings.current()
    return Path(s.cache_dir or os.path.join(s.xdg_cache_home, "deltaserve"))


def data_root() -> Path:
    """$DELTASERVE_DATA_DIR (or `chat --data-dir`), else $XDG_DATA_HOME/deltaserve (XDG_DATA_HOME defaults to
    ~/.local/share)."""
    s = settings.current()
    return Path(s.data_dir or os.path.join(s.xdg_data_home, "deltaserve"))
