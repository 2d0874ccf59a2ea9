"""ModelConfig: the hyperparameters and feature flags of a decoder, from any source.

A model family (families.py) turns a Hugging Face config.json or GGUF metadata
into this one dataclass; model.py reads nothing else. Features are fields, never
family-name branches: a new family that combines known features needs no change
in model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import ModelLoadError
from .oneline import one_line
from .rope import F32_MAX, RopeSpec

ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
# counts beyond these cannot be real models: refuse before anything is sized from them
MAX_DIM = 1 << 17
MAX_LAYERS = 4096
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_POSITIONS = 1 << 40       # a trained context or a window: any larger is not a real model
MAX_EXPERTS = 4096


@dataclass
class ModelConfig:
    arch: str                      # family name (families.py), for display and convert
    dim: int                       # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int                   # intermediate size of the gated MLP (of each expert in a MoE model)
    vocab_size: int
    max_seq_len: int               # trained context length
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"rope_type": "linear"|"llama3"|"longrope", ...} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False          # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    qk_norm_whole: bool = False    # ... over all of q and all of k instead, one norm each (OLMo 2)
    qk_norm_after_rope: bool = False   # ... after rope instead of before it (Hunyuan dense)
    post_norms: bool = False       # RMSNorm on attention and MLP outputs before the residual add (Gemma 3)
    activation: str = "silu"       # gate activation of the MLP: "silu" | "gelu_tanh"
    embed_scale: float = 1.0       # token embeddings are multiplied by this (Gemma: sqrt(dim))
    residual_scale: float = 1.0    # each block output is multiplied by this before the residual add (Granite)
    logit_scale: float = 1.0       # the logits are multiplied by this (Granite: 1 / logits_scaling)
    attn_scale: float | None = None    # attention score scale; None = 1/sqrt(head_dim)
    attn_softcap: float = 0.0      # scaled scores s -> c * tanh(s / c) before the softmax (Gemma 2); 0: none
    final_softcap: float = 0.0     # the logits z -> c * tanh(z / c) (Gemma 2); 0: none
    rotary_dim: int | None = None  # leading dims of each head that rotate; None = all (partial rotary)
    sliding_window: int = 0        # positions a sliding layer attends to, itself included (0 = none)
    layer_types: tuple | None = None   # per layer "full" | "sliding"; None: all sliding iff a window is set
    rope_local_theta: float | None = None   # rope base of sliding layers, unscaled (Gemma 3)
    nope_layers: tuple = ()        # layers without rotary embeddings (SmolLM3)
    n_experts: int = 0             # experts of each layer's MLP (a mixture of experts); 0: one dense MLP
    n_experts_used: int = 0        # experts a token runs through, those of the highest router scores
    expert_norm: bool = True       # the chosen experts' softmax weights are renormalized to sum 1
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""                 # for display only

    def __post_init__(self) -> None:
        limits = {"dim": MAX_DIM, "n_layers": MAX_LAYERS, "n_heads": MAX_DIM, "n_kv_heads": MAX_DIM,
                  "head_dim": MAX_DIM, "ffn_dim": 1 << 20, "vocab_size": MAX_VOCAB,
                  "max_seq_len": MAX_POSITIONS}
        for key, limit in limits.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ModelLoadError(f"config: {key} must be a positive integer, got {_short(value)}")
            if value > limit:
                raise ModelLoadError(f"config: {key} = {value} is beyond any real model (at most {limit})")
            setattr(self, key, int(value))
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(
                f"config: num_attention_heads ({self.n_heads}) is not a multiple of "
                f"num_key_value_heads ({self.n_kv_heads})")
        self.norm_eps = _finite_positive(self.norm_eps, "rms_norm_eps")
        self.embed_scale = _finite_positive(self.embed_scale, "embedding scale")
        self.residual_scale = _finite_positive(self.residual_scale, "residual scale")
        self.logit_scale = _finite_positive(self.logit_scale, "logit scale")
        _finite_positive(self.stream_embed_scale, "embedding scale / residual scale")
        _finite_positive(self.stream_norm_eps, "rms_norm_eps / residual scale^2")
        if self.attn_scale is not None:
            self.attn_scale = _finite_positive(self.attn_scale, "attention scale")
        for key, what in (("attn_softcap", "attention soft cap"), ("final_softcap", "final logit soft cap")):
            value = getattr(self, key)
            setattr(self, key, 0.0 if value in (0, None) else _finite_positive(value, what))
        experts, used = self.n_experts, self.n_experts_used
        for key, value in (("n_experts", experts), ("n_experts_used", used)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_EXPERTS:
                raise ModelLoadError(f"config: {key} must be a whole number in [0, {MAX_EXPERTS}], got {_short(value)}")
        if experts and not 1 <= used <= experts:
            raise ModelLoadError(f"config: {used} experts used per token out of {experts}: "
                                 f"must be between 1 and the number of experts")
        if not experts and used:
            raise ModelLoadError(f"config: {used} experts used per token, but the model has none")
        self.n_experts, self.n_experts_used = int(experts), int(used)
        if not isinstance(self.expert_norm, (bool, np.bool_)):
            raise ModelLoadError(f"config: expert_norm must be true or false, got {_short(self.expert_norm)}")
        self.expert_norm = bool(self.expert_norm)
        if experts and self.post_norms:
            raise ModelLoadError("config: a mixture of experts with a norm on the MLP's output is not supported")
        if self.qk_norm_whole and not self.qk_norm:
            raise ModelLoadError("config: qk_norm_whole needs qk_norm")
        if self.qk_norm_after_rope and not self.qk_norm:
            raise ModelLoadError("config: qk_norm_after_rope needs qk_norm")
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"config: activation {self.activation!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        rot = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if isinstance(rot, bool) or not isinstance(rot, (int, np.integer)) or not 0 < rot <= self.head_dim or rot % 2:
            raise ModelLoadError(f"config: the rotary dimension must be even and within head_dim "
                                 f"{self.head_dim}, got {_short(rot)}")
        window = self.sliding_window
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
            raise ModelLoadError(f"config: sliding_window must be a whole number >= 0, got {_short(window)}")
        if window > MAX_POSITIONS:
            raise ModelLoadError(f"config: sliding_window = {window} is beyond any real model (at most {MAX_POSITIONS})")
        self.sliding_window = int(window)
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.n_layers or any(t not in LAYER_TYPES for t in types):
                raise ModelLoadError(f"config: layer_types must list 'full' or 'sliding' for each of the "
                                     f"{self.n_layers} layers")
            if "sliding" in types and not self.sliding_window:
                raise ModelLoadError("config: sliding layers are listed but sliding_window is not set")
            self.layer_types = types
        nope = tuple(int(i) for i in self.nope_layers)
        if any(not 0 <= i < self.n_layers for i in nope):
            raise ModelLoadError(f"config: a NoPE layer index is outside 0..{self.n_layers - 1}")
        self.nope_layers = nope
        # token ids outside the vocabulary can never be sampled (eos) or embedded (bos)
        self.eos_token_ids = [int(i) for i in self.eos_token_ids
                              if isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                              and 0 <= i < self.vocab_size]
        bos = self.bos_token_id
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, (int, np.integer))
                                or not 0 <= bos < self.vocab_size):
            self.bos_token_id = None
        # RopeSpec validates theta and the scaling parameters now, not at the first token
        self.rope()
        if self.rope_local_theta is not None:
            self.rope(local=True)

    # -- derived sizes ---------------------------------------------------------
    @property
    def moe(self) -> bool:
        """Each layer's MLP is a mixture of experts (a router and n_experts gated MLPs)."""
        return self.n_experts > 0

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
        mlp = 3 * self.dim * self.ffn_dim * max(1, self.n_experts) + self.n_experts * self.dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.dim

    @property
    def active_params(self) -> int:
        """Parameters a token's forward pass multiplies with: a mixture of experts counts the
        experts it uses, a dense model all its parameters."""
        if not self.moe:
            return self.n_params
        unused = 3 * self.dim * self.ffn_dim * (self.n_experts - self.n_experts_used) * self.n_layers
        return self.n_params - unused

    def kv_bytes_per_token(self) -> int:
        """FP16 K and V for one position across all layers."""
        return 2 * self.n_layers * self.kv_dim * 2

    # -- the residual stream, carried divided by residual_scale ----------------
    # Granite adds r * block(x) to its stream x. A block sees the stream only through an
    # RMSNorm, which cannot tell x from x / r once its eps is divided by r^2 as well, so the
    # model carries g = x / r: g starts at embedding * embed_scale / r, takes each block's
    # output with a plain residual add, and its norms use eps / r^2. The logits are the same,
    # and the token path has no extra multiply. (A block's own norms, q/k and post norms,
    # see no stream and keep norm_eps.)
    @property
    def stream_embed_scale(self) -> float:
        return self.embed_scale / self.residual_scale

    @property
    def stream_norm_eps(self) -> float:
        return self.norm_eps / self.residual_scale ** 2

    # -- per-layer features ----------------------------------------------------
    def layer_window(self, i: int) -> int:
        """Positions layer i attends to (itself included); 0 = the whole cache."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding" else 0

    def rope(self, local: bool = False) -> RopeSpec:
        """The rotary embedding of full layers, or (local) of sliding layers when they differ."""
        dim = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if local and self.rope_local_theta is not None:
            return RopeSpec(float(self.rope_local_theta), dim, None)
        return RopeSpec(float(self.rope_theta), dim, self.rope_scaling)

    def layer_rope(self, i: int) -> RopeSpec | None:
        """Layer i's rotary embedding; None for NoPE layers."""
        if i in self.nope_layers:
            return None
        return self.rope(local=self.layer_window(i) > 0)

    def inv_freq(self, context: int | None = None) -> np.ndarray:
        """Rotary inverse frequencies of full layers (rotary_dim // 2,) float32."""
        return self.rope().inv_freq(self.max_seq_len if context is None else context)


def _short(value) -> str:
    return one_line(repr(value), 40)


def _finite_positive(value, what: str) -> float:
    if isinstance(value, bool):
        raise ModelLoadError(f"config: {what} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ModelLoadError(f"config: {what} must be a number, got {_short(value)}") from None
    # the kernels compute in float32: a value it rounds to 0 or inf would be taken silently
    if not math.isfinite(v) or not _F32_TINY <= v <= F32_MAX:
        raise ModelLoadError(f"config: {what} must be a finite number > 0 within float32's range, "
                             f"got {_short(value)}")
    return v


_F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def token_id_list(value) -> list[int]:
    """A bos/eos id field of a JSON config (int, list of ints or null) as a list of ints."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
