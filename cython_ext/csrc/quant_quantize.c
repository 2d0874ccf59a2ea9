/* Weight quantizers: float32 rows -> GGUF blocks, the C twin of
 * cyllm.quant.reference.quantize (same float32 operations in the same order, so the
 * same bytes; tests/test_quant_convert.py checks it). The math is llama.cpp's
 * reference quantizers' (what llama-quantize writes without an importance matrix):
 * - q8_0: d = max|x| / 127, q = round(x / d) (half away from zero);
 * - q4_0 / q5_0: d = (signed max-magnitude element) / -8 (-16), q = trunc(x / d + 8.5 (16.5));
 * - q4_1 / q5_1: d = (max - min) / 15 (31), m = min, q = trunc((x - m) / d + 0.5);
 * - q4_k / q5_k: per sub-block of 32 a weighted least-squares scale and min over 21 (16)
 *   candidate inverse scales (weights av|x| + |x|), then 6-bit scales/mins relative to
 *   the superblock's largest, and the levels requantized against the stored scales;
 * - q6_k: per sub-block of 16 a signed scale over 19 candidates (weights x^2), then
 *   8-bit scales relative to the superblock's largest.
 * Compiled at the baseline ISA with -ffp-contract=off (setup.py): a fused multiply-add
 * would change the bytes. Rows are independent (threads split them in quant.pxi).
 */
#include <math.h>
#include <string.h>
#include "quant_impl.h"

#define GROUP_MAX_EPS 1e-15f

/* round half to even (np.rint): adding 1.5 * 2^23 leaves the rounded integer in the low
 * mantissa bits (exact for |v| < 2^22; larger values only occur where the caller clips
 * the level to a small range anyway). Branch-free, so the loops computing levels
 * vectorize; a libm rintf call per element would dominate the K-quant searches. */
static inline int nearest(float v) {
    v = v < -4.0e6f ? -4.0e6f : v > 4.0e6f ? 4.0e6f : v;
    float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* C's roundf (half away from zero) for |v| < 2^23 without a libm call */
static inline int round_away(float v) {
    int i = (int)v;                     /* toward zero */
    float fr = v - (float)i;            /* exact */
    return i + (fr >= 0.5f) - (fr <= -0.5f);
}

static inline float fmax_(float a, float b) { return a > b ? a : b; }
static inline float fmin_(float a, float b) { return a < b ? a : b; }

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static inline void put16(uint8_t *p, float v) {
    uint16_t h = cyllm_f2h(v);
    memcpy(p, &h, 2);
}

/* ---- 32-element blocks ------------------------------------------------------------- */

static void q8_0_block(uint8_t *o, const float *x) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmax_(amax, fabsf(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put16(o, d);
    for (int i = 0; i < 32; i++) o[2 + i] = (uint8_t)(int8_t)round_away(x[i] * id);
}

/* q4_0 (five = 0) / q5_0 (five = 1) */
static void qx_0_block(uint8_t *o, const float *x, int five) {
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < 32; i++) {
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); mx = x[i]; }
    }
    const float half = five ? 16.0f : 8.0f;
    const int top = five ? 31 : 15;
    const float d = mx / -half;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int i = 0; i < 32; i++) {
        int v = (int)(int8_t)(x[i] * id + (half + 0.5f));
        q[i] = v < top ? v : top;
    }
    put16(o, d);
    uint8_t *qs = o + (five ? 6 : 2);
    if (five) {
        uint32_t qh = 0;
        for (int i = 0; i < 32; i++) qh |= (uint32_t)((q[i] >> 4) & 1) << i;
        memcpy(o + 2, &qh, 4);
    }
    for (int i = 0; i < 16; i++) qs[i] = (uint8_t)((q[i] & 15) | ((q[i + 16] & 15) << 4));
}

/* q4_1 (five = 0) / q5_1 (five = 1) */
static void qx_1_block(uint8_t *o, const float *x, int five) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < 32; i++) { mn = fmin_(mn, x[i]); mx = fmax_(mx, x[i]); }
    const float d = (mx - mn) / (five ? 31.0f : 15.0f);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int i = 0; i < 32; i++) {
        int v = (int)(int8_t)((x[i] - mn) * id + 0.5f);
        q[i] = five ? v : (v < 15 ? v : 15);
    }
    put16(o, d);
    put16(o + 2, mn);
    uint8_t *qs = o + (five ? 8 : 4);
    if (five) {
        uint32_t qh = 0;
        for (int i = 0; i < 32; i++) qh |= (uint32_t)((q[i] >> 4) & 1) << i;
        memcpy(o + 4, &qh, 4);
    }
    for (int i = 0; i < 16; i++) qs[i] = (uint8_t)((q[i] & 15) | ((q[i + 16] & 15) << 4));
}

/* ---- K-quants ------------------------------------------------------------------------ */

/* Scale and min of n values minimising sum w (scale*L + min - x)^2 (reference._make_qkx2):
 * returns the scale, *neg_min = -min, L[n] in [0, nmax]. */
static float make_qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min,
                       float rmin, float rdelta, int nstep) {
    float mn = x[0], mx = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        mn = fmin_(mn, x[i]);
        mx = fmax_(mx, x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0.0f) mn = 0.0f;
    if (mx == mn) {
        memset(L, 0, (size_t)n);
        *neg_min = -mn;
        return 0.0f;
    }
    float iscale = (float)nmax / (mx - mn);
    float scale = 1.0f / iscale;
    float best = 0.0f;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)clampi(nearest(iscale * (x[i] - mn)), 0, nmax);
        float diff = scale * (float)L[i] + mn - x[i];
        best += w[i] * (diff * diff);
    }
    uint8_t La[32];
    for (int s = 0; s <= nstep; s++) {
        float isc = (rmin + rdelta * (float)s + (float)nmax) / (mx - mn);
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < n; i++)         /* levels first: this loop vectorizes */
            La[i] = (uint8_t)clampi(nearest(isc * (x[i] - mn)), 0, nmax);
        for (int i = 0; i < n; i++) {       /* sums left to right, as the reference */
            float lf = (float)La[i];
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (!(D > 0.0f)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        if (this_min > 0.0f) {
            this_min = 0.0f;
            this_scale = sum_xl / sum_l2;
        }
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            float diff = this_scale * (float)La[i] + this_min - x[i];
            err += w[i] * (diff * diff);
        }
        if (err < best) {
            memcpy(L, La, (size_t)n);
            best = err;
            scale = this_scale;
            mn = this_min;
        }
    }
    *neg_min = -mn;
    return scale;
}

/* q4_k (five = 0) / q5_k (five = 1): one superblock of 256 */
static void qk45_block(uint8_t *o, const float *x, int five) {
    const int nmax = five ? 31 : 15, nstep = five ? 15 : 20;
    const float rmin = five ? -0.5f : -1.0f;
    uint8_t L[QK_K];
    float scales[8], mins[8], w[32];
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0.0f;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        const float av_x = sqrtf(sum_x2 / 32.0f);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        scales[j] = make_qkx2(32, nmax, xs, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        uint8_t a = (uint8_t)nearest(inv_scale * scales[j]), b = (uint8_t)nearest(inv_min * mins[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    const uint16_t d16 = cyllm_f2h(max_scale / 63.0f), m16 = cyllm_f2h(max_min / 63.0f);
    const float dh = cyllm_h2f(d16), mh = cyllm_h2f(m16);
    for (int j = 0; j < 8; j++) {
        const float d = dh * (float)ls[j];
        if (d == 0.0f) continue;              /* keep the search's levels */
        const float dm = mh * (float)lm[j];
        for (int l = 0; l < 32; l++)
            L[32 * j + l] = (uint8_t)clampi(nearest((x[32 * j + l] + dm) / d), 0, nmax);
    }
    memcpy(o, &d16, 2);
    memcpy(o + 2, &m16, 2);
    uint8_t *sc = o + 4;
    for (int j = 0; j < 4; j++) {
        sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        sc[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
    uint8_t *qs = o + (five ? 48 : 16);
    if (five) {
        uint8_t *qh = o + 16;
        memset(qh, 0, 32);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                qh[l] |= (uint8_t)((((L[64 * c + l] >> 4) & 1) << (2 * c))
                                   | (((L[64 * c + 32 + l] >> 4) & 1) << (2 * c + 1)));
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            qs[32 * c + l] = (uint8_t)((L[64 * c + l] & 15) | ((L[64 * c + 32 + l] & 15) << 4));
}

/* Signed scale of 16 values, levels [-32, 31], weights x^2 (reference._make_qx):
 * returns the scale, L[16] = level + 32 (0 for an all-zero group). */
static float make_qx16(const float *x, uint8_t *L) {
    const int nmax = 32;
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < 16; i++) {
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); mx = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, 16);
        return 0.0f;
    }
    float w[16];
    for (int i = 0; i < 16; i++) w[i] = x[i] * x[i];
    float iscale = (float)-nmax / mx;
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < 16; i++) {
        int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (uint8_t)(l + nmax);
        sumlx += w[i] * x[i] * (float)l;
        suml2 += w[i] * (float)l * (float)l;
    }
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int s = -9; s <= 9; s++) {
        if (s == 0) continue;
        float isc = -((float)nmax + 0.1f * (float)s) / mx;
        int lv[16];
        sumlx = suml2 = 0.0f;
        for (int i = 0; i < 16; i++) lv[i] = clampi(nearest(isc * x[i]), -nmax, nmax - 1);
        for (int i = 0; i < 16; i++) {
            sumlx += w[i] * x[i] * (float)lv[i];
            suml2 += w[i] * (float)lv[i] * (float)lv[i];
        }
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < 16; i++) L[i] = (uint8_t)(lv[i] + nmax);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static void q6_k_block(uint8_t *o, const float *x) {
    uint8_t L[QK_K];
    float scales[16], max_scale = 0.0f, max_abs = 0.0f;
    for (int j = 0; j < 16; j++) {
        scales[j] = make_qx16(x + 16 * j, L + 16 * j);
        if (fabsf(scales[j]) > max_abs) { max_abs = fabsf(scales[j]); max_scale = scales[j]; }
    }
    if (max_abs < GROUP_MAX_EPS) {
        memset(o, 0, QB_Q6_K);
        return;
    }
    const float iscale = -128.0f / max_scale;
    const uint16_t d16 = cyllm_f2h(1.0f / iscale);
    const float dh = cyllm_h2f(d16);
    int8_t sc[16];
    for (int j = 0; j < 16; j++) {
        int v = nearest(iscale * scales[j]);
        sc[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; j++) {
        const float d = dh * (float)sc[j];
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = (uint8_t)(clampi(nearest(x[16 * j + i] / d), -32, 31) + 32);
    }
    uint8_t *ql = o, *qh = o + 128;
    for (int h = 0; h < 2; h++) {
        const uint8_t *Lh = L + 128 * h;
        for (int l = 0; l < 32; l++) {
            const int q1 = Lh[l], q2 = Lh[32 + l], q3 = Lh[64 + l], q4 = Lh[96 + l];
            ql[64 * h + l] = (uint8_t)((q1 & 15) | ((q3 & 15) << 4));
            ql[64 * h + 32 + l] = (uint8_t)((q2 & 15) | ((q4 & 15) << 4));
            qh[32 * h + l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
        }
    }
    memcpy(o + 192, sc, 16);
    memcpy(o + 208, &d16, 2);
}

void cyllm_quantize_row(int fmt, uint8_t *out, const float *x, int64_t n) {
    const cyllm_qformat_info *fi = cyllm_qformat(fmt);
    const int64_t nb = n / fi->block;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = out + b * fi->block_bytes;
        const float *xb = x + b * fi->block;
        switch (fmt) {
        case CYLLM_QF_Q8_0: q8_0_block(o, xb); break;
        case CYLLM_QF_Q4_0: qx_0_block(o, xb, 0); break;
        case CYLLM_QF_Q5_0: qx_0_block(o, xb, 1); break;
        case CYLLM_QF_Q4_1: qx_1_block(o, xb, 0); break;
        case CYLLM_QF_Q5_1: qx_1_block(o, xb, 1); break;
        case CYLLM_QF_Q4_K: qk45_block(o, xb, 0); break;
        case CYLLM_QF_Q5_K: qk45_block(o, xb, 1); break;
        case CYLLM_QF_Q6_K: q6_k_block(o, xb); break;
        default: break;
        }
    }
}
