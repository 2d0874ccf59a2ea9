"""Exceptions that cyllm raises for bad input.

Every error a user can cause derives from CyllmError. The CLI catches it,
prints one line (``cyllm: error: <message>``) and exits with status 2; the
Python API lets it propagate so callers can catch it by type.
"""


class CyllmError(Exception):
    """Base class of every user-facing cyllm error."""


class ModelLoadError(CyllmError):
    """A model path, config or weight file cannot be used."""


class UnsupportedModelError(ModelLoadError):
    """The architecture, rope type or tensor type is known but not supported."""


class TokenizerError(CyllmError):
    """The tokenizer files are missing or unusable."""


class InvalidArgumentError(CyllmError, ValueError):
    """An argument (token ids, thread count, sampling parameter...) is out of range."""


class ContextFullError(CyllmError):
    """The prompt does not fit in the context window."""


class BackendUnavailableError(CyllmError):
    """The requested backend is unknown or cannot run on this machine."""


# what to install for the cuda backend (its errors and `cyllm info` say it)
CUDA_INSTALL_HINT = ("in a cyllm source checkout: pip install '.[cuda]', or install the CuPy wheel for "
                     "your CUDA version: pip install cupy-cuda12x (CUDA 12) / cupy-cuda13x (CUDA 13)")
