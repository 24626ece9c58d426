"""deltaserve: a resident-session inference engine for the Qwen3.5 hybrid models.

    import deltaserve
    model = deltaserve.load("Qwen3.5-0.8B-Q8_0.gguf")
    session = model.session()
    turn = session.chat([{"role": "user", "content": "Hello"}])
"""

import os as _os

from deltaserve.version import __version__

# oneDNN keeps up to 1024 compiled primitives per process by default, one per shape: a server that sees prompts of
# many lengths grew from 244 to 1,206 MiB over 300 of them (demo model), most of it this cache and glibc's heap
# (session/resident.py hands the heap back after long prefills). 256 keeps every shape a decode repeats: 618 MiB, flat.
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
# and torch's ideep keeps its own cache of computations (LRU_CACHE_CAPACITY, 1024 by default), also one per shape:
# it was the rest of that growth (on a Xeon, demo model, 1,000 random-length prompts: 479 MiB after 50, 630 after
# 1,000, live heap growing while no tensor or Python object did). 64: 380 and 376 MiB.
_os.environ.setdefault("LRU_CACHE_CAPACITY", "64")


def load(path=None, device: str = "cpu", threads: int | None = None, cache: bool = True, weights: str | None = None,
         draft=None, mmproj=None, kv_type: str | None = None):
    """Load a Qwen3.5 GGUF file or HF directory (no path: the embedded demo model); see `deltaserve.api.load`."""
    from deltaserve.api import load as _load

    return _load(path, device=device, threads=threads, cache=cache, weights=weights, draft=draft, mmproj=mmproj,
                 kv_type=kv_type)


__all__ = ["load", "__version__"]
