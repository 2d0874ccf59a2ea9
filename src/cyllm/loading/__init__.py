"""Model loading: dispatch on the path, plus the shared weight validation.

Every loader returns ``(ModelConfig, weights, Tokenizer | None)`` where
``weights`` follows the weights contract (HF tensor names, matrices float16,
1-D tensors float32) and has passed :func:`validate_weights`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

__all__ = ["load_path", "validate_weights", "expected_shapes"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, name -> shape (from the config alone)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.dim),
        "model.norm.weight": (c.dim,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.dim,)
        shapes[p + "post_attention_layernorm.weight"] = (c.dim,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_dim, c.dim)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_dim, c.dim)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_dim, c.dim)
        shapes[p + "self_attn.o_proj.weight"] = (c.dim, c.q_dim)
        shapes[p + "mlp.gate_proj.weight"] = (c.ffn_dim, c.dim)
        shapes[p + "mlp.up_proj.weight"] = (c.ffn_dim, c.dim)
        shapes[p + "mlp.down_proj.weight"] = (c.dim, c.ffn_dim)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_dim,)
    return shapes


def validate_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Check presence, shape and dtype of every tensor the model reads.

    Matrices must be float16 and 1-D tensors float32 (the weights contract).
    A tied checkpoint may still carry lm_head.weight; then it is checked too.
    Raises ModelLoadError naming the first offending tensor.
    """
    shapes = expected_shapes(config)
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        shapes["lm_head.weight"] = (config.vocab_size, config.dim)
    for name, shape in shapes.items():
        arr = weights.get(name)
        if arr is None:
            raise ModelLoadError(f"missing tensor {name}")
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
