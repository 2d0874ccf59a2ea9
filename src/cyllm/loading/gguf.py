"""GGUF (llama.cpp's single-file format) -> ModelConfig, HF-named weights, Tokenizer.

The container (header, metadata, tensor table, memory map) is read by gguf_file.py;
this module turns it into a model. Dequantization of the block formats is delegated
to ``gguf.quants``.

A fact about llama.cpp's files this code relies on: its HF->GGUF converter reorders
the rows of attn_q / attn_k within each head from the "rotate half" layout (pairs
i, i + d/2) to the interleaved layout (pairs 2i, 2i + 1). ``_unpermute_rows`` undoes it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from ..config import MAX_DIM, MAX_LAYERS, ModelConfig
from ..families import family, family_for_gguf
from ..errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ..jsonio import JsonObject
from ..oneline import one_line
from .gguf_file import (BF16, F16, F32, SUPPORTED_TENSOR_TYPES, GGUFFile, GGUFTensorInfo, clip, meta_value,
                        read_gguf)

_FP16_MAX = 65504.0

# ----------------------------------------------------------------------------- config

def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    try:
        return _config_from_gguf(gf)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, KeyError) as e:
        # a guard: the typed reads below should leave little for this to catch
        raise ModelLoadError(f"{one_line(gf.path)}: bad GGUF hyperparameters ({type(e).__name__}: "
                             f"{clip(e, 200)})") from None


def _typed_metadata(gf: GGUFFile) -> JsonObject:
    """The metadata with typed, range-checked accessors (messages name the file and the key)."""
    md = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in gf.metadata.items()}
    return JsonObject(md, f"{one_line(gf.path)}: GGUF metadata")


def _rope_scaling(gf: GGUFFile, m: JsonObject, p: str, rot_dim: int) -> dict | None:
    kind = m.text(p + "rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": m.number(p + "rope.scaling.factor", 1.0, positive=True)}
    if kind == "yarn":
        # llama.cpp's YaRN is transformers' when only these keys are set (its magnitude then is
        # 0.1 ln(factor) + 1); its attention-factor and log-multiplier keys follow rules of
        # their own, per architecture
        other = [k for k in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier",
                             "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor") if p + k in gf.metadata]
        if other:
            raise UnsupportedModelError(f"{one_line(gf.path)}: YaRN with {p}{other[0]} is not supported")
        return {"rope_type": "yarn", "factor": m.number(p + "rope.scaling.factor", positive=True),
                "original_max_position_embeddings": m.int(p + "rope.scaling.original_context_length", minimum=1),
                "beta_fast": m.number(p + "rope.scaling.yarn_beta_fast", 32.0, positive=True),
                "beta_slow": m.number(p + "rope.scaling.yarn_beta_slow", 1.0, positive=True)}
    if kind not in ("none", ""):
        raise UnsupportedModelError(f"{one_line(gf.path)}: rope scaling {clip(repr(kind))} is not supported")
    if "rope_freqs.weight" in gf.tensors:
        # Llama 3.x: the scaled frequencies' divisors, used as they are
        div = _tensor_float32(gf, gf.tensors["rope_freqs.weight"]).reshape(-1)
        if div.shape != (rot_dim // 2,):
            raise ModelLoadError(f"{one_line(gf.path)}: rope_freqs has {div.size} entries, expected {rot_dim // 2}")
        if not np.allclose(div, 1.0):
            return {"rope_type": "llama3", "divisors": div.astype(np.float64).tolist()}
    return None


def _block_indices(gf: GGUFFile) -> set[str]:
    """The distinct block numbers of the file's ``blk.N.*`` tensors (as written)."""
    return {m.group(1) for m in map(_BLK_RE.match, gf.tensors) if m}


def _config_from_gguf(gf: GGUFFile) -> ModelConfig:
    md = gf.metadata
    m = _typed_metadata(gf)
    where = one_line(gf.path)
    arch = m.text("general.architecture", None)
    if arch is None:
        raise ModelLoadError(f"{where}: GGUF metadata has no general.architecture")
    fam = family_for_gguf(arch, md)
    p = f"{arch}."
    if isinstance(md.get(p + "attention.head_count"), (np.ndarray, list)) or isinstance(
            md.get(p + "attention.head_count_kv"), (np.ndarray, list)):
        raise UnsupportedModelError(f"{where}: per-layer head counts are not supported")
    if isinstance(md.get(p + "feed_forward_length"), (np.ndarray, list)):
        raise UnsupportedModelError(f"{where}: per-layer feed-forward sizes are not supported")
    # counts are bounded before anything (per-layer lists, caches) is sized from them
    dim = m.int(p + "embedding_length", minimum=1, maximum=MAX_DIM)
    n_layers = m.int(p + "block_count", minimum=1, maximum=MAX_LAYERS)
    blocks = _block_indices(gf)
    if n_layers > len(blocks):
        raise ModelLoadError(f"{where}: GGUF {p}block_count is {n_layers}, but the file holds the tensors "
                             f"of {len(blocks)} blocks")
    n_heads = m.int(p + "attention.head_count", minimum=1, maximum=MAX_DIM)
    n_kv = m.int(p + "attention.head_count_kv", n_heads, minimum=1, maximum=MAX_DIM)
    head_dim = m.int(p + "attention.key_length", None, minimum=1, maximum=MAX_DIM)
    if head_dim is None:
        if dim % n_heads:
            raise ModelLoadError(f"{where}: GGUF {p}embedding_length {dim} is not a multiple of "
                                 f"attention.head_count {n_heads} and no attention.key_length is given")
        head_dim = dim // n_heads
    v_dim = m.int(p + "attention.value_length", head_dim, minimum=1)
    if v_dim != head_dim:
        raise UnsupportedModelError(f"{where}: key length {head_dim} != value length {v_dim}")
    rot = m.int(p + "rope.dimension_count", head_dim, minimum=1, maximum=MAX_DIM)
    emb = gf.tensors.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(f"{where}: GGUF file has no token_embd.weight tensor")
    if len(emb.dims) != 2 or emb.dims[0] != dim:
        raise ModelLoadError(f"{where}: token_embd.weight has dims {emb.dims}, expected [{dim}, vocab]")
    vocab = emb.dims[1]
    if "blk.0.ffn_gate_up_exps.weight" in gf.tensors:
        raise UnsupportedModelError(f"{where}: expert gate and up matrices fused in one tensor "
                                    "(ffn_gate_up_exps) are not supported")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta_value(md, key)
        if isinstance(v, int) and 0 <= v < vocab and v not in eos_ids:
            eos_ids.append(v)
    bos = meta_value(md, "tokenizer.ggml.bos_token_id")
    name = meta_value(md, "general.name")
    fields = dict(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=m.int(p + "feed_forward_length", minimum=1), vocab_size=vocab,
        max_seq_len=m.int(p + "context_length", 2048, minimum=1),
        norm_eps=m.number(p + "attention.layer_norm_rms_epsilon", 1e-5, positive=True),
        rope_theta=m.number(p + "rope.freq_base", 10000.0, positive=True),
        rope_scaling=_rope_scaling(gf, m, p, rot),
        rotary_dim=rot if rot != head_dim else None,
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors or "blk.0.attn_qkv.bias" in gf.tensors,   # (fused: --fuse-qkv)
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        bos_token_id=bos if isinstance(bos, int) and 0 <= bos < vocab else None,
        eos_token_ids=eos_ids, name=name if isinstance(name, str) else gf.path.stem)
    config_tensors = {n: _tensor_float32(gf, gf.tensors[n]).reshape(-1)
                      for n in fam.gguf_config_tensors if n in gf.tensors}
    meta = {k: v for k, v in m.items() if k.startswith(p)}
    fields.update(fam.gguf_features(meta, p, config_tensors))
    try:
        cfg = ModelConfig(arch=fam.name, **fields)
    except TypeError as e:
        raise ModelLoadError(f"{where}: bad GGUF hyperparameter ({clip(e, 200)})") from None
    if "blk.0.ffn_gate_exps.weight" in gf.tensors and not cfg.moe:
        raise UnsupportedModelError(f"{where}: mixture-of-experts files of GGUF architecture {clip(arch)} "
                                    "are not supported")
    return cfg


# ----------------------------------------------------------------------------- tensors

def _unpermute_rows(w: np.ndarray, n_heads: int, rot: int = 0) -> np.ndarray:
    """Undo llama.cpp's q/k row reordering: interleaved rotary pairs -> rotate-half.

    Within one head of d rows, GGUF row 2*i + j holds HF row j*d/2 + i
    (j in {0, 1}); so view each head as (d/2, 2) and transpose to (2, d/2).
    ``rot`` (partial rotary, GLM-4): only a head's first rot rows are paired so, the rest
    stay where they are (0: the whole head). Works on (rows, cols) matrices and (rows,) biases.
    """
    return w[_unpermute_order(w.shape[0], n_heads, rot)]


def _unpermute_order(rows: int, n_heads: int, rot: int = 0) -> np.ndarray:
    """Row r of _unpermute_rows' result is row order[r] of its input."""
    d = rows // n_heads
    r = rot or d
    order = np.arange(rows).reshape(n_heads, d)
    paired = order[:, :r].reshape(n_heads, r // 2, 2).swapaxes(1, 2).reshape(n_heads, r)
    return np.concatenate([paired, order[:, r:]], axis=1).reshape(-1)


def _dequantize(gf: GGUFFile, info: GGUFTensorInfo, rows: slice | None = None) -> np.ndarray:
    """A tensor as float32, numpy shape, or the rows ``rows`` of it seen as (rows, last dim).

    F16 comes back as a zero-copy float16 view.
    """
    t = info.ggml_type
    if t not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"{gf.path}: tensor {clip(info.name)} has type {info.type_name}, which is not supported "
            f"(supported: {', '.join(v[0] for v in SUPPORTED_TENSOR_TYPES.values())})")
    shape = info.shape
    n_rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    _, block, bsize = SUPPORTED_TENSOR_TYPES[t]
    raw = gf.tensor_bytes(info).reshape(n_rows, shape[-1] // block * bsize)   # (rows, bytes per row)
    if rows is not None:
        raw = raw[rows]
        shape = (raw.shape[0], shape[-1])
    if t == F16:
        return raw.view(np.float16).reshape(shape)
    if t == F32:
        return raw.view(np.float32).reshape(shape)
    if t == BF16:
        # bfloat16 is the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    try:
        # an inf or nan scale makes its arithmetic warn; the caller refuses the non-finite result
        with np.errstate(all="ignore"):
            out = quants.dequantize(raw, GGMLQuantizationType(t))
    except Exception as e:   # the gguf package is third-party: never let its errors escape raw
        raise ModelLoadError(f"{gf.path}: cannot dequantize tensor {clip(info.name)} ({type(e).__name__}: {clip(e, 200)})") from None
    return out.reshape(shape)


# rows dequantized at a time: bounds the float32 temporary (~16 MB) whatever the tensor size
_CHUNK_ELEMENTS = 1 << 22


def _matrix_f16(gf: GGUFFile, info: GGUFTensorInfo, name: str) -> np.ndarray:
    """A matrix as float16: a zero-copy view for F16, else dequantized chunk by chunk."""
    if info.ggml_type == F16 or len(info.shape) < 2:
        return _to_f16(_dequantize(gf, info), name, gf.path)
    cols = info.shape[-1]
    rows = math.prod(info.shape[:-1])
    out = np.empty((rows, cols), dtype=np.float16)       # a stack of matrices: their rows in turn
    step = max(1, _CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        part = slice(r0, min(r0 + step, rows))
        out[part] = _to_f16(_dequantize(gf, info, part), name, gf.path)
    gf.release(info)
    return out.reshape(info.shape)


def _tensor_float32(gf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    return np.asarray(_dequantize(gf, info), dtype=np.float32)


def _to_f16(a: np.ndarray, name: str, path) -> np.ndarray:
    if a.dtype == np.float16:
        return a
    big = max(float(a.max(initial=0.0)), -float(a.min(initial=0.0)))   # no |a| temporary
    if math.isnan(big):             # numpy's max and min propagate a nan
        raise ModelLoadError(f"{path}: tensor {clip(name)} holds nan values")
    if big > _FP16_MAX:
        raise UnsupportedModelError(
            f"{path}: tensor {clip(name)} has values up to {big:g}, beyond float16 range")
    return a.astype(np.float16)


_BLK_RE = re.compile(r"blk\.(\d+)\.(.+)$")

# GGML types without a native kernel -> the native format they are converted to at load:
# one with more bits whose scales are no coarser than the source's (the K-quants and IQ2_XS,
# IQ2_S, IQ1_M scale every 16 elements, which only q6_k does among the native formats).
# Q3_K, IQ1_M, IQ3_XXS -> q6_k, IQ3_S -> q4_k and IQ4_NL/IQ4_XS -> q8_0 hold the file's
# values exactly (IQ4_XS, IQ3_S: up to an f16 rounding of a scale or min) and are re-encoded
# block by block (quant/transcode.py); the others are dequantized and requantized. The default
# model requantized by llama-quantize, perplexity against llama-perplexity on the same file
# (tests/test_quant_llamacpp.py): Q3_K +0.3% (requantized: to q4_k +4.6%, q5_k +4.1%, q6_k
# +0.7%), IQ4_NL +0.3% (to q5_0: +3.7%), IQ4_XS +0.4% (to q5_k +2.6%, q6_k +1.0%), IQ3_S +0.06%
# (requantized: to q5_k -1.2%, to q4_k +18%). The price is memory: such a tensor holds
# 1.3-3.8x its bytes in the file. The row-length rule of the source is the target's.
CONVERT_TO_NATIVE = {
    10: "q6_k", 11: "q6_k",                 # Q2_K, Q3_K
    23: "q8_0", 20: "q8_0",                 # IQ4_XS, IQ4_NL: the table's int8 values
    21: "q4_k",                             # IQ3_S: 16 even levels a 32-element scale
    18: "q6_k",                             # IQ3_XXS: 8 uneven magnitudes, held as codes
    16: "q5_k", 19: "q5_k",                 # IQ2_XXS, IQ1_S: 32-element scales
    17: "q6_k", 22: "q6_k", 29: "q6_k",     # IQ2_XS, IQ2_S, IQ1_M: 16-element scales
}


@dataclass
class PlannedTensor:
    hf_name: str
    info: GGUFTensorInfo
    shape: tuple[int, ...]     # HF (numpy) shape
    dtype: np.dtype            # float16 for F16/F32/BF16 matrices, float32 for 1-D
    unpermute_heads: int = 0   # >0: q/k rows to reorder with this many heads
    fmt: str | None = None     # native block format of a quantized matrix (a QuantMatrix); None: dtype
    # a stack of expert matrices (E, rows, cols) in the file: shape is (E * rows, cols), and
    # the model reads expert e's rows under expert_names[e]
    expert_names: tuple = ()
    # a tensor that llama.cpp's converter fused from several of the table's (--fuse-qkv's
    # attn_qkv): (names, first row, rows, heads to unpermute) of each, names one per item of
    # the tensor's rows (one item: the whole tensor)
    parts: tuple = ()
    unpermute_rot: int = 0     # the rows of a head that rotate where they are not all (_unpermute_rows)

    def _views(self, a):
        """(HF name, rows of a) of each entry, a the materialized tensor (or its shape's stand-in)."""
        if self.parts:
            items = len(self.parts[0][0])
            step = self.shape[0] // items
            for names, r0, rows, heads in self.parts:
                for e, name in enumerate(names):
                    yield name, slice(e * step + r0, e * step + r0 + rows), heads
        elif self.expert_names:
            rows = self.shape[0] // len(self.expert_names)
            for e, name in enumerate(self.expert_names):
                yield name, slice(e * rows, (e + 1) * rows), 0
        else:
            yield self.hf_name, slice(0, self.shape[0]), 0

    def entry_shapes(self):
        """(HF name, shape) of each array ``entries`` yields."""
        return [(name, (rows.stop - rows.start, *self.shape[1:])) for name, rows, _ in self._views(None)]

    def entries(self, a):
        """(HF name, array) pairs of the materialized tensor ``a``: one, a row view per expert,
        or the fused parts (their q/k rows back in HF's order: a copy of those)."""
        if not self.expert_names and not self.parts:
            yield self.hf_name, a
            return
        for name, rows, heads in self._views(a):
            v = a[rows]
            yield name, (_unpermute_part(v, heads, self.unpermute_rot) if heads else v)

    @property
    def converted(self) -> str | None:
        """'SOURCE -> target' when the file's type is not what the model will hold."""
        src = self.info.type_name
        if self.fmt is not None:
            return None if src.lower() == self.fmt else f"{src} -> {self.fmt.upper()}"
        if self.dtype == np.float16 and src != "F16":
            return f"{src} -> F16"
        return None


def _unpermute_part(v, heads: int, rot: int = 0):
    """Rows of a fused q or k (an array or a QuantMatrix) from llama.cpp's order to HF's."""
    order = _unpermute_order(v.shape[0], heads, rot)
    return v.take_rows(order) if hasattr(v, "take_rows") else v[order]


def _fused(name: str, by_gguf: dict, cfg: ModelConfig, fam):
    """(table rows it holds, want shape, parts) of a tensor llama.cpp's converter fused with
    --fuse-qkv (blk.N.attn_qkv.{weight,bias}: q, then k, then v) for a family whose table has
    them apart, or None. (Its --fuse-gate-up-exps fuses experts only in architectures cyllm
    does not run.)"""
    m = _BLK_RE.match(name)
    if m is None:
        return None
    i, tail = int(m.group(1)), m.group(2)
    blk = f"blk.{i}."
    if tail in ("attn_qkv.weight", "attn_qkv.bias"):
        kind = tail.split(".")[1]
        rows = [by_gguf.get(f"{blk}attn_{r}.{kind}") for r in "qkv"]
        if None in rows:
            return None
        parts, r0 = [], 0
        for (t, layer), n in zip(rows, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)):
            heads = 0
            if fam.permute_qk and t.permute:
                heads = t.permute_heads(cfg)
            parts.append(((t.hf_name(layer),), r0, n, heads))
            r0 += n
        want = (r0, cfg.dim) if kind == "weight" else (r0,)
        return rows, want, tuple(parts)
    return None


def _plan_fused(gf: GGUFFile, name: str, info, fused, native: bool, rot: int = 0) -> PlannedTensor:
    """The PlannedTensor of a fused tensor (_fused): its type and shape checked as a table row's
    (``rot``: the rows of a head that rotate, where not all)."""
    from ..quant.formats import format_by_ggml_type
    _, want, parts = fused
    if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"{gf.path}: tensor {clip(name)} has type {info.type_name}, which is not supported "
            f"(supported: {', '.join(v[0] for v in SUPPORTED_TENSOR_TYPES.values())})")
    if info.shape != want:
        raise ModelLoadError(f"{gf.path}: tensor {clip(name)} has shape {info.shape}, expected {want}")
    for _, _, n, heads in parts:
        if heads and n % (2 * heads):
            raise ModelLoadError(f"{gf.path}: tensor {clip(name)} has {n} rows for {heads} heads: "
                                 "a head of an odd size cannot hold the row pairs of this family's layout")
    cfg_dtype = np.dtype(np.float16 if len(want) > 1 else np.float32)
    fmt = None
    if native and cfg_dtype == np.float16 and info.ggml_type not in (F32, F16, BF16):
        fmt = CONVERT_TO_NATIVE.get(info.ggml_type) or format_by_ggml_type(info.ggml_type).name
    return PlannedTensor(name, info, want, cfg_dtype, 0, fmt, (), parts, rot)


def paired_rows(cfg: ModelConfig, fam) -> int:
    """The rows of a head whose rotary pairs are adjacent in the file (0: all of them). A
    checkpoint already in that order (GLM-4's partial rotary) pairs only its rotating rows;
    llama.cpp's converter permutes a llama-style head whole, whatever rotates."""
    return (cfg.rotary_dim or 0) if fam.hf_rope_interleaved else 0


def plan_tensors(gf: GGUFFile, cfg: ModelConfig, native: bool = False) -> list[PlannedTensor]:
    """Map every GGUF tensor to its HF name through the family's table; check shapes and presence.

    native: quantized matrices stay in a native block format (QuantMatrix, see materialize);
    otherwise every matrix becomes float16 (what `cyllm convert` writes).
    """
    from ..quant.formats import format_by_ggml_type
    fam = family(cfg.arch)
    by_gguf = {t.gguf_name(i): (t, i) for t, i in fam.expected(cfg)}
    ignored = set(fam.gguf_config_tensors) | {"rope_freqs.weight"}     # read by _rope_scaling
    plan, seen = [], set()
    for name, info in gf.tensors.items():
        if name in ignored:
            continue
        fused = None if name in by_gguf else _fused(name, by_gguf, cfg, fam)
        if fused is not None:
            held = {t.gguf_name(layer) for t, layer in fused[0]}
            if held & seen:
                raise ModelLoadError(f"{gf.path}: tensor {clip(name)} holds {clip(min(held & seen))}, "
                                     "which the file also has on its own")
            plan.append(_plan_fused(gf, name, info, fused, native, paired_rows(cfg, fam)))
            seen.update(held)
            continue
        if name in seen:
            raise ModelLoadError(f"{gf.path}: tensor {clip(name)} is also part of a fused tensor in the file")
        if name not in by_gguf:
            m = _BLK_RE.match(name)
            if m and int(m.group(1)) >= cfg.n_layers:
                raise ModelLoadError(f"{gf.path}: tensor {clip(name)} is past block_count {cfg.n_layers}")
            raise UnsupportedModelError(f"{gf.path}: unexpected tensor {clip(name)} for a {fam.name} model")
        t, layer = by_gguf[name]
        if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"{gf.path}: tensor {clip(name)} has type {info.type_name}, which is not supported "
                f"(supported: {', '.join(v[0] for v in SUPPORTED_TENSOR_TYPES.values())})")
        want = t.gguf_shape(cfg)
        if info.shape != want:
            raise ModelLoadError(f"{gf.path}: tensor {clip(name)} has shape {info.shape}, expected {want}")
        names = tuple(t.hf_names(cfg, layer)) if t.experts else ()
        if t.experts:
            want = (want[0] * want[1], want[2])         # the experts' rows one after another
        heads = 0
        if fam.permute_qk and t.permute:
            heads = t.permute_heads(cfg)
            if want[0] % (2 * heads):      # llama.cpp's converter pairs the rows of each head
                raise ModelLoadError(f"{gf.path}: tensor {clip(name)} has {want[0]} rows for {heads} heads: "
                                     "a head of an odd size cannot hold the row pairs of this family's layout")
        dtype = np.dtype(t.matrix_dtype(cfg))
        fmt = None
        if native and dtype == np.float16 and info.ggml_type not in (F32, F16, BF16):
            fmt = CONVERT_TO_NATIVE.get(info.ggml_type) or format_by_ggml_type(info.ggml_type).name
        # a stack of experts is named by its GGUF name (its entries by their HF names)
        plan.append(PlannedTensor(name if t.experts else t.hf_name(layer), info, want, dtype, heads, fmt, names,
                                  unpermute_rot=paired_rows(cfg, fam) if heads else 0))
        seen.add(name)
    missing = [n for n, (t, _) in by_gguf.items() if n not in seen and not t.optional]
    if missing:
        raise ModelLoadError(f"{gf.path}: GGUF file lacks {len(missing)} tensors of a {fam.name} model "
                             f"(first: {missing[0]})")
    return plan


# byte offsets of the f16 scale fields in a block of each native format (d; and m or dmin)
_SCALE_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2),
                 "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
_SCAN_BLOCKS = 1 << 20      # blocks checked at a time: bounds the temporaries to a few MB


def _check_block_scales(gf: GGUFFile, info: GGUFTensorInfo, qm, converted: bool = False) -> None:
    """Refuse a matrix one of whose blocks has an inf or nan scale: the file's own, or, in a
    matrix converted at load (``converted``), one its values overflowed (finite values whose
    block scale is beyond f16: an IQ4_XS scale near f16's largest). The kernels would read
    it as it is, and the int8 rounding of the next activation turns the NaNs into finite
    noise: the text would be wrong with no sign of it. f16 inf/nan: exponent bits all set
    (0x7C in the high byte). Reads the whole tensor once (the first token would anyway)."""
    blocks = qm.data.reshape(-1, qm.fmt.block_bytes)              # (nb, block bytes), a view
    for b0 in range(0, blocks.shape[0], _SCAN_BLOCKS):
        part = blocks[b0:b0 + _SCAN_BLOCKS]
        for off in _SCALE_FIELDS[qm.fmt.name]:
            bad = np.flatnonzero((part[:, off + 1] & 0x7C) == 0x7C)
            if bad.size:
                f = qm.fmt.name.upper()
                why = (f"has an inf or nan scale once converted to {f} (the file's own, or values beyond "
                       f"what {f} can hold)" if converted else "has an inf or nan scale")
                raise ModelLoadError(f"{gf.path}: tensor {clip(info.name)}: block {b0 + int(bad[0])} {why}")


def _quant_matrix(gf: GGUFFile, p: PlannedTensor):
    """A quantized matrix in its native format: a zero-copy view of the mapped blocks,
    or (a type without a native kernel) re-encoded exactly where the target holds the same
    values (quant/transcode.py), else dequantized and requantized, chunk by chunk."""
    from ..quant.convert import quantize_rows_f32
    from ..quant.formats import format_by_name
    from ..quant.matrix import QuantMatrix
    from ..quant.transcode import EXACT, ScaleOverflow
    fmt = format_by_name(p.fmt)
    info = p.info
    rows, cols = p.shape
    native = SUPPORTED_TENSOR_TYPES[info.ggml_type][0].lower() == fmt.name
    if native:
        qm = QuantMatrix.from_buffer(gf.buf, info.offset, fmt, p.shape, p.hf_name)
    else:
        out = np.empty((rows, fmt.row_bytes(cols)), np.uint8)
        exact = EXACT.get((info.ggml_type, fmt.name))
        src = gf.tensor_bytes(info).reshape(rows, -1) if exact else None     # (rows, bytes per row)
        step = max(1, _CHUNK_ELEMENTS // cols)
        for r0 in range(0, rows, step):
            part = slice(r0, min(r0 + step, rows))
            if not exact:
                out[part] = quantize_rows_f32(np.asarray(_dequantize(gf, info, part), np.float32), fmt, p.hf_name)
                continue
            try:
                out[part] = exact(src[part]).reshape(part.stop - r0, -1)
            except ScaleOverflow as e:      # rows whose values do not fit the target's scales
                out[part] = e.blocks.reshape(part.stop - r0, -1)
                for r in r0 + e.rows:
                    one = slice(int(r), int(r) + 1)
                    out[one] = quantize_rows_f32(np.asarray(_dequantize(gf, info, one), np.float32), fmt, p.hf_name)
        gf.release(info)
        qm = QuantMatrix(out, fmt, p.shape, p.hf_name)
    _check_block_scales(gf, info, qm, converted=not native)    # the file's blocks, or the re-encoded copies
    if p.unpermute_heads:
        # llama.cpp's q/k row order -> HF's: whole block rows move, so this is a copy of the
        # matrix ((rows, row_bytes) bytes, a few MB per layer); the file pages of the
        # original are then dropped from this process (they would count twice)
        qm = _unpermute_part(qm, p.unpermute_heads, p.unpermute_rot)
        gf.release(info)
    return qm


def materialize(gf: GGUFFile, p: PlannedTensor):
    """One planned tensor: a QuantMatrix (p.fmt set), else in its contract dtype
    (F16 matrices stay zero-copy views)."""
    if p.fmt is not None:
        return _quant_matrix(gf, p)
    if p.dtype == np.float16:
        a = _matrix_f16(gf, p.info, p.hf_name)
    else:
        a = np.asarray(_dequantize(gf, p.info), dtype=np.float32)
    if p.unpermute_heads:
        a = _unpermute_rows(a, p.unpermute_heads, p.unpermute_rot)
    return a.reshape(p.shape)           # a stack of experts: (E * rows, cols)


def iter_entries(gf: GGUFFile, plan: list[PlannedTensor]):
    for p in plan:
        yield from p.entries(materialize(gf, p))
        if any(heads for *_, heads in p.parts):
            # a fused q/k/v's q and k were copied (unpermuted): drop the tensor's pages, as for
            # a q or k on its own (v's view faults its own back in)
            gf.release(p.info)


def iter_weights(gf: GGUFFile, cfg: ModelConfig, native: bool = False):
    yield from iter_entries(gf, plan_tensors(gf, cfg, native))


def conversion_note(plan: list[PlannedTensor]) -> str | None:
    """One line naming the tensor types converted at load (None: everything runs as stored)."""
    counts: dict[str, int] = {}
    for p in plan:
        c = p.converted
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
    if not counts:
        return None
    parts = ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
    return f"converted at load (no native kernel for the stored type): {parts}"


# ----------------------------------------------------------------------------- entry point

def native_quantized() -> bool:
    """Whether quantized GGUF matrices stay in their block format (the default) or are
    dequantized to float16 at load (CYLLM_QUANT=f16: to compare against the float path, or
    for a backend without quantized kernels).

    Native blocks are what the file holds: a third to a quarter of the float16 bytes to read
    per token, computed with activations rounded to int8 blocks as llama.cpp does (the
    perplexity of a file matches llama.cpp's llama-perplexity on it; see the README).
    """
    value = os.environ.get("CYLLM_QUANT", "native").strip().lower()
    if value not in ("native", "f16"):
        raise InvalidArgumentError(f"CYLLM_QUANT must be 'native' or 'f16', got {one_line(value, 40)!r}")
    return value == "native"


def load_gguf(path: str | os.PathLike):
    """GGUF file -> (ModelConfig, {HF name: array or QuantMatrix}, Tokenizer | None).

    Quantized matrices stay quantized unless CYLLM_QUANT=f16 (see native_quantized()):
    matrices in a native block format (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k)
    stay in the memory map as QuantMatrix views (llama-style q/k: a row-permuted copy);
    other block types become the nearest native format, F32/BF16 matrices float16, with
    one notice on stderr; F16 matrices other than q/k are zero-copy views; vectors f32.
    """
    gf = read_gguf(path)
    cfg = config_from_gguf(gf)
    native = native_quantized()
    plan = plan_tensors(gf, cfg, native=native)
    note = conversion_note(plan) if native else None     # f16 asked for: nothing to say
    if note:
        import sys
        print(f"cyllm: note: {gf.path.name}: {note}", file=sys.stderr)
    weights = dict(iter_entries(gf, plan))
    from .weights import validate_weights
    validate_weights(cfg, weights)
    from .gguf_tokenizer import build_tokenizer, make_tokenizer

    info = build_tokenizer(gf, cfg.vocab_size)
    tokenizer = make_tokenizer(info) if info is not None else None
    return cfg, weights, tokenizer


def describe(path: str | os.PathLike) -> str:
    """Human summary of a GGUF file's metadata (debugging aid)."""
    gf = read_gguf(path)
    md = {k: (v if not isinstance(v, (list, np.ndarray)) else f"[{len(v)} items]") for k, v in gf.metadata.items()}
    return json.dumps(md, indent=1, default=str)
