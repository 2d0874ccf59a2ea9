"""NumPy reference of the block formats: the ground truth the C kernels are tested against.

- decode / dequantize: every format of formats.FORMATS (checked against
  gguf.quants.dequantize in tests/test_quant_reference.py).
- quantize: q8_0, q4_0, q4_1, q5_0, q5_1 (bit-exact with gguf.quants.quantize, which
  matches llama.cpp's reference quantizers), q4_k, q5_k (the weighted scale/min
  search of llama.cpp's reference quantizer: 21 resp. 16 candidate scales per
  sub-block of 32, least-squares scale and min for each) and q6_k (the signed
  search over 18 candidate scales per sub-block of 16, weighted by x^2). Float32
  arithmetic in llama.cpp's order, sums accumulated left to right (np.cumsum), so
  the output follows llama.cpp's `quantize_row_*_ref` (what llama-quantize writes
  without an importance matrix) up to the rare rounding tie.
- quantize_act: x -> the activation blocks the kernels read (cyllm's layout,
  formats.ACT_FORMATS), bit-exact with the C code (same float32 operations).
- qdot: the reference integer dot product of quantized rows with a quantized
  activation: per-block integer sums (exact) and the float result.

Everything is vectorised over blocks; shapes are in the comments.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .formats import ACT_FORMATS, FORMATS, R16_BASE, WeightFormat, format_by_name

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)


def _fmt(fmt) -> WeightFormat:
    return fmt if isinstance(fmt, WeightFormat) else format_by_name(fmt)


def _blocks(data: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """(n_blocks, block_bytes) uint8 view of block data of any shape."""
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if b.size % fmt.block_bytes:
        raise InvalidArgumentError(
            f"{b.size} bytes is not a whole number of {fmt.name} blocks ({fmt.block_bytes} B)")
    return b.reshape(-1, fmt.block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n,) float32 from little-endian float16."""
    return np.ascontiguousarray(b).view("<f2").reshape(-1).astype(F32)


def _nib(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed nibbles -> (n, 32): low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) uint8 little-endian 32-bit mask -> (n, 32) bits, bit j for element j."""
    m = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((m >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed q4_k/q5_k scales -> sc, m (n, 8) 6-bit integers.

    Sub-blocks 0-3: low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7: the
    nibbles of bytes 8-11 (scale low, min high) plus the top 2 bits of bytes 0-3 / 4-7."""
    s = scales.astype(np.int32)
    sc = np.empty((s.shape[0], 8), np.int32)
    m = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    m[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def decode(data: np.ndarray, fmt) -> dict:
    """The integer and scale components of every block (the dot reference uses these).

    32-blocks: q (nb, 32) int32 (offset removed for q4_0/q5_0: q-8, q-16), d (nb,), and
    m (nb,) for q4_1/q5_1. K-quants: q (nb, 256) int32 (q6_k: q-32), d, dmin (nb,),
    sc (nb, 8) [q6_k: (nb, 16) signed], m (nb, 8) [not q6_k].
    """
    fmt = _fmt(fmt)
    b = _blocks(data, fmt)
    name = fmt.name
    if name == "q8_0":
        return {"d": _f16(b[:, 0:2]), "q": b[:, 2:].view(np.int8).astype(np.int32)}
    if name == "q4_0":
        return {"d": _f16(b[:, 0:2]), "q": _nib(b[:, 2:18]).astype(np.int32) - 8}
    if name == "q4_1":
        return {"d": _f16(b[:, 0:2]), "m": _f16(b[:, 2:4]), "q": _nib(b[:, 4:20]).astype(np.int32)}
    if name == "q5_0":
        q = _nib(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
        return {"d": _f16(b[:, 0:2]), "q": q.astype(np.int32) - 16}
    if name == "q5_1":
        q = _nib(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
        return {"d": _f16(b[:, 0:2]), "m": _f16(b[:, 2:4]), "q": q.astype(np.int32)}
    if name in ("q4_k", "q5_k"):
        sc, m = k_scale_min(b[:, 4:16])
        if name == "q4_k":
            qs = b[:, 16:144].reshape(-1, 4, 32)           # 4 chunks of 32 bytes = 64 elements
            q = np.stack([qs & 15, qs >> 4], axis=2)        # (nb, 4, 2, 32): sub-block 2c, 2c+1
        else:
            qh = b[:, 16:48]                               # (nb, 32): bit 2c / 2c+1 of byte l
            qs = b[:, 48:176].reshape(-1, 4, 32)
            shifts = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
            hi = (qh[:, None, None, :] >> shifts) & 1       # (nb, 4, 2, 32)
            q = np.stack([qs & 15, qs >> 4], axis=2) | (hi << 4)
        return {"d": _f16(b[:, 0:2]), "dmin": _f16(b[:, 2:4]), "sc": sc, "m": m,
                "q": q.reshape(-1, 256).astype(np.int32)}
    if name == "q6_k":
        ql = b[:, 0:128].reshape(-1, 2, 2, 32)              # (half, 32-byte group, l)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        low = np.stack([ql & 15, ql >> 4], axis=2)           # (nb, half, nibble, group, l)
        # element 128*h + 32*k + l, k = 2*nibble + group: low from ql[h][group], high bits 2k
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 2, 2, 1)
        high = (qh[:, :, None, :, :] >> shifts) & 3
        q = (low | (high << 4)).reshape(-1, 256).astype(np.int32) - 32
        return {"d": _f16(b[:, 208:210]), "sc": b[:, 192:208].view(np.int8).astype(np.int32), "q": q}
    raise InvalidArgumentError(f"decode: {name} is not a block format")


def unpack_r16(data: np.ndarray, fmt, cols: int) -> np.ndarray:
    """An r16 layout (rows interleaved by 16, cython_ext/csrc/quant.h: q4_k_r16, q4_0_r16,
    q8_0_r16, q4_1_r16, q6_k_r16, q5_k_r16, q5_0_r16, q5_1_r16) -> the file format's rows, (rows,
    row_bytes) uint8."""
    f = _fmt(fmt)
    if f.name == "q6_k_r16":
        nb = cols // 256
        g = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nb, 16 * 210)  # (groups, nb, 3360)
        c = np.arange(48)                                        # the file's 4-byte chunks: ql's 32, qh's 16
        at = np.where(c < 32, 3 * (8 * (c // 16) + c % 8) + (c // 8) % 2, 3 * (c - 32) + 2)   # their 64-byte chunk
        q = g[:, :, :3072].reshape(-1, nb, 48, 16, 4)[:, :, at].transpose(0, 1, 3, 2, 4).reshape(-1, nb, 16, 192)
        d = g[:, :, 3072:3104].reshape(-1, nb, 16, 2)
        sc = g[:, :, 3104:].reshape(-1, nb, 16, 16).transpose(0, 1, 3, 2)       # (groups, nb, row, k)
        blocks = np.concatenate([q, sc, d], axis=3)                              # ql, qh, scales, d
        return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(-1, nb * 210)
    if f.block == 32:
        nb, bb = cols // 32, f.block_bytes
        nf = 2 if f.name in ("q4_1_r16", "q5_1_r16") else 1                      # f16 fields: d (, m)
        nc = (bb - 2 * nf) // 4                                                  # 4-byte chunks
        g = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nb, 16 * bb)   # (groups, nb, 16 bb)
        fields = [g[:, :, 32 * k:32 * k + 32].reshape(-1, nb, 16, 2) for k in range(nf)]
        qs = g[:, :, 32 * nf:].reshape(-1, nb, nc, 16, 4).transpose(0, 1, 3, 2, 4).reshape(-1, nb, 16, 4 * nc)
        blocks = np.concatenate(fields + [qs], axis=3)                           # (groups, nb, 16, bb)
        return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(-1, nb * bb)
    nb, bb = cols // 256, f.block_bytes                                          # q4_k_r16 (144), q5_k_r16 (176)
    g = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nb, 16 * bb)      # (groups, nb, 16 bb)
    d = g[:, :, 0:32].reshape(-1, nb, 16, 2)
    dmin = g[:, :, 32:64].reshape(-1, nb, 16, 2)
    sc = g[:, :, 64:256].reshape(-1, nb, 12, 16).transpose(0, 1, 3, 2)         # (groups, nb, 16, 12)
    q = g[:, :, 256:].reshape(-1, nb, (bb - 16) // 4, 16, 4)                     # 64-byte chunks
    if f.name == "q5_k_r16":                    # the file's qh chunks l (8), then qs chunks c (32): their places
        c = np.arange(32)
        at = np.concatenate([1 + 2 * np.arange(8), np.where(c < 8, 2 * c, 8 + c)])
        q = q[:, :, at]
    q = q.transpose(0, 1, 3, 2, 4).reshape(-1, nb, 16, bb - 16)
    blocks = np.concatenate([d, dmin, sc, q], axis=3)                            # (groups, nb, 16, bb)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(-1, nb * bb)


def dequantize(data: np.ndarray, fmt, cols: int | None = None) -> np.ndarray:
    """Block data -> float32, shape (rows, cols) when cols is given, else flat.

    Float formats (f32, f16, bf16) are accepted too (raw little-endian bytes), and the
    r16 layouts (cols required)."""
    fmt = _fmt(fmt)
    if fmt.name in R16_BASE:
        if cols is None:
            raise InvalidArgumentError(f"dequantize of the {fmt.name} layout needs cols")
        data, fmt = unpack_r16(data, fmt, cols), FORMATS[R16_BASE[fmt.name]]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if fmt.name == "f32":
        y = raw.view("<f4").astype(F32)
    elif fmt.name == "f16":
        y = raw.view("<f2").astype(F32)
    elif fmt.name == "bf16":
        y = (raw.view("<u2").astype(np.uint32) << 16).view(F32)
    else:
        c = decode(raw, fmt)
        q = c["q"].astype(F32)
        if fmt.block == 32:
            y = c["d"][:, None] * q
            if "m" in c:
                y = y + c["m"][:, None]
        elif fmt.name == "q6_k":
            dl = c["d"][:, None] * c["sc"].astype(F32)                    # (nb, 16)
            y = (dl[:, :, None] * q.reshape(-1, 16, 16))
        else:
            dl = c["d"][:, None] * c["sc"].astype(F32)                    # (nb, 8)
            ml = c["dmin"][:, None] * c["m"].astype(F32)
            y = dl[:, :, None] * q.reshape(-1, 8, 32) - ml[:, :, None]
        y = y.reshape(-1)
    return y if cols is None else y.reshape(-1, cols)


# -- quantizers (llama.cpp's reference math) -----------------------------------------

def _rows(x: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise InvalidArgumentError(f"quantize takes a 1-D or 2-D array, got shape {x.shape}")
    if x.shape[1] % fmt.block:
        raise InvalidArgumentError(
            f"quantize to {fmt.name}: a row of {x.shape[1]} is not a multiple of {fmt.block}")
    if not np.all(np.isfinite(x)):
        raise InvalidArgumentError(f"quantize to {fmt.name}: the input holds inf or nan")
    return x


def _h(v: np.ndarray) -> np.ndarray:
    """float32 (n,) -> (n, 2) uint8 float16 bytes (round to nearest even)."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _cast_i8(v: np.ndarray) -> np.ndarray:
    """C's (int8_t) cast of a float in [0, 128): truncation toward zero."""
    return np.trunc(v).astype(np.int32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude (first one on ties), per row of (n, k)."""
    i = np.abs(x).argmax(axis=1)
    return x[np.arange(x.shape[0]), i]


def _pack_nib(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes: element j low nibble, j+16 high nibble."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_qh(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..31 -> (n, 4) bytes of the little-endian 5th-bit mask."""
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return bits.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(-1, 4)


def _quantize_32(x: np.ndarray, name: str) -> np.ndarray:
    """x (nb, 32) float32 -> (nb, block_bytes) for the 32-element formats."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if name == "q8_0":
            d = np.abs(x).max(axis=1) / F32(127)
            idd = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
            v = x * idd[:, None]
            a = np.abs(v)
            fl = np.floor(a)
            # C's roundf (half away from zero); floor(a + 0.5) would round 0.49999997 up
            q = (np.sign(v) * (fl + (a - fl >= F32(0.5)))).astype(np.int8)
            return np.concatenate([_h(d), q.view(np.uint8)], axis=1)
        if name in ("q4_0", "q5_0"):
            half = F32(8) if name == "q4_0" else F32(16)
            top = 15 if name == "q4_0" else 31
            d = _signed_absmax(x) / -half
            idd = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
            q = np.minimum(top, _cast_i8(x * idd[:, None] + (half + F32(0.5))))
            if name == "q4_0":
                return np.concatenate([_h(d), _pack_nib(q)], axis=1)
            return np.concatenate([_h(d), _pack_qh(q), _pack_nib(q & 15)], axis=1)
        # q4_1 / q5_1
        top = 15 if name == "q4_1" else 31
        mn, mx = x.min(axis=1), x.max(axis=1)
        d = (mx - mn) / F32(top)
        idd = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
        q = _cast_i8((x - mn[:, None]) * idd[:, None] + F32(0.5))
        if name == "q4_1":
            q = np.minimum(15, q)
            return np.concatenate([_h(d), _h(mn), _pack_nib(q)], axis=1)
        return np.concatenate([_h(d), _h(mn), _pack_qh(q), _pack_nib(q & 15)], axis=1)


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over the last axis (C's loop order, unlike np.sum)."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even."""
    return np.rint(v).astype(np.int32)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale and min of each row of x (n, k) minimising sum w*(scale*L + min - x)^2 over
    nstep+1 candidate inverse scales (rmin + rdelta*i + nmax)/(max - min), each refined by
    weighted least squares. Returns scale (n,), -min (n,) and L (n, k) in [0, nmax]."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mn = x.min(axis=1)
        mx = x.max(axis=1)
        sum_w = _seqsum(w)
        sum_x = _seqsum(w * x)
        mn = np.minimum(mn, F32(0))
        flat = mx == mn
        rng = np.where(flat, F32(1), mx - mn).astype(F32)
        iscale = F32(nmax) / rng
        scale = F32(1) / iscale
        L = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        diff = scale[:, None] * L.astype(F32) + mn[:, None] - x
        best = _seqsum(w * (diff * diff))
        for step in range(nstep + 1):
            # llama.cpp searches from the best min found so far (min moves inside the loop)
            rng = np.where(flat, F32(1), mx - mn).astype(F32)
            isc = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / rng
            La = np.clip(_nearest(isc[:, None] * (x - mn[:, None])), 0, nmax)
            lf = La.astype(F32)
            sum_l = _seqsum(w * lf)
            sum_l2 = _seqsum(w * lf * lf)
            sum_xl = _seqsum(w * lf * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            diff = this_scale[:, None] * lf + this_min[:, None] - x
            err = _seqsum(w * (diff * diff))
            take = (D > 0) & (err < best)
            L = np.where(take[:, None], La, L)
            best = np.where(take, err, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
        scale = np.where(flat, F32(0), scale).astype(F32)
        L = np.where(flat[:, None], 0, L)
        return scale, (-mn).astype(F32), L


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed scale of each row of x (n, k) with levels [-nmax, nmax-1], weights x^2,
    searching 18 inverse scales -(nmax + 0.1*i)/max around the plain one. Returns
    scale (n,) and L (n, k) = level + nmax."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        amax = np.abs(x).max(axis=1)
        mx = _signed_absmax(x)
        zero = amax < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx).astype(F32)
        w = x * x

        def levels(isc):
            return np.clip(_nearest(isc[:, None] * x), -nmax, nmax - 1)

        iscale = F32(-nmax) / mx
        lv = levels(iscale)
        lf = lv.astype(F32)
        sumlx = _seqsum(w * x * lf)
        suml2 = _seqsum(w * lf * lf)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        L = lv
        for i in range(-9, 10):
            if i == 0:
                continue
            isc = -(F32(nmax) + F32(0.1) * F32(i)) / mx
            lv = levels(isc)
            lf = lv.astype(F32)
            sumlx = _seqsum(w * x * lf)
            suml2 = _seqsum(w * lf * lf)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(take[:, None], lv, L)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
        scale = np.where(zero, F32(0), scale).astype(F32)
        L = np.where(zero[:, None], 0, L + nmax)
        return scale, L


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins (nb, 8) -> the 12 packed bytes of q4_k/q5_k (inverse of k_scale_min)."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out


def _quantize_k45(x: np.ndarray, name: str) -> np.ndarray:
    """x (nb, 256) -> q4_k / q5_k blocks."""
    nb = x.shape[0]
    nmax, rmin, nstep = (15, -1.0, 20) if name == "q4_k" else (31, -0.5, 15)
    sub = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seqsum(sub * sub) / F32(32))
    w = av_x[:, None] + np.abs(sub)
    scales, mins, L = _make_qkx2(sub, w, nmax, rmin, 0.1, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    L = L.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(63, _nearest(inv_scale[:, None] * scales) & 255)      # C: uint8_t, then MIN
    lm = np.minimum(63, _nearest(inv_min[:, None] * mins) & 255)
    d16 = (max_scale / F32(63)).astype("<f2")
    m16 = (max_min / F32(63)).astype("<f2")
    # requantize against the stored (rounded) scales; a zero scale keeps the search's levels
    dd = d16.astype(F32)[:, None] * ls.astype(F32)                         # (nb, 8)
    dm = m16.astype(F32)[:, None] * lm.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest((x.reshape(nb, 8, 32) + dm[:, :, None]) / dd[:, :, None]), 0, nmax)
    L = np.where((dd != 0)[:, :, None], lq, L).reshape(nb, 4, 2, 32)
    d_bytes, m_bytes = d16.view(np.uint8).reshape(nb, 2), m16.view(np.uint8).reshape(nb, 2)
    if name == "q4_k":
        return pack_q4k(L.reshape(nb, 256), ls, lm, d_bytes, m_bytes)
    head = np.concatenate([d_bytes, m_bytes, _pack_k_scales(ls, lm)], axis=1)
    qs = ((L[:, :, 0] & 15) | ((L[:, :, 1] & 15) << 4)).astype(np.uint8).reshape(nb, 128)
    shifts = np.arange(8, dtype=np.int32).reshape(1, 4, 2, 1)
    qh = (((L >> 4) & 1) << shifts).sum(axis=(1, 2)).astype(np.uint8)    # (nb, 32)
    return np.concatenate([head, qh, qs], axis=1)


def pack_q4k(codes: np.ndarray, ls: np.ndarray, lm: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """q4_k blocks from codes (nb, 256) in [0, 15], 6-bit scales and mins (nb, 8), and d, dmin
    (nb, 2) f16 bytes -> (nb, 144) uint8; element 64 g + 32 h + l: the low nibble of
    qs[32 g + l] for h = 0, its high nibble for h = 1."""
    nb = codes.shape[0]
    L = codes.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = (L[:, :, 0] & 15) | ((L[:, :, 1] & 15) << 4)                     # (nb, 4, 32)
    return np.concatenate([d.reshape(nb, 2), dmin.reshape(nb, 2), _pack_k_scales(ls, lm),
                           qs.reshape(nb, 128)], axis=1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    scales, L = _make_qx(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    amax_i = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), amax_i]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / np.where(zero, F32(1), max_scale).astype(F32)
        d16 = (F32(1) / iscale).astype("<f2")
        sc = np.minimum(127, _nearest(iscale[:, None] * scales))           # (nb, 16)
        dd = d16.astype(F32)[:, None] * sc.astype(F32)
        lq = np.clip(_nearest(x.reshape(nb, 16, 16) / dd[:, :, None]), -32, 31) + 32
    L = np.where((dd != 0)[:, :, None], lq, L).reshape(nb, 256)
    out = pack_q6k(L, sc, d16.view(np.uint8).reshape(nb, 2))
    out[zero] = 0
    return out


def pack_q6k(codes: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q6_k blocks from codes (nb, 256) in [0, 63], scales (nb, 16) int8 and d (nb, 2) f16
    bytes -> (nb, 210) uint8; element 128 h + 32 k + l: low 4 bits in ql[h][k % 2][l]
    (the high nibble for k >= 2), high 2 bits in qh[h][l] at bit 2 k."""
    nb = codes.shape[0]
    L = codes.astype(np.uint8).reshape(nb, 2, 4, 32)                    # (half, k, l)
    ql = np.empty((nb, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (L[:, :, 0] & 15) | ((L[:, :, 2] & 15) << 4)
    ql[:, :, 1] = (L[:, :, 1] & 15) | ((L[:, :, 3] & 15) << 4)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).astype(np.uint8)                    # (nb, 2, 32)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64),
                           scales.astype(np.int8).view(np.uint8), d.reshape(nb, 2)], axis=1)


def quantize(x: np.ndarray, fmt, chunk_rows: int | None = None) -> np.ndarray:
    """float rows (rows, cols) -> (rows, row_bytes) uint8 blocks of `fmt`.

    Rows are processed in chunks (about 1M elements) so memory stays bounded."""
    fmt = _fmt(fmt)
    if not fmt.quantized:
        raise InvalidArgumentError(f"quantize: {fmt.name} is not a block format")
    x = _rows(x, fmt)
    rows, cols = x.shape
    out = np.empty((rows, fmt.row_bytes(cols)), np.uint8)
    step = chunk_rows or max(1, (1 << 20) // cols)
    for r in range(0, rows, step):
        xb = x[r:r + step].reshape(-1, fmt.block)
        if fmt.block == 32:
            b = _quantize_32(xb, fmt.name)
        elif fmt.name == "q6_k":
            b = _quantize_q6k(xb)
        else:
            b = _quantize_k45(xb, fmt.name)
        out[r:r + step] = b.reshape(-1, out.shape[1])
    return out


# -- activations and the reference dot product -----------------------------------------

def quantize_act(x: np.ndarray, act: str) -> dict:
    """x (n,) float32 -> the activation blocks: q (n,) int8, d (nb,) float32, and
    sums (nb,) int32 for "q8_0" / bsums (nb*16,) int16 for "q8_k".

    Per block: amax = max|x|, d = amax/127, q = rint(x * (127/amax)) (0 when amax == 0):
    the same float32 operations as the C kernels, so the bytes are identical."""
    if act not in ACT_FORMATS:
        raise InvalidArgumentError(f"unknown activation format {act!r}")
    block = ACT_FORMATS[act][0]
    x = np.asarray(x, dtype=F32).reshape(-1)
    if x.size % block:
        raise InvalidArgumentError(f"activation of length {x.size} is not a multiple of {block}")
    xb = x.reshape(-1, block)
    amax = np.abs(xb).max(axis=1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        idd = np.where(amax == 0, F32(0), F32(127) / amax).astype(F32)
    q = np.rint(xb * idd[:, None]).astype(np.int8)
    out = {"q": q.reshape(-1), "d": d.astype(F32)}
    if act == "q8_0":
        out["sums"] = q.astype(np.int32).sum(axis=1).astype(np.int32)
    else:
        out["bsums"] = q.reshape(-1, 16).astype(np.int32).sum(axis=1).astype(np.int16)
    return out


def pack_act(a: dict, act: str) -> np.ndarray:
    """The activation dict -> the bytes the C kernels read (formats.ACT_FORMATS layout):
    q8_0: [q: n int8][d: nb f32][sums: nb int32]; q8_k: [q: n int8][d: nb f32][bsums: 16 nb int16]."""
    tail = a["sums"].astype("<i4") if act == "q8_0" else a["bsums"].astype("<i2")
    return np.concatenate([a["q"].view(np.uint8), a["d"].astype("<f4").view(np.uint8),
                           tail.view(np.uint8)])


def qdot(data: np.ndarray, fmt, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference of the kernels' math: rows of quantized weights (rows, row_bytes) times
    x (cols,) quantized to the format's activation blocks.

    Returns (out (rows,) float64, isum (rows, n_int) int64): isum holds the exact integer
    parts the kernels compute (32-blocks: sum q_w*q_x per block; K-quants: per superblock
    sum_j sc_j * sum(q_w*q_x over sub-block j), then sum_j m_j * bsum_j for q4_k/q5_k),
    and out combines them with the scales in float64."""
    fmt = _fmt(fmt)
    x = np.asarray(x, dtype=F32).reshape(-1)
    rows = np.asarray(data).shape[0]
    a = quantize_act(x, fmt.act)
    c = decode(data, fmt)
    nbr = x.size // fmt.block                      # blocks per row
    qx = a["q"].astype(np.int64).reshape(nbr, fmt.block)
    qw = c["q"].astype(np.int64).reshape(rows, nbr, fmt.block)
    dx = a["d"].astype(np.float64)
    d = c["d"].astype(np.float64).reshape(rows, nbr)
    if fmt.block == 32:
        isum = (qw * qx[None]).sum(axis=2)                               # (rows, nbr)
        out = (d * dx[None] * isum).sum(axis=1)
        if "m" in c:
            sx = a["sums"].astype(np.int64)
            out = out + (c["m"].astype(np.float64).reshape(rows, nbr) * dx[None] * sx[None]).sum(axis=1)
        return out, isum
    if fmt.name == "q6_k":
        sub = (qw.reshape(rows, nbr, 16, 16) * qx.reshape(1, nbr, 16, 16)).sum(axis=3)
        isum = (c["sc"].astype(np.int64).reshape(rows, nbr, 16) * sub).sum(axis=2)   # (rows, nbr)
        out = (d * dx[None] * isum).sum(axis=1)
        return out, isum
    sub = (qw.reshape(rows, nbr, 8, 32) * qx.reshape(1, nbr, 8, 32)).sum(axis=3)
    isum = (c["sc"].astype(np.int64).reshape(rows, nbr, 8) * sub).sum(axis=2)
    bs = a["bsums"].astype(np.int64).reshape(nbr, 8, 2).sum(axis=2)                   # per 32
    imin = (c["m"].astype(np.int64).reshape(rows, nbr, 8) * bs[None]).sum(axis=2)
    dmin = c["dmin"].astype(np.float64).reshape(rows, nbr)
    out = (d * dx[None] * isum - dmin * dx[None] * imin).sum(axis=1)
    return out, np.concatenate([isum, imin], axis=1)


def matvec(data: np.ndarray, fmt, x: np.ndarray, cols: int) -> np.ndarray:
    """Float reference: dequantize(W) @ x in float64 (no activation quantization)."""
    return dequantize(data, fmt, cols).astype(np.float64) @ np.asarray(x, np.float64)


__all__ = ["decode", "dequantize", "quantize", "quantize_act", "pack_act", "qdot", "matvec",
           "k_scale_min", "unpack_r16", "FORMATS"]
