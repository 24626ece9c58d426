"""deltaserve: a resident-session inference engine for the Qwen3.5 hybrid models."""

__version__ = "0.1.0"
