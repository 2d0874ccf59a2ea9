"""ModelConfig: the hyperparameters of a Llama-family decoder, from any source.

Both loaders (Hugging Face config.json and GGUF metadata) produce this one
dataclass; model.py reads nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import ModelLoadError, UnsupportedModelError

# architectures accepted from config.json "architectures"; the value is the
# family name used internally (it decides only whether q/k/v carry a bias).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    arch: str                      # "llama" | "mistral" | "qwen2"
    dim: int                       # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int                   # intermediate size of the SwiGLU MLP
    vocab_size: int
    max_seq_len: int               # trained context length
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"rope_type": "llama3", "factor": ..., ...} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""                 # for display only

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ModelLoadError(f"config: {key} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(
                f"config: num_attention_heads ({self.n_heads}) is not a multiple of "
                f"num_key_value_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_params(self) -> int:
        """Parameter count (the output matrix counted once when tied)."""
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.dim

    def kv_bytes_per_token(self) -> int:
        """FP16 K and V for one position across all layers."""
        return 2 * self.n_layers * self.kv_dim * 2

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies (head_dim // 2,) float32, rope scaling applied.

        Computed the way Hugging Face transformers does it so that positions
        rotate identically (float32 at the end).
        """
        half = self.head_dim // 2
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.int64)
                                         .astype(np.float32) / self.head_dim))
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", "default") == "llama3":
            inv = _llama3_scale(inv.astype(np.float64), scaling)
        assert inv.shape == (half,)
        return np.asarray(inv, dtype=np.float32)

    def rope_tables(self, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables, each (n_pos, head_dim // 2) float32."""
        inv = self.inv_freq()
        t = np.arange(n_pos, dtype=np.float32)
        freqs = np.outer(t, inv).astype(np.float32)          # (n_pos, half)
        return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1 frequency-dependent rope scaling (published formula)."""
    try:
        factor = float(s["factor"])
        low = float(s.get("low_freq_factor", 1.0))
        high = float(s.get("high_freq_factor", 4.0))
        orig = float(s["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config: llama3 rope_scaling is missing or has a bad {e}") from None
    low_wavelen = orig / low
    high_wavelen = orig / high
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def token_id_list(value) -> list[int]:
    """A bos/eos id field of a JSON config (int, list of ints or null) as a list of ints."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either the classic keys or `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    else:
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    """Build a ModelConfig from a parsed Hugging Face config.json."""
    archs = cfg.get("architectures") or []
    if not archs:
        mt = cfg.get("model_type")
        archs = {"llama": ["LlamaForCausalLM"], "mistral": ["MistralForCausalLM"],
                 "qwen2": ["Qwen2ForCausalLM"]}.get(mt, [f"model_type={mt!r}"])
    arch_name = archs[0]
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    arch = SUPPORTED_ARCHITECTURES[arch_name]

    def need(key):
        if key not in cfg or cfg[key] is None:
            raise ModelLoadError(f"config.json: missing required key {key!r}")
        return cfg[key]

    dim = need("hidden_size")
    n_heads = need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or (dim // n_heads if isinstance(dim, int) and isinstance(n_heads, int) and n_heads else 0)
    theta, scaling = _rope_settings(cfg)
    eos_ids = token_id_list(cfg.get("eos_token_id"))
    if arch == "qwen2":
        bias = True
    else:
        bias = bool(cfg.get("attention_bias", False))
    try:
        return ModelConfig(
            arch=arch, dim=dim, n_layers=need("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_seq_len=cfg.get("max_position_embeddings") or 2048,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            name=name)
    except TypeError as e:
        raise ModelLoadError(f"config.json: bad value ({e})") from None
