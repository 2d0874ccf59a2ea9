"""Small q5_0 matrices widened to q8_0 at upload, value for value.

A q5_0 value is d * (c - 16) with a 5-bit code c, a q8_0 value d * q with an int8 q: q = c - 16
with the same f16 d is the same number, and the q8_0 kernels compute the same integer dot.
Where a matrix's launch is a short wave of blocks that each finish in a few microseconds, a
token's time goes to the instructions each warp issues, not to the bytes it reads: q8_0's dot
unpacks nothing, q5_0's first spreads a fifth bit into every code. Q4_K_M and Q5_K_M files of
models whose width is no multiple of 256 (SmolLM2's 576 and 960, Qwen2.5-0.5B's 896) hold
most layer matrices as q5_0, the fallback of q4_k and q5_k. Kept against widened, one process a
model (bench/results/cuda_quant_model_h100.md, twenty-seventh session): SmolLM2-135M Q4_K_M
1502 -> 1572 tok/s on an H200 (its F16: 1527), 1483 -> 1621 on an H100 (F16: 1542); SmolLM2-360M
1188 -> 1291 and 1320 -> 1431. There the 1.55x bytes cost less than the instructions they save; on large matrices the bytes decide, so only small ones are widened.
q4_0 (1.9x the bytes) gained nothing on SmolLM2-135M and lost 6% on Llama-3.2-1B's 2048-wide
matrices, so it keeps its format.

The test is on the bytes a square matrix of the row width would take widened (or the matrix
itself where it has more rows than columns): q, k and v share a width and go out as one launch
only when their formats agree, so all three must widen or none.
"""

from __future__ import annotations

from ...quant.formats import FORMATS, WeightFormat

Q5_0 = FORMATS["q5_0"]
Q8_0 = FORMATS["q8_0"]
_OFFSET = 16                          # q5_0 codes are unsigned, value = d * (code - 16)


def widened_bytes(rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) matrix as q8_0 blocks."""
    return rows * (cols // Q8_0.block) * Q8_0.block_bytes


def widens(fmt: WeightFormat, rows: int, cols: int, sm_count: int, kib_per_sm: int) -> bool:
    """True where a (rows, cols) ``fmt`` matrix is uploaded as q8_0: a q5_0 one whose width's
    square (or itself, if taller) as q8_0 is at most ``kib_per_sm`` KiB a multiprocessor."""
    if fmt.name != Q5_0.name or kib_per_sm <= 0 or sm_count <= 0:
        return False
    return widened_bytes(max(rows, cols), cols) <= kib_per_sm * 1024 * sm_count


def widen_q8_0(xp, blocks):
    """(rows, row_bytes) uint8 q5_0 block rows -> (rows, nbi * 34) q8_0 block rows holding the
    same values. ``xp`` is numpy or cupy (the upload runs it on the device)."""
    rows, rb = blocks.shape
    nbi = rb // Q5_0.block_bytes
    b = blocks.reshape(rows, nbi, Q5_0.block_bytes)     # d (2 bytes), qh (4), qs (16)
    qs = b[:, :, 6:]                                    # (rows, nbi, 16): codes e (low), e + 16 (high)
    codes = xp.concatenate([qs & 15, qs >> 4], axis=2)  # (rows, nbi, 32)
    # qh: a little-endian 32-bit mask, bit e the fifth bit of code e
    bits = (b[:, :, 2:6, None] >> xp.arange(8, dtype=xp.uint8)) & 1      # (rows, nbi, 4, 8)
    codes |= bits.reshape(rows, nbi, 32) << 4
    out = xp.empty((rows, nbi, Q8_0.block_bytes), dtype=xp.uint8)
    out[:, :, :2] = b[:, :, :2]                         # the f16 scale d
    out[:, :, 2:] = (codes.astype(xp.int16) - _OFFSET).astype(xp.int8).view(xp.uint8)
    return out.reshape(rows, nbi * Q8_0.block_bytes)
