"""Tiny random Hugging Face checkpoints on disk, for tests (not a test module).

``make_tiny_model(tmp_path, kind, dtype=..., sharded=..., seed=...)`` writes a
complete model directory (config.json, generation_config.json, safetensors
weights, tokenizer.json, tokenizer_config.json with a chat template) using
transformers + torch, and returns its path. Nothing is cached globally: call
it with pytest's tmp_path / tmp_path_factory.

Weights are drawn with a larger spread than transformers' default init (and
norm weights around 1, biases non-zero) so that logits differ visibly between
tokens and a wrong implementation cannot hide behind near-uniform outputs.

The model families (``FAMILY_KINDS``: Llama 3.2, Mistral with a
sliding window, Qwen2, Qwen3, Gemma 3, Phi-3 / Phi-4-mini, SmolLM3, Granite, OLMo 2 / 3) are built
with transformers' own config and model classes, each with a tokenizer in its
family's style (``KIND_TOKENIZER``): byte-level BPE with the family's split
regex and special tokens appended at the end of the vocabulary (llama3, qwen2,
gpt-4o), or a real SentencePiece ``tokenizer.model`` (trained with the
``sentencepiece`` package) plus the equivalent ``tokenizer.json`` (gemma;
llama2 for Mistral and Phi-3). ``FAMILY_FEATURES`` says what each one exercises
and ``GGUF_FAITHFUL`` which ones survive llama.cpp's GGUF conventions unchanged;
tests/llamacpp_tools.py makes their GGUFs. The family kinds need transformers 5
(``rope_parameters``, its tokenizer classes built from vocab + merges) and
``sentencepiece``.
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


# --- the model families ---------------------------------------------------------
# Sizes break shortcuts: odd head counts, MQA/GQA, head_dim != hidden/heads where the family
# allows it, rows that are not multiples of 32 (llama.cpp's q8_0 falls back to f16 for those),
# a sliding window (16) shorter than the 70-token test sequence, rope scalings whose original
# context (32) the sequence passes.
_LONGROPE_SHORT = [1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0]
_LONGROPE_LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8, 4.6, 5.5, 6.5, 8.0]

# Gemma 2's soft caps in the tiny kind: set from the scores and logits of its random weights
# (without them: logits up to ~3.5; either cap taken out moves them by >10%) so that both bind
ATTN_CAP, FINAL_CAP = 1.0, 2.0
FAMILY_KINDS = {
    # Llama 3.2 1B/3B style: tied embeddings, llama3 rope scaling (original context 32, so
    # wavelengths >= 32 are divided by 8 and 8..32 smoothed), MQA, head_dim 40 != 96/4
    "llama32": ("llama", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=40, intermediate_size=200, rms_norm_eps=1e-5,
                              tie_word_embeddings=True, max_position_embeddings=256,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                               "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32})),
    # Mistral with a 16-token sliding window (every layer), GQA, head_dim 24 != 80/4
    "mistral_swa": ("mistral", dict(hidden_size=80, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=24, intermediate_size=144, sliding_window=16,
                                    rms_norm_eps=1e-5, rope_theta=1e6)),
    # Qwen2/2.5: q/k/v biases, 7 heads (odd) over 1 kv head, untied
    "qwen2": ("qwen2", dict(hidden_size=112, num_attention_heads=7, num_key_value_heads=1,
                            intermediate_size=176, rms_norm_eps=1e-6, rope_theta=1e6,
                            use_sliding_window=False, tie_word_embeddings=False)),
    # Qwen3: per-head q_norm/k_norm, explicit head_dim 48 != 64/4, tied (as Qwen3-0.6B)
    "qwen3": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=48, intermediate_size=160, rms_norm_eps=1e-6,
                            rope_theta=1e6, use_sliding_window=False, tie_word_embeddings=True)),
    # Seed-OSS: Qwen2's q/k/v biases (none on o_proj or the MLP), GQA 4/2, head_dim 24 != 64/4,
    # untied
    "seed_oss": ("seed_oss", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  intermediate_size=120, num_hidden_layers=3, rms_norm_eps=1e-6,
                                  attention_bias=True, attention_out_bias=False, mlp_bias=False,
                                  attention_dropout=0.0, residual_dropout=0.0, max_position_embeddings=512,
                                  rope_theta=1e6, tie_word_embeddings=False)),
    # Gemma 1: Llama's two norms a layer, as (1+w), GELU-tanh (the released configs' hidden_act
    # "gelu", which transformers runs as the tanh approximation), embeddings scaled by
    # sqrt(hidden), MQA, head_dim 32 != 72/4, tied
    "gemma": ("gemma", dict(hidden_size=72, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=32, intermediate_size=136, num_hidden_layers=3, rms_norm_eps=1e-6,
                            hidden_act="gelu",
                            max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)),
    # Gemma 2: Gemma 3's norms without q/k norms, every other layer sliding (16 positions, from
    # layer 0), one rope base, GQA 4/2, head_dim 32 != 80/4 (query_pre_attn_scalar = head_dim,
    # what a GGUF carries), and soft caps small enough to bind on these random weights (the
    # released models use 50 and 30 on their own scales)
    "gemma2": ("gemma2", dict(hidden_size=80, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, intermediate_size=152, num_hidden_layers=4,
                              sliding_window=16, query_pre_attn_scalar=32, rms_norm_eps=1e-6,
                              max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                              attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)),
    # Gemma 3 text: 6 layers in the default 5:1 pattern (layers 0-4 sliding, layer 5 global;
    # llama.cpp hard-codes this pattern), sliding window 16, local rope base 10000 vs global
    # 1e6 with linear scaling 8 on the global layers only, query_pre_attn_scalar == head_dim
    # (the only value a GGUF can carry for a model that is not 27B), four norms per layer +
    # q/k norms, all (1+w) RMSNorms, GELU-tanh, embeddings scaled by sqrt(hidden), tied
    "gemma3": ("gemma3", dict(hidden_size=80, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=48, intermediate_size=152, num_hidden_layers=6,
                              sliding_window=16, query_pre_attn_scalar=48, rms_norm_eps=1e-6,
                              max_position_embeddings=512, tie_word_embeddings=True,
                              rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                     "rope_theta": 1000000.0}})),
    # the same with query_pre_attn_scalar (64) != head_dim (48) and an explicit layer_types
    # list that is not the 5:1 pattern: HF-directory tests only, a GGUF cannot carry either
    "gemma3_qscale": ("gemma3", dict(hidden_size=80, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=48, intermediate_size=152, num_hidden_layers=6,
                                     sliding_window=16, query_pre_attn_scalar=64,
                                     rms_norm_eps=1e-6, max_position_embeddings=512,
                                     tie_word_embeddings=True,
                                     layer_types=["sliding_attention", "full_attention",
                                                  "sliding_attention", "sliding_attention",
                                                  "full_attention", "sliding_attention"],
                                     rope_parameters={
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0}})),
    # Phi-3 / 3.5 mini style: fused qkv_proj and gate_up_proj, partial rotary 0.5 (12 of 24
    # dims), no rope scaling, SentencePiece tokenizer, untied, vocab padded past the tokens
    "phi3": ("phi3", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=160, rms_norm_eps=1e-5, max_position_embeddings=128,
                          original_max_position_embeddings=128, sliding_window=None,
                          tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5})),
    # Phi-4-mini style: longrope (short/long factors, original context 32 < 70 tokens, so the
    # long factors and the attention factor sqrt(1 + ln(256/32)/ln(32)) apply), partial rotary
    # 0.75 (24 of 32 dims: 12 factors), MQA with 3 heads, tied, gpt-4o style BPE tokenizer
    "phi3_longrope": ("phi3", dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                                   intermediate_size=128, rms_norm_eps=1e-5,
                                   max_position_embeddings=256, original_max_position_embeddings=32,
                                   sliding_window=None, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.75,
                                                    "original_max_position_embeddings": 32,
                                                    "factor": 8.0,
                                                    "short_factor": _LONGROPE_SHORT,
                                                    "long_factor": _LONGROPE_LONG})),
    # SmolLM3: NoPE on every 4th layer (layer 3 of 5; llama.cpp hard-codes the interval 4),
    # GQA 6/2, tied
    "smollm3": ("smollm3", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                intermediate_size=232, num_hidden_layers=5, rms_norm_eps=1e-6,
                                no_rope_layer_interval=4, rope_theta=2e6,
                                use_sliding_window=False, tie_word_embeddings=True)),
    # Granite 3.x: Llama's block with four multipliers (embeddings x12, block outputs x0.22 before
    # the residual add, attention scale 1/16 instead of 1/sqrt(24), logits / 2), GQA 4/2, tied
    "granite": ("granite", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=176, num_hidden_layers=3, rms_norm_eps=1e-5,
                                rope_theta=10000.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.0625, logits_scaling=2.0,
                                tie_word_embeddings=True)),
    # OLMo 2: no pre-norms (attention and MLP read the stream), q/k RMSNorm over the whole
    # projection, post-norms on both sub-block outputs, GQA 4/2, untied
    "olmo2": ("olmo2", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=160, num_hidden_layers=3, rms_norm_eps=1e-6,
                            rope_theta=500000.0, tie_word_embeddings=False)),
    # OLMo 3: OLMo 2's block with sliding-window layers (16 positions; layers 0-2 of 4, as its
    # default 3:1 pattern) and a rope for each kind: YaRN (factor 8 past an original context of
    # 32) on the full layer, the plain base 10000 on the sliding ones
    "olmo3": ("olmo3", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=160, num_hidden_layers=4, rms_norm_eps=1e-6,
                            sliding_window=16, max_position_embeddings=256, tie_word_embeddings=False,
                            rope_parameters={
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                   "original_max_position_embeddings": 32}})),
    # EXAONE 4 (the 1.2B's kind): norms on each sub-block's output and none before, per-head q/k
    # norms, every layer full with rope, GQA 4/2, tied
    "exaone4": ("exaone4", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=160, num_hidden_layers=3, rms_norm_eps=1e-5,
                                rope_theta=1e6, sliding_window=None, layer_types=["full_attention"] * 3,
                                tie_word_embeddings=True)),
    # Ernie 4.5 (the 0.3B's kind): Llama's block with interleaved (GPT-J style) rope in the
    # checkpoint, explicit head_dim, GQA 4/2, tied
    "ernie4_5": ("ernie4_5", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  intermediate_size=160, num_hidden_layers=3, rms_norm_eps=1e-5,
                                  rope_theta=500000.0, use_bias=False, tie_word_embeddings=True)),
    # GLM-4 (the 9B-0414's kind): q/k/v biases, half of each head rotating in adjacent pairs,
    # gate and up in one tensor, four norms a layer, GQA 4/2, head_dim != dim/heads, untied
    "glm4": ("glm4", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          intermediate_size=160, num_hidden_layers=3, rms_norm_eps=1e-5,
                          max_position_embeddings=512, attention_bias=True, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5})),
    # Hunyuan dense (HunYuanDenseV1, the 0.5B-7B's kind): per-head q/k norms after rope, the
    # releases' "dynamic" rope with a fixed alpha (a base stretched to 10000 * 1000^(32/30);
    # llama.cpp's converter checks the base and the 32k context), GQA 4/2, tied
    "hunyuan_dense": ("hunyuan_dense", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, intermediate_size=160, num_hidden_layers=3,
                                            rms_norm_eps=1e-5, max_position_embeddings=32768,
                                            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                             "rope_theta": 10000.0},
                                            tie_word_embeddings=True)),
    # Mixtures of experts (weights rounded to float16 values: see MOE_ARCHS)
    # Qwen3-MoE: Qwen3's attention, 6 experts of 40 (not its unused dense size, 96), 2 a token,
    # their weights renormalized (as the released models), untied
    "qwen3moe": ("qwen3moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=24, intermediate_size=96, moe_intermediate_size=40,
                                  num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                  num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=1e6,
                                  use_sliding_window=False, tie_word_embeddings=False)),
    # Mixtral: Llama's attention (q/k interleaved in GGUF), 5 experts of 64, 2 a token
    "mixtral": ("mixtral", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=24, intermediate_size=64, num_local_experts=5,
                                num_experts_per_tok=2, num_hidden_layers=3, rms_norm_eps=1e-5,
                                rope_theta=1e6, sliding_window=None)),
    # Granite MoE (3.x 1B-A400M/3B-A800M): Granite's four multipliers, 6 experts of 64, 2 a
    # token (a softmax over their logits: renormalized), each layer's experts stacked in the
    # checkpoint (input_linear: gate then up, output_linear), GQA, tied
    "granitemoe": ("granitemoe", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_local_experts=6, num_experts_per_tok=2,
                                      num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=10000.0,
                                      embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.0625, logits_scaling=2.0,
                                      tie_word_embeddings=True)),
    # OLMoE: q/k norms over the whole projection, 8 experts of 56, 3 a token, weights not
    # renormalized (llama.cpp's converter writes rms eps 1e-5 whatever the config says)
    "olmoe": ("olmoe", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=56, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=False, num_hidden_layers=3, rms_norm_eps=1e-5,
                            rope_theta=10000.0, tie_word_embeddings=False)),
}
# An expert is chosen by the order of the router's scores: where two are within the rounding
# of float16 weights (cyllm's) apart from float32 ones (transformers'), the two pick different
# experts and that token's logits differ by far more than 1e-2. The mixture-of-experts kinds
# therefore hold float16 values (stored as float32), so both sides start from the same weights.
MOE_ARCHS = {"qwen3moe", "mixtral", "olmoe", "granitemoe"}
KINDS.update(FAMILY_KINDS)
# EXAONE 4 hybrid (the 32B's kind): three sliding layers (window 16) in four, the fourth with no
# rope. llama.cpp runs that only at 64 layers, so not a GGUF kind: checked from the HF directory
KINDS["exaone4_swa"] = ("exaone4", {**FAMILY_KINDS["exaone4"][1], "num_hidden_layers": 4, "sliding_window": 16,
                                    "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
# the same at 64 layers (the 32B's depth, the only one llama.cpp slides at), narrow: its GGUF
KINDS["exaone4_swa64"] = ("exaone4", {**KINDS["exaone4_swa"][1], "hidden_size": 64, "head_dim": 16,
                                      "intermediate_size": 64, "num_hidden_layers": 64,
                                      "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 16})
# Qwen3 with YaRN rope scaling (factor 8 over an original context of 32, which the 70-token
# test sequence passes): not a family of its own, so not in FAMILY_KINDS
KINDS["qwen3_yarn"] = ("qwen3", {**FAMILY_KINDS["qwen3"][1], "max_position_embeddings": 256,
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                                                     "original_max_position_embeddings": 32}})

# kind -> tokenizer style (see make_family_tokenizer); other kinds default to "bytelevel"
KIND_TOKENIZER = {"llama32": "llama3", "mistral_swa": "llama2", "qwen2": "qwen2",
                  "qwen3": "qwen2", "seed_oss": "qwen2", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_qscale": "gemma", "phi3": "phi3",
                  "phi3_longrope": "gpt4o", "smollm3": "smollm3", "granite": "llama3",
                  "olmo2": "llama3", "olmo3": "llama3", "qwen3_yarn": "qwen2", "qwen3moe": "qwen2",
                  "mixtral": "llama2", "olmoe": "llama3", "granitemoe": "llama3", "exaone4": "llama3",
                  "exaone4_swa": "llama3", "exaone4_swa64": "llama3", "ernie4_5": "llama2",
                  "hunyuan_dense": "qwen2", "glm4": "gpt4o"}

# what each family kind exercises (for test ids and reports)
FAMILY_FEATURES = {
    "llama32": "tied embeddings, llama3 rope scaling past its original context, MQA, head_dim != dim/heads",
    "mistral_swa": "sliding window 16 < sequence, GQA, head_dim != dim/heads",
    "qwen2": "q/k/v biases, odd head count, MQA",
    "qwen3": "q/k RMSNorm per head, explicit head_dim, tied",
    "seed_oss": "q/k/v biases, llama.cpp's post_attention_norm for the pre-MLP norm, GQA, head_dim != dim/heads",
    "gemma": "2 (1+w) norms, GELU-tanh though hidden_act says gelu, embedding scale, MQA, head_dim != dim/heads, tied",
    "gemma2": "attention and final logit soft caps, every other layer sliding, 4 (1+w) norms, "
              "GELU-tanh, embedding scale, GQA, tied",
    "gemma3": "5:1 sliding/global layers, two rope bases, linear scaling on global layers, "
              "4 norms + q/k norms, (1+w) norms, GELU-tanh, embedding scale, tied",
    "gemma3_qscale": "gemma3 with query_pre_attn_scalar != head_dim and a custom layer_types list",
    "phi3": "fused qkv and gate_up, partial rotary 0.5, SentencePiece tokenizer, padded vocab",
    "phi3_longrope": "longrope short/long factors past the original context, partial rotary 0.75, MQA, tied",
    "smollm3": "NoPE every 4th layer, GQA, tied",
    "granite": "embedding, residual, attention and logit multipliers, GQA, tied",
    "olmo2": "no pre-norms, q/k norms over the whole projection, post-norms, GQA, untied",
    "olmo3": "olmo2's block, sliding window 16 on 3 of 4 layers, YaRN on the full layer only",
    "exaone4": "no pre-norms, norms on each sub-block's output, per-head q/k norms, GQA, tied",
    "ernie4_5": "interleaved rope in the checkpoint, head_dim != dim/heads, SentencePiece tokenizer, tied",
    "glm4": "q/k/v biases, partial rotary 0.5 in adjacent pairs, fused gate_up, post-norms, GQA, untied",
    "hunyuan_dense": "per-head q/k norms after rope, rope base stretched by alpha, GQA, head_dim != dim/heads, tied",
    "qwen3moe": "6 experts, 2 a token, renormalized weights, q/k norms, expert size != dense size",
    "mixtral": "5 experts, 2 a token, llama's q/k layout in GGUF, SentencePiece tokenizer, head_dim != dim/heads",
    "olmoe": "8 experts, 3 a token, weights not renormalized, q/k norms over the whole projection",
    "granitemoe": "6 experts, 2 a token, stacked in the checkpoint (gate and up in one tensor), "
                  "Granite's four multipliers, tied",
}

# kinds whose GGUF, read by llama.cpp's rules, is the same model as the HF directory. Not so:
# mistral_swa (the converter writes no sliding window for the llama architecture and llama.cpp
# applies none) and gemma3_qscale (llama.cpp scales queries by 1/sqrt(head_dim) except for the
# 62-layer 27B, and hard-codes the 5:1 pattern).
GGUF_FAITHFUL = {"llama32", "qwen2", "qwen3", "seed_oss", "gemma", "gemma2", "gemma3", "phi3", "phi3_longrope", "smollm3", "granite",
                 "olmo2", "exaone4", "ernie4_5", "glm4", "hunyuan_dense", "qwen3moe", "mixtral", "olmoe", "granitemoe"}

# HF architecture -> (config class, model class) in transformers
_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
}

# pre-tokenizer split regexes, as the families' tokenizer.json files state them
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

# style -> byte-level BPE recipe: split regex, NFC normalizer, special tokens appended after
# the trained vocabulary (as in the real files), bos (added by the post-processor when
# add_bos), eos, pad, tokenizer_class, chat template, the llama.cpp pre-tokenizer name
_BPE_STYLES = {
    "llama3": dict(split=LLAMA3_SPLIT, nfc=False,
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, add_bos=True,
                   tokenizer_class="PreTrainedTokenizerFast", template=LLAMA3_TEMPLATE, pre="llama-bpe"),
    # SmolLM3's tokenizer is Llama 3's split with ChatML specials; llama.cpp's converter
    # identifies it as "smaug-bpe", whose split is llama3's
    "smollm3": dict(split=LLAMA3_SPLIT, nfc=False,
                    specials=["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
                    bos=None, eos="<|im_end|>", pad="<|im_end|>", add_bos=False,
                    tokenizer_class="PreTrainedTokenizerFast", template=CHATML_TEMPLATE, pre="smaug-bpe"),
    "qwen2": dict(split=QWEN2_SPLIT, nfc=True, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
                  tokenizer_class="Qwen2Tokenizer", template=CHATML_TEMPLATE, pre="qwen2"),
    "gpt4o": dict(split=GPT4O_SPLIT, nfc=False,
                  specials=["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
                  bos="<|endoftext|>", eos="<|endoftext|>", pad="<|endoftext|>", add_bos=False,
                  tokenizer_class="GPT2Tokenizer", template=PHI3_TEMPLATE, pre="gpt-4o"),
}

# style -> SentencePiece recipe: specials at the ids SentencePiece gives them, user-defined
# pieces, added tokens appended after the model (Phi-3), dummy prefix, padding rows
_SPM_STYLES = {
    "gemma": dict(ids=dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3),
                  pieces=dict(pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>"),
                  user_defined=["<mask>", "<start_of_turn>", "<end_of_turn>"], added=[], dummy_prefix=False,
                  bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, vocab_padding=0,
                  tokenizer_class="GemmaTokenizer", template=GEMMA_TEMPLATE),
    # Llama 2 / Mistral 7B: <unk> <s> </s>, dummy prefix, no added tokens
    "llama2": dict(ids=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
                   pieces=dict(unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>"),
                   user_defined=[], added=[], dummy_prefix=True, bos="<s>", eos="</s>", pad=None,
                   unk="<unk>", add_bos=True, vocab_padding=0, tokenizer_class="LlamaTokenizer",
                   template=MISTRAL_TEMPLATE),
    "phi3": dict(ids=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
                 pieces=dict(unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>"),
                 user_defined=[], added=["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"],
                 dummy_prefix=True, bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
                 add_bos=True, vocab_padding=3, tokenizer_class="LlamaTokenizer", template=PHI3_TEMPLATE),
}

# tokenizer style -> tokenizer.ggml.pre the GGUF of that family carries ("default" for
# SentencePiece vocabularies, which llama.cpp's converter writes itself)
GGUF_PRE = {style: spec["pre"] for style, spec in _BPE_STYLES.items()}
GGUF_PRE.update({"gemma": "default", "llama2": "default", "phi3": "default",
                 "sentencepiece": "default"})


class FamilyTokenizer:
    """A tokenizer in one family's style, ready to write into a model directory.

    tok: the ``tokenizers.Tokenizer`` (tokenizer.json); spm: the SentencePiece model bytes
    (tokenizer.model) or None; vocab_size: the model's embedding rows (>= tokens);
    bos_id/eos_id/pad_id; config: tokenizer_config.json; pre: tokenizer.ggml.pre.
    """

    def __init__(self, tok, spm, vocab_size, bos, eos, pad, unk, add_bos, tokenizer_class,
                 template, pre):
        self.tok, self.spm, self.vocab_size, self.pre = tok, spm, vocab_size, pre
        self.bos_id = tok.token_to_id(bos) if bos else None
        self.eos_id = tok.token_to_id(eos)
        self.pad_id = tok.token_to_id(pad) if pad else None
        added = {str(i): t for i, t in tok.get_added_tokens_decoder().items()}
        self.config = {
            "tokenizer_class": tokenizer_class,
            "add_bos_token": add_bos,
            "add_eos_token": False,
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "unk_token": unk,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": template,
            "added_tokens_decoder": {
                k: {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                    "normalized": t.normalized, "single_word": t.single_word, "special": t.special}
                for k, t in sorted(added.items(), key=lambda kv: int(kv[0]))},
        }

    def write(self, directory: Path) -> None:
        directory = Path(directory)
        self.tok.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2),
                                                         encoding="utf-8")
        if self.spm is not None:
            (directory / "tokenizer.model").write_bytes(self.spm)


def _bos_post_processor(bos: str | None, bos_id: int | None, byte_level: bool):
    from tokenizers import processors
    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, bos_id)]))
    return processors.Sequence(steps) if steps else None


def _make_bpe_family(style: str, vocab_size: int) -> FamilyTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers

    spec = _BPE_STYLES[style]
    tok = Tokenizer(models.BPE(unk_token=None))
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    bos = spec["bos"] if spec["add_bos"] else None
    tok.post_processor = _bos_post_processor(bos, tok.token_to_id(bos) if bos else None, True)
    return FamilyTokenizer(tok, None, tok.get_vocab_size(with_added_tokens=True), spec["bos"],
                           spec["eos"], spec["pad"], spec["eos"] if spec["pad"] is None else spec["pad"],
                           spec["add_bos"], spec["tokenizer_class"], spec["template"], spec["pre"])


def _train_spm(spec: dict, vocab_size: int) -> bytes:
    """A SentencePiece BPE model with byte fallback (as Llama 2, Gemma), trained on CORPUS."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, split_digits=True,
        add_dummy_prefix=spec["dummy_prefix"], remove_extra_whitespaces=False,
        normalization_rule_name="identity", user_defined_symbols=spec["user_defined"],
        num_threads=1, minloglevel=2, **spec["ids"], **spec["pieces"])
    return buf.getvalue()


def _make_spm_family(style: str, vocab_size: int) -> FamilyTokenizer:
    """tokenizer.model from SentencePiece, tokenizer.json from transformers' tokenizer class
    of the family built on the same pieces (merges ordered by piece score, as SentencePiece's
    BPE applies them); tests check both encode alike."""
    import sentencepiece as spm
    import transformers
    from tokenizers import AddedToken
    from transformers.tokenization_utils_base import generate_merges

    spec = _SPM_STYLES[style]
    model = _train_spm(spec, vocab_size)
    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    # specials, byte pieces and user-defined pieces take part in no merge
    skip = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.id_to_piece(i) in spec["user_defined"]]
    scores = {p: sp.get_score(i) for p, i in vocab.items()}
    merges = generate_merges(vocab, scores, skip_tokens=skip)
    cls = getattr(transformers, spec["tokenizer_class"])
    kw = dict(bos_token=spec["bos"], eos_token=spec["eos"], unk_token=spec["unk"])
    if style == "gemma":
        kw.update(pad_token=spec["pad"], mask_token="<mask>")
    tok = cls(vocab=vocab, merges=merges, **kw)._tokenizer
    if spec["dummy_prefix"]:
        # SentencePiece prepends "\u2581" even to text that starts with a space; the Metaspace
        # pre-tokenizer does not, the normalizer of Llama 2 / Phi-3's tokenizer.json does
        from tokenizers import normalizers
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
        tok.pre_tokenizer = None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in spec["user_defined"] + spec["added"]])
    tok.post_processor = _bos_post_processor(spec["bos"], vocab[spec["bos"]], False)
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    return FamilyTokenizer(tok, model, n_tokens + spec["vocab_padding"], spec["bos"], spec["eos"],
                           spec["pad"], spec["unk"], spec["add_bos"], spec["tokenizer_class"],
                           spec["template"], "default")


def make_family_tokenizer(style: str) -> FamilyTokenizer:
    """A tokenizer in a model family's style (see _BPE_STYLES / _SPM_STYLES)."""
    if style in _BPE_STYLES:
        return _make_bpe_family(style, 400)
    if style in _SPM_STYLES:
        return _make_spm_family(style, 480)
    raise ValueError(f"unknown family tokenizer style {style!r}")


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


def _hf_config(arch: str, vocab: int, overrides: dict, bos_id=1, eos_id=2, pad_id=None):
    import transformers
    cls = getattr(transformers, _ARCH_CLASSES[arch][0])
    kw = dict(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=512,
              bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    if pad_id is not None:
        kw["pad_token_id"] = pad_id
    elif arch == "glm4":
        kw["pad_token_id"] = None           # Glm4Config's default (151329) is past a tiny vocabulary
    if arch == "llama":
        kw["attention_bias"] = False
    if arch == "hunyuan_dense":
        kw["eod_token_id"] = eos_id         # the end of a document (llama.cpp's converter: its EOS)
    kw.update(overrides)
    return cls(**kw)


def _randomize(model, seed: int, std: float = 0.08, norm_center: float = 1.0,
               qk_std: float | None = None) -> None:
    """Weights ~ N(0, std), biases ~ N(0, 0.1), norm weights ~ norm_center + N(0, 0.1).

    norm_center is the identity value of the family's norm weight: 1 for x * w, 0 for
    Gemma's x * (1 + w). qk_std, when given, draws the q and k projections (also the q/k
    rows of a fused qkv_proj) with that spread instead: sharper attention, so that
    positional features (rope variants, NoPE layers, windows) move the logits visibly.
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        if qk_std is None:
            return
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        qk_rows = (c.num_attention_heads + c.num_key_value_heads) * head_dim
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(qk_std * torch.randn(p.shape, generator=g))
            elif name.endswith("qkv_proj.weight"):
                p[:qk_rows].copy_(qk_std * torch.randn((qk_rows, p.shape[1]), generator=g))


def make_tiny_model(tmp_path, kind: str = "llama_mqa_odd", dtype: str = "float32",
                    sharded: bool = False, seed: int = 0, tokenizer: str | None = None,
                    chat_template_file: bool = False) -> Path:
    """Write a tiny random model of ``kind`` (see KINDS) under tmp_path; return its dir.

    dtype: "float32" | "float16" | "bfloat16" (storage dtype of the safetensors).
    sharded: split into several safetensors shards with an index file.
    tokenizer: "bytelevel" | "sentencepiece" (see make_tokenizer) or a family style
    ("llama3", "smollm3", "qwen2", "gpt4o", "gemma", "llama2", "phi3"; see
    make_family_tokenizer);
    None picks the kind's own (KIND_TOKENIZER, else "bytelevel").
    """
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    arch, overrides = KINDS[kind]
    tokenizer = tokenizer or KIND_TOKENIZER.get(kind, "bytelevel")
    if tokenizer in ("bytelevel", "sentencepiece"):
        ftok = None
        tok = make_tokenizer(tokenizer)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        ids = dict(bos_id=tok.token_to_id(BOS), eos_id=tok.token_to_id(EOS))
    else:
        ftok = make_family_tokenizer(tokenizer)
        vocab = ftok.vocab_size
        ids = dict(bos_id=ftok.bos_id, eos_id=ftok.eos_id, pad_id=ftok.pad_id)

    out = Path(tmp_path) / f"{kind}-{dtype}{'-sharded' if sharded else ''}-{tokenizer}-s{seed}"
    out.mkdir(parents=True, exist_ok=False)
    config = _hf_config(arch, vocab, overrides, **ids)
    model_cls = getattr(transformers, _ARCH_CLASSES[arch][1])
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, seed, norm_center=0.0 if arch in ("gemma", "gemma2", "gemma3") else 1.0,
               qk_std=0.15 if kind in FAMILY_KINDS else None)
    if arch in MOE_ARCHS:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids["bos_id"], eos_token_id=ids["eos_id"], pad_token_id=ids.get("pad_id"))
    model = model.to(getattr(torch, dtype)).eval()
    transformers.utils.logging.disable_progress_bar()
    kw = {"max_shard_size": "40KB"} if sharded else {}
    model.save_pretrained(out, **kw)
    if ftok is not None:
        ftok.write(out)
    else:
        write_tokenizer(out, tok, template_file=chat_template_file)
    return out


def load_reference(model_dir, dtype: str = "float32"):
    """The transformers model for ``model_dir`` (eager attention, eval mode)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
