"""Errors a user can meet. Each carries a message meant to be printed as is: one line, the numbers named."""


class DeltaserveError(Exception):
    """Base of every error deltaserve raises on purpose; the CLI prints its message, never a traceback."""


class ModelFormatError(DeltaserveError):
    """A model file or directory is not what it claims to be: wrong arch, truncated, missing tensor, wrong shape."""


class ContextError(DeltaserveError):
    """A prompt the context cannot hold, refused whole."""


class CapacityError(DeltaserveError):
    """A plan that does not fit the measured free memory, refused with the arithmetic."""


class BackendError(DeltaserveError):
    """A failure inside a backend (a forward, an allocation, a restore)."""
