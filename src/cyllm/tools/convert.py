"""GGUF file -> Hugging Face model directory (config.json, model.safetensors F16, tokenizer files).

Tensors are dequantized and written one at a time (the safetensors header is
computed up front from the shapes), so converting never holds more than one
dequantized tensor in memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, ModelLoadError
from ..families import family, hf_config_dict
from ..loading.gguf import config_from_gguf, materialize, paired_rows, plan_tensors, read_gguf
from ..loading.gguf_tokenizer import build_tokenizer
from .hf_gguf import _permute_order

OUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json")


def _hf_config(cfg) -> dict:
    """config.json of the family; llama3 rope divisors from GGUF go back to their published parameters."""
    from ..rope import llama3_params_from_divisors
    scaling = cfg.rope_scaling
    if scaling and "divisors" in scaling:
        params = llama3_params_from_divisors(scaling["divisors"], cfg.rope_theta, cfg.rotary_dim or cfg.head_dim)
        if params is None:
            raise InvalidArgumentError("the GGUF's rope_freqs match no published llama3 rope scaling, which "
                                       "config.json could express; this file cannot be converted")
        cfg = dataclasses.replace(cfg, rope_scaling={"rope_type": "llama3", **params})
    if cfg.arch == "mixtral" and not cfg.expert_norm:
        raise InvalidArgumentError("this Mixtral file does not renormalize its experts' weights, which "
                                   "transformers' Mixtral always does; it cannot be converted")
    return hf_config_dict(cfg)


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]], meta: dict) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) and each tensor's data offset; all F16."""
    header: dict = {"__metadata__": meta}
    offsets = []
    pos = 0
    for name, shape in entries:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)       # data start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offsets


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise InvalidArgumentError(
                f"output directory {out} is not empty; choose a new directory or allow overwriting")
        for name in OUT_FILES:
            p = out / name
            if p.is_file() or p.is_symlink():
                p.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"cannot create output directory {out} ({e.strerror or e})") from None


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                       progress: bool = False) -> Path:
    """Write a Hugging Face (transformers-loadable) model directory from a GGUF file.

    Returns the output directory. All tensors are stored as F16 (1-D norm
    weights included, as in float16 HF checkpoints).
    """
    gf = read_gguf(gguf_path)
    cfg = config_from_gguf(gf)
    if any(t.hf_part for t in family(cfg.arch).tensors):
        raise InvalidArgumentError(f"a {cfg.arch} file cannot be converted to a Hugging Face directory: its "
                                   "checkpoints keep the experts' gate and up in one tensor, which cyllm does "
                                   "not write")
    plan = plan_tensors(gf, cfg)
    tinfo = build_tokenizer(gf, cfg.vocab_size)
    out = Path(out_dir)
    _prepare_out_dir(out, overwrite)

    header, _ = _safetensors_header([e for p in plan for e in p.entry_shapes()], {"format": "pt"})
    fam = family(cfg.arch)
    minus_one = {name for t, _, name in fam.expected_names(cfg) if t.hf_plus_one}
    # q/k rows back in the checkpoint's interleaved rotary order (Ernie 4.5): HF -> llama.cpp's
    interleave = {name: t.permute_heads(cfg)
                  for t, _, name in fam.expected_names(cfg) if t.permute and fam.hf_rope_interleaved}
    rot = paired_rows(cfg, fam)     # partial rotary (GLM-4): only a head's first rot rows are paired
    tmp = out / "model.safetensors.part"
    bar = None
    if progress:
        import sys
        from tqdm import tqdm
        bar = tqdm(total=len(plan), desc="converting", unit="tensor", file=sys.stderr)
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for p in plan:
                for name, a in p.entries(materialize(gf, p)):
                    if name in minus_one:
                        a = a - np.float32(1.0)     # GGUF holds Gemma's 1 + w, HF checkpoints w
                    if name in interleave:
                        a = a[_permute_order(a.shape[0], interleave[name], rot)]
                    if a.dtype != np.float16:
                        a = a.astype(np.float16)    # 1-D f32 norms, a MoE router: well inside fp16 range
                    f.write(np.ascontiguousarray(a, dtype="<f2").data)
                if bar is not None:
                    bar.update(1)
        os.replace(tmp, out / "model.safetensors")
    except OSError as e:
        raise ModelLoadError(f"cannot write {out / 'model.safetensors'} ({e.strerror or e})") from None
    finally:
        if bar is not None:
            bar.close()
        if tmp.exists():
            tmp.unlink()

    _write_json(out / "config.json", _hf_config(cfg))
    gen = {"bos_token_id": cfg.bos_token_id,
           "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids))
           if cfg.eos_token_ids else None}
    if tinfo is not None:
        pad = tinfo.tokenizer.token_to_id(tinfo.pad_token) if tinfo.pad_token else None
        if pad is not None:
            gen["pad_token_id"] = pad
        _write_tokenizer(out, tinfo)
    _write_json(out / "generation_config.json", gen)
    return out


def _write_tokenizer(out: Path, t) -> None:
    from tokenizers import Tokenizer, processors
    tok = Tokenizer.from_str(t.tokenizer.to_str())
    if t.add_bos and t.bos_token is not None and t.bos_id is not None:
        # the directory form states BOS in the post-processor (what HF tokenizers read)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{t.bos_token} $A", pair=f"{t.bos_token} $A {t.bos_token} $B",
            special_tokens=[(t.bos_token, t.bos_id)])
    # written here, not by tok.save: its failures (a full disk) are plain Exceptions, not OSError
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(t.add_bos),
        "add_eos_token": bool(t.add_eos),
        "bos_token": t.bos_token,
        "eos_token": t.eos_token,
        "unk_token": t.unk_token,
        "pad_token": t.pad_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": None,
    }
    tc = {k: v for k, v in tc.items() if v is not None}
    if t.chat_template and t.tool_template:
        tc["chat_template"] = [{"name": "default", "template": t.chat_template},
                               {"name": "tool_use", "template": t.tool_template}]
    elif t.chat_template:
        tc["chat_template"] = t.chat_template
    _write_json(out / "tokenizer_config.json", tc)


def _write_json(path: Path, obj) -> None:
    try:
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise ModelLoadError(f"cannot write {path} ({e.strerror or e})") from None
