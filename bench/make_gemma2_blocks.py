#!/usr/bin/env python3
"""A random-weight Gemma-2-2B-shaped Hugging Face directory for engine comparisons on CPU.

    python bench/make_gemma2_blocks.py OUT_DIR
    python -m cyllm quantize OUT_DIR g2-q4_k_m.gguf --type q4_k_m
    python bench/compare_llamabench.py -m g2-q4_k_m.gguf -t 2 -p 128 -n 32 -r 3 --native-build

The released 2B's 26 blocks (hidden 2304, FFN 9216, 8 query heads over 4 KV heads of 256, a 4096
window on every other layer, soft caps 50 and 30) with the tests' tiny Gemma tokenizer (480
tokens) instead of 256000: the blocks' cost, not the output matrix's. Weights N(0, 0.02), norms
N(0, 0.1) around Gemma's (1 + w), bfloat16 as the released checkpoints.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory to write (must not exist)")
    out = ap.parse_args().out
    import torch
    import transformers

    import tinymodels as tm
    ftok = tm.make_family_tokenizer("gemma")
    cfg = transformers.Gemma2Config(
        vocab_size=ftok.vocab_size, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, bos_token_id=ftok.bos_id, eos_token_id=ftok.eos_id,
        pad_token_id=ftok.pad_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1 if name.endswith("norm.weight") else 0.02)
    out.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out)
    ftok.write(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
