"""`cyllm info -m MODEL`: what a model file is, from its headers alone (nothing is loaded or run).

GGUF: the metadata and tensor table (loading/gguf_file.read_gguf, which maps the file
but reads no tensor data). Hugging Face directory: config.json, the safetensors
headers, tokenizer.json / tokenizer_config.json. Values from the file are
shown through ``_clip`` (printable, bounded), since a file can hold anything.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from ..errors import CyllmError, ModelLoadError


def _clip(value, limit: int = 80) -> str:
    s = str(value)
    if not s.isprintable():
        s = repr(s)[1:-1]
    return s if len(s) <= limit else s[:limit] + "..."


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def gguf_file_type_name(ft) -> str | None:
    """llama.cpp's name of a general.file_type value (Q4_K_M...), from the gguf package's table."""
    if isinstance(ft, bool) or not isinstance(ft, int):
        return None
    try:
        from gguf import LlamaFileType
        name = LlamaFileType(ft).name
    except (ImportError, ValueError):
        return None
    name = name.replace("MOSTLY_", "")
    return {"ALL_F32": "F32"}.get(name, name)


def _expert_tensor_names(config) -> set[str]:
    """Every name an expert matrix goes by, from the family's table: GGUF's stacks, the HF
    checkpoint's tensors (one an expert, or a layer's stack), and the weights contract's."""
    from ..families import family
    names = set()
    for t, i in family(config.arch).expected(config):
        if t.experts:
            names.update((t.gguf_name(i), *t.hf_names(config, i)))
            if t.hf_part is not None:
                names.add(t.hf_name(i))         # the checkpoint's one tensor of every expert
    return names


def _weights_per_token(config, sizes: dict[str, int]) -> int:
    """Bytes of weights one decode step reads: every layer tensor (of a mixture of experts' expert
    matrices, the share of the experts a token uses), the final norm, the output matrix, and one
    row of the embedding table (all of it when it is also the output)."""
    total = 0
    emb = out = 0
    used = config.n_experts_used / config.n_experts if config.moe else 1.0
    experts = _expert_tensor_names(config) if config.moe else set()
    for name, nbytes in sizes.items():
        if name in ("model.embed_tokens.weight", "token_embd.weight"):
            emb = nbytes
        elif name in ("lm_head.weight", "output.weight"):
            out = nbytes
        elif name == "rope_freqs.weight":
            continue
        elif name in experts:
            total += round(nbytes * used)
        else:
            total += nbytes
    if out:
        return total + out + emb // max(config.vocab_size, 1)
    return total + emb


def _f16_sizes(config, shapes: dict[str, tuple]) -> dict[str, int]:
    """Bytes of each tensor as cyllm holds it: float16 matrices, float32 vectors."""
    out = {}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= int(d)
        out[name] = n * (2 if len(shape) >= 2 else 4)
    return out


def _bytes_lines(config, file_sizes: dict[str, int], shapes: dict[str, tuple]) -> list[str]:
    lines = []
    if config is None:
        return lines
    kv = config.kv_bytes_per_token()
    lines.append(f"KV cache: {fmt_bytes(kv)} per token of context (float16 K and V, "
                 f"{fmt_bytes(kv * min(config.max_seq_len, 4096))} for {min(config.max_seq_len, 4096)} tokens)")
    held = _weights_per_token(config, _f16_sizes(config, shapes))
    infile = _weights_per_token(config, file_sizes)
    lines.append(f"weights read per generated token: {fmt_bytes(held)} as cyllm holds them "
                 f"(float16 matrices), {fmt_bytes(infile)} in the file's format")
    return lines


# -- GGUF ---------------------------------------------------------------------------------
def describe_gguf(path: Path) -> list[str]:
    from ..loading.gguf import config_from_gguf, read_gguf

    gf = read_gguf(path)
    md = gf.metadata

    def meta(key, default=None):
        v = md.get(key, default)
        return v.item() if hasattr(v, "item") and not hasattr(v, "__len__") else v

    arch = meta("general.architecture")
    lines = [f"file: {path} (GGUF v{gf.version}, {fmt_bytes(path.stat().st_size)})"]
    if meta("general.name") is not None:
        lines.append(f"name: {_clip(meta('general.name'))}")
    config, why = None, None
    try:
        config = config_from_gguf(gf)
    except CyllmError as e:
        why = str(e)
    runs_as = f" (runs as {config.arch})" if config is not None and config.arch != arch else ""
    lines.append(f"family: {_clip(arch)}{runs_as}" + ("" if why is None else f" (cyllm cannot run it: {_clip(why, 200)})"))
    if config is not None:
        lines += _config_lines(config)
    else:
        p = f"{arch}."
        parts = [f"{k.split('.')[-1]} {_clip(meta(p + k))}" for k in
                 ("block_count", "embedding_length", "attention.head_count", "feed_forward_length")
                 if meta(p + k) is not None]
        if parts:
            lines.append("sizes: " + ", ".join(parts))
        if meta(p + "context_length") is not None:
            lines.append(f"context: {_clip(meta(p + 'context_length'))} tokens (trained)")
    ft = meta("general.file_type")
    ft_name = gguf_file_type_name(ft)
    lines.append("quantization: " + (f"{ft_name} (general.file_type {ft})" if ft_name
                                     else "not stated (no general.file_type)" if ft is None
                                     else f"general.file_type {_clip(ft)}"))
    types = Counter(t.type_name for t in gf.tensors.values())
    lines.append("tensor types: " + ", ".join(f"{n} x{c}" for n, c in types.most_common()))
    tok = meta("tokenizer.ggml.model")
    if tok is None:
        lines.append("tokenizer: none in the file")
    else:
        tokens = md.get("tokenizer.ggml.tokens")
        n = len(tokens) if isinstance(tokens, list) else "?"
        # the values are the file's: a string where a well-formed file has one, else shown as they are
        kind = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}.get(tok, "") if isinstance(tok, str) else ""
        pre = meta("tokenizer.ggml.pre")
        if isinstance(pre, str) and not pre:
            pre = None                  # an empty name states none
        lines.append(f"tokenizer: {_clip(tok)}" + (f" ({kind})" if kind else "") + f", {n} tokens"
                     + (f", pre-tokenizer {_clip(pre)}" if pre is not None else ""))
    tmpl = md.get("tokenizer.chat_template")
    lines.append("chat template: " + (f"yes ({len(tmpl)} characters)" if isinstance(tmpl, str) and tmpl
                                      else "none (chat needs --chat-template NAME|FILE)"))
    file_sizes = {name: t.nbytes for name, t in gf.tensors.items()}
    shapes = {name: t.shape for name, t in gf.tensors.items()}
    lines += _bytes_lines(config, file_sizes, shapes)
    return lines


def _config_lines(c) -> list[str]:
    rope = c.rope_scaling.get("rope_type") if c.rope_scaling else "none"
    return [
        f"parameters: {fmt_params(c.n_params)}",
        f"sizes: {c.n_layers} layers, hidden {c.dim}, {c.n_heads} heads ({c.n_kv_heads} KV heads, "
        f"head dim {c.head_dim}), feed-forward {c.ffn_dim}{' an expert' if c.moe else ''}, vocabulary {c.vocab_size}"
        + (", tied embeddings" if c.tie_word_embeddings else ""),
        *([f"experts: {c.n_experts} a layer, {c.n_experts_used} a token (feed-forward {c.ffn_dim} each; "
           f"{fmt_params(c.active_params)} parameters used a token)"] if c.moe else []),
        f"context: {c.max_seq_len} tokens (trained)",
        f"rope: theta {c.rope_theta:g}, scaling {rope}",
    ]


# -- Hugging Face directory ---------------------------------------------------------------
def describe_hf_dir(d: Path) -> list[str]:
    from ..families import config_from_hf
    from ..loading.hf import read_json
    from ..loading.safetensors import open_checkpoint

    raw = read_json(d / "config.json") if (d / "config.json").is_file() else None
    if raw is None:
        raise ModelLoadError(f"{d} has no config.json (not a Hugging Face model directory)")
    st_files = sorted(d.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in st_files)
    lines = [f"directory: {d} (Hugging Face checkpoint, {len(st_files)} safetensors file"
             f"{'s' if len(st_files) != 1 else ''}, {fmt_bytes(total)})"]
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else raw.get("model_type")
    config, why = None, None
    try:
        config = config_from_hf(raw, name=d.name)
    except CyllmError as e:
        why = str(e)
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as e:
        why = f"bad config.json ({type(e).__name__})"
    lines.append(f"family: {_clip(arch)}" + ("" if why is None else f" (cyllm cannot run it: {_clip(why, 200)})"))
    if config is not None:
        lines += _config_lines(config)
    q = raw.get("quantization_config")
    file_sizes, shapes = {}, {}
    dtypes: Counter = Counter()
    try:
        for name, (f, tname) in open_checkpoint(d).items():
            dtype, shape = f.dtype_of(tname), f.shape_of(tname)
            dtypes[dtype] += 1
            shapes[name] = shape
            n = 1
            for x in shape:
                n *= int(x)
            file_sizes[name] = n * {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "I8": 1, "U8": 1}.get(dtype, 2)
    except CyllmError as e:
        lines.append(f"tensors: unreadable ({_clip(e, 200)})")
    if isinstance(q, dict):
        lines.append(f"quantization: {_clip(q.get('quant_method', 'yes'))} (not supported by cyllm)")
    else:
        main = dtypes.most_common(1)[0][0] if dtypes else "?"
        lines.append(f"quantization: none ({main} weights)")
    if dtypes:
        lines.append("tensor types: " + ", ".join(f"{n} x{c}" for n, c in dtypes.most_common()))
    lines.append(_hf_tokenizer_line(d))
    tmpl = _hf_has_template(d)
    lines.append("chat template: " + ("yes" if tmpl else "none (chat needs --chat-template NAME|FILE)"))
    if file_sizes:
        lines += _bytes_lines(config, file_sizes, shapes)
    return lines


def _small_json(path: Path, limit: int = 64 << 20):
    try:
        # a regular file only: a FIFO would block the read, a device (/dev/zero) never end it
        if not path.is_file() or path.stat().st_size > limit:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def _hf_tokenizer_line(d: Path) -> str:
    tj = d / "tokenizer.json"
    if not tj.is_file():
        return "tokenizer: none (no tokenizer.json)"
    data = _small_json(tj)
    if not isinstance(data, dict):
        return "tokenizer: tokenizer.json (unreadable)"
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    kind = model.get("type", "?")
    vocab = model.get("vocab")
    added = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
    n = (len(vocab) if isinstance(vocab, (dict, list)) else 0) + len(added)
    pre = data.get("pre_tokenizer") if isinstance(data.get("pre_tokenizer"), dict) else {}
    return f"tokenizer: {_clip(kind)} ({n} tokens" + (f", pre-tokenizer {_clip(pre.get('type'))}" if pre else "") + ")"


def _hf_has_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file():
        return True
    cfg = _small_json(d / "tokenizer_config.json")
    return isinstance(cfg, dict) and bool(cfg.get("chat_template"))


def describe_model(path) -> list[str]:
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_dir():
        return describe_hf_dir(p)
    if p.is_file():
        return describe_gguf(p)
    raise ModelLoadError(f"model path not found: {p}")
