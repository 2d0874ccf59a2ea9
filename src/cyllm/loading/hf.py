"""Load a Hugging Face model directory (config.json + safetensors + tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..rope import F32_MAX
from ..families import config_from_hf, family
from .gguf import _unpermute_rows, paired_rows
from ..errors import ModelLoadError, UnsupportedModelError
from ..jsonio import JsonObject, read_json_file
from .weights import validate_weights
from .safetensors import SafetensorsFile, bf16_bits_to_f32, open_checkpoint

F16_MAX = 65504.0
# elements converted per step: bounds the float32 temporary of a BF16/F32 ->
# F16 conversion (a whole 128k x 4096 embedding would need 2 GB at once)
_CHUNK_ELEMS = 1 << 22


def read_json(path: Path, what: str | None = None) -> JsonObject:
    """A JSON object from a file of the model directory; ModelLoadError naming the file when bad
    (bounded: see jsonio)."""
    return read_json_file(path, ModelLoadError, name=what)


def _merge_generation_config(config: ModelConfig, d: Path) -> None:
    gpath = d / "generation_config.json"
    if not gpath.is_file():
        return
    gen = read_json(gpath)
    merged = list(config.eos_token_ids)
    for i in gen.token_ids("eos_token_id"):
        if i not in merged and i < config.vocab_size:
            merged.append(i)
    config.eos_token_ids = merged
    if config.bos_token_id is None:
        bos = [i for i in gen.token_ids("bos_token_id") if i < config.vocab_size]
        if bos:
            config.bos_token_id = bos[0]


def _to_f16(name: str, f: SafetensorsFile, tname: str) -> np.ndarray:
    """A 2-D tensor as float16: zero-copy when stored F16, else checked conversion."""
    tag, raw = f.raw(tname)
    if tag == "F16":
        return raw
    if tag not in ("BF16", "F32", "F64"):
        raise UnsupportedModelError(f"tensor {name} in {f.path} has dtype {tag}; expected F16, BF16 or F32")
    flat = raw.reshape(-1)
    out = np.empty(flat.shape, dtype=np.float16)
    for s in range(0, flat.size, _CHUNK_ELEMS):
        src = flat[s:s + _CHUNK_ELEMS]
        src32 = bf16_bits_to_f32(src) if tag == "BF16" else src
        with np.errstate(over="ignore"):
            dst = src32.astype(np.float16)
        bad = np.isinf(dst) & np.isfinite(src32)
        if bad.any():
            worst = float(np.max(np.abs(src32[bad])))
            raise ModelLoadError(
                f"tensor {name} ({tag}) has values up to {worst:g}, beyond the float16 range "
                f"(+-{F16_MAX:g}); this model cannot be converted to float16")
        out[s:s + _CHUNK_ELEMS] = dst
    return out.reshape(raw.shape)


def _to_f32(name: str, f: SafetensorsFile, tname: str) -> np.ndarray:
    """A vector (or a matrix kept in float32, a MoE router) as float32 (zero-copy when stored F32)."""
    tag, raw = f.raw(tname)
    if tag == "F32":
        return raw
    if tag == "BF16":
        return bf16_bits_to_f32(raw)
    if tag == "F64":
        big = max(float(raw.max(initial=0.0)), -float(raw.min(initial=0.0)))
        if not big <= F32_MAX:          # nan compares false too
            raise ModelLoadError(f"tensor {name} in {f.path} has values ({big:g}) float32 cannot hold")
    if tag in ("F16", "F64"):
        return raw.astype(np.float32)
    raise UnsupportedModelError(f"tensor {name} in {f.path} has dtype {tag}; expected F16, BF16 or F32")


def checkpoint_tensors(config: ModelConfig, d: Path):
    """The family's expected tensors in the directory's safetensors, each checked for presence
    and shape before anything is read: yields (table row, layer, HF name, shape, file, name in
    the file, part). part is None, or for an expert matrix that the file keeps with every
    expert's in one tensor (Tensor.hf_part), (expert, first row, end row) of that tensor. A
    tied output matrix the checkpoint leaves out is skipped."""
    index = open_checkpoint(d)
    fam = family(config.arch)
    found, read = [], set()

    def locate(name: str, shape: tuple, optional: bool):
        if name not in index:
            if optional:
                return None
            raise ModelLoadError(f"missing tensor {name} in the checkpoint in {d}")
        f, tname = index[name]
        got = f.shape_of(tname)
        if got != shape:
            # check before converting: a wrong shape must not cost a conversion
            raise ModelLoadError(f"tensor {name} has shape {got}, expected {shape}")
        read.add(name)
        return f, tname

    for t, i in fam.expected(config):
        shape = t.shape(config)
        if t.hf_part is not None:
            # the stack's shape first: a config's expert count is checked before its names are made
            f, tname = locate(t.hf_name(i), t.hf_stack_shape(config), False)
            r0 = t.hf_part[0] * shape[0]
            found.extend((t, i, name, shape, f, tname, (e, r0, r0 + shape[0]))
                         for e, name in enumerate(t.hf_names(config, i)))
            continue
        for name in t.hf_names(config, i):
            where = locate(name, shape, t.optional and config.tie_word_embeddings)
            if where is not None:
                found.append((t, i, name, shape, *where, None))
    # A block parameter the table does not read is a feature cyllm lacks (an attention output
    # bias, MLP biases, ...): dropping it would give wrong text without a word.
    for name in index:
        if name.startswith("model.layers.") and name.endswith((".weight", ".bias")) and name not in read:
            raise UnsupportedModelError(f"{d}: tensor {name} is not part of a {fam.name} model as cyllm "
                                        "runs it (a feature it does not support)")
    yield from found


def load_hf_weights(config: ModelConfig, d: Path) -> dict[str, np.ndarray]:
    """The model's tensors from the directory's safetensors, normalized and validated."""
    weights: dict[str, np.ndarray] = {}
    fam = family(config.arch)
    stacks: dict = {}           # (file, name in the file) -> the whole stack of experts, converted once
    for t, _, name, shape, f, tname, part in checkpoint_tensors(config, d):
        if part is not None:
            key = (id(f), tname)
            if key not in stacks:
                stacks[key] = _to_f16(tname, f, tname)
            e, r0, r1 = part
            weights[name] = stacks[key][e, r0:r1]           # a view: (rows, cols), contiguous
            continue
        a = _to_f16(name, f, tname) if t.matrix_dtype(config) == np.float16 else _to_f32(name, f, tname)
        if t.permute and fam.hf_rope_interleaved:
            # rotary pairs (2i, 2i+1) of each head -> (i, i + d/2), the order cyllm's rope takes
            heads = t.permute_heads(config)
            a = _unpermute_rows(a, heads, paired_rows(config, fam))
        if t.hf_plus_one:
            a = a + np.float32(1.0)      # the (1+w) norm stored as w: the model applies plain w
        weights[name] = a
    # everything else (rotary_emb.inv_freq, ...) is not read by the model: dropped
    validate_weights(config, weights)
    return weights


def load_hf_dir(path: str | os.PathLike):
    """(ModelConfig, weights, Tokenizer | None) from a Hugging Face model directory."""
    d = Path(path)
    if not d.exists():
        raise ModelLoadError(f"model path not found: {d}")
    if not d.is_dir():
        raise ModelLoadError(f"{d} is not a directory")
    cpath = d / "config.json"
    if not cpath.is_file():
        raise ModelLoadError(f"no config.json in {d} (not a Hugging Face model directory)")
    cfg = read_json(cpath)
    config = config_from_hf(cfg, name=d.resolve().name)
    _merge_generation_config(config, d)
    weights = load_hf_weights(config, d)

    from ..tokenizer import Tokenizer
    # a tokenizer with more ids than the embedding has rows is not rejected here:
    # some checkpoints ship unused added tokens; the model checks the ids it gets
    tokenizer = Tokenizer.from_hf_dir(d)
    return config, weights, tokenizer
