"""Model loading: dispatch on the path, plus the shared weight validation.

Every loader returns ``(ModelConfig, weights, Tokenizer | None)`` where
``weights`` follows the weights contract (HF tensor names; a matrix is a float16
array or a cyllm.quant.QuantMatrix in a native block format; 1-D tensors float32)
and has passed :func:`validate_weights`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..families import family

GGUF_MAGIC = b"GGUF"

__all__ = ["load_path", "validate_weights", "expected_shapes"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, HF name -> shape (from the config and its family's table)."""
    fam = family(config.arch)
    return {t.hf_name(i): t.shape(config) for t, i in fam.expected(config)
            if not (t.optional and config.tie_word_embeddings)}


def validate_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Check presence, shape and dtype of every tensor the model reads.

    Matrices must be float16 arrays or QuantMatrix (whose rows are whole blocks of its
    format and whose data has the size the shape needs) and 1-D tensors float32 (the
    weights contract). A tied checkpoint may still carry lm_head.weight; then it is
    checked too. Raises ModelLoadError naming the first offending tensor.
    """
    from ..quant.formats import QuantMatrix
    fam = family(config.arch)
    for t, i in fam.expected(config):
        name, shape = t.hf_name(i), t.shape(config)
        arr = weights.get(name)
        if arr is None:
            if t.optional and config.tie_word_embeddings:
                continue
            raise ModelLoadError(f"missing tensor {name}")
        if isinstance(arr, QuantMatrix) and len(shape) == 2:
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
        want = np.float16 if len(shape) == 2 else np.float32
        if arr.dtype != want:
            raise ModelLoadError(f"tensor {name} has dtype {arr.dtype}, expected {np.dtype(want)}")


def _is_gguf_file(p: Path) -> bool:
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def load_path(path: str | os.PathLike):
    """Load a model from a Hugging Face directory or a .gguf file.

    Returns ``(config, weights, tokenizer_or_None)``.
    """
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.exists():
        raise ModelLoadError(f"model path not found: {p}")
    if p.is_dir():
        from .hf import load_hf_dir
        return load_hf_dir(p)
    if p.is_file() and _is_gguf_file(p):
        from .gguf import load_gguf
        return load_gguf(p)
    if p.suffix.lower() == ".safetensors" or p.name == "config.json":
        raise ModelLoadError(
            f"{p} is a single file; pass the model directory ({p.parent}) that holds "
            "config.json and the safetensors weights")
    raise ModelLoadError(
        f"{p} is neither a model directory (with config.json and safetensors weights) "
        "nor a GGUF file")
