"""Argument checks shared by the CUDA backend's decode and prefill ops."""

from __future__ import annotations

from ...errors import InvalidArgumentError
from ..base import ACTIVATIONS


def check_act(act) -> str:
    if act not in ACTIVATIONS:
        raise InvalidArgumentError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return act


def check_window(window) -> int:
    w = int(window)
    if w < 0:
        raise InvalidArgumentError(f"window must be >= 0 (0: no window), got {w}")
    return min(w, 2**31 - 1)
