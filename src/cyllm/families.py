"""Model families: each is one description, read by both loaders, validation and convert.

A family names its Hugging Face architectures and its GGUF architecture, lists
its tensors in one table (the HF name, the GGUF name, the shape rule and the
load transforms) and says how its config.json / GGUF metadata map onto
ModelConfig's feature fields. model.py knows tensors only by *role* (the GGUF
name inside a block: "attn_q.weight", "ffn_up.weight", ...), never by family.

Facts the tables encode (llama.cpp's converter is the reference for GGUF):
- llama.cpp interleaves the rows of q/k for its rope layout only in its
  llama-style converters (Llama, Mistral, SmolLM3): ``Family.permute_qk``.
- Gemma's RMSNorm multiplies by (1 + w). HF checkpoints store w, GGUF files
  store 1 + w: ``Tensor.hf_plus_one`` adds the 1 when reading HF weights only.
- Gemma 2 is Gemma 3's block without q/k norms, every other layer sliding (from the first),
  one rope base, and tanh soft caps on the attention scores and the logits; llama.cpp reads
  50 and 30 where a file names no cap, and scales queries as for Gemma 3 (dim / heads for the
  27B, here 46 layers).
- Phi-3 fuses q/k/v into one matrix and gate/up into one (gate rows first);
  GGUF keeps both fused (the gate/up pair under the name ffn_up).
- OLMo 2's blocks have no pre-norms: GGUF names its output norms post_attention_norm and
  post_ffw_norm, and its q/k norms span the whole projection (no rope interleaving).
- Granite's converter is Llama's (q/k interleaved) without head_dim; its four
  multipliers become ``granite.embedding_scale``, ``residual_scale``,
  ``attention.scale`` and ``logit_scale`` (the last divides the logits).
- A mixture of experts: HF names each expert's matrices (``experts.{e}.``); llama.cpp
  stacks a layer's experts in one tensor each (``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``: (experts, rows, cols)) and keeps the router (``ffn_gate_inp``) F32.
  Mixtral is GGUF ``llama`` with ``llama.expert_count``. Whether the chosen experts' weights
  are renormalized is fixed per architecture in llama.cpp (qwen3moe and llama yes, olmoe no)
  and a config key in transformers (``norm_topk_prob``; Mixtral always).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .config import MAX_LAYERS, ModelConfig
from .errors import ModelLoadError, UnsupportedModelError
from .jsonio import JsonObject, check_number, short
from .oneline import one_line

Shape = Callable[[ModelConfig], tuple]


@dataclass(frozen=True)
class Tensor:
    role: str                          # GGUF name inside a block ("attn_q.weight") or a global GGUF name
    hf: str                            # HF name; "{i}" is the layer index
    shape: Shape                       # logical (numpy) shape
    when: Callable[[ModelConfig], bool] = lambda c: True    # present under this config
    optional: bool = False             # may be missing (a tied output matrix)
    gguf: str | None = None            # GGUF name when it differs from the role ("blk.{i}." + role)
    permute: str = ""                  # "q" | "k": rows interleaved by llama.cpp (families with permute_qk)
    hf_plus_one: bool = False          # (1+w) norm: HF stores w, GGUF stores 1+w
    # one matrix per expert: HF names each ("{e}" in hf, of shape `shape`), GGUF stacks them in
    # one tensor of shape (n_experts, *shape)
    experts: bool = False
    # (p, parts): an expert matrix the HF checkpoint keeps with every expert's in one tensor
    # `hf` (no "{e}") of shape (n_experts, parts * rows, cols), this row's matrices being part
    # p of each expert's rows (Granite MoE's input_linear: gate, then up). The weights contract
    # names expert e's matrix "<hf>:<e>" (":<e>.<p>" where parts > 1), names no file holds.
    hf_part: tuple[int, int] | None = None
    float32: bool = False              # a matrix kept in float32 (a MoE router: its scores pick experts)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    def gguf_name(self, i: int | None = None) -> str:
        name = self.gguf or (("blk.{i}." + self.role) if self.per_layer else self.role)
        return name.format(i=i)

    def hf_name(self, i: int | None = None, e: int | None = None) -> str:
        return self.hf.format(i=i, e=e)

    def hf_names(self, c: ModelConfig, i: int | None = None):
        """The HF names of this row in layer i (an iterable): one per expert for expert matrices."""
        if self.hf_part is not None:
            p, parts = self.hf_part
            tail = f".{p}" if parts > 1 else ""
            return (f"{self.hf_name(i)}:{e}{tail}" for e in range(c.n_experts))
        return (self.hf_name(i, e) for e in range(c.n_experts)) if self.experts else (self.hf_name(i),)

    def hf_stack_shape(self, c: ModelConfig) -> tuple:
        """The shape of the HF tensor that holds this row's experts (hf_part rows)."""
        rows, cols = self.shape(c)
        return (c.n_experts, self.hf_part[1] * rows, cols)

    def gguf_shape(self, c: ModelConfig) -> tuple:
        """The (numpy) shape of the GGUF tensor: expert matrices stacked."""
        return (c.n_experts, *self.shape(c)) if self.experts else self.shape(c)

    def permute_heads(self, c: ModelConfig) -> int:
        """The heads whose rows a q/k row's pairing (llama.cpp's permutation) runs over: the
        query heads for q, the KV heads for k (a permuted row's)."""
        return c.n_heads if self.permute == "q" else c.n_kv_heads

    def matrix_dtype(self, c: ModelConfig):
        """The dtype of the contract: float16 matrices (float32 where marked), float32 vectors."""
        return np.float16 if len(self.shape(c)) == 2 and not self.float32 else np.float32


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_arch: str
    tensors: tuple[Tensor, ...]
    permute_qk: bool = False
    # the HF checkpoint's q/k rows are already in the interleaved rotary order llama.cpp's GGUF
    # uses (GPT-J style pairs 2i, 2i+1: Ernie 4.5): read with the GGUF's un-permutation, and
    # written to GGUF as they are
    hf_rope_interleaved: bool = False
    hf_features: Callable[[dict], dict] = lambda cfg: {}           # config.json -> ModelConfig fields
    gguf_features: Callable[[dict, str, dict], dict] = lambda md, p, t: {}   # metadata, prefix, tensors
    gguf_config_tensors: tuple[str, ...] = ()    # GGUF tensors read into the config, not weights
    hf_extra: Callable[[ModelConfig], dict] = lambda c: {}        # convert: family keys of config.json
    fused_qkv: bool = False
    fused_gate_up: bool = False

    @property
    def hf_defaults(self) -> tuple:
        """config.json keys a checkpoint may leave out, at the family's transformers config class
        defaults where they differ from common_hf's (rms_norm_eps 1e-5, max_position_embeddings
        2048, rope_theta 10000, untied): _HF_DEFAULTS."""
        return _HF_DEFAULTS.get(self.name, ())

    def expected(self, c: ModelConfig) -> list[tuple[Tensor, int | None]]:
        """Every (tensor, layer) this config reads, globals first."""
        out = []
        for t in self.tensors:
            if not t.when(c):
                continue
            if t.per_layer:
                out.extend((t, i) for i in range(c.n_layers))
            else:
                out.append((t, None))
        return out

    def expected_names(self, c: ModelConfig):
        """Every (tensor, layer, HF name) this config reads, a name per expert for expert matrices:
        yielded, so that a checkpoint lacking the first is refused before a hostile config's
        millions of expert names are built."""
        for t, i in self.expected(c):
            for name in t.hf_names(c, i):
                yield t, i, name

    def tensor(self, role: str) -> Tensor:
        for t in self.tensors:
            if t.role == role:
                return t
        raise KeyError(role)


# -- the common tensor table -----------------------------------------------------------

def _dense(c): return not c.moe
def _emb(c): return (c.vocab_size, c.dim)
def _vec(c): return (c.dim,)
def _hd(c): return (c.head_dim,)


def _layers(prefix: str = "model.layers.{i}.") -> dict[str, Tensor]:
    """Llama's names; other families replace or add rows."""
    p = prefix
    rows = [
        Tensor("attn_norm.weight", p + "input_layernorm.weight", _vec),
        Tensor("attn_q.weight", p + "self_attn.q_proj.weight", lambda c: (c.q_dim, c.dim), permute="q"),
        Tensor("attn_k.weight", p + "self_attn.k_proj.weight", lambda c: (c.kv_dim, c.dim), permute="k"),
        Tensor("attn_v.weight", p + "self_attn.v_proj.weight", lambda c: (c.kv_dim, c.dim)),
        Tensor("attn_q.bias", p + "self_attn.q_proj.bias", lambda c: (c.q_dim,),
               when=lambda c: c.attention_bias, permute="q"),
        Tensor("attn_k.bias", p + "self_attn.k_proj.bias", lambda c: (c.kv_dim,),
               when=lambda c: c.attention_bias, permute="k"),
        Tensor("attn_v.bias", p + "self_attn.v_proj.bias", lambda c: (c.kv_dim,),
               when=lambda c: c.attention_bias),
        Tensor("attn_q_norm.weight", p + "self_attn.q_norm.weight", _hd, when=lambda c: c.qk_norm),
        Tensor("attn_k_norm.weight", p + "self_attn.k_norm.weight", _hd, when=lambda c: c.qk_norm),
        Tensor("attn_output.weight", p + "self_attn.o_proj.weight", lambda c: (c.dim, c.q_dim)),
        Tensor("ffn_norm.weight", p + "post_attention_layernorm.weight", _vec),
        Tensor("ffn_gate.weight", p + "mlp.gate_proj.weight", lambda c: (c.ffn_dim, c.dim), when=_dense),
        Tensor("ffn_up.weight", p + "mlp.up_proj.weight", lambda c: (c.ffn_dim, c.dim), when=_dense),
        Tensor("ffn_down.weight", p + "mlp.down_proj.weight", lambda c: (c.dim, c.ffn_dim), when=_dense),
    ]
    return {t.role: t for t in rows}


def _globals() -> dict[str, Tensor]:
    rows = [
        Tensor("token_embd.weight", "model.embed_tokens.weight", _emb),
        Tensor("output_norm.weight", "model.norm.weight", _vec),
        Tensor("output.weight", "lm_head.weight", _emb, optional=True),
    ]
    return {t.role: t for t in rows}


def _moe_rows(router: str, gate: str, up: str, down: str, prefix: str = "model.layers.{i}.",
              stacked: bool = False) -> dict:
    """_table changes for a mixture-of-experts MLP: the router (n_experts, dim), kept in float32,
    and each expert's gate, up and down matrices ("{e}" in their HF names) in place of the
    dense MLP's. llama.cpp stacks the experts of a layer in one tensor each. ``stacked``: the
    HF checkpoint does too, gate and up in one tensor (gate == up, gate's rows first)."""
    p, moe = prefix, (lambda c: c.moe)
    parts = (lambda part: dict(hf_part=part)) if stacked else (lambda part: {})
    return dict(
        ffn_gate__weight=None, ffn_up__weight=None, ffn_down__weight=None,
        ffn_gate_inp__weight=Tensor("ffn_gate_inp.weight", p + router, lambda c: (c.n_experts, c.dim),
                                    when=moe, float32=True),
        ffn_gate_exps__weight=Tensor("ffn_gate_exps.weight", p + gate, lambda c: (c.ffn_dim, c.dim),
                                     when=moe, experts=True, **parts((0, 2))),
        ffn_up_exps__weight=Tensor("ffn_up_exps.weight", p + up, lambda c: (c.ffn_dim, c.dim),
                                   when=moe, experts=True, **parts((1, 2))),
        ffn_down_exps__weight=Tensor("ffn_down_exps.weight", p + down, lambda c: (c.dim, c.ffn_dim),
                                     when=moe, experts=True, **parts((0, 1))))


def _table(**changes: Tensor | None) -> tuple[Tensor, ...]:
    """The llama table with rows replaced (a Tensor), removed (None) or added (a new role)."""
    rows = {**_globals(), **_layers()}
    for role, t in changes.items():
        role = role.replace("__", ".")
        if t is None:
            rows.pop(role, None)
        else:
            rows[t.role] = t
    return tuple(rows.values())


# -- reading config.json ---------------------------------------------------------------
# every value goes through JsonObject's typed accessors (jsonio): a string where a
# number belongs, a number where a flag belongs or NaN in a scale is one clear error

def _n_layers(cfg: JsonObject) -> int:
    # bounded before any per-layer list is built from it
    return cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)


def _head_dim_or_none(cfg: JsonObject) -> int | None:
    """_head_dim, or None where config.json gives none and hidden_size / heads is no whole
    number: a family whose config class has a default head_dim (Seed-OSS) sets it then."""
    if cfg.int("head_dim", None, minimum=1) is None and \
            cfg.int("hidden_size", minimum=1) % cfg.int("num_attention_heads", minimum=1):
        return None
    return _head_dim(cfg)


def _head_dim(cfg: JsonObject) -> int:
    head_dim = cfg.int("head_dim", None, minimum=1)
    if head_dim is None:
        dim, n_heads = cfg.int("hidden_size", minimum=1), cfg.int("num_attention_heads", minimum=1)
        if dim % n_heads:
            raise ModelLoadError(f"{cfg.where}: hidden_size {dim} is not divisible by "
                                 f"num_attention_heads {n_heads} and no head_dim is given")
        head_dim = dim // n_heads
    return head_dim


def rope_params(cfg: JsonObject, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(theta, scaling or None) from the classic keys or transformers 5's ``rope_parameters``
    (which may be keyed by layer type, as Gemma 3's is)."""
    params = cfg.obj("rope_parameters")
    if params is not None and any(k in params for k in _LAYER_TYPE_NAMES):
        params = params.obj(layer_type)     # None: this layer type falls back to the classic keys
    theta = params.number("rope_theta", None, positive=True) if params is not None else None
    if theta is None:
        theta = cfg.number("rope_theta", 10000.0, positive=True)
    scaling = params if params is not None else cfg.obj("rope_scaling")
    if scaling is not None:
        kind = scaling.text("rope_type", None) or scaling.text("type", None) or "default"
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        for k in ("rope_theta", "type", "partial_rotary_factor"):
            if scaling is not None:
                scaling.pop(k, None)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # as transformers: the trained context from the config's top level, else the scaling's,
        # else max_position_embeddings; no factor: the ratio of the two contexts
        max_pos = cfg.int("max_position_embeddings", None, minimum=1)
        orig = cfg.int("original_max_position_embeddings", None, minimum=1) \
            or scaling.get("original_max_position_embeddings") or max_pos
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("factor") is None and max_pos and isinstance(orig, (int, float)) and orig > 0:
            scaling["factor"] = max_pos / orig
    return theta, scaling


_LAYER_TYPE_NAMES = {"full_attention": "full", "sliding_attention": "sliding"}


def _layer_types(cfg: JsonObject, n_layers: int) -> tuple | None:
    types = cfg.list("layer_types", "str", length=n_layers)
    if types is None:
        return None
    if not all(t in _LAYER_TYPE_NAMES for t in types):
        raise cfg.fail("layer_types", "a list of 'full_attention' or 'sliding_attention'", types)
    return tuple(_LAYER_TYPE_NAMES[t] for t in types)


def _window_layers(cfg: JsonObject, n_layers: int, all_sliding: bool) -> tuple[int, tuple | None]:
    window = cfg.int("sliding_window", 0, minimum=0)
    if not cfg.flag("use_sliding_window", True):
        window = 0
    types = _layer_types(cfg, n_layers) if window else None
    if types is not None:
        return window, types
    return (window, None) if all_sliding else (0, None)


def common_hf(cfg: JsonObject, name: str) -> dict:
    """The ModelConfig fields every family reads the same way (ModelConfig checks the ranges)."""
    n_heads = cfg.int("num_attention_heads", minimum=1)
    theta, scaling = rope_params(cfg)
    bos = cfg.token_ids("bos_token_id")
    return dict(
        dim=cfg.int("hidden_size", minimum=1), n_layers=_n_layers(cfg), n_heads=n_heads,
        n_kv_heads=cfg.int("num_key_value_heads", None, minimum=1) or n_heads, head_dim=_head_dim_or_none(cfg),
        ffn_dim=cfg.int("intermediate_size", minimum=1), vocab_size=cfg.int("vocab_size", minimum=1),
        max_seq_len=cfg.int("max_position_embeddings", None, minimum=1) or 2048,
        norm_eps=cfg.number("rms_norm_eps", 1e-5, positive=True), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        attention_bias=cfg.flag("attention_bias", False),
        bos_token_id=bos[0] if bos else None, eos_token_ids=cfg.token_ids("eos_token_id"), name=name)


def _mistral_hf(cfg):
    window, types = _window_layers(cfg, _n_layers(cfg), all_sliding=True)
    return dict(sliding_window=window, layer_types=types)


def _qwen2_hf(cfg):
    # Qwen2 windows only the layers its layer_types mark (use_sliding_window is usually off)
    window, types = _window_layers(cfg, _n_layers(cfg), all_sliding=False)
    return dict(attention_bias=True, sliding_window=window if types else 0, layer_types=types)


def _seed_oss_hf(cfg):
    # SeedOssConfig's defaults (q/k/v biases, head_dim 128, eps 1e-6) come from _HF_DEFAULTS;
    # it can also put biases on o_proj and the MLP, which no release does
    for key in ("attention_out_bias", "mlp_bias"):
        if cfg.flag(key, False):
            raise UnsupportedModelError(f"Seed-OSS: {key} is not supported")
    return {}


def _qwen3_hf(cfg):
    window, types = _window_layers(cfg, _n_layers(cfg), all_sliding=False)
    return dict(qk_norm=True, sliding_window=window if types else 0, layer_types=types)


def _absent_or(cfg, key: str, read):
    """read(): the key's value or its default where absent; None where the key is null (a
    feature turned off, where an absent key takes the config class's default)."""
    return None if key in cfg and cfg[key] is None else read()


def _softcaps_hf(cfg, attn: float | None = None, final: float | None = None) -> dict:
    """The soft caps; a key that is absent takes the family's default (transformers' config
    class: Gemma 2 50 and 30, Gemma 3 none), a null one turns the cap off."""
    caps = {}
    for key, field, default in (("attn_logit_softcapping", "attn_softcap", attn),
                                ("final_logit_softcapping", "final_softcap", final)):
        caps[field] = _absent_or(cfg, key, lambda: cfg.number(key, default, positive=True, null_ok=True)) or 0.0
    return caps


def _gemma_act(cfg, family: str) -> None:
    act = cfg.text("hidden_activation", None) or cfg.text("hidden_act", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{family}: activation {short(act)} is not supported")


def _gemma_hf(cfg):
    # Gemma 1: transformers' GemmaConfig runs hidden_act, the approximate GELU where it is absent,
    # and reads the released config.json files' "gelu" as that too (a legacy value, it says)
    head_dim = cfg.int("head_dim", 256, minimum=1) or _head_dim(cfg)
    theta, scaling = rope_params(cfg)
    act = cfg.text("hidden_act", None) or "gelu_pytorch_tanh"
    if act not in ("gelu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma: activation {short(act)} is not supported")
    return dict(head_dim=head_dim, activation="gelu_tanh", embed_scale=math.sqrt(cfg.int("hidden_size", minimum=1)),
                rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=True)


def _gemma2_hf(cfg):
    # keys a config leaves out take transformers' Gemma2Config defaults: head_dim 256, a 4096
    # window on every other layer from the first, query_pre_attn_scalar 256, caps 50 and 30
    n = _n_layers(cfg)
    head_dim = cfg.int("head_dim", 256, minimum=1) or _head_dim(cfg)
    window = _absent_or(cfg, "sliding_window", lambda: cfg.int("sliding_window", 4096, minimum=0)) or 0
    types = _layer_types(cfg, n) or tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    theta, scaling = rope_params(cfg)
    qpas = cfg.number("query_pre_attn_scalar", 256.0, positive=True, null_ok=True) or head_dim
    _gemma_act(cfg, "Gemma 2")
    return dict(head_dim=head_dim, post_norms=True, activation="gelu_tanh",
                embed_scale=math.sqrt(cfg.int("hidden_size", minimum=1)), attn_scale=qpas ** -0.5,
                sliding_window=window if "sliding" in types else 0, layer_types=types if window else None,
                rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=True,
                **_softcaps_hf(cfg, attn=50.0, final=30.0))


def _gemma3_hf(cfg):
    # keys a config leaves out take transformers' Gemma3TextConfig defaults: head_dim and
    # query_pre_attn_scalar 256, a 4096 window, rope bases 1e6 (global) and 10000 (sliding)
    n = _n_layers(cfg)
    head_dim = cfg.int("head_dim", 256, minimum=1) or _head_dim(cfg)
    window = _absent_or(cfg, "sliding_window", lambda: cfg.int("sliding_window", 4096, minimum=0)) or 0
    types = _layer_types(cfg, n)
    if types is None:
        pattern = (cfg.int("sliding_window_pattern", None, minimum=1)
                   or cfg.int("_sliding_window_pattern", 6, minimum=1))
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    theta, scaling = rope_params(cfg, "full_attention")
    if "rope_parameters" not in cfg and "rope_theta" not in cfg and "rope_scaling" not in cfg:
        theta = 1e6
    local_theta, local_scaling = rope_params(cfg, "sliding_attention")
    if "rope_local_base_freq" in cfg:
        local_theta = cfg.number("rope_local_base_freq", positive=True)
    if local_scaling is not None:
        raise UnsupportedModelError("Gemma 3: rope scaling on sliding layers is not supported")
    qpas = cfg.number("query_pre_attn_scalar", 256.0, positive=True, null_ok=True) or head_dim
    _gemma_act(cfg, "Gemma 3")
    return dict(head_dim=head_dim, qk_norm=True, post_norms=True, activation="gelu_tanh", **_softcaps_hf(cfg),
                embed_scale=math.sqrt(cfg.int("hidden_size", minimum=1)), attn_scale=qpas ** -0.5,
                sliding_window=window if "sliding" in types else 0, layer_types=types if window else None,
                rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, tie_word_embeddings=True)


def _rotary_dims(cfg, default: float = 1.0) -> int:
    """The leading dims of a head that rotate: head_dim * partial_rotary_factor (config.json's
    top level, else its rope_parameters, else ``default``), as transformers truncates it."""
    factor = cfg.number("partial_rotary_factor", None, positive=True, null_ok=True)
    params = cfg.obj("rope_parameters")
    if factor is None and params is not None:
        factor = params.number("partial_rotary_factor", None, positive=True, null_ok=True)
    if factor is not None and factor > 1:
        raise cfg.fail("partial_rotary_factor", "a number in (0, 1]", factor)
    hd = _head_dim(cfg)
    rot = int(hd * (factor if factor is not None else default))
    if rot < 2 or rot % 2:
        raise cfg.fail("partial_rotary_factor", f"a share of head_dim {hd} that rotates an even number of dims",
                       factor if factor is not None else default)
    return rot


def _phi3_hf(cfg):
    theta, scaling = rope_params(cfg)
    rot = _rotary_dims(cfg)
    if scaling is not None and scaling.get("rope_type") == "longrope":
        orig = cfg.int("original_max_position_embeddings", None, minimum=1)
        if orig is None:
            orig = JsonObject(scaling, cfg.where, prefix="rope_scaling.").int(
                "original_max_position_embeddings", None, minimum=1)
        if orig is None:
            raise ModelLoadError(f"{cfg.where}: longrope needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("factor") is None:
            scaling["factor"] = (cfg.int("max_position_embeddings", None, minimum=1) or orig) / orig
    window = cfg.int("sliding_window", 0, minimum=0)
    return dict(rotary_dim=rot, rope_scaling=scaling, rope_theta=theta, sliding_window=window)


def _smollm3_hf(cfg):
    n = _n_layers(cfg)
    flags = cfg.list("no_rope_layers", "flag", length=n)
    if flags is not None:
        nope = tuple(i for i, f in enumerate(flags) if not f)
    else:
        step = cfg.int("no_rope_layer_interval", 4, minimum=0)
        nope = tuple(i for i in range(n) if step and (i + 1) % step == 0)
    window, types = _window_layers(cfg, n, all_sliding=False)
    return dict(nope_layers=nope, sliding_window=window if types else 0, layer_types=types)


def _olmo2_hf(cfg):
    # OLMo 3 adds sliding-window layers (layer_types) and a rope for each kind of layer
    window, types = _window_layers(cfg, _n_layers(cfg), all_sliding=False)
    theta, scaling = rope_params(cfg, "full_attention")
    local_theta, local_scaling = rope_params(cfg, "sliding_attention")
    if types and local_scaling is not None:
        raise UnsupportedModelError("OLMo 3: rope scaling on sliding layers is not supported")
    return dict(qk_norm=True, qk_norm_whole=True, post_norms=True, sliding_window=window if types else 0,
                layer_types=types, rope_theta=theta, rope_scaling=scaling,
                rope_local_theta=local_theta if types else None)


def _exaone4_hf(cfg):
    # where config.json sets a sliding window, its layer_types (or else its sliding_window_pattern,
    # "LLLG" or a period, as transformers and llama.cpp's converter read it) name the sliding
    # layers, and the full ones have no rope; without a window every layer is full, with rope
    n = _n_layers(cfg)
    # no key: Exaone4Config's default window (4096); null: no sliding layers
    window = cfg.int("sliding_window", 0, minimum=0) if "sliding_window" in cfg else 4096
    types = _layer_types(cfg, n) if window else None
    if window and types is None:
        pattern = cfg.get("sliding_window_pattern")
        if isinstance(pattern, str):
            if not pattern or not set(pattern) <= {"L", "G"}:
                raise cfg.fail("sliding_window_pattern", "a period or a string of L and G", pattern)
            types = tuple("sliding" if pattern[i % len(pattern)] == "L" else "full" for i in range(n))
        else:
            step = cfg.int("sliding_window_pattern", 4, minimum=1)
            types = tuple("sliding" if (i + 1) % step else "full" for i in range(n))
    nope = tuple(i for i, t in enumerate(types) if t == "full") if window else ()
    return dict(qk_norm=True, post_norms=True, sliding_window=window, layer_types=types, nope_layers=nope)


def _ernie4_5_hf(cfg):
    if cfg.flag("use_bias", False):
        raise UnsupportedModelError("Ernie 4.5: biases on the linear layers (use_bias) are not supported")
    return {}


def _hunyuan_dense_hf(cfg):
    # CLA (k/v shared across layers) and biases, which cyllm does not apply: refused; the
    # checkpoints' rope is "dynamic" with a fixed alpha, which transformers reads as a stretched
    # base (its ntk_alpha: theta * alpha^(d / (d - 2))), the same at every length
    for key in ("attention_bias", "mlp_bias", "use_cla"):
        if cfg.flag(key, False):
            raise UnsupportedModelError(f"Hunyuan: {key} is not supported")
    fields = dict(qk_norm=True, qk_norm_after_rope=True)
    # the end of a document ends generation too (llama.cpp's converter makes it the file's EOS)
    eos = list(cfg.token_ids("eos_token_id"))
    eod = [e for e in cfg.token_ids("eod_token_id") if e not in eos]
    if eod:
        fields["eos_token_ids"] = eos + eod
    theta, scaling = rope_params(cfg)
    if scaling is not None and scaling["rope_type"] == "dynamic" and scaling.get("alpha") is not None:
        alpha = check_number(scaling["alpha"], "rope_parameters.alpha", positive=True, fail=cfg.fail)
        hd = _head_dim(cfg)
        if hd <= 2:
            raise cfg.fail("head_dim", "more than 2 with an alpha-scaled rope", hd)
        try:
            stretched = theta * alpha ** (hd / (hd - 2))
        except OverflowError:
            stretched = math.inf
        if not math.isfinite(stretched):
            raise cfg.fail("rope_parameters.alpha", f"small enough that rope_theta * alpha^({hd}/{hd - 2}) "
                           "is finite", scaling["alpha"])
        fields.update(rope_theta=stretched, rope_scaling=None)
    return fields


def _glm4_hf(cfg):
    # half of each head rotates by default (Glm4Config), in adjacent pairs (GPT-J style) in the
    # checkpoint itself; GLM-4V's multimodal rope is another model
    params = cfg.obj("rope_parameters") or cfg.obj("rope_scaling")
    if params is not None and "mrope_section" in params:
        raise UnsupportedModelError("GLM-4: multimodal rope (mrope_section) is not supported")
    rot = _rotary_dims(cfg, 0.5)
    return dict(rotary_dim=rot if rot != _head_dim(cfg) else None, post_norms=True)


def _experts_hf(cfg, family: str, norm_default: bool) -> dict:
    """A mixture of experts on every layer: the counts, each expert's MLP size (ffn_dim), and
    whether the chosen experts' weights are renormalized (``norm_topk_prob``)."""
    n = cfg.int("num_local_experts", None, minimum=1) or cfg.int("num_experts", minimum=1)
    step = cfg.int("decoder_sparse_step", 1, minimum=0)
    dense = cfg.list("mlp_only_layers", "int") or []
    if step != 1 or dense:
        raise UnsupportedModelError(f"{family}: dense MLP layers among the expert layers "
                                    "(decoder_sparse_step, mlp_only_layers) are not supported")
    if cfg.int("shared_expert_intermediate_size", 0, minimum=0):
        raise UnsupportedModelError(f"{family}: shared experts are not supported")
    ffn = cfg.int("moe_intermediate_size", None, minimum=1) or cfg.int("intermediate_size", minimum=1)
    return dict(n_experts=n, n_experts_used=cfg.int("num_experts_per_tok", minimum=1), ffn_dim=ffn,
                expert_norm=cfg.flag("norm_topk_prob", norm_default))


def _qwen3moe_hf(cfg):
    return {**_qwen3_hf(cfg), **_experts_hf(cfg, "Qwen3-MoE", norm_default=False)}


def _mixtral_hf(cfg):
    # transformers' Mixtral renormalizes the chosen experts' weights whatever the config says
    return {**_mistral_hf(cfg), **_experts_hf(cfg, "Mixtral", norm_default=True), "expert_norm": True}


def _olmoe_hf(cfg):
    if cfg.number("clip_qkv", None, positive=True, null_ok=True) is not None:
        raise UnsupportedModelError("OLMoE: clip_qkv is not supported")
    return dict(qk_norm=True, qk_norm_whole=True, **_experts_hf(cfg, "OLMoE", norm_default=False))


def _granitemoe_hf(cfg):
    # transformers' GraniteMoe: a softmax over the chosen experts' logits, i.e. their
    # probabilities renormalized, whatever the config says
    if cfg.int("shared_intermediate_size", 0, minimum=0):
        raise UnsupportedModelError("Granite MoE: shared experts are not supported")
    return {**_granite_hf(cfg), **_experts_hf(cfg, "Granite MoE", norm_default=True), "expert_norm": True}


def _granite_hf(cfg):
    # transformers' GraniteConfig defaults: every multiplier 1.0 (attention's too, not 1/sqrt(d))
    return dict(embed_scale=cfg.number("embedding_multiplier", 1.0, positive=True),
                residual_scale=cfg.number("residual_multiplier", 1.0, positive=True),
                attn_scale=cfg.number("attention_multiplier", 1.0, positive=True),
                logit_scale=1.0 / cfg.number("logits_scaling", 1.0, positive=True))


# -- reading GGUF metadata -------------------------------------------------------------

def _gguf_scale(md, key: str, default: float | None) -> float | None:
    """A positive float of the metadata, or ``default`` where the key is absent."""
    v = md.get(key)
    return default if v is None else check_number(v, "GGUF " + key, positive=True)


def _gguf_scalar(md, key: str):
    """A metadata value that must be one number or flag (absent: None): an array there is refused
    in one line, not compared as one (numpy's ambiguous truth value)."""
    v = md.get(key)
    if isinstance(v, (list, tuple, np.ndarray)):
        raise ModelLoadError(f"GGUF: {short(key, 60)} must be a single value, got an array")
    return v


def _experts_gguf(md, p: str, family: str, norm: bool) -> dict:
    """The expert counts and sizes of a mixture-of-experts file. ``norm``: whether the chosen
    experts' weights are renormalized, which llama.cpp fixes for each of these architectures
    (Qwen3-MoE and Mixtral yes, OLMoE no) whatever a file's expert_weights_norm says."""
    n, used = _gguf_scalar(md, p + "expert_count"), _gguf_scalar(md, p + "expert_used_count")
    if not n:
        raise ModelLoadError(f"GGUF: a {family} file needs {p}expert_count, got {short(n)}")
    gating = _gguf_scalar(md, p + "expert_gating_func")
    if gating not in (None, 1):             # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModelError(f"GGUF: expert gating function {short(gating)} is not supported (softmax only)")
    scale = _gguf_scalar(md, p + "expert_weights_scale")
    if scale not in (None, 0, 0.0, 1, 1.0):
        raise UnsupportedModelError(f"GGUF: expert weight scale {short(scale)} is not supported")
    if _gguf_scalar(md, p + "expert_shared_count"):
        raise UnsupportedModelError("GGUF: shared experts are not supported")
    out = dict(n_experts=n, n_experts_used=used, expert_norm=norm)
    ffn = _gguf_scalar(md, p + "expert_feed_forward_length")
    if ffn is not None:
        out["ffn_dim"] = ffn
    return out


def _qwen3moe_gguf(md, p, t):
    return _experts_gguf(md, p, "qwen3moe", norm=True)


def _mixtral_gguf(md, p, t):
    return {**_sliding_gguf(md, p, t), **_experts_gguf(md, p, "Mixtral", norm=True)}


def _olmoe_gguf(md, p, t):
    return dict(qk_norm=True, qk_norm_whole=True, **_experts_gguf(md, p, "olmoe", norm=False))


def _olmo2_gguf(md, p, t):
    # llama.cpp's olmo2 architecture also carries OLMo 3, whose files name a sliding window
    if md.get(p + "attention.sliding_window"):
        raise UnsupportedModelError("OLMo 3 GGUF files (sliding-window layers) are not supported; "
                                    "its Hugging Face directory is")
    return dict(qk_norm=True, qk_norm_whole=True, post_norms=True)


def _gguf_sliding(md, p: str, n: int, default_step: int) -> tuple:
    """Each layer's kind from attention.sliding_window_pattern as llama.cpp reads it: a flag a
    layer, or a period whose last layer is full (0: every layer sliding); absent: default_step.
    Anything else is refused in one line, not read as the default."""
    key = p + "attention.sliding_window_pattern"
    pattern = md.get(key)
    if isinstance(pattern, (list, tuple, np.ndarray)):
        flags = list(pattern)
        if len(flags) != n or not all(isinstance(v, (bool, np.bool_, int, np.integer)) and v in (0, 1)
                                      for v in flags):
            raise ModelLoadError(f"GGUF: {key} must be {n} flags (one a layer), got {short(pattern)}")
        return tuple("sliding" if v else "full" for v in flags)
    if pattern is None:
        step = default_step
    elif isinstance(pattern, (int, np.integer)) and not isinstance(pattern, (bool, np.bool_)) and pattern >= 0:
        step = int(pattern)
    else:
        raise ModelLoadError(f"GGUF: {key} must be a period or a flag a layer, got {short(pattern)}")
    return tuple("sliding" if step == 0 or i % step < step - 1 else "full" for i in range(n))


def _gguf_window(md, p: str, default: int) -> int:
    """attention.sliding_window: a whole number of positions (0 or absent: ``default``)."""
    key = p + "attention.sliding_window"
    v = _gguf_scalar(md, key)
    if v is None:
        return default
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ModelLoadError(f"GGUF: {key} must be a whole number of positions, got {short(v)}")
    return int(v) or default


def _exaone4_gguf(md, p, t):
    # llama.cpp's exaone4 runs sliding layers only in the 64-layer 32B: its window (default 4096)
    # on the layers the file's pattern marks (default: three of every four), no rope on the
    # others; any other depth is all full layers with rope, whatever the file says
    n = _gguf_scalar(md, p + "block_count")
    out = dict(qk_norm=True, post_norms=True)
    if n != 64:
        return out
    types = _gguf_sliding(md, p, n, 4)
    out.update(sliding_window=_gguf_window(md, p, 4096), layer_types=types,
               nope_layers=tuple(i for i, v in enumerate(types) if v == "full"))
    # only the sliding layers have rope, with the file's scaling: their base is the model's
    base = _gguf_scalar(md, p + "rope.freq_base_swa")
    if base is not None:
        out["rope_theta"] = float(check_number(base, "GGUF " + p + "rope.freq_base_swa", positive=True))
    return out


def _granite_gguf(md, p, t):
    # llama.cpp's converter writes each multiplier only when config.json has it; llama.cpp
    # then scales attention by 1/sqrt(head_dim) and leaves the rest alone
    return dict(embed_scale=_gguf_scale(md, p + "embedding_scale", 1.0),
                residual_scale=_gguf_scale(md, p + "residual_scale", 1.0),
                attn_scale=_gguf_scale(md, p + "attention.scale", None),
                logit_scale=1.0 / _gguf_scale(md, p + "logit_scale", 1.0))


def _granitemoe_gguf(md, p, t):
    # llama.cpp renormalizes the chosen experts' weights for granitemoe, as transformers does;
    # its converter writes GraniteMoeShared as granitemoe too, with a shared expert's size
    if _gguf_scalar(md, p + "expert_shared_feed_forward_length"):
        raise UnsupportedModelError("GGUF: Granite MoE with shared experts is not supported")
    return {**_granite_gguf(md, p, t), **_experts_gguf(md, p, "granitemoe", norm=True)}


def _sliding_gguf(md, p, t):
    w = _gguf_window(md, p, 0)          # a bad value refused in one line, not read as none
    return dict(sliding_window=w) if w else {}


def _gemma_gguf(md, p, default_step: int, layers_27b: int, default_window: int = 0) -> dict:
    """What Gemma 2 and 3 files share: the sliding layers (the pattern key, else llama.cpp's
    fixed step: every step-th layer global; the window key, else ``default_window``), the query
    scale, the embedding scale, the norms."""
    n = md[p + "block_count"]
    types = _gguf_sliding(md, p, n, default_step)
    dim, heads = md[p + "embedding_length"], md[p + "attention.head_count"]
    head_dim = md.get(p + "attention.key_length") or dim // heads
    # GGUF keeps no query_pre_attn_scalar; llama.cpp uses head_dim, except for the 27B
    qpas = dim // heads if n == layers_27b else head_dim
    window = _gguf_window(md, p, default_window)
    return dict(post_norms=True, activation="gelu_tanh", embed_scale=math.sqrt(dim),
                attn_scale=qpas ** -0.5, sliding_window=int(window),
                layer_types=types if window else None, tie_word_embeddings=True)


def _gemma1_gguf(md, p, t):
    # llama.cpp's Gemma: GELU (tanh), embeddings scaled by sqrt(dim), queries by 1/sqrt(head_dim)
    return dict(activation="gelu_tanh", embed_scale=math.sqrt(md[p + "embedding_length"]), tie_word_embeddings=True)


def _gemma2_gguf(md, p, t):
    # llama.cpp: every other layer sliding, 4096 positions where the file names no window, and
    # caps of 50 and 30 where it names none
    out = _gemma_gguf(md, p, 2, 46, default_window=4096)
    caps = {}
    for key, field, default in (("attn_logit_softcapping", "attn_softcap", 50.0),
                                ("final_logit_softcapping", "final_softcap", 30.0)):
        caps[field] = _gguf_scale(md, p + key, default)
    return {**out, **caps}


def _gemma3_gguf(md, p, t):
    # llama.cpp's fixed Gemma 3 layout: every sixth layer is global; the 27B has 62 layers
    return dict(_gemma_gguf(md, p, 6, 62), qk_norm=True, rope_local_theta=10000.0)


def _phi3_gguf(md, p, t):
    out = _sliding_gguf(md, p, t)
    rot = md.get(p + "rope.dimension_count")
    if isinstance(rot, int):
        out["rotary_dim"] = rot
    if "rope_factors_long.weight" in t and "rope_factors_short.weight" in t:
        orig = md.get(p + "rope.scaling.original_context_length")
        ctx = md.get(p + "context_length")
        if not isinstance(orig, int) or orig <= 0:
            raise ModelLoadError("GGUF: phi3 rope factors need rope.scaling.original_context_length")
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": t["rope_factors_long.weight"].tolist(),
            "short_factor": t["rope_factors_short.weight"].tolist(),
            "original_max_position_embeddings": orig,
            "factor": (ctx or orig) / orig,
            "attention_factor": md.get(p + "rope.scaling.attn_factor")}
    return out


def _smollm3_gguf(md, p, t):
    n = md[p + "block_count"]
    # llama.cpp's SmolLM3: every fourth layer has no rope
    return dict(nope_layers=tuple(i for i in range(n) if (i + 1) % 4 == 0))


# -- the families ----------------------------------------------------------------------

_P = "model.layers.{i}."
LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",), "llama", _table(), permute_qk=True)
MISTRAL = Family("mistral", ("MistralForCausalLM",), ("mistral",), "llama", _table(), permute_qk=True,
                 hf_features=_mistral_hf, gguf_features=_sliding_gguf,
                 hf_extra=lambda c: {"sliding_window": c.sliding_window or None})
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", _table(), hf_features=_qwen2_hf,
               hf_extra=lambda c: {"use_sliding_window": False})
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", _table(), hf_features=_qwen3_hf)
# Seed-OSS: Qwen2's q/k/v biases; llama.cpp names the pre-MLP norm post_attention_norm
SEED_OSS = Family(
    "seed_oss", ("SeedOssForCausalLM",), ("seed_oss",), "seed_oss",
    _table(ffn_norm__weight=Tensor("ffn_norm.weight", _P + "post_attention_layernorm.weight", _vec,
                                   gguf="blk.{i}.post_attention_norm.weight")),
    hf_features=_seed_oss_hf, hf_extra=lambda c: {"attention_out_bias": False, "mlp_bias": False})
SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), "smollm3", _table(), permute_qk=True,
                 hf_features=_smollm3_hf, gguf_features=_smollm3_gguf,
                 hf_extra=lambda c: {"no_rope_layers": [0 if i in c.nope_layers else 1
                                                        for i in range(c.n_layers)]})
_G = dict(hf_plus_one=True)
# Gemma 2 and 3: (1+w) norms before and after each sub-block, no output matrix (tied)
_GEMMA_NORMS = dict(
    output__weight=None,
    output_norm__weight=Tensor("output_norm.weight", "model.norm.weight", _vec, **_G),
    attn_norm__weight=Tensor("attn_norm.weight", _P + "input_layernorm.weight", _vec, **_G),
    post_attention_norm__weight=Tensor("post_attention_norm.weight",
                                       _P + "post_attention_layernorm.weight", _vec, **_G),
    ffn_norm__weight=Tensor("ffn_norm.weight", _P + "pre_feedforward_layernorm.weight", _vec, **_G),
    post_ffw_norm__weight=Tensor("post_ffw_norm.weight", _P + "post_feedforward_layernorm.weight", _vec, **_G))


def _gemma_hf_extra(c: ModelConfig) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": c.sliding_window or None,
            "layer_types": [("sliding_attention" if c.layer_window(i) else "full_attention")
                            for i in range(c.n_layers)],
            "query_pre_attn_scalar": round(c.attn_scale ** -2) if c.attn_scale else c.head_dim,
            "attn_logit_softcapping": c.attn_softcap or None, "final_logit_softcapping": c.final_softcap or None}


# Gemma 1: Llama's two norms a layer as (1+w), GELU-tanh, embedding scale, tied
GEMMA = Family(
    "gemma", ("GemmaForCausalLM",), ("gemma",), "gemma",
    _table(output__weight=None, attn_q_norm__weight=None, attn_k_norm__weight=None,
           output_norm__weight=Tensor("output_norm.weight", "model.norm.weight", _vec, **_G),
           attn_norm__weight=Tensor("attn_norm.weight", _P + "input_layernorm.weight", _vec, **_G),
           ffn_norm__weight=Tensor("ffn_norm.weight", _P + "post_attention_layernorm.weight", _vec, **_G)),
    hf_features=_gemma_hf, gguf_features=_gemma1_gguf,
    hf_extra=lambda c: {"hidden_act": "gelu_pytorch_tanh"})
GEMMA2 = Family(
    "gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "gemma2",
    _table(attn_q_norm__weight=None, attn_k_norm__weight=None, **_GEMMA_NORMS),
    hf_features=_gemma2_hf, gguf_features=_gemma2_gguf, hf_extra=_gemma_hf_extra)
GEMMA3 = Family(
    "gemma3", ("Gemma3ForCausalLM",), ("gemma3_text", "gemma3"), "gemma3",
    _table(attn_q_norm__weight=Tensor("attn_q_norm.weight", _P + "self_attn.q_norm.weight", _hd, **_G),
           attn_k_norm__weight=Tensor("attn_k_norm.weight", _P + "self_attn.k_norm.weight", _hd, **_G),
           **_GEMMA_NORMS),
    hf_features=_gemma3_hf, gguf_features=_gemma3_gguf,
    hf_extra=lambda c: {**_gemma_hf_extra(c), "rope_local_base_freq": c.rope_local_theta})
PHI3 = Family(
    "phi3", ("Phi3ForCausalLM",), ("phi3",), "phi3",
    _table(attn_q__weight=None, attn_k__weight=None, attn_v__weight=None,
           attn_q__bias=None, attn_k__bias=None, attn_v__bias=None, ffn_gate__weight=None, ffn_up__weight=None,
           attn_qkv__weight=Tensor("attn_qkv.weight", _P + "self_attn.qkv_proj.weight",
                                   lambda c: (c.q_dim + 2 * c.kv_dim, c.dim)),
           ffn_gate_up__weight=Tensor("ffn_gate_up.weight", _P + "mlp.gate_up_proj.weight",
                                      lambda c: (2 * c.ffn_dim, c.dim), gguf="blk.{i}.ffn_up.weight")),
    hf_features=_phi3_hf, gguf_features=_phi3_gguf,
    gguf_config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
    hf_extra=lambda c: {"partial_rotary_factor": (c.rotary_dim or c.head_dim) / c.head_dim,
                        "sliding_window": c.sliding_window or None},
    fused_qkv=True, fused_gate_up=True)
def _granite_extra(c: ModelConfig) -> dict:
    return {"embedding_multiplier": c.embed_scale, "residual_multiplier": c.residual_scale,
            "attention_multiplier": c.attn_scale or c.head_dim ** -0.5, "logits_scaling": 1.0 / c.logit_scale}


GRANITE = Family("granite", ("GraniteForCausalLM",), ("granite",), "granite", _table(), permute_qk=True,
                 hf_features=_granite_hf, gguf_features=_granite_gguf, hf_extra=_granite_extra)
# OLMo 2: no norm before attention or the MLP (they read the stream), one RMSNorm over all of q
# and one over all of k, and a norm on each sub-block's output before the residual add
OLMO2 = Family(
    "olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), ("olmo2", "olmo3"), "olmo2",
    _table(attn_norm__weight=None, ffn_norm__weight=None,
           attn_q_norm__weight=Tensor("attn_q_norm.weight", _P + "self_attn.q_norm.weight", lambda c: (c.q_dim,)),
           attn_k_norm__weight=Tensor("attn_k_norm.weight", _P + "self_attn.k_norm.weight", lambda c: (c.kv_dim,)),
           post_attention_norm__weight=Tensor("post_attention_norm.weight",
                                              _P + "post_attention_layernorm.weight", _vec),
           post_ffw_norm__weight=Tensor("post_ffw_norm.weight", _P + "post_feedforward_layernorm.weight", _vec)),
    hf_features=_olmo2_hf, gguf_features=_olmo2_gguf)

# EXAONE 4: OLMo 2's block (norms on each sub-block's output, none before) with Qwen3's per-head
# q/k norms; hybrid models (the 32B) slide three layers of four and give the fourth no rope
EXAONE4 = Family(
    "exaone4", ("Exaone4ForCausalLM",), ("exaone4",), "exaone4",
    _table(attn_norm__weight=None, ffn_norm__weight=None,
           post_attention_norm__weight=Tensor("post_attention_norm.weight",
                                              _P + "post_attention_layernorm.weight", _vec),
           post_ffw_norm__weight=Tensor("post_ffw_norm.weight", _P + "post_feedforward_layernorm.weight", _vec)),
    hf_features=_exaone4_hf, gguf_features=_exaone4_gguf,
    hf_extra=lambda c: {"sliding_window": c.sliding_window or None,
                        "layer_types": [("sliding_attention" if c.layer_window(i) else "full_attention")
                                        for i in range(c.n_layers)]})

# Ernie 4.5 (dense): Llama's block with interleaved (GPT-J style) rope in the checkpoint itself
ERNIE4_5 = Family("ernie4_5", ("Ernie4_5ForCausalLM",), ("ernie4_5",), "ernie4_5", _table(), permute_qk=True,
                  hf_rope_interleaved=True, hf_features=_ernie4_5_hf, hf_extra=lambda c: {"use_bias": False})

# GLM-4 (Glm4ForCausalLM: GLM-4-9B/32B-0414, GLM-Z1): q/k/v biases, half of each head rotating
# in adjacent pairs (the checkpoint's own order, as llama.cpp's), gate and up in one tensor,
# and norms on both sub-blocks' outputs besides the pre-norms
GLM4 = Family(
    "glm4", ("Glm4ForCausalLM",), ("glm4",), "glm4",
    _table(ffn_gate__weight=None, ffn_up__weight=None,
           ffn_gate_up__weight=Tensor("ffn_gate_up.weight", _P + "mlp.gate_up_proj.weight",
                                      lambda c: (2 * c.ffn_dim, c.dim), gguf="blk.{i}.ffn_up.weight"),
           post_attention_norm__weight=Tensor("post_attention_norm.weight",
                                              _P + "post_self_attn_layernorm.weight", _vec),
           post_ffw_norm__weight=Tensor("post_ffw_norm.weight", _P + "post_mlp_layernorm.weight", _vec)),
    permute_qk=True, hf_rope_interleaved=True, hf_features=_glm4_hf,
    gguf_features=lambda md, p, t: dict(post_norms=True),
    hf_extra=lambda c: {"partial_rotary_factor": (c.rotary_dim or c.head_dim) / c.head_dim,
                        "attention_bias": bool(c.attention_bias)},
    fused_gate_up=True)

# Hunyuan dense (HunYuanDenseV1): Llama's block with per-head q/k norms taken after rope
HUNYUAN_DENSE = Family(
    "hunyuan_dense", ("HunYuanDenseV1ForCausalLM",), ("hunyuan_v1_dense",), "hunyuan-dense",
    _table(attn_q_norm__weight=Tensor("attn_q_norm.weight", _P + "self_attn.query_layernorm.weight", _hd,
                                      when=lambda c: c.qk_norm),
           attn_k_norm__weight=Tensor("attn_k_norm.weight", _P + "self_attn.key_layernorm.weight", _hd,
                                      when=lambda c: c.qk_norm)),
    hf_features=_hunyuan_dense_hf, gguf_features=lambda md, p, t: dict(qk_norm_after_rope=True),
    hf_extra=lambda c: {"attention_bias": False, "mlp_bias": False, "use_cla": False})

# Mixtures of experts: the block of their dense sibling with the MLP replaced by a router and
# n_experts gated MLPs (_moe_rows)
_QWEN_EXPERTS = _moe_rows("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                          "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
def _experts_hf_extra(c: ModelConfig, count_key: str) -> dict:
    return {count_key: c.n_experts, "num_experts_per_tok": c.n_experts_used, "norm_topk_prob": c.expert_norm}


QWEN3MOE = Family("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", _table(**_QWEN_EXPERTS),
                  hf_features=_qwen3moe_hf, gguf_features=_qwen3moe_gguf,
                  hf_extra=lambda c: {**_experts_hf_extra(c, "num_experts"), "moe_intermediate_size": c.ffn_dim,
                                      "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False})
MIXTRAL = Family(
    "mixtral", ("MixtralForCausalLM",), ("mixtral",), "llama",
    _table(**_moe_rows("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                       "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")),
    permute_qk=True, hf_features=_mixtral_hf, gguf_features=_mixtral_gguf,
    hf_extra=lambda c: {**_experts_hf_extra(c, "num_local_experts"), "sliding_window": c.sliding_window or None})
OLMOE = Family(
    "olmoe", ("OlmoeForCausalLM",), ("olmoe",), "olmoe",
    _table(attn_q_norm__weight=Tensor("attn_q_norm.weight", _P + "self_attn.q_norm.weight", lambda c: (c.q_dim,)),
           attn_k_norm__weight=Tensor("attn_k_norm.weight", _P + "self_attn.k_norm.weight", lambda c: (c.kv_dim,)),
           **_QWEN_EXPERTS),
    hf_features=_olmoe_hf, gguf_features=_olmoe_gguf,
    hf_extra=lambda c: {**_experts_hf_extra(c, "num_experts"), "clip_qkv": None})

# Granite MoE: Granite's block and multipliers; its checkpoints keep a layer's experts in two
# tensors (input_linear: gate and up, output_linear: down), which llama.cpp splits into three
GRANITEMOE = Family(
    "granitemoe", ("GraniteMoeForCausalLM",), ("granitemoe",), "granitemoe",
    _table(**_moe_rows("block_sparse_moe.router.layer.weight", "block_sparse_moe.input_linear.weight",
                       "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
                       stacked=True)),
    permute_qk=True, hf_features=_granitemoe_hf, gguf_features=_granitemoe_gguf,
    hf_extra=lambda c: {**_granite_extra(c), **_experts_hf_extra(c, "num_local_experts")})

# Each family's transformers config class defaults for keys a config.json may leave out, where
# they differ from common_hf's (Family.hf_defaults; tests/test_hardening_files.py checks them
# against the classes)
_EPS6 = ("rms_norm_eps", 1e-6)
_HF_DEFAULTS = {
    "llama": (_EPS6,), "mistral": (_EPS6, ("max_position_embeddings", 131072)),
    "qwen2": (_EPS6, ("max_position_embeddings", 32768)), "qwen3": (_EPS6, ("max_position_embeddings", 32768)),
    "seed_oss": (_EPS6, ("max_position_embeddings", 524288), ("attention_bias", True), ("head_dim", 128)),
    "gemma": (_EPS6, ("max_position_embeddings", 8192)), "gemma2": (_EPS6, ("max_position_embeddings", 8192)),
    "gemma3": (_EPS6, ("max_position_embeddings", 131072)), "phi3": (("max_position_embeddings", 4096),),
    "smollm3": (_EPS6, ("max_position_embeddings", 32768), ("tie_word_embeddings", True), ("rope_theta", 2e6)),
    "granite": (_EPS6,), "qwen3moe": (_EPS6, ("max_position_embeddings", 32768)),
    "mixtral": (("max_position_embeddings", 131072), ("rope_theta", 1e6)),
    "olmoe": (("max_position_embeddings", 4096),), "granitemoe": (_EPS6,),
    "ernie4_5": (("max_position_embeddings", 131072), ("tie_word_embeddings", True), ("rope_theta", 5e5)),
    "glm4": (("max_position_embeddings", 131072), ("rms_norm_eps", 1.5625e-7), ("attention_bias", True),
             ("head_dim", 128), ("num_key_value_heads", 2)),
}
FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, SEED_OSS, GEMMA, GEMMA2, GEMMA3, PHI3, SMOLLM3, GRANITE,
                                OLMO2, EXAONE4, ERNIE4_5, GLM4, HUNYUAN_DENSE, QWEN3MOE, MIXTRAL, OLMOE,
                                GRANITEMOE)
BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnsupportedModelError(f"model family {name!r} is not supported "
                                    f"(supported: {', '.join(BY_NAME)})") from None


def family_for_hf(cfg: dict) -> Family:
    cfg = cfg if isinstance(cfg, JsonObject) else JsonObject(cfg, "config.json")
    archs = cfg.list("architectures", "str")
    supported = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    for arch in archs or []:
        for f in FAMILIES:
            if arch in f.hf_architectures:
                return f
    if not archs:
        mt = cfg.get("model_type")
        for f in FAMILIES:
            if isinstance(mt, str) and mt in f.hf_model_types:
                return f
        raise UnsupportedModelError(f"model_type {short(mt, 60)} is not supported (supported: {supported})")
    raise UnsupportedModelError(f"architecture {short(archs[0], 60)} is not supported (supported: {supported})")


def family_for_gguf(arch: str, md: dict) -> Family:
    if arch == "llama" and _gguf_scalar(md, "llama.expert_count"):
        return MIXTRAL          # llama.cpp writes Mixtral as llama with experts
    if arch == "llama" and _gguf_scalar(md, "llama.attention.sliding_window"):
        return MISTRAL
    for f in FAMILIES:
        if f.gguf_arch == arch:
            return f
    supported = ", ".join(sorted({f.gguf_arch for f in FAMILIES}))
    raise UnsupportedModelError(f"GGUF architecture {short(arch, 60)} is not supported (supported: {supported})")


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    """ModelConfig from a parsed Hugging Face config.json (a JsonObject from jsonio.read_json_file,
    or a plain dict)."""
    cfg = cfg if isinstance(cfg, JsonObject) else JsonObject(cfg, "config.json")
    fam = family_for_hf(cfg)
    if fam.hf_defaults:
        cfg = JsonObject({**dict(fam.hf_defaults), **cfg}, cfg.where, cfg.err)
    fields = common_hf(cfg, name)
    try:
        fields.update(fam.hf_features(cfg))
        if fields["head_dim"] is None:
            _head_dim(cfg)      # no family default either: its one-line error
        return ModelConfig(arch=fam.name, **fields)
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as e:
        # a guard: the typed reads above should leave nothing for this to catch
        raise ModelLoadError(f"{cfg.where}: bad value ({type(e).__name__}: {one_line(e, 120)})") from None


def hf_config_dict(c: ModelConfig, torch_dtype: str = "float16") -> dict:
    """config.json for a directory transformers loads as this family (used by convert)."""
    fam = family(c.arch)
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    if scaling and "divisors" in scaling:
        scaling = None    # GGUF llama3 divisors have no exact HF form; convert refuses them earlier
    d = {
        "architectures": [fam.hf_architectures[0]], "model_type": fam.hf_model_types[0],
        "hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": scaling, "hidden_act": "silu",
        "attention_bias": bool(c.attention_bias), "mlp_bias": False,
        "tie_word_embeddings": bool(c.tie_word_embeddings), "torch_dtype": torch_dtype,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": (c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids))
        if c.eos_token_ids else None,
        "pad_token_id": None,       # else transformers fills in its class default, maybe past the vocabulary
        "use_cache": True,
    }
    if scaling and scaling.get("rope_type") == "longrope":
        d["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    d.update(fam.hf_extra(c))
    return d
