#!/usr/bin/env python3
"""A random-weight Hugging Face directory with the blocks of a released model, for engine
comparisons on CPU (the blocks' cost, not the output matrix's: the tests' tiny tokenizers).

    python bench/make_blocks.py OUT_DIR [--shape gemma2-2b|qwen3-30b-a3b|glm4-9b|hunyuan-7b] [--layers N]
    python -m cyllm quantize OUT_DIR out-q4_k_m.gguf --type q4_k_m
    python bench/compare_llamabench.py -m out-q4_k_m.gguf -t 2 -p 128 -n 32 -r 3 --native-build

gemma2-2b: the released 2B's 26 blocks (hidden 2304, FFN 9216, 8 query heads over 4 KV heads of
256, a 4096 window on every other layer, soft caps 50 and 30) with the Gemma tokenizer of 480
tokens.
qwen3-30b-a3b: Qwen3-30B-A3B's blocks (hidden 2048, 32 query heads over 4 KV heads of 128,
q/k norms, 128 experts of 768 a layer, 8 a token, renormalized), 48 of them unless --layers
says fewer, with the Qwen2 tokenizer of the tests.
glm4-9b: GLM-4-9B-0414's 40 blocks (hidden 4096, FFN 13696, 32 query heads over 2 KV heads of
128, q/k/v biases, half of each head rotating) with the tests' gpt-4o-style tokenizer (GLM's
<|endoftext|> and <|user|> among its specials, which llama.cpp's converter asks for).
hunyuan-7b: Hunyuan-7B-Instruct's 32 blocks (hidden 4096, FFN 14336, 32 query heads over 8 KV
heads of 128, q/k norms after rope, rope alpha 1000) with the tests' Qwen2 tokenizer.
Weights N(0, 0.02), norms N(0, 0.1) around the family's identity, bfloat16 as the released
checkpoints.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# shape -> (transformers class prefix, tokenizer style, norm identity, released blocks, config)
SHAPES = {
    "gemma2-2b": ("Gemma2", "gemma", 0.0, 26, dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, max_position_embeddings=8192, tie_word_embeddings=True)),
    "qwen3-30b-a3b": ("Qwen3Moe", "qwen2", 1.0, 48, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)),
    "glm4-9b": ("Glm4", "gpt4o", 1.0, 40, dict(
        hidden_size=4096, intermediate_size=13696, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        attention_bias=True, rms_norm_eps=1.5625e-7, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "hunyuan-7b": ("HunYuanDenseV1", "qwen2", 1.0, 32, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory to write (must not exist)")
    ap.add_argument("--shape", choices=list(SHAPES), default="gemma2-2b")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the released model's)")
    args = ap.parse_args()
    import torch
    import transformers

    import tinymodels as tm
    prefix, style, norm_center, blocks, fields = SHAPES[args.shape]
    ftok = tm.make_family_tokenizer(style)
    ids = dict(bos_token_id=ftok.bos_id, eos_token_id=ftok.eos_id, pad_token_id=ftok.pad_id)
    if prefix == "HunYuanDenseV1":
        ids["eod_token_id"] = ftok.eos_id       # llama.cpp's converter makes it the file's EOS
    cfg = getattr(transformers, prefix + "Config")(vocab_size=ftok.vocab_size,
                                                   num_hidden_layers=args.layers or blocks, **fields, **ids)
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(norm_center, 0.1)
            else:
                p.normal_(0.0, 0.02)
    out = args.out
    out.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out)
    ftok.write(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
