"""Re-encodings of GGUF block types that have no kernel into native formats that keep their values.

Some types without a kernel hold values that a native format represents exactly (or, for
IQ4_XS, up to an f16 rounding of its scales), block for block, so loading them needs no
float round trip and adds (next to) no rounding:

- Q3_K -> q6_k: a Q3_K value is d * (s - 32) * q with q in [-4, 3] and a 6-bit scale s for
  every 16 elements; a q6_k value is d * sc * (c - 32) with an int8 scale sc for every 16
  elements and c in [0, 63]. So sc = s - 32, c = q + 32, and d stays.
- IQ4_NL -> q8_0: an IQ4_NL value is d * T[n] with a 4-bit index n into a table T of 16
  int8 values; a q8_0 value is d * q with q an int8. So q = T[n], and d stays.
- IQ4_XS -> q8_0: the same table, with a 6-bit scale ls for every 32 elements of a 256-block:
  d * (ls - 32) * T[n]. The q8_0 scale is d * (ls - 32) rounded to f16.
- IQ1_M -> q6_k: d * (2s + 1) * (g + delta), g in {-1, 0, 1}, delta = +-1/8, a 3-bit s for
  every 16 elements: q6_k scale d/8, sub-scale 2s + 1, codes (g + delta) * 8 (iq1m_to_q6k).
- IQ3_XXS -> q6_k: d * (1 + 2s) / 4 * g with g even, |g| <= 62: scale d/2, codes g/2 + 32.
- IQ3_S -> q4_k: d * (1 + 2s) * g with g odd in -15..15, 16 even steps: q4_k's step and min
  (its min rounded to f16, the one inexact step).

The block layouts are ggml's (Q3_K: hmask[32] qs[64] scales[12] d; IQ4_NL: d qs[16];
IQ4_XS: d scales_h scales_l[4] qs[128]; IQ1_M: qs[32] qh[16] scales[8]; IQ3_XXS: d qs[64]
words[8]; IQ3_S: d qs[64] qh[8] signs[32] scales[4]; q6_k: ql[128] qh[64] scales[16] d; q4_k:
d dmin scales[12] qs[128]; q8_0: d qs[32]). tests/test_gguf.py checks each against gguf-py's
dequantizer (llama.cpp's own Python code). Scales are copied as they are: an inf or nan one
reaches the native block, where the loader's check of every block scale refuses it.
Everything is vectorised over blocks.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .reference import pack_q4k, pack_q6k

Q3_K, IQ3_XXS, IQ4_NL, IQ3_S, IQ4_XS, IQ1_M = 11, 18, 20, 21, 23, 29    # GGML type ids
_BLOCK_BYTES = {Q3_K: 110, IQ3_XXS: 98, IQ4_NL: 18, IQ3_S: 110, IQ4_XS: 136, IQ1_M: 56}
# IQ4_NL's value table (ggml's kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)


def _blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    size = _BLOCK_BYTES[ggml_type]
    if b.size % size:
        raise InvalidArgumentError(f"{b.size} bytes is not a whole number of {size}-byte blocks")
    return b.reshape(-1, size)


def q3k_codes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K blocks -> (q (nb, 256) int8 in [-4, 3], scale (nb, 16) int8 in [-32, 31],
    d (nb, 2) uint8: the f16 bytes as stored); value = d * scale[e // 16] * q[e]."""
    b = _blocks(raw, Q3_K)
    nb = b.shape[0]
    hmask, qs, sc12, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], b[:, 108:110]
    # 16 six-bit scales: scale i = 4g + k takes its low 4 bits from byte 4(g % 2) + k
    # (the high nibble for g >= 2) and its high 2 bits from byte 8 + k, bits 2g
    g = np.arange(4).reshape(4, 1)
    k = np.arange(4).reshape(1, 4)
    low = (sc12[:, (g % 2) * 4 + k] >> (4 * (g // 2)).astype(np.uint8)) & 15        # (nb, 4, 4)
    high = (sc12[:, 8 + k + 0 * g] >> (2 * g).astype(np.uint8)) & 3
    scale = ((low | (high << 4)).astype(np.int16) - 32).reshape(nb, 16).astype(np.int8)
    # element e = 128 n + 32 j + l (l < 32): 2 low bits from qs[32 n + l] at bit 2 j, the
    # third from hmask[l] at bit 4 n + j (set: q = low, clear: q = low - 4)
    n = np.arange(2).reshape(2, 1, 1)
    j = np.arange(4).reshape(1, 4, 1)
    low2 = (qs.reshape(nb, 2, 1, 32) >> (2 * j).astype(np.uint8)) & 3                   # (nb, 2, 4, 32)
    hbit = (hmask.reshape(nb, 1, 1, 32) >> (4 * n + j).astype(np.uint8)) & 1
    q = (low2.astype(np.int8) - 4 * (1 - hbit).astype(np.int8)).reshape(nb, 256)
    return q, scale, d


def q3k_to_q6k(raw: np.ndarray) -> np.ndarray:
    """Q3_K blocks -> the q6_k blocks of the same values, (nb, 210) uint8."""
    q, scale, d = q3k_codes(raw)
    return pack_q6k(q.astype(np.int16) + 32, scale, d)


def iq4nl_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks -> the q8_0 blocks of the same values, (nb, 34) uint8: element j of a
    block is the low nibble of qs[j], element j + 16 its high nibble."""
    b = _blocks(raw, IQ4_NL)
    qs = b[:, 2:18]
    idx = np.concatenate([qs & 15, qs >> 4], axis=1)                  # (nb, 32)
    return np.concatenate([b[:, 0:2], IQ4_NL_VALUES[idx].view(np.uint8)], axis=1)


def iq4xs_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (d, scales_h u16, scales_l[4], qs[128]) -> q8_0 blocks, 8 per block,
    (nb * 8, 34) uint8. Sub-block i of 32 has the 6-bit scale ls (low 4 bits: nibble i % 2
    of scales_l[i // 2], high 2: bits 2i of scales_h) and the values d * (ls - 32) * T[n],
    n from qs[16 i + j] as in IQ4_NL; the q8_0 scale is d * (ls - 32) rounded to f16 (a
    relative error under 2^-11, the one inexact step), its codes T[n]."""
    b = _blocks(raw, IQ4_XS)
    nb = b.shape[0]
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)                     # (nb, 1)
    sh = b[:, 2:4].copy().view("<u2").astype(np.uint32)                     # (nb, 1)
    i = np.arange(8)
    ls = ((b[:, 4 + i // 2] >> (4 * (i % 2)).astype(np.uint8)) & 15).astype(np.int32) \
        | (((sh >> (2 * i).astype(np.uint32)) & 3).astype(np.int32) << 4)  # (nb, 8)
    with np.errstate(over="ignore", invalid="ignore"):
        dl = (d * (ls - 32).astype(np.float32)).astype("<f2")                # (nb, 8)
    qs = b[:, 8:136].reshape(nb, 8, 16)
    idx = np.concatenate([qs & 15, qs >> 4], axis=2)                         # (nb, 8, 32)
    out = np.concatenate([dl.reshape(nb, 8, 1).view(np.uint8).reshape(nb, 8, 2),
                          IQ4_NL_VALUES[idx].view(np.uint8)], axis=2).reshape(nb * 8, 34)
    over = (np.isfinite(d) & ~np.isfinite(dl)).reshape(raw.shape[0], -1).any(axis=1)    # (rows,)
    if over.any():
        raise ScaleOverflow("an IQ4_XS sub-block scale, d * (ls - 32), beyond f16", np.flatnonzero(over), out)
    return out


def iq1m_to_q6k(raw: np.ndarray) -> np.ndarray:
    """IQ1_M blocks (qs[32] qh[16] scales[8]) -> the q6_k blocks of the same values. An
    IQ1_M value is d * (2s + 1) * (g + delta) with a 3-bit s for every 16 elements, g in
    {-1, 0, 1} and delta = +-1/8, so (g + delta) * 8 is in {+-1, +-7, +-9}: q6_k holds it
    with d/8 as its scale (exact unless d/8 falls below f16's normal range), 2s + 1 as the
    sub-scale and those codes. The grid lookup is gguf-py's (its dequantizer, whose float32
    products of these small integers are exact); d and s are read from the block: d is the
    top nibbles of the four 16-bit scale words (bits 0-3 from the first), s the 3-bit
    fields at bits 0, 3, 6, 9 of each word."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    b = _blocks(raw, IQ1_M)
    nb = b.shape[0]
    words = b[:, 48:56].copy().view("<u2")                                 # (nb, 4)
    dbits = ((words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0x00F0) | ((words[:, 2] >> 4) & 0x0F00)
             | (words[:, 3] & 0xF000)).astype("<u2")
    d = dbits.view("<f2")                                                   # (nb,)
    s = ((words[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(nb, 16).astype(np.int32)
    # a corrupt (inf/nan) d passes through to the q6_k scale, which the loader refuses
    with np.errstate(invalid="ignore", over="ignore"):
        vals = quants.dequantize(b.reshape(-1), GGMLQuantizationType.IQ1_M).reshape(nb, 16, 16)
        unit = d.astype(np.float64)[:, None] * (2 * s + 1) / 8              # (nb, 16)
        codes = np.nan_to_num(np.rint(vals / np.where(unit == 0, 1.0, unit)[:, :, None])).astype(np.int16)
        d6 = (d.astype(np.float32) / 8).astype("<f2").view(np.uint8).reshape(nb, 2)
    return pack_q6k((codes + 32).reshape(nb, 256), (2 * s + 1).astype(np.int8), d6)


def _grid(name: str) -> np.ndarray:
    """An i-quant's grid, (entries, 4) uint8: the magnitudes each index stands for. gguf-py
    holds llama.cpp's tables; read from there rather than copied."""
    from gguf import quants
    cls = getattr(quants, name)
    cls.init_grid()
    return cls.grid.reshape(-1, 4).astype(np.uint8)


# 7-bit sign index -> its 8 sign bits: the eighth makes the count of minus signs even
_PARITY = np.array([bin(i).count("1") & 1 for i in range(128)], np.uint8)


def _bits(b: np.ndarray) -> np.ndarray:
    """(n, k) uint8 -> (n, 8k) of 0/1, least significant bit of each byte first."""
    return np.unpackbits(b, axis=1, bitorder="little")


def iq3xxs_to_q6k(raw: np.ndarray) -> np.ndarray:
    """IQ3_XXS blocks (d, qs[64], 8 words of signs and scale) -> the q6_k blocks of the same
    values. Sub-block i of 32 has the word w_i: four 7-bit sign indices (bits 7k) and a 4-bit
    s (bits 28-31), and the values d * (1 + 2s) / 4 * g * sign, g from the grid by qs (four
    elements an entry). The grid's g are even (4..62), so q6_k holds them with d/2 as its
    scale (exact unless d/2 falls below f16's normal range), 1 + 2s as the sub-scale of both
    its 16-element halves and codes +-g/2 + 32."""
    b = _blocks(raw, IQ3_XXS)
    nb = b.shape[0]
    mag = _grid("IQ3_XXS")[b[:, 2:66]].reshape(nb, 256).astype(np.int16) >> 1   # (nb, 256)
    words = b[:, 66:98].copy().view("<u4")                                      # (nb, 8)
    idx = ((words[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127).astype(np.uint8)
    signs = idx | (_PARITY[idx] << 7)                                           # (nb, 8, 4)
    neg = _bits(signs.reshape(nb, 32)).astype(bool)                             # (nb, 256)
    codes = np.where(neg, -mag, mag) + 32
    sub = (1 + 2 * (words >> 28)).astype(np.int8)                              # (nb, 8)
    with np.errstate(over="ignore", invalid="ignore"):
        d6 = (b[:, 0:2].copy().view("<f2").astype(np.float32) / 2).astype("<f2")
    return pack_q6k(codes, np.repeat(sub, 2, axis=1), d6.view(np.uint8).reshape(nb, 2))


def iq3s_to_q4k(raw: np.ndarray) -> np.ndarray:
    """IQ3_S blocks (d, qs[64], qh[8], signs[32], scales[4]) -> the q4_k blocks of the same
    values. Sub-block i of 32 has the nibble s (nibble i % 2 of scales[i // 2]) and the values
    d * (1 + 2s) * g * sign, g odd in 1..15 from the grid by the 9-bit index qs | qh's bit << 8
    (four elements an entry). Those are 16 evenly spaced levels, -15..15 in steps of 2, so
    q4_k holds them: code (g * sign + 15) / 2, scale 2d and sub-scale 1 + 2s for the step, and
    the offset d * 15 * (1 + 2s) as min 15d and sub-min 1 + 2s. 2d is exact; 15d is rounded to
    f16 (a relative error under 2^-11 on the offset, the one inexact step)."""
    b = _blocks(raw, IQ3_S)
    nb = b.shape[0]
    idx = b[:, 2:66].astype(np.uint16) | (_bits(b[:, 66:74]).astype(np.uint16) << 8)   # (nb, 64)
    mag = _grid("IQ3_S")[idx].reshape(nb, 256).astype(np.int16)
    neg = _bits(b[:, 74:106]).astype(bool)                                      # (nb, 256)
    codes = (np.where(neg, -mag, mag) + 15) >> 1                                # (nb, 256) in [0, 15]
    sub = 1 + 2 * np.stack([b[:, 106:110] & 15, b[:, 106:110] >> 4], axis=2).reshape(nb, 8)
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)                         # (nb, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        dd = (2 * d).astype("<f2")
        dmin = (15 * d).astype("<f2")
    out = pack_q4k(codes, sub, sub, dd.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2))
    over = (np.isfinite(d) & ~np.isfinite(dmin)).reshape(raw.shape[0], -1).any(axis=1)   # (rows,)
    if over.any():
        raise ScaleOverflow("an IQ3_S scale above 4367 (its q4_k min, 15 d, exceeds f16)",
                            np.flatnonzero(over), out)
    return out


class ScaleOverflow(ValueError):
    """A finite scale of the file's whose re-encoded form does not fit f16. Carries the
    rows (indices into the input) that hold one and the re-encoded blocks (the other rows
    exact): the loader requantizes those rows only (a file's own inf or nan scales are
    refused after)."""

    def __init__(self, message: str, rows: np.ndarray, blocks: np.ndarray):
        super().__init__(message)
        self.rows = rows
        self.blocks = blocks


# (GGML type, native format) -> the exact re-encoding; the loader uses it in place of
# dequantize-then-quantize
EXACT = {(Q3_K, "q6_k"): q3k_to_q6k, (IQ4_NL, "q8_0"): iq4nl_to_q8_0, (IQ4_XS, "q8_0"): iq4xs_to_q8_0,
         (IQ1_M, "q6_k"): iq1m_to_q6k, (IQ3_XXS, "q6_k"): iq3xxs_to_q6k, (IQ3_S, "q4_k"): iq3s_to_q4k}

