"""A Hugging Face model directory as GGUF content: metadata and tensors in llama.cpp's conventions.

`cyllm quantize HF_DIR OUT.gguf --type T` writes these (quantize.py); this module says
*what* a llama.cpp file of the model holds, read lazily from the safetensors so the
writer streams one tensor (one row chunk) at a time.

What llama.cpp's converter writes, and so what this writes (facts, checked against its
output by tests/test_quantize_tool.py):
- hyperparameters as ``{arch}.*`` keys; ``attention.key_length``/``value_length`` only
  when config.json names a ``head_dim``; the llama-style architectures (llama, smollm3, granite, granitemoe)
  also carry ``vocab_size`` and ``rope.dimension_count``; Phi-3 its rotary dims,
  ``rope.scaling.original_context_length`` and ``attention.sliding_window`` (0: none);
  Gemma 3 ``rope.freq_base_swa`` and the global layers' linear scaling; Gemma 2 its two
  soft caps and ``attention.sliding_window``, and no rope base (llama.cpp's 10000); YaRN scaling as
  ``rope.scaling.type`` "yarn", its factor, original context and the betas config.json gives; Granite (llama-style
  keys, no head_dim) its multipliers as ``attention.scale``, ``embedding_scale``,
  ``residual_scale`` and ``logit_scale``; a mixture of experts its expert counts (and Qwen3-MoE
  ``expert_feed_forward_length``, its dense size as ``feed_forward_length``); Hunyuan dense
  with the releases' "dynamic" alpha rope its stretched base, ``rope.scaling.type`` "none",
  factor 1, and 256k as both context lengths; GLM-4 ``rope.dimension_count``, and ``<|user|>``
  as ``eot_token_id``;
- tensors under the family table's GGUF names (families.py), a layer's experts stacked in one
  tensor each (E, rows, cols), the router F32; llama-style q/k rows
  interleaved for llama.cpp's rope (``Family.permute_qk``); Gemma's (1+w) norms stored
  as 1+w; vectors F32; Llama 3 rope scaling as a ``rope_freqs.weight`` tensor of
  divisors, Phi-3 longrope as ``rope_factors_long/short.weight``;
- the vocabulary as ``tokenizer.ggml.*``: "gpt2" (byte-level BPE: tokens, token types,
  merges, ``pre`` naming the split regex) from tokenizer.json, or "llama" (SentencePiece:
  tokens, scores, types) from tokenizer.model; added special tokens are CONTROL (3),
  other added tokens USER_DEFINED (4), embedding rows past the vocabulary "[PAD<i>]"
  UNUSED (5); bos/eos/unk/pad ids and add_bos/add_eos from tokenizer_config.json (ids it
  lacks from config.json's ``*_token_id``);
  the chat template.
Sliding windows of the llama architecture (Mistral) are not written: llama.cpp's
converter writes none and llama.cpp applies none (a note says so).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import ModelConfig
from ..errors import ModelLoadError, TokenizerError, UnsupportedModelError
from ..families import Family, config_from_hf, family
from ..jsonio import read_json_file
from ..oneline import one_line
from ..tokenizer import hf_chat_templates

# tokenizer.ggml.token_type values (llama.cpp)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class SourceTensor:
    """One tensor of the output: GGUF name, numpy shape, and its float32 rows on demand."""
    name: str
    shape: tuple[int, ...]
    # a slice of the rows -> float32 (GGUF layout); a stack of expert matrices (E, rows, cols)
    # has the rows of each in turn
    rows: Callable[[slice], np.ndarray]

    def all(self) -> np.ndarray:
        return self.rows(slice(0, int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else self.shape[0]))


@dataclass
class HFSource:
    path: Path
    config: ModelConfig
    family: Family
    hf: dict                          # config.json
    metadata: list                    # [(key, value, GGUFValueType, sub type or None)]
    tensors: list[SourceTensor]

    @property
    def arch(self) -> str:
        return self.family.gguf_arch


# ---------------------------------------------------------------------------------- tensors

def _float32(f, tname: str, rows: slice | None) -> np.ndarray:
    from ..loading.safetensors import bf16_bits_to_f32
    tag, raw = f.raw(tname)
    if rows is not None:
        raw = raw[rows]
    if tag == "BF16":
        return bf16_bits_to_f32(raw)
    if tag in ("F32", "F16", "F64"):
        return np.asarray(raw, np.float32)
    raise UnsupportedModelError(f"{one_line(f.path)}: tensor {tname} has dtype {tag}; expected F16, BF16 or F32")


def _permute_order(rows: int, heads: int, rot: int = 0) -> np.ndarray:
    """GGUF row r of a llama-style q/k matrix is HF row order[r]: within each head, the
    rotate-half pairs (i, i + r/2) of its first r = rot rows (0: all) become adjacent rows
    (2i, 2i + 1), the rest stay where they are; the inverse of the loader's reordering."""
    from ..loading.gguf import _unpermute_order
    return np.argsort(_unpermute_order(rows, heads, rot))


def _reader(f, tname: str, order: np.ndarray | None, plus_one: bool, stacked=None):
    """Rows of a tensor as float32, on demand; ``stacked``: (expert, first row, end row) of a
    tensor holding every expert's matrices (checkpoint_tensors), whose rows these are."""
    def rows(part: slice) -> np.ndarray:
        if stacked is not None:
            e, r0, r1 = stacked
            a = _take(f, tname, (e, np.arange(r0, r1)[part]))
        elif order is None:
            a = _float32(f, tname, part)
        else:
            a = _take(f, tname, order[part])
        if plus_one:
            a = a + np.float32(1.0)
        return np.ascontiguousarray(a, np.float32)
    return rows


def _take(f, tname: str, idx) -> np.ndarray:
    """Rows idx (an index array, or a tuple of indices) of a tensor as float32 without
    converting the rest of it."""
    from ..loading.safetensors import bf16_bits_to_f32
    tag, raw = f.raw(tname)
    sel = raw[idx]
    return bf16_bits_to_f32(sel) if tag == "BF16" else np.asarray(sel, np.float32)


def _stacked(readers: list, rows_each: int):
    """The rows of expert matrices stacked in turn (each ``rows_each`` rows), read on demand."""
    def rows(part: slice) -> np.ndarray:
        parts = []
        for e in range(part.start // rows_each, (part.stop - 1) // rows_each + 1):
            r0 = max(part.start - e * rows_each, 0)
            r1 = min(part.stop - e * rows_each, rows_each)
            parts.append(readers[e](slice(r0, r1)))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
    return rows


def _const(a: np.ndarray):
    a = np.ascontiguousarray(a, np.float32)
    return lambda part: a[part]


def _tensors(cfg: ModelConfig, fam: Family, d: Path) -> list[SourceTensor]:
    from ..loading.hf import checkpoint_tensors
    out: list[SourceTensor] = []
    rot = cfg.rotary_dim or cfg.head_dim
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "llama3":
        from ..rope import RopeSpec
        div = RopeSpec(cfg.rope_theta, rot, scaling).divisors(cfg.max_seq_len)
        out.append(SourceTensor("rope_freqs.weight", (rot // 2,), _const(div)))
    elif kind == "longrope":
        for which in ("long", "short"):
            fac = np.asarray(scaling[f"{which}_factor"], np.float32)
            if fac.shape != (rot // 2,):
                raise ModelLoadError(f"{one_line(d)}: rope {which}_factor has {fac.size} entries, expected {rot // 2}")
            out.append(SourceTensor(f"rope_factors_{which}.weight", fac.shape, _const(fac)))
    experts: dict = {}          # (table row, layer) -> the readers of its experts so far
    for t, i, _, shape, f, tname, stacked in checkpoint_tensors(cfg, d):
        order = None
        if fam.permute_qk and t.permute and not fam.hf_rope_interleaved:   # (already in llama.cpp's order)
            heads = t.permute_heads(cfg)
            order = _permute_order(shape[0], heads)     # llama.cpp's converter: the whole head
        reader = _reader(f, tname, order, t.hf_plus_one, stacked)
        if not t.experts:
            out.append(SourceTensor(t.gguf_name(i), shape, reader))
            continue
        # llama.cpp stacks a layer's experts in one tensor (E, rows, cols): written once the last is seen
        readers = experts.setdefault((t.role, i), [])
        readers.append(reader)
        if len(readers) == cfg.n_experts:
            out.append(SourceTensor(t.gguf_name(i), (cfg.n_experts, *shape), _stacked(readers, shape[0])))
    return out


# ---------------------------------------------------------------------------------- metadata

GRANITES = ("granite", "granitemoe")      # llama.cpp's converter: one Granite base class
GEMMA_EOT = 107      # the end-of-turn id llama.cpp's converter writes for every Gemma (see hf_source)


def _hparams(cfg: ModelConfig, fam: Family, hf: dict, name: str) -> list:
    import gguf
    T = gguf.GGUFValueType
    a = fam.gguf_arch + "."
    kv = [("general.architecture", fam.gguf_arch, T.STRING, None), ("general.name", name, T.STRING, None),
          (a + "block_count", cfg.n_layers, T.UINT32, None),
          (a + "context_length", cfg.max_seq_len, T.UINT32, None),
          (a + "embedding_length", cfg.dim, T.UINT32, None),
          (a + "feed_forward_length", cfg.ffn_dim, T.UINT32, None),
          (a + "attention.head_count", cfg.n_heads, T.UINT32, None),
          (a + "attention.head_count_kv", cfg.n_kv_heads, T.UINT32, None),
          (a + "rope.freq_base", cfg.rope_theta, T.FLOAT32, None),
          (a + "attention.layer_norm_rms_epsilon", cfg.norm_eps, T.FLOAT32, None)]
    if hf.get("head_dim") is not None and fam.name not in GRANITES:    # Granite's converter drops it
        kv += [(a + "attention.key_length", cfg.head_dim, T.UINT32, None),
               (a + "attention.value_length", cfg.head_dim, T.UINT32, None)]
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        kv += [(a + "rope.scaling.type", "linear", T.STRING, None),
               (a + "rope.scaling.factor", float(scaling["factor"]), T.FLOAT32, None)]
    elif kind == "yarn":        # the keys llama.cpp's converter writes, each only when given
        kv += [(a + "rope.scaling.type", "yarn", T.STRING, None),
               (a + "rope.scaling.factor", float(scaling["factor"]), T.FLOAT32, None),
               (a + "rope.scaling.original_context_length", int(scaling["original_max_position_embeddings"]),
                T.UINT32, None)]
        for hf_key, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                            ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if scaling.get(hf_key) is not None:
                kv.append((a + "rope.scaling." + key, float(scaling[hf_key]), T.FLOAT32, None))
    elif kind not in (None, "llama3", "longrope"):
        raise UnsupportedModelError(f"rope scaling {kind!r} cannot be written to a GGUF by cyllm")
    if fam.gguf_arch in ("llama", "smollm3", *GRANITES):
        kv += [(a + "vocab_size", cfg.vocab_size, T.UINT32, None),
               (a + "rope.dimension_count", cfg.rotary_dim or cfg.head_dim, T.UINT32, None)]
    if fam.name == "mistral" and cfg.sliding_window and cfg.sliding_window < cfg.max_seq_len:
        print(f"cyllm: note: the sliding window ({cfg.sliding_window}) is not written: llama.cpp applies "
              "none to llama-architecture files", file=sys.stderr)
    if fam.name == "gemma3" and (cfg.attn_softcap or cfg.final_softcap):
        raise UnsupportedModelError("a Gemma 3 with soft caps cannot be written to a GGUF: llama.cpp's gemma3 "
                                    "reads none")
    if fam.name == "gemma3":
        kv += [(a + "rope.freq_base_swa", cfg.rope_local_theta or 10000.0, T.FLOAT32, None),
               (a + "attention.sliding_window", cfg.sliding_window, T.UINT32, None)]
    if fam.name == "gemma" and cfg.rope_theta == 10000.0:
        kv = [e for e in kv if e[0] != a + "rope.freq_base"]    # the converter writes none: 10000
    if fam.name == "gemma2":
        # the converter's keys; it writes no rope base, which llama.cpp then takes as 10000
        if not (cfg.attn_softcap and cfg.final_softcap):
            raise UnsupportedModelError("a Gemma 2 without both soft caps cannot be written to a GGUF: "
                                        "llama.cpp would apply its defaults, 50 and 30")
        alternate = tuple("sliding" if i % 2 == 0 else "full" for i in range(cfg.n_layers))
        if not cfg.sliding_window or cfg.layer_types != alternate:
            raise UnsupportedModelError("a Gemma 2 whose sliding layers are not every other one from the first "
                                        "cannot be written to a GGUF: llama.cpp applies that pattern")
        if cfg.rope_theta == 10000.0:
            kv = [e for e in kv if e[0] != a + "rope.freq_base"]
        kv += [(a + "attn_logit_softcapping", cfg.attn_softcap, T.FLOAT32, None),
               (a + "final_logit_softcapping", cfg.final_softcap, T.FLOAT32, None),
               (a + "attention.sliding_window", cfg.sliding_window, T.UINT32, None)]
    if fam.name == "olmo2" and cfg.layer_types:
        # OLMo 3: cyllm reads no OLMo 3 GGUF (llama.cpp's windowed olmo2), so it writes none
        raise UnsupportedModelError("OLMo 3 (sliding-window layers) cannot be written to a GGUF by cyllm")
    if fam.name == "exaone4":       # the vocabulary size, and a hybrid's window and sliding layers
        kv.append((a + "vocab_size", cfg.vocab_size, T.UINT32, None))
        if cfg.sliding_window:
            if cfg.n_layers != 64:
                raise UnsupportedModelError(f"an EXAONE 4 with sliding layers and {cfg.n_layers} layers cannot be "
                                            "written to a GGUF: llama.cpp runs them only at 64 layers")
            kv += [(a + "attention.sliding_window", cfg.sliding_window, T.UINT32, None),
                   (a + "attention.sliding_window_pattern", [bool(cfg.layer_window(i)) for i in range(cfg.n_layers)],
                    T.ARRAY, T.BOOL)]
    if fam.name == "glm4":          # the rotating dims of a head (half, in the releases)
        kv.append((a + "rope.dimension_count", cfg.rotary_dim or cfg.head_dim, T.UINT32, None))
    if fam.name == "hunyuan_dense":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "dynamic":
            # the converter's reading of the releases' alpha rope: the stretched base (above),
            # no scaling, and the 256k context the alpha is for
            ctx = 256 * 1024
            kv = [(k, ctx if k == a + "context_length" else v, vt, st) for k, v, vt, st in kv]
            kv += [(a + "rope.scaling.type", "none", T.STRING, None),
                   (a + "rope.scaling.factor", 1.0, T.FLOAT32, None),
                   (a + "rope.scaling.original_context_length", ctx, T.UINT32, None)]
    if fam.name in GRANITES:        # each multiplier config.json gives (llama.cpp's converter skips 0)
        for hf_key, key in (("attention_multiplier", "attention.scale"), ("embedding_multiplier", "embedding_scale"),
                            ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            if hf.get(hf_key):
                kv.append((a + key, float(hf[hf_key]), T.FLOAT32, None))
    if cfg.moe:
        # the keys llama.cpp's converter writes; it reads no renormalization flag for these
        # architectures (Qwen3-MoE and Mixtral renormalize, OLMoE does not), so a model that
        # differs cannot be written
        if cfg.expert_norm != (fam.name != "olmoe"):
            raise UnsupportedModelError(f"a {fam.name} model whose expert weights are "
                                        f"{'' if cfg.expert_norm else 'not '}renormalized cannot be written to a GGUF: "
                                        "llama.cpp fixes that choice for the architecture")
        kv += [(a + "expert_count", cfg.n_experts, T.UINT32, None),
               (a + "expert_used_count", cfg.n_experts_used, T.UINT32, None)]
        if fam.name == "qwen3moe":      # feed_forward_length: the dense size config.json names
            kv = [(k, hf.get("intermediate_size", v) if k == a + "feed_forward_length" else v, vt, st)
                  for k, v, vt, st in kv]
            kv.append((a + "expert_feed_forward_length", cfg.ffn_dim, T.UINT32, None))
    if fam.name == "phi3":
        orig = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") \
            or cfg.max_seq_len
        kv += [(a + "rope.dimension_count", cfg.rotary_dim or cfg.head_dim, T.UINT32, None),
               (a + "rope.scaling.original_context_length", int(orig), T.UINT32, None),
               (a + "attention.sliding_window", cfg.sliding_window or 0, T.UINT32, None)]
        if kind == "longrope":
            from ..rope import RopeSpec
            mag = RopeSpec(cfg.rope_theta, cfg.rotary_dim or cfg.head_dim, scaling).magnitude()
            kv.append((a + "rope.scaling.attn_factor", mag, T.FLOAT32, None))
    for key, v, vtype, _ in kv:
        if vtype == T.UINT32 and not 0 <= v < 1 << 32:
            raise UnsupportedModelError(f"{key} = {v} does not fit the GGUF's 32-bit field")
    return kv


# ---------------------------------------------------------------------------------- vocabulary

# llama.cpp pre-tokenizer names by the split regex of tokenizer.json (the regexes are the
# public ones of those tokenizers; gguf_tokenizer.py maps the names back to them)
def _pre_by_regex() -> dict[str, str]:
    from ..loading import gguf_tokenizer as gt
    return {gt._LLAMA3_SPLIT: "llama-bpe", gt._QWEN2_SPLIT: "qwen2", gt._TEKKEN_SPLIT: "tekken",
            gt._GPT4O_SPLIT: "gpt-4o"}


def _walk_pre(node, out: list) -> None:
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "Sequence":
        parts = node.get("pretokenizers")
        for p in parts if isinstance(parts, list) else []:
            _walk_pre(p, out)
    else:
        out.append(node)


def _pre_name(tj: dict) -> str:
    steps: list = []
    _walk_pre(tj.get("pre_tokenizer"), steps)
    table = _pre_by_regex()
    for s in steps:
        if s.get("type") == "Split":
            pat = s.get("pattern") or {}
            rx = pat.get("Regex") if isinstance(pat, dict) else None
            if isinstance(rx, str) and rx in table:
                return table[rx]
    types = [s.get("type") for s in steps if isinstance(s.get("type"), str)]
    if "Digits" in types and "ByteLevel" in types:
        return "smollm"
    if types == ["ByteLevel"]:
        return "gpt-2"
    print("cyllm: warning: the tokenizer's pre-tokenizer is none llama.cpp names by cyllm's table; "
          "writing tokenizer.ggml.pre = \"default\" (llama.cpp may split text differently)", file=sys.stderr)
    return "default"


def _tok_text(v):
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _added(tj: dict, tc: dict) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of the added tokens (tokenizer.json, then tokenizer_config.json)."""
    out: dict[int, tuple[str, bool]] = {}
    listed, decoder = tj.get("added_tokens"), tc.get("added_tokens_decoder")
    for t in listed if isinstance(listed, list) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str):
            out[t["id"]] = (t["content"], bool(t.get("special")))
    for k, t in (decoder if isinstance(decoder, dict) else {}).items():
        # ASCII digits only and few of them: "²" is a digit to isdigit(), not to int()
        if (isinstance(t, dict) and str(k).isascii() and str(k).isdigit() and len(str(k)) < 12
                and isinstance(t.get("content"), str)):
            out[int(k)] = (t["content"], bool(t.get("special")))
    return out


def _vocab_gpt2(tj: dict, tc: dict, n_vocab: int):
    model = tj.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(vocab, dict):
        raise UnsupportedModelError("tokenizer.json: only BPE vocabularies can be written to a GGUF")
    added = _added(tj, tc)
    by_id: dict[int, str] = {i: t for t, i in vocab.items() if isinstance(i, int)}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i][0])
            types.append(CONTROL if added[i][1] else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    listed = model.get("merges")
    if not isinstance(listed, list) or not listed:
        raise TokenizerError("tokenizer.json: a BPE vocabulary without a list of merges")
    merges = []
    for m in listed:            # "a b", or ["a", "b"] (the newer form)
        if isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            m = " ".join(m)
        if not isinstance(m, str):
            raise TokenizerError(f"tokenizer.json: a merge is {one_line(repr(m), 60)}, not a pair of strings")
        merges.append(m)
    return tokens, types, merges


def _vocab_spm(d: Path, tc: dict, tj: dict, n_vocab: int):
    try:
        import sentencepiece
    except ImportError:
        raise UnsupportedModelError("writing a SentencePiece vocabulary needs the sentencepiece package "
                                    "(pip install sentencepiece)") from None
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(d / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"cannot read {one_line(d / 'tokenizer.model')} ({one_line(e, 120)})") from None
    n_sp = sp.GetPieceSize()
    tokens, scores, types = [], [], []
    for i in range(n_vocab):
        if i < n_sp:
            tokens.append(sp.IdToPiece(i))
            scores.append(float(sp.GetScore(i)))
            types.append(UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else
                         UNUSED if sp.IsUnused(i) else BYTE if sp.IsByte(i) else NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            scores.append(-10000.0)
            types.append(UNUSED)
    for i, (text, special) in _added(tj, tc).items():
        if 0 <= i < n_vocab:
            tokens[i] = text
            scores[i] = -1000.0
            types[i] = CONTROL if special else USER_DEFINED
    pieces = sp.EncodeAsPieces("a")
    space_prefix = bool(pieces) and pieces[0].startswith("\u2581")
    return tokens, scores, types, space_prefix


def _add_bos(tc: dict, tj: dict, bos: str | None) -> bool | None:
    if isinstance(tc.get("add_bos_token"), bool):
        return tc["add_bos_token"]
    steps = []
    pp = tj.get("post_processor")
    if isinstance(pp, dict):
        steps = pp.get("processors") if pp.get("type") == "Sequence" else [pp]
    for s in steps if isinstance(steps, list) else []:
        if isinstance(s, dict) and s.get("type") == "TemplateProcessing":
            single = s.get("single")
            first = single[0] if isinstance(single, list) and single else {}
            special = first.get("SpecialToken") if isinstance(first, dict) else None
            return bool(bos) and isinstance(special, dict) and special.get("id") == bos
    return None


def _tokenizer_kv(d: Path, cfg: ModelConfig, hf: dict) -> list:
    import gguf
    T = gguf.GGUFValueType
    tj = read_json_file(d / "tokenizer.json", TokenizerError, missing_ok=True)
    tc = read_json_file(d / "tokenizer_config.json", TokenizerError, missing_ok=True)
    if not tj and not (d / "tokenizer.model").is_file():
        raise TokenizerError(f"{one_line(d)} has no tokenizer.json or tokenizer.model; a GGUF needs the vocabulary")
    n = cfg.vocab_size
    kv = []
    if (d / "tokenizer.model").is_file():
        tokens, scores, types, space_prefix = _vocab_spm(d, tc, tj, n)
        kv += [("tokenizer.ggml.model", "llama", T.STRING, None), ("tokenizer.ggml.pre", "default", T.STRING, None),
               ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
               ("tokenizer.ggml.scores", scores, T.ARRAY, T.FLOAT32),
               ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32)]
        if not space_prefix:
            kv.append(("tokenizer.ggml.add_space_prefix", False, T.BOOL, None))
    else:
        tokens, types, merges = _vocab_gpt2(tj, tc, n)
        pre = _pre_name(tj)
        if cfg.arch == "glm4" and pre == "llama-bpe":
            pre = "glm4"    # GLM-4's name for Llama 3's split: llama.cpp then adds no BOS
        kv += [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", pre, T.STRING, None),
               ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
               ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
               ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING)]
    ids = {t: i for i, t in enumerate(tokens)}
    special = {}
    for key, gkey in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        text = _tok_text(tc.get(key))
        if text is not None and text in ids:
            special[gkey] = ids[text]
    if "bos" not in special and cfg.bos_token_id is not None:
        special["bos"] = cfg.bos_token_id
    if "eos" not in special and cfg.eos_token_ids:
        special["eos"] = cfg.eos_token_ids[0]
    for key, gkey in (("unk_token_id", "unknown"), ("pad_token_id", "padding")):   # as llama.cpp's converter
        v = hf.get(key)
        if gkey not in special and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            special[gkey] = v
    if cfg.arch == "glm4":
        # llama.cpp's converter: <|endoftext|> for whichever of these the tokenizer's files leave
        # out, and <|user|> (where a turn hands back to the user) as the end of a turn
        for gkey in ("eos", "unknown", "bos"):
            if gkey not in special and "<|endoftext|>" in ids:
                special[gkey] = ids["<|endoftext|>"]
        if "<|user|>" in ids:
            special["eot"] = ids["<|user|>"]
    for gkey in ("bos", "eos", "unknown", "padding", "eot"):
        if gkey in special:
            kv.append((f"tokenizer.ggml.{gkey}_token_id", int(special[gkey]), T.UINT32, None))
    add_bos = _add_bos(tc, tj, _tok_text(tc.get("bos_token")))
    if add_bos is not None:
        kv.append(("tokenizer.ggml.add_bos_token", add_bos, T.BOOL, None))
    kv.append(("tokenizer.ggml.add_eos_token", bool(tc.get("add_eos_token") is True), T.BOOL, None))
    # the default template, and the other named ones (a "tool_use" one) under llama.cpp's keys
    for name, text in hf_chat_templates(d, tc).items():
        if text and (name == "default" or name.isidentifier()):
            key = "tokenizer.chat_template" if name == "default" else f"tokenizer.chat_template.{name}"
            kv.append((key, text, T.STRING, None))
    return kv


# ---------------------------------------------------------------------------------- entry point

def is_hf_dir(path) -> bool:
    return Path(path).is_dir()


def hf_source(path) -> HFSource:
    """The GGUF content of the Hugging Face model directory `path` (nothing converted yet)."""
    from ..loading.hf import _merge_generation_config, read_json
    d = Path(path)
    cpath = d / "config.json"
    if not cpath.is_file():
        raise ModelLoadError(f"no config.json in {one_line(d)} (not a Hugging Face model directory)")
    hf = read_json(cpath)
    cfg = config_from_hf(hf, name=d.resolve().name)
    _merge_generation_config(cfg, d)
    fam = family(cfg.arch)
    kv = _hparams(cfg, fam, dict(hf), cfg.name) + _tokenizer_kv(d, cfg, dict(hf))
    if fam.name == "gemma" and GEMMA_EOT < cfg.vocab_size:
        import gguf
        # llama.cpp's converter marks id 107 end-of-turn in every Gemma file (<end_of_turn> in
        # the released vocabulary; CodeGemma's FIM ids it sets too find no key in gguf 0.19)
        kv.append(("tokenizer.ggml.eot_token_id", GEMMA_EOT, gguf.GGUFValueType.UINT32, None))
    return HFSource(d, cfg, fam, dict(hf), kv, _tensors(cfg, fam, d))
