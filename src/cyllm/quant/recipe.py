"""Which format each tensor gets when a model is quantized: llama.cpp's recipes.

llama-quantize does not give every matrix the file type's format. Facts of its
per-tensor rules (llama.cpp src/llama-quant.cpp, ``llama_tensor_get_type``), for the
types cyllm writes:
- base format: q8_0 -> Q8_0, q4_0 -> Q4_0, q4_k_m -> Q4_K, q5_k_m -> Q5_K, q6_k -> Q6_K;
- only matrices named "*weight" are quantized, never norms (1-D tensors stay F32);
- the output matrix (the token embedding when the output is tied to it) gets Q6_K,
  except for Q8_0 files (Q8_0), and Q8_0 when its row is not a multiple of the base
  format's block;
- Q4_K_M / Q5_K_M: attn_v and ffn_down of "more bits" layers get Q6_K, where layer i of
  n is one when i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2 (C integer division); a fused
  attn_qkv counts as attn_v (llama.cpp 0.3.36's tensor categories put it with attn_v,
  which shadows the older "attn_qkv gets Q5_K / Q6_K" rule: llama-quantize writes Q6_K on
  the more-bits layers and the base type elsewhere);
- a mixture of experts: the router (ffn_gate_inp) is never quantized; a stack of expert
  matrices (ffn_*_exps, one tensor a layer) follows the rules of its dense name; a model of
  exactly 8 experts (Mixtral) gets Q8_0 for attn_k and attn_v and, in Q4_K_M, Q5_K for
  attn_output;
- a K-quant whose row is not a multiple of 256 falls back to Q5_0 (Q4_K), Q5_1 (Q5_K)
  or Q8_0 (Q6_K); a 32-block format whose row is not a multiple of 32 cannot be made
  (cyllm keeps such a matrix F16).
tests/test_quantize_tool.py checks these choices against the files llama-quantize writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# file type -> base format (cyllm format names)
FILE_TYPES = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k": "q6_k"}
# llama.cpp's LLAMA_FTYPE_* values (general.file_type in GGUF files)
LLAMA_FTYPE = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
BLOCK = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class Recipe:
    file_type: str          # a key of FILE_TYPES
    n_layers: int
    has_output: bool        # False: the token embedding doubles as the output matrix
    n_experts: int = 0      # experts of each layer's MLP (0: a dense model)

    def format_of(self, name: str, shape: tuple[int, ...]) -> str | None:
        """The format of GGUF tensor `name` of numpy shape (rows, cols), or (experts, rows, cols)
        for a stack of experts; None: keep it as it is (a vector, a norm, a router, or a matrix
        no format of the recipe can hold)."""
        if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ffn_gate_inp." in name:
            return None
        cols = shape[-1]
        ft = self.file_type
        fmt = FILE_TYPES[ft]
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else -1
        if name == "output.weight" or (not self.has_output and name == "token_embd.weight"):
            if cols % BLOCK[fmt]:
                fmt = "q8_0"
            elif fmt != "q8_0":
                fmt = "q6_k"
        elif "attn_v.weight" in name or "attn_qkv.weight" in name:
            if ft in ("q4_k_m", "q5_k_m") and use_more_bits(layer, self.n_layers):
                fmt = "q6_k"
            if self.n_experts == 8 and "attn_v.weight" in name:
                fmt = "q8_0"
        elif "attn_k.weight" in name and self.n_experts == 8:
            fmt = "q8_0"
        elif "attn_output.weight" in name and self.n_experts == 8 and ft == "q4_k_m":
            fmt = "q5_k"
        elif "ffn_down" in name:
            if ft in ("q4_k_m", "q5_k_m") and use_more_bits(layer, self.n_layers):
                fmt = "q6_k"
        if cols % BLOCK[fmt]:
            fmt = _FALLBACK.get(fmt)
            if fmt is None or cols % BLOCK[fmt]:
                return None
        return fmt


def recipe(file_type: str, n_layers: int, has_output: bool, n_experts: int = 0) -> Recipe:
    key = file_type.strip().lower()
    if key not in FILE_TYPES:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError(
            f"unknown quantization type {file_type!r} (supported: {', '.join(FILE_TYPES)})")
    return Recipe(key, n_layers, has_output, n_experts)
