"""Argument checks shared by the CUDA backend's decode and prefill ops."""

from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError
from ..base import ACTIVATIONS


def check_act(act) -> str:
    if act not in ACTIVATIONS:
        raise InvalidArgumentError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return act


def check_softcap(softcap) -> np.float32:
    """An attention score soft cap: 0 (none) or a finite number > 0."""
    try:
        c = float(softcap)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"softcap must be a number, got {softcap!r}") from None
    if not (c == 0 or 0 < c < 1e30):
        raise InvalidArgumentError(f"softcap must be 0 (none) or a finite number > 0, got {softcap!r}")
    return np.float32(c)


def check_window(window) -> int:
    w = int(window)
    if w < 0:
        raise InvalidArgumentError(f"window must be >= 0 (0: no window), got {w}")
    return min(w, 2**31 - 1)
