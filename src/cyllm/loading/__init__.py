"""Model loading: dispatch on the path, plus the shared weight validation.

Every loader returns ``(ModelConfig, weights, Tokenizer | None)`` where
``weights`` follows the weights contract (HF tensor names; a matrix is a float16
array or a cyllm.quant.QuantMatrix in a native block format; 1-D tensors float32)
and has passed :func:`validate_weights`.
"""

from __future__ import annotations

import os
from pathlib import Path


from ..errors import ModelLoadError
from .weights import expected_shapes, validate_weights

GGUF_MAGIC = b"GGUF"

__all__ = ["load_path", "validate_weights", "expected_shapes"]


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
