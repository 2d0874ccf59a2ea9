"""Tiny random Hugging Face checkpoints on disk, for tests (not a test module).

``make_tiny_model(tmp_path, kind, dtype=..., sharded=..., seed=...)`` writes a
complete model directory (config.json, generation_config.json, safetensors
weights, tokenizer.json, tokenizer_config.json with a chat template) using
transformers + torch, and returns its path. Nothing is cached globally: call
it with pytest's tmp_path / tmp_path_factory.

Weights are drawn with a larger spread than transformers' default init (and
norm weights around 1, biases non-zero) so that logits differ visibly between
tokens and a wrong implementation cannot hide behind near-uniform outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tiny models are useful for testing inference engines quickly.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00fcber stra\u00dfe ni\u00f1o.",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u6211\u4eec\u5728\u6d4b\u8bd5\u3002 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002",
    "Emoji: \U0001f600 \U0001f680 \U0001f44d\U0001f3fd and numbers 12345 67890.",
    "def main():\n    print('hello')\n    return 0\n",
    "The rain in Spain stays mainly in the plain. Once upon a time, there was a model.",
    "user: what is the capital of France? assistant: Paris is the capital of France.",
]

BOS, EOS, UNK = "<s>", "</s>", "<unk>"

# a small template exercising loops, conditionals, raise_exception and the
# special-token variables, rendered with trim_blocks/lstrip_blocks
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}\n"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|assistant|>\n"
    "{% endif %}"
)

# kind -> (architecture, config overrides)
KINDS = {
    # multi-query attention with odd sizes: 3 heads of 24, 1 kv head
    "llama_mqa_odd": ("llama", dict(hidden_size=72, num_attention_heads=3, num_key_value_heads=1,
                                    head_dim=24, intermediate_size=100, rms_norm_eps=1e-5)),
    # head_dim (32) != hidden / heads (16)
    "llama_explicit_head_dim": ("llama", dict(hidden_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=32,
                                              intermediate_size=96, rms_norm_eps=1e-6)),
    # Llama 3.1 rope scaling with a small original context so it bites
    "llama3_rope": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, rope_theta=500000.0,
                                  max_position_embeddings=256,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    "mistral_gqa": ("mistral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=112, sliding_window=None, rope_theta=1e6)),
    "qwen2_bias": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6,
                                 use_sliding_window=False)),
    "llama_tied": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                 intermediate_size=80, tie_word_embeddings=True)),
}


def make_tokenizer(style: str = "bytelevel", vocab_size: int = 400):
    """Train a tiny BPE tokenizer in memory; returns a ``tokenizers.Tokenizer``.

    style "bytelevel": GPT-2 style (ByteLevel pre-tokenizer/decoder, every byte
    representable). style "sentencepiece": Llama-2 style (Metaspace, byte
    fallback <0xNN> tokens, leading-space strip in the decoder). Both add BOS
    through a TemplateProcessing post-processor; ids 0/1/2 = <unk> <s> </s>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = [UNK, BOS, EOS]
    if style == "bytelevel":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS, trainer=trainer)
    elif style == "sentencepiece":
        # train merges on Metaspace pieces, then rebuild the model with the 256
        # byte-fallback tokens placed right after the specials (Llama layout)
        base = Tokenizer(models.BPE())
        base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[],
                                      limit_alphabet=120, show_progress=False)
        base.train_from_iterator(CORPUS, trainer=trainer)
        trained = json.loads(base.to_str())["model"]
        vocab = {s: i for i, s in enumerate(specials)}
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
            if piece not in vocab:
                vocab[piece] = len(vocab)
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK,
                                   byte_fallback=True, fuse_unk=True))
        tok.add_special_tokens(specials)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def write_tokenizer(directory: Path, tok, chat_template: str | None = CHAT_TEMPLATE,
                    template_file: bool = False) -> None:
    """tokenizer.json + tokenizer_config.json (generic fast tokenizer class)."""
    directory = Path(directory)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False},
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None and not template_file:
        cfg["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    if chat_template is not None and template_file:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _hf_config(arch: str, vocab: int, overrides: dict):
    import transformers
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    kw = dict(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        kw["attention_bias"] = False
    kw.update(overrides)
    return cls(**kw)


def _randomize(model, seed: int, std: float = 0.08) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_tiny_model(tmp_path, kind: str = "llama_mqa_odd", dtype: str = "float32",
                    sharded: bool = False, seed: int = 0, tokenizer: str = "bytelevel",
                    chat_template_file: bool = False) -> Path:
    """Write a tiny random model of ``kind`` (see KINDS) under tmp_path; return its dir.

    dtype: "float32" | "float16" | "bfloat16" (storage dtype of the safetensors).
    sharded: split into several safetensors shards with an index file.
    tokenizer: "bytelevel" | "sentencepiece" (see make_tokenizer).
    """
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    arch, overrides = KINDS[kind]
    tok = make_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)

    out = Path(tmp_path) / f"{kind}-{dtype}{'-sharded' if sharded else ''}-{tokenizer}-s{seed}"
    out.mkdir(parents=True, exist_ok=False)
    config = _hf_config(arch, vocab, overrides)
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype)).eval()
    transformers.utils.logging.disable_progress_bar()
    kw = {"max_shard_size": "40KB"} if sharded else {}
    model.save_pretrained(out, **kw)
    write_tokenizer(out, tok, template_file=chat_template_file)
    return out


def load_reference(model_dir, dtype: str = "float32"):
    """The transformers model for ``model_dir`` (eager attention, eval mode)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
