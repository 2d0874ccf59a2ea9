"""The weights contract: which tensors a config needs, with which shapes and dtypes."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..families import family


def first_overlap(spans) -> tuple[str, str] | None:
    """The names of two tensors whose stored bytes intersect, or None; spans: (begin, end, name)
    of each tensor that holds bytes, in any order. The formats lay tensors out one after another,
    and tensors that all point at the same bytes would let a small file ask for memory in
    proportion to its tensor count (each one is converted, repacked or copied on its own)."""
    ordered = sorted(spans)
    for (_, end, a), (begin, _, b) in zip(ordered, ordered[1:]):
        if begin < end:
            return a, b
    return None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, HF name -> shape (from the config and its family's table)."""
    fam = family(config.arch)
    return {name: t.shape(config) for t, _, name in fam.expected_names(config)
            if not (t.optional and config.tie_word_embeddings)}


def validate_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Check presence, shape and dtype of every tensor the model reads.

    Matrices must be float16 arrays or QuantMatrix (whose rows are whole blocks of its
    format and whose data has the size the shape needs) and 1-D tensors float32 (the
    weights contract). A tied checkpoint may still carry lm_head.weight; then it is
    checked too. Raises ModelLoadError naming the first offending tensor.
    """
    from ..quant.matrix import QuantMatrix
    fam = family(config.arch)
    for t, _, name in fam.expected_names(config):
        shape = t.shape(config)
        arr = weights.get(name)
        if arr is None:
            if t.optional and config.tie_word_embeddings:
                continue
            raise ModelLoadError(f"missing tensor {name}")
        want = t.matrix_dtype(config)
        if isinstance(arr, QuantMatrix) and want == np.float16:
            if arr.shape != shape:
                raise ModelLoadError(f"tensor {name} has shape {arr.shape}, expected {shape}")
            if shape[1] % arr.fmt.block or arr.data.shape != (shape[0], arr.fmt.row_bytes(shape[1])):
                raise ModelLoadError(f"tensor {name}: {arr.fmt.name} data of shape {arr.data.shape} "
                                     f"does not hold {shape[0]} rows of {shape[1]} elements")
            continue
        if not isinstance(arr, np.ndarray):
            raise ModelLoadError(f"tensor {name} is a {type(arr).__name__}, not a numpy array")
        if tuple(arr.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(arr.shape)}, expected {shape}")
        if arr.dtype != want:
            raise ModelLoadError(f"tensor {name} has dtype {arr.dtype}, expected {np.dtype(want)}")
        # norms and biases (a few KB each): a nan there reaches the next quantized matvec, whose
        # int8 rounding of its input turns it into finite noise -- wrong text, no error.
        # (Matrices are too big to scan at load; a nan in a float16 one reaches the logits check.)
        # A router's scores pick the experts: a nan there picks arbitrarily. Small, so checked too.
        if want == np.float32 and not np.all(np.isfinite(arr)):
            raise ModelLoadError(f"tensor {name} holds inf or nan values")
