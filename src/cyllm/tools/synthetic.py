"""Random-weight models with the real shapes of common Llama-family checkpoints.

Decode speed is bound by the bytes read, not by the values, so a model of the
right shapes filled with random float16 numbers benchmarks exactly like the
real one -- with no download. ``build_synthetic(preset, seed)`` returns
``(ModelConfig, weights)`` following the weights contract (HF tensor names,
matrices float16, 1-D tensors float32); ``Model.from_weights`` runs it.

Drawing billions of normal variates would take minutes for a 7B shape, so one
modest random block (~1M values) is drawn per seed and every matrix is tiled
from it at a tensor-specific offset; the block length is prime, so rows of any
width start at different phases and no two rows are equal.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..config import ModelConfig
from ..errors import InvalidArgumentError, ModelLoadError

# Hyperparameters as published in each model's config.json.
PRESETS: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): 134.5 M params, tied embeddings
    "smollm2-135m": dict(arch="llama", dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         ffn_dim=1536, vocab_size=49152, max_seq_len=8192, norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # the same shape with a separate output matrix (163 M params): a GPU benchmark shape
    "smollm2-135m-untied": dict(arch="llama", dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                head_dim=64, ffn_dim=1536, vocab_size=49152, max_seq_len=8192,
                                norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False),
    # HuggingFaceTB/SmolLM2-360M: 362 M params, tied
    "smollm2-360m": dict(arch="llama", dim=960, n_layers=32, n_heads=15, n_kv_heads=5, head_dim=64,
                         ffn_dim=2560, vocab_size=49152, max_seq_len=8192, norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0: 1.10 B params, untied
    "tinyllama-1.1b": dict(arch="llama", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64,
                           ffn_dim=5632, vocab_size=32000, max_seq_len=2048, norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B: 1.24 B params, tied, llama3 rope scaling
    "llama3.2-1b": dict(arch="llama", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                        ffn_dim=8192, vocab_size=128256, max_seq_len=131072, norm_eps=1e-5,
                        rope_theta=500000.0, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    # meta-llama/Llama-2-7b-hf: 6.74 B params, untied, full multi-head attention
    "llama2-7b": dict(arch="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                      ffn_dim=11008, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.1: 7.24 B params, untied, 8 KV heads
    "mistral-7b": dict(arch="mistral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       ffn_dim=14336, vocab_size=32000, max_seq_len=32768, norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=False),
    # Qwen/Qwen3-8B: 8.19 B params, untied, 8 KV heads, q/k norms
    "qwen3-8b": dict(arch="qwen3", dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     ffn_dim=12288, vocab_size=151936, max_seq_len=40960, norm_eps=1e-6,
                     rope_theta=1000000.0, tie_word_embeddings=False, qk_norm=True),
    # Qwen/Qwen3-30B-A3B: 30.5 B params, 3.3 B of them a token (128 experts of 768 a layer, 8
    # chosen, their weights renormalized), q/k norms, untied; the router in float32 as the
    # weights contract keeps it, drawn like the matrices (so each token routes at random)
    "qwen3-30b-a3b": dict(arch="qwen3moe", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          ffn_dim=768, vocab_size=151936, max_seq_len=40960, norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=False, qk_norm=True,
                          n_experts=128, n_experts_used=8, expert_norm=True),
    # for tests: runs in milliseconds on any backend
    "tiny": dict(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_dim=128, vocab_size=256, max_seq_len=2048, norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=True),
}

_BLOCK_LEN = 1_048_573          # prime: tiles of it never line up with a row width


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_config(preset: str) -> ModelConfig:
    """The ModelConfig of a preset (InvalidArgumentError for an unknown name)."""
    key = preset.strip().lower() if isinstance(preset, str) else preset
    if key not in PRESETS:
        raise InvalidArgumentError(
            f"unknown synthetic preset {preset!r} (choose from {', '.join(PRESETS)})")
    return ModelConfig(**PRESETS[key], name=f"synthetic:{key}")


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of the float16 matrices + float32 vectors the preset allocates."""
    from ..loading import expected_shapes
    total = 0
    for shape in expected_shapes(config).values():
        total += int(np.prod(shape)) * (2 if len(shape) == 2 else 4)
    return total


def mem_available() -> int | None:
    """Host memory this process can still allocate, in bytes (None where unknown): memory.py."""
    from ..memory import host_available
    return host_available()


def check_fits(nbytes: int, what: str, factor: float = 1.0) -> None:
    """ModelLoadError when ``nbytes * factor`` exceeds 90% of the available memory."""
    avail = mem_available()
    need = int(nbytes * factor)
    if avail is not None and need > 0.9 * avail:
        raise ModelLoadError(
            f"{what} needs {need / 1e9:.1f} GB but only {avail / 1e9:.1f} GB of memory is "
            "available; choose a smaller preset")


def _tile(block: np.ndarray, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A float16 array of ``shape`` filled with ``block`` repeated from ``offset``."""
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.float16)
    L = block.shape[0]
    pos, src = 0, offset % L
    while pos < n:                      # chunked copies: ~memcpy speed, no temporaries
        take = min(L - src, n - pos)
        out[pos:pos + take] = block[src:src + take]
        pos += take
        src = 0
    return out.reshape(shape)


def build_synthetic(preset: str, seed: int = 0, check_memory: bool = True,
                    memory_factor: float = 1.0) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, weights)`` of a random-weight model with the preset's real shapes.

    Deterministic by ``seed``. Matrices are float16 with spread 1/sqrt(fan_in)
    (activations keep their scale through the layers); norm weights are
    float32 around 1. ``memory_factor`` scales the size checked against free
    memory (a backend that widens weights to float32 needs 2x more).
    """
    config = preset_config(preset)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgumentError(f"seed must be an integer, got {seed!r}")
    if check_memory:
        check_fits(weight_bytes(config), f"synthetic preset {preset!r}", memory_factor)
    rng = np.random.default_rng(int(seed))
    block = rng.standard_normal(_BLOCK_LEN, dtype=np.float32).astype(np.float16)   # (L,) ~N(0,1)
    from ..loading import expected_shapes

    from ..families import family

    float32 = {name for t, _, name in family(config.arch).expected_names(config) if t.float32}
    scaled: dict[int, np.ndarray] = {}   # fan_in -> block * 1/sqrt(fan_in), scaled once
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(config).items():
        # a tensor-specific but seed-stable phase into the block
        h = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")
        if len(shape) == 2:
            fan_in = 1 if name == "model.embed_tokens.weight" else shape[1]
            if fan_in not in scaled:
                scaled[fan_in] = (block.astype(np.float32) / np.sqrt(fan_in)).astype(np.float16)
            weights[name] = _tile(scaled[fan_in], shape, h)
            if name in float32:
                weights[name] = weights[name].astype(np.float32)
        else:
            # (dim,) norms ~1 (biases, for arches with them, small around 0)
            r = np.random.default_rng(h)
            if name.endswith(".bias"):
                weights[name] = (0.02 * r.standard_normal(shape[0])).astype(np.float32)
            else:
                weights[name] = (1.0 + 0.1 * r.standard_normal(shape[0])).astype(np.float32)
    return config, weights
