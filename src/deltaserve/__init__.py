"""deltaserve: a resident-session inference engine for the Qwen3.5 hybrid models.

    import deltaserve
    model = deltaserve.load("Qwen3.5-0.8B-Q8_0.gguf")
    session = model.session()
    turn = session.chat([{"role": "user", "content": "Hello"}])
"""

from deltaserve.version import __version__


def load(path=None, device: str = "cpu", threads: int | None = None, cache: bool = True, weights: str | None = None):
    """Load a Qwen3.5 GGUF file or HF directory (no path: the embedded demo model); see `deltaserve.api.load`."""
    from deltaserve.api import load as _load

    return _load(path, device=device, threads=threads, cache=cache, weights=weights)


__all__ = ["load", "__version__"]
