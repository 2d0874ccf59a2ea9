"""The tokenizer of a GGUF file, rebuilt as a `tokenizers.Tokenizer` from its metadata.

Two vocabulary kinds (``tokenizer.ggml.model``): "gpt2" (byte-level BPE: tokens
and merges) and "llama" (SentencePiece-style: tokens and scores, with byte
fallback). Special tokens, BOS/EOS and the chat template come from the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TokenizerError, UnsupportedModelError
from .gguf import GGUFFile, _clip, _meta

# tokenizer.ggml.token_type values (llama.cpp)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


# Pre-tokenizer split patterns by llama.cpp's tokenizer.ggml.pre name (public regexes of
# those tokenizers). None = GPT-2's own pattern (the ByteLevel pre-tokenizer's built-in regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral")},
    **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen")},
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,          # Phi-4-mini
}
# these split every digit apart before the GPT-2 pattern (their HF tokenizers use Digits)
_PRE_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
# names whose split is GPT-2's own pattern
_PRE_GPT2 = {None, "", "default", "gpt-2", "gpt2", "phi-2", "stablelm2", "olmo", "mpt", "jais", "roberta-bpe"}


def known_pre_tokenizer(pre) -> bool:
    return pre in _PRE_SPLITS or pre in _PRE_DIGITS or pre in _PRE_GPT2


def _byte_level_pre_tokenizer(pre: str | None, path=None):
    from tokenizers import Regex, pre_tokenizers
    if not known_pre_tokenizer(pre):
        # text still tokenizes, but maybe not as the model was trained: say so once
        import sys
        print(f"cyllm: warning: {path}: unknown pre-tokenizer {_clip(repr(pre))}; splitting text "
              "the GPT-2 way, which may differ from the model's training", file=sys.stderr)
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _spm_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece-BPE vocabulary.

    SentencePiece merges the adjacent pair whose concatenation is the
    highest-scoring vocabulary piece; as BPE merges: every split of a piece into
    two vocabulary pieces, ranked by the piece's score (ties: shorter left part
    first, then vocabulary order).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    cands = []
    for tok, score in zip(tokens, scores):
        local = []
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        for _, _, left, right in local:
            cands.append((float(score), len(left), len(right), left, right))
    # stable sort, best first, same key and tie order as transformers' generate_merges
    cands.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(c[3], c[4]) for c in cands]


@dataclass
class GGUFTokenizerInfo:
    tokenizer: Any                  # tokenizers.Tokenizer
    kind: str                       # "gpt2" | "llama"
    bos_id: int | None
    eos_ids: list[int]
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def build_tokenizer(gf: GGUFFile, vocab_size: int | None = None) -> GGUFTokenizerInfo | None:
    """tokenizers.Tokenizer + special-token facts from tokenizer.ggml.* metadata (None if absent)."""
    md = gf.metadata
    kind = _meta(md, "tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise TokenizerError(f"{gf.path}: GGUF tokenizer has no token list")
    if vocab_size is not None and len(tokens) > vocab_size:
        raise TokenizerError(f"{gf.path}: GGUF tokenizer has {len(tokens)} tokens, more than the "
                             f"model's vocabulary of {vocab_size}")
    types = md.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{gf.path}: GGUF tokenizer token_type length {len(types)} != {len(tokens)} tokens")

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def tok_id(key):
        v = _meta(md, key)
        return v if isinstance(v, int) and 0 <= v < len(tokens) else None

    bos_id = tok_id("tokenizer.ggml.bos_token_id")
    unk_id = tok_id("tokenizer.ggml.unknown_token_id")
    pad_id = tok_id("tokenizer.ggml.padding_token_id")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = tok_id(key)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)

    try:
        if kind == "gpt2":
            alphabet_map = _bytes_to_unicode()
            alphabet = set(alphabet_map.values())
            vocab = {}
            for i, t in enumerate(tokens):
                # a piece written in raw text (not the byte alphabet) is respelled byte-wise
                spelled = t if set(t) <= alphabet else "".join(alphabet_map[b] for b in t.encode("utf-8"))
                vocab.setdefault(spelled, i)
            merges_raw = md.get("tokenizer.ggml.merges")
            if not isinstance(merges_raw, list):
                raise TokenizerError(f"{gf.path}: GGUF gpt2 tokenizer has no merges")
            merges = []
            for m in merges_raw:
                parts = m.split(" ")
                if len(parts) != 2:
                    raise TokenizerError(f"{gf.path}: bad GGUF merge {_clip(repr(m))}")
                merges.append((parts[0], parts[1]))
            tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
            tk.pre_tokenizer = _byte_level_pre_tokenizer(_meta(md, "tokenizer.ggml.pre"), gf.path)
            tk.decoder = decoders.ByteLevel()
            special_ok = lambda t: set(t) <= alphabet   # noqa: E731  (non-alphabet "controls" are mislabels)
            add_bos_default = False
        elif kind == "llama":
            scores = md.get("tokenizer.ggml.scores")
            if scores is None:
                scores = np.zeros(len(tokens), dtype=np.float32)
            if len(scores) != len(tokens):
                raise TokenizerError(f"{gf.path}: GGUF tokenizer scores length {len(scores)} != {len(tokens)} tokens")
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
            merges_raw = md.get("tokenizer.ggml.merges")
            if isinstance(merges_raw, list) and merges_raw:
                merges = [tuple(m.split(" ", 1)) for m in merges_raw]
            else:
                merges = _spm_merges(tokens, scores)
            unk = tokens[unk_id] if unk_id is not None else None
            tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
            add_prefix = bool(_meta(md, "tokenizer.ggml.add_space_prefix", True))
            tk.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False)
            seq = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            if add_prefix:
                seq.append(decoders.Strip(content=" ", left=1))
            tk.decoder = decoders.Sequence(seq)
            special_ok = lambda t: True   # noqa: E731
            add_bos_default = True   # llama.cpp's default for SentencePiece vocabularies
        else:
            raise UnsupportedModelError(
                f"{gf.path}: GGUF tokenizer model {_clip(repr(kind))} is not supported (supported: 'gpt2', 'llama')")
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and t and special_ok(t)]
        if control:
            tk.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t and t in vocab]
        if user:
            tk.add_tokens(user)
    except (TokenizerError, UnsupportedModelError):
        raise
    except Exception as e:   # tokenizers raises plain Exceptions on bad vocabularies
        raise TokenizerError(f"{gf.path}: cannot build the GGUF tokenizer ({type(e).__name__}: {_clip(e, 200)})") from None

    def name(i):
        return tokens[i] if i is not None else None

    template = _meta(md, "tokenizer.chat_template")
    return GGUFTokenizerInfo(
        tokenizer=tk, kind=kind, bos_id=bos_id, eos_ids=eos_ids, bos_token=name(bos_id),
        eos_token=name(eos_ids[0]) if eos_ids else None, unk_token=name(unk_id), pad_token=name(pad_id),
        add_bos=bool(_meta(md, "tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(_meta(md, "tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None)


def make_tokenizer(info: GGUFTokenizerInfo):
    """The project's Tokenizer around a built GGUF tokenizer."""
    from ..tokenizer import Tokenizer
    return Tokenizer(info.tokenizer, info.bos_id, list(info.eos_ids), chat_template=info.chat_template,
                     bos_token=info.bos_token, eos_token=info.eos_token, add_bos=info.add_bos)
