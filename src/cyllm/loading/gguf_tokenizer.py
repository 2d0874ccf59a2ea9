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
from ..oneline import one_line
from .gguf_file import GGUFFile, clip, meta_value

# What the builder accepts. Real vocabularies: up to ~260k tokens, a few MB of text, tokens
# of at most a few hundred characters, as many merges as tokens. Deriving SentencePiece
# merges costs the sum of squared token lengths, so a hostile vocabulary (one token of a
# million characters, or tokens growing by one character each) would hang the builder.
MAX_TOKENS = 1 << 22
MAX_TOKEN_CHARS = 4096
MAX_VOCAB_CHARS = 1 << 26
MAX_MERGES = 1 << 23
MAX_SPM_MERGE_CHARS = 1 << 23  # when merges are derived from scores: characters of all tokens,
MAX_SPM_MERGE_WORK = 1 << 28   # and the sum of their squared lengths (a 262k Gemma vocabulary: ~2M, ~20M)
MAX_SPM_MERGES = 1 << 22       # and the merges so derived (each piece's splits into two pieces): a vocabulary
                               # of every a/b string to length 18 (21 MB) derived 6M, 3.6 GB and 44 s

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
# Qwen3.5: Qwen2's with combining marks (\p{M}) kept inside words
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral",
                                  "midm-2.0", "glm4")},
    **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,          # Phi-4-mini
}
# DeepSeek's first models (llama architecture: DeepSeek-LLM 7B/67B, DeepSeek-Coder 1.3-33B):
# several splits, each applied to the pieces the one before it left (their tokenizer.json's
# Sequence of isolated Splits, as llama.cpp runs them)
_DEEPSEEK_LETTERS = ("A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
                     "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
                     "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
                     "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
                     "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
                     "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
                     "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                     "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
                     "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
                     "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
                     "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
                     "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
                     "\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_PRE_SEQUENCES = {
    "deepseek-llm": (r"[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                     r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                     _CJK_RUNS, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUNS, r"\p{N}"),
    # Hunyuan dense: digits in runs of up to three, then CJK ideographs and kana, then its own
    # split of the rest (a punctuation mark with the Latin letters after it, words, punctuation)
    "hunyuan-dense": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                      r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                      r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
# these split every digit apart before the GPT-2 pattern (their HF tokenizers use Digits)
_PRE_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
# names whose split is GPT-2's own pattern
_PRE_GPT2 = {None, "", "default", "gpt-2", "gpt2", "phi-2", "olmo", "mpt", "jais", "roberta-bpe",
            "a.x-4.0", "mellum", "exaone4"}


# pre-tokenizer names whose vocabulary llama.cpp gives no BOS token (so none is ever added)
_PRE_NO_BOS = {"glm4"}


def known_pre_tokenizer(pre) -> bool:
    return pre in _PRE_SPLITS or pre in _PRE_SEQUENCES or pre in _PRE_DIGITS or pre in _PRE_GPT2


def _byte_level_pre_tokenizer(pre: str | None, path=None):
    from tokenizers import Regex, pre_tokenizers
    if not known_pre_tokenizer(pre):
        # text still tokenizes, but maybe not as the model was trained: say so once
        import sys
        print(f"cyllm: warning: {path}: unknown pre-tokenizer {clip(repr(pre))}; splitting text "
              "the GPT-2 way, which may differ from the model's training", file=sys.stderr)
    splits = (_PRE_SPLITS[pre],) if pre in _PRE_SPLITS else _PRE_SEQUENCES.get(pre)
    if splits:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _spm_merges(tokens: list[str], scores, where: str) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece-BPE vocabulary.

    SentencePiece merges the adjacent pair whose concatenation is the
    highest-scoring vocabulary piece; as BPE merges: every split of a piece into
    two vocabulary pieces, ranked by the piece's score (ties: shorter left part
    first, then vocabulary order).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    get = vocab.get
    cands = []
    for tok, score in zip(tokens, scores):
        local = []
        for k in range(1, len(tok)):
            il = get(tok[:k])
            if il is None:          # most splits end here: the right part is never cut
                continue
            ir = get(tok[k:])
            if ir is not None:
                local.append((il, ir, k))
        local.sort()
        # the pieces by index: the vocabulary's own strings, not a copy a merge
        cands += [(float(score), k, len(tok) - k, il, ir) for il, ir, k in local]
        if len(cands) > MAX_SPM_MERGES:
            raise TokenizerError(f"{where}: GGUF SentencePiece vocabulary would give more than {MAX_SPM_MERGES} "
                                 "merges (no real one gives that many)")
    # stable sort, best first, same key and tie order as transformers' generate_merges
    cands.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(tokens[c[3]], tokens[c[4]]) for c in cands]


def _merges(md, where: str) -> list[str] | None:
    m = md.get("tokenizer.ggml.merges")
    if m is None:
        return None
    if not isinstance(m, list) or not all(isinstance(x, str) for x in m):
        raise TokenizerError(f"{where}: GGUF tokenizer.ggml.merges must be an array of strings")
    if len(m) > MAX_MERGES:
        raise TokenizerError(f"{where}: GGUF tokenizer has {len(m)} merges (at most {MAX_MERGES})")
    if m and max(map(len, m)) > 2 * MAX_TOKEN_CHARS + 1:
        raise TokenizerError(f"{where}: a GGUF merge is longer than two tokens can be")
    return m


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
    tool_template: str | None       # tokenizer.chat_template.tool_use (a second template, for tools)
    aliases: dict[int, int]         # ids whose piece an earlier id spells too -> that id
    n_tokens: int                   # the token list's length: every id below it decodes


def _check_vocabulary(where: str, tokens, vocab_size: int | None) -> None:
    """Bounds on what the builder accepts: a hostile vocabulary must not hang it or fill memory."""
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{where}: GGUF tokenizer has no token list (tokenizer.ggml.tokens must be "
                             "an array of strings)")
    if len(tokens) > MAX_TOKENS:
        raise TokenizerError(f"{where}: GGUF tokenizer has {len(tokens)} tokens (at most {MAX_TOKENS})")
    # one token a row of the embedding, as llama.cpp requires (its converter pads the list):
    # with fewer, a sampled id past the list would stop the text midway
    if vocab_size is not None and len(tokens) != vocab_size:
        raise TokenizerError(f"{where}: GGUF tokenizer has {len(tokens)} tokens, but the model's "
                             f"vocabulary has {vocab_size}")
    longest = max(map(len, tokens))
    if longest > MAX_TOKEN_CHARS:
        raise TokenizerError(f"{where}: GGUF tokenizer has a token of {longest} characters "
                             f"(at most {MAX_TOKEN_CHARS}); not a real vocabulary")
    total = sum(map(len, tokens))
    if total > MAX_VOCAB_CHARS:
        raise TokenizerError(f"{where}: GGUF tokenizer tokens hold {total} characters in all "
                             f"(at most {MAX_VOCAB_CHARS}); not a real vocabulary")


def _array(md, where: str, key: str, n: int, kind: str):
    """A per-token metadata array (token_type: integers, scores: finite numbers) of n entries, or None."""
    v = md.get(key)
    if v is None:
        return None
    ok = isinstance(v, np.ndarray) and v.ndim == 1 and len(v) == n and (
        np.issubdtype(v.dtype, np.integer) if kind == "int" else
        (np.issubdtype(v.dtype, np.number) and not np.isnan(v).any()))
    if not ok:
        what = "integers" if kind == "int" else "numbers"
        got = f"{len(v)} entries" if isinstance(v, (list, np.ndarray)) else type(v).__name__
        raise TokenizerError(f"{where}: GGUF {key} must be an array of {n} {what} (one per token), got {got}")
    return v


def _flag(md, where: str, key: str, default: bool) -> bool:
    v = meta_value(md, key, default)
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise TokenizerError(f"{where}: GGUF {key} must be true or false, got {clip(repr(v), 40)}")


def _text(md, where: str, key: str):
    v = meta_value(md, key)
    if v is None or isinstance(v, str):
        return v
    raise TokenizerError(f"{where}: GGUF {key} must be a string, got {clip(repr(v), 40)}")


def build_tokenizer(gf: GGUFFile, vocab_size: int | None = None) -> GGUFTokenizerInfo | None:
    """tokenizers.Tokenizer + special-token facts from tokenizer.ggml.* metadata (None if absent)."""
    md = gf.metadata
    where = one_line(gf.path)
    kind = _text(md, where, "tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = md.get("tokenizer.ggml.tokens")
    _check_vocabulary(where, tokens, vocab_size)
    types = _array(md, where, "tokenizer.ggml.token_type", len(tokens), "int")
    types = types.tolist() if types is not None else [TOKEN_NORMAL] * len(tokens)

    from tokenizers import AddedToken, Tokenizer, decoders, models

    def tok_id(key):
        v = meta_value(md, key)
        return v if isinstance(v, int) and 0 <= v < len(tokens) else None

    bos_id = tok_id("tokenizer.ggml.bos_token_id")
    unk_id = tok_id("tokenizer.ggml.unknown_token_id")
    pad_id = tok_id("tokenizer.ggml.padding_token_id")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = tok_id(key)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)

    aliases: dict[int, int] = {}    # a later id of a piece spelled twice -> its first id
    try:
        if kind == "gpt2":
            pre = _text(md, where, "tokenizer.ggml.pre")
            alphabet_map = _bytes_to_unicode()
            alphabet = set(alphabet_map.values())
            vocab = {}
            for i, t in enumerate(tokens):
                # a piece written in raw text (not the byte alphabet) is respelled byte-wise
                spelled = t if set(t) <= alphabet else "".join(alphabet_map[b] for b in t.encode("utf-8"))
                if vocab.setdefault(spelled, i) != i:
                    aliases[i] = vocab[spelled]     # GPT-NeoX's "  " beside "ĠĠ", Command-R's 43
            merges_raw = _merges(md, where)
            if merges_raw is None:
                raise TokenizerError(f"{where}: GGUF gpt2 tokenizer has no merges")
            merges = []
            for m in merges_raw:
                parts = m.split(" ")
                if len(parts) != 2:
                    raise TokenizerError(f"{where}: bad GGUF merge {clip(repr(m))}")
                merges.append((parts[0], parts[1]))
            # Llama 3's tokenizer takes a whole pre-token that is in the vocabulary as it is,
            # before any merge (llama.cpp and its tokenizer.json alike)
            tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                      ignore_merges=_PRE_SPLITS.get(pre) is _LLAMA3_SPLIT))
            tk.pre_tokenizer = _byte_level_pre_tokenizer(pre, where)
            tk.decoder = decoders.ByteLevel()
            special_ok = lambda t: set(t) <= alphabet   # noqa: E731  (non-alphabet "controls" are mislabels)
            add_bos_default = False
        elif kind == "llama":
            scores = _array(md, where, "tokenizer.ggml.scores", len(tokens), "number")
            if scores is None:
                scores = np.zeros(len(tokens), dtype=np.float32)
            vocab = {}
            for i, t in enumerate(tokens):
                if vocab.setdefault(t, i) != i:
                    aliases[i] = vocab[t]
            merges_raw = _merges(md, where)
            if merges_raw:
                merges = [tuple(m.split(" ", 1)) for m in merges_raw]
                if any(len(m) != 2 for m in merges):
                    raise TokenizerError(f"{where}: a GGUF merge is not two pieces separated by a space")
            else:
                chars, work = sum(len(t) for t in tokens), sum(len(t) ** 2 for t in tokens)
                if chars > MAX_SPM_MERGE_CHARS or work > MAX_SPM_MERGE_WORK:
                    raise TokenizerError(f"{where}: GGUF SentencePiece vocabulary is too large to derive its "
                                         f"merges from ({chars} characters; squared lengths sum to {work})")
                merges = _spm_merges(tokens, scores, where)
            unk = tokens[unk_id] if unk_id is not None else None
            tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
            add_prefix = _flag(md, where, "tokenizer.ggml.add_space_prefix", True)
            # as llama.cpp's SentencePiece tokenizer: spaces become U+2581 and one more is put in
            # front even when the text already starts with a space (" Hi" -> "__Hi"); a
            # Metaspace pre-tokenizer would not add it then
            from tokenizers import normalizers
            spaces = normalizers.Replace(" ", "\u2581")
            tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_prefix else spaces
            tk.pre_tokenizer = None
            seq = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            if add_prefix:
                seq.append(decoders.Strip(content=" ", left=1))
            tk.decoder = decoders.Sequence(seq)
            special_ok = lambda t: True   # noqa: E731
            add_bos_default = True   # llama.cpp's default for SentencePiece vocabularies
        else:
            raise UnsupportedModelError(
                f"{where}: GGUF tokenizer model {clip(repr(kind))} is not supported (supported: 'gpt2', 'llama')")
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and t and special_ok(t)]
        if control:
            tk.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t and t in vocab]
        if user:
            tk.add_tokens(user)
    except (TokenizerError, UnsupportedModelError, KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 - tokenizers raises plain Exceptions, or panics (pyo3's
        # PanicException is a BaseException), on bad vocabularies
        raise TokenizerError(f"{where}: cannot build the GGUF tokenizer ({type(e).__name__}: {clip(e, 200)})") from None

    def name(i):
        return tokens[i] if i is not None else None

    template = _text(md, where, "tokenizer.chat_template")
    return GGUFTokenizerInfo(
        tokenizer=tk, kind=kind, bos_id=bos_id, eos_ids=eos_ids, bos_token=name(bos_id),
        eos_token=name(eos_ids[0]) if eos_ids else None, unk_token=name(unk_id), pad_token=name(pad_id),
        # llama.cpp's glm4 vocabulary has no BOS to add, whatever the file's flag says
        add_bos=_flag(md, where, "tokenizer.ggml.add_bos_token", add_bos_default)
        and not (kind == "gpt2" and pre in _PRE_NO_BOS),
        add_eos=_flag(md, where, "tokenizer.ggml.add_eos_token", False),
        chat_template=template, tool_template=_text(md, where, "tokenizer.chat_template.tool_use"),
        aliases=aliases, n_tokens=len(tokens))


def make_tokenizer(info: GGUFTokenizerInfo):
    """The project's Tokenizer around a built GGUF tokenizer."""
    from ..tokenizer import Tokenizer
    tok = Tokenizer(info.tokenizer, info.bos_id, list(info.eos_ids), chat_template=info.chat_template,
                    bos_token=info.bos_token, eos_token=info.eos_token, add_bos=info.add_bos,
                    aliases=info.aliases, tool_template=info.tool_template)
    tok.cover_ids(info.n_tokens)
    return tok
