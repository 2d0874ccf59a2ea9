/* Generic (portable C) quantized kernels: the reference table, and the fallback for
 * CPUs without AVX2 and for non-x86 targets (must compile for aarch64).
 *
 * Per row: the integer dot product of each block (int32, exact), then one float
 * multiply-add per block (32-blocks) or superblock (K-quants), summed left to right.
 * Compiled with -ffp-contract=off (setup.py), so the dequantizers give the bits of
 * cyllm.quant.reference.dequantize on every target.
 */
#include <math.h>
#include "quant_impl.h"

/* software prefetch distance of the quantized matvecs: 8 KiB ahead measured best of 2, 8 and
 * 16 KiB for TinyLlama-shape Q4_K_M / Q4_0 / Q8_0 decode at 2 threads (AMD EPYC family 25
 * model 17: 45.4 / 46.4 / 29.7 -> 49.5 / 47.0 / 31.5 tok/s from 2 to 8 KiB) */
int64_t cyllm_qpf_bytes = 8192;

static const cyllm_qformat_info INFO[CYLLM_QF_COUNT] = {
    {"q8_0", 8, 32, QB_Q8_0, CYLLM_QA_Q8_0},
    {"q4_0", 2, 32, QB_Q4_0, CYLLM_QA_Q8_0},
    {"q4_1", 3, 32, QB_Q4_1, CYLLM_QA_Q8_0},
    {"q5_0", 6, 32, QB_Q5_0, CYLLM_QA_Q8_0},
    {"q5_1", 7, 32, QB_Q5_1, CYLLM_QA_Q8_0},
    {"q4_k", 12, QK_K, QB_Q4_K, CYLLM_QA_Q8_K},
    {"q5_k", 13, QK_K, QB_Q5_K, CYLLM_QA_Q8_K},
    {"q6_k", 14, QK_K, QB_Q6_K, CYLLM_QA_Q8_K},
    {"q4_k_r16", -1, QK_K, QB_Q4_K, CYLLM_QA_Q8_K},
    {"q4_0_r16", -1, 32, QB_Q4_0, CYLLM_QA_Q8_0},
    {"q8_0_r16", -1, 32, QB_Q8_0, CYLLM_QA_Q8_0},
    {"q4_1_r16", -1, 32, QB_Q4_1, CYLLM_QA_Q8_0},
    {"q6_k_r16", -1, QK_K, QB_Q6_K, CYLLM_QA_Q8_K},
    {"q5_k_r16", -1, QK_K, QB_Q5_K, CYLLM_QA_Q8_K},
    {"q5_0_r16", -1, 32, QB_Q5_0, CYLLM_QA_Q8_0},
    {"q5_1_r16", -1, 32, QB_Q5_1, CYLLM_QA_Q8_0},
};

const cyllm_qformat_info *cyllm_qformat(int fmt) {
    return fmt >= 0 && fmt < CYLLM_QF_COUNT ? &INFO[fmt] : 0;
}

int cyllm_qact_block(int act) {
    return act == CYLLM_QA_Q8_0 ? 32 : act == CYLLM_QA_Q8_K ? QK_K : 0;
}

int64_t cyllm_qact_bytes(int act, int64_t n) {
    int blk = cyllm_qact_block(act);
    if (blk == 0 || n < 0 || n % blk) return -1;
    int64_t nb = n / blk;
    return act == CYLLM_QA_Q8_0 ? n + 8 * nb : n + 4 * nb + 32 * nb;
}

/* 0.5 x (1 + tanh(u)) written as x * sigmoid(2u): the same function without the
 * cancellation of 1 + tanh(u) for negative u (relative error stays ~1 ulp) */
float cyllm_gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

void cyllm_qglu(float *out, const float *g, const float *u, int64_t r0, int64_t r1, int act) {
    for (int64_t i = r0; i < r1; i++) out[i] = cyllm_qact_apply(act, g[i]) * u[i];
}

/* ---- activation quantization ---------------------------------------------------- */

static void quantize_act_generic(void *xq, const float *x, int64_t n, int act, int64_t b0, int64_t b1) {
    const int blk = cyllm_qact_block(act);
    char *p = (char *)xq;
    int8_t *q = (int8_t *)p;
    float *d = (float *)(p + n);
    int64_t nb = n / blk;
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * blk;
        float amax = 0.0f;
        for (int i = 0; i < blk; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        int8_t *qb = q + b * blk;
        for (int i = 0; i < blk; i++) qb[i] = (int8_t)(int)rintf(xb[i] * id);
        if (act == CYLLM_QA_Q8_0) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += qb[i];
            ((int32_t *)(p + n + 4 * nb))[b] = s;
        } else {
            int16_t *bs = (int16_t *)(p + n + 4 * nb) + b * 16;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += qb[g * 16 + i];
                bs[g] = (int16_t)s;
            }
        }
    }
}

/* ---- per-format decoders of one block into integers ------------------------------
 * 32-blocks: v[32] = the integer weights (q4_0: 0..15, offset handled by the caller). */

static inline void nib32(int8_t *v, const uint8_t *qs) {
    for (int j = 0; j < 16; j++) { v[j] = (int8_t)(qs[j] & 15); v[j + 16] = (int8_t)(qs[j] >> 4); }
}

static inline void nib32_h(int8_t *v, const uint8_t *qs, uint32_t qh) {
    for (int j = 0; j < 16; j++) {
        v[j] = (int8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        v[j + 16] = (int8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

static inline int32_t idot32(const int8_t *a, const int8_t *b) {
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* 32-block formats: one row . x */
static inline float dot_q8_0(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += QB_Q8_0) {
        int32_t i = idot32((const int8_t *)(w + 2), a->q + b * 32);
        s += (cyllm_h2f(cyllm_rd16(w)) * a->d[b]) * (float)i;
    }
    return s;
}

static inline float dot_q4_0(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    int8_t v[32];
    for (int64_t b = 0; b < nb; b++, w += QB_Q4_0) {
        nib32(v, w + 2);
        int32_t i = idot32(v, a->q + b * 32) - 8 * a->sum[b];
        s += (cyllm_h2f(cyllm_rd16(w)) * a->d[b]) * (float)i;
    }
    return s;
}

static inline float dot_q4_1(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    int8_t v[32];
    for (int64_t b = 0; b < nb; b++, w += QB_Q4_1) {
        nib32(v, w + 4);
        int32_t i = idot32(v, a->q + b * 32);
        s += (cyllm_h2f(cyllm_rd16(w)) * a->d[b]) * (float)i
             + cyllm_h2f(cyllm_rd16(w + 2)) * (a->d[b] * (float)a->sum[b]);
    }
    return s;
}

static inline float dot_q5_0(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    int8_t v[32];
    for (int64_t b = 0; b < nb; b++, w += QB_Q5_0) {
        nib32_h(v, w + 6, cyllm_rd32(w + 2));
        int32_t i = idot32(v, a->q + b * 32) - 16 * a->sum[b];
        s += (cyllm_h2f(cyllm_rd16(w)) * a->d[b]) * (float)i;
    }
    return s;
}

static inline float dot_q5_1(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    int8_t v[32];
    for (int64_t b = 0; b < nb; b++, w += QB_Q5_1) {
        nib32_h(v, w + 8, cyllm_rd32(w + 4));
        int32_t i = idot32(v, a->q + b * 32);
        s += (cyllm_h2f(cyllm_rd16(w)) * a->d[b]) * (float)i
             + cyllm_h2f(cyllm_rd16(w + 2)) * (a->d[b] * (float)a->sum[b]);
    }
    return s;
}

/* K-quants: per superblock isum = sum_j sc_j * (q . x over sub-block j) and, for the
 * asymmetric ones, imin = sum_j m_j * (x sum over sub-block j) */
static inline void k45_decode(int8_t *v, const uint8_t *qs, const uint8_t *qh) {
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
            if (qh) {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            v[64 * c + l] = (int8_t)lo;
            v[64 * c + 32 + l] = (int8_t)hi;
        }
    }
}

static inline float dot_k45(const uint8_t *w, const cyllm_qact_view *a, int64_t nb, int five) {
    float s = 0.0f;
    int8_t v[QK_K];
    const int bb = five ? QB_Q5_K : QB_Q4_K;
    for (int64_t b = 0; b < nb; b++, w += bb) {
        uint8_t sc[8], m[8];
        cyllm_k_scales(w + 4, sc, m);
        k45_decode(v, five ? w + 48 : w + 16, five ? w + 16 : 0);
        const int8_t *xq = a->q + b * QK_K;
        const int16_t *bs = a->bsum + b * 16;
        int32_t isum = 0, imin = 0;
        for (int j = 0; j < 8; j++) {
            isum += (int32_t)sc[j] * (idot32(v + 32 * j, xq + 32 * j));
            imin += (int32_t)m[j] * ((int32_t)bs[2 * j] + (int32_t)bs[2 * j + 1]);
        }
        const float dx = a->d[b];
        s += (cyllm_h2f(cyllm_rd16(w)) * dx) * (float)isum
             - (cyllm_h2f(cyllm_rd16(w + 2)) * dx) * (float)imin;
    }
    return s;
}

static inline float dot_q4_k(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    return dot_k45(w, a, nb, 0);
}
static inline float dot_q5_k(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    return dot_k45(w, a, nb, 1);
}

/* q6_K: v = q - 32 in element order */
static inline void q6k_decode(int8_t *v, const uint8_t *w) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
        int8_t *y = v + 128 * h;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

static inline float dot_q6_k(const uint8_t *w, const cyllm_qact_view *a, int64_t nb) {
    float s = 0.0f;
    int8_t v[QK_K];
    for (int64_t b = 0; b < nb; b++, w += QB_Q6_K) {
        q6k_decode(v, w);
        const int8_t *sc = (const int8_t *)(w + 192);
        const int8_t *xq = a->q + b * QK_K;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t t = 0;
            for (int i = 0; i < 16; i++) t += (int32_t)v[16 * j + i] * (int32_t)xq[16 * j + i];
            isum += (int32_t)sc[j] * t;
        }
        s += (cyllm_h2f(cyllm_rd16(w + 208)) * a->d[b]) * (float)isum;
    }
    return s;
}

/* ---- dequantization (float32 in the reference's order of operations) -------------- */

static void dequant_block(int fmt, float *y, const uint8_t *w) {
    int8_t v[QK_K];
    switch (fmt) {
    case CYLLM_QF_Q8_0: {
        float d = cyllm_h2f(cyllm_rd16(w));
        for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)w[2 + i];
        break; }
    case CYLLM_QF_Q4_0: case CYLLM_QF_Q5_0: {
        float d = cyllm_h2f(cyllm_rd16(w));
        int off = fmt == CYLLM_QF_Q4_0 ? 8 : 16;
        if (fmt == CYLLM_QF_Q4_0) nib32(v, w + 2); else nib32_h(v, w + 6, cyllm_rd32(w + 2));
        for (int i = 0; i < 32; i++) y[i] = d * (float)(v[i] - off);
        break; }
    case CYLLM_QF_Q4_1: case CYLLM_QF_Q5_1: {
        float d = cyllm_h2f(cyllm_rd16(w)), m = cyllm_h2f(cyllm_rd16(w + 2));
        if (fmt == CYLLM_QF_Q4_1) nib32(v, w + 4); else nib32_h(v, w + 8, cyllm_rd32(w + 4));
        for (int i = 0; i < 32; i++) y[i] = d * (float)v[i] + m;
        break; }
    case CYLLM_QF_Q4_K: case CYLLM_QF_Q5_K: {
        const int five = fmt == CYLLM_QF_Q5_K;
        uint8_t sc[8], m[8];
        cyllm_k_scales(w + 4, sc, m);
        k45_decode(v, five ? w + 48 : w + 16, five ? w + 16 : 0);
        float d = cyllm_h2f(cyllm_rd16(w)), dmin = cyllm_h2f(cyllm_rd16(w + 2));
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int i = 0; i < 32; i++) y[32 * j + i] = dl * (float)v[32 * j + i] - ml;
        }
        break; }
    case CYLLM_QF_Q6_K: {
        q6k_decode(v, w);
        float d = cyllm_h2f(cyllm_rd16(w + 208));
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int j = 0; j < 16; j++) {
            float dl = d * (float)sc[j];
            for (int i = 0; i < 16; i++) y[16 * j + i] = dl * (float)v[16 * j + i];
        }
        break; }
    }
}

void cyllm_qdequant_row_f32_generic(int fmt, float *out, const uint8_t *row, int64_t n) {
    const int blk = INFO[fmt].block, bb = INFO[fmt].block_bytes;
    for (int64_t b = 0; b < n / blk; b++) dequant_block(fmt, out + b * blk, row + b * bb);
}

void cyllm_qdequant_rows_f16_generic(int fmt, uint16_t *out, const uint8_t *w, int64_t row_bytes,
                                     int64_t n, int64_t r0, int64_t r1) {
    const int blk = INFO[fmt].block, bb = INFO[fmt].block_bytes;
    float y[QK_K];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        uint16_t *o = out + (r - r0) * n;
        for (int64_t b = 0; b < n / blk; b++) {
            dequant_block(fmt, y, row + b * bb);
            for (int i = 0; i < blk; i++) o[b * blk + i] = cyllm_f2h(y[i]);
        }
    }
}

/* ---- q4_k and q5_k with rows interleaved by 16 (quant.h) --------------------------------
 * Both: d, dmin and the 12 scale bytes as planes of 16 rows, then the chunks of 4 bytes of each
 * row (row i at 4i): q4_k's 32 of qs; q5_k's 32 of qs with its 8 of qh placed among them. */

/* where chunk c of qs (the file's bytes 4c..) and chunk l of qh lie in a superblock */
static int k45_r16_qs(int five, int c) { return five ? cyllm_r16_q5_qs(c) : 256 + 64 * c; }

static void k45_r16_repack(int five, uint8_t *dst, const uint8_t *src, int64_t rb, int64_t g0, int64_t g1) {
    const int bb = five ? QB_Q5_K : QB_Q4_K, qs = five ? 48 : 16;      /* qs's offset in the file's block */
    const int64_t nb = rb / bb;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + g * CYLLM_R16 * rb + b * CYLLM_R16 * bb;
            for (int i = 0; i < CYLLM_R16; i++) {
                const uint8_t *s = src + (g * CYLLM_R16 + i) * rb + b * bb;
                memcpy(o + 2 * i, s, 2);                               /* d */
                memcpy(o + 32 + 2 * i, s + 2, 2);                      /* dmin */
                for (int k = 0; k < 12; k++) o[64 + 16 * k + i] = s[4 + k];
                for (int l = 0; five && l < 8; l++) memcpy(o + cyllm_r16_q5_qh(l) + 4 * i, s + 16 + 4 * l, 4);
                for (int c = 0; c < 32; c++) memcpy(o + k45_r16_qs(five, c) + 4 * i, s + qs + 4 * c, 4);
            }
        }
}

static void k45_r16_gather(int five, uint8_t *out, const uint8_t *w, int64_t rb, int64_t r, int64_t b) {
    const int bb = five ? QB_Q5_K : QB_Q4_K, qs = five ? 48 : 16;
    const uint8_t *p = w + (r / CYLLM_R16) * CYLLM_R16 * rb + b * CYLLM_R16 * bb;
    const int i = (int)(r % CYLLM_R16);
    memcpy(out, p + 2 * i, 2);
    memcpy(out + 2, p + 32 + 2 * i, 2);
    for (int k = 0; k < 12; k++) out[4 + k] = p[64 + 16 * k + i];
    for (int l = 0; five && l < 8; l++) memcpy(out + 16 + 4 * l, p + cyllm_r16_q5_qh(l) + 4 * i, 4);
    for (int c = 0; c < 32; c++) memcpy(out + qs + 4 * c, p + k45_r16_qs(five, c) + 4 * i, 4);
}

/* ---- q6_k with rows interleaved by 16 (quant.h) --------------------------------------- */

/* the file's q6_k block: ql[128], qh[64], scales[16], d. Its 48 chunks of 4 bytes (ql's 32,
 * then qh's 16) -> their place among the 48 chunks of 64 bytes of an r16 superblock: ql chunk
 * c is step 8 (c / 16) + c % 8, slot (c / 8) % 2; qh chunk c step c, slot 2 (quant.h) */
static int q6k_r16_chunk(int c) {
    return c < 32 ? 3 * (8 * (c / 16) + c % 8) + (c / 8) % 2 : 3 * (c - 32) + 2;
}

static void q6k_r16_repack(uint8_t *dst, const uint8_t *src, int64_t rb, int64_t g0, int64_t g1) {
    const int64_t nb = rb / QB_Q6_K;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + g * CYLLM_R16 * rb + b * CYLLM_R16_SB6;
            for (int i = 0; i < CYLLM_R16; i++) {
                const uint8_t *s = src + (g * CYLLM_R16 + i) * rb + b * QB_Q6_K;
                for (int c = 0; c < 48; c++) memcpy(o + 64 * q6k_r16_chunk(c) + 4 * i, s + 4 * c, 4);
                memcpy(o + CYLLM_R16_Q6_D + 2 * i, s + 208, 2);
                for (int k = 0; k < 16; k++) o[CYLLM_R16_Q6_SC + 16 * k + i] = s[192 + k];
            }
        }
}

static void q6k_r16_gather(uint8_t *out, const uint8_t *w, int64_t rb, int64_t r, int64_t b) {
    const uint8_t *p = w + (r / CYLLM_R16) * CYLLM_R16 * rb + b * CYLLM_R16_SB6;
    const int i = (int)(r % CYLLM_R16);
    for (int c = 0; c < 48; c++) memcpy(out + 4 * c, p + 64 * q6k_r16_chunk(c) + 4 * i, 4);
    for (int k = 0; k < 16; k++) out[192 + k] = p[CYLLM_R16_Q6_SC + 16 * k + i];
    memcpy(out + 208, p + CYLLM_R16_Q6_D + 2 * i, 2);
}

/* ---- q4_0, q8_0, q4_1, q5_0 and q5_1 with rows interleaved by 16 (quant.h) ---------- */

/* a 32-element block's bytes after a header of f16 fields -- d (q4_1, q5_1: d, m), each
 * stored as a plane of 16 -- come in 4-byte chunks: 4 (q4_0, q4_1), 5 (q5_0, q5_1: qh, then
 * qs) or 8 (q8_0) */
static int b32_fields(int fmt) { return fmt == CYLLM_QF_Q4_1 || fmt == CYLLM_QF_Q5_1 ? 2 : 1; }
static int b32_chunks(int fmt) { return (INFO[fmt].block_bytes - 2 * b32_fields(fmt)) / 4; }

static void b32_r16_repack(int fmt, uint8_t *dst, const uint8_t *src, int64_t rb, int64_t g0, int64_t g1) {
    const int bb = INFO[fmt].block_bytes, nc = b32_chunks(fmt), nf = b32_fields(fmt);
    const int64_t nb = rb / bb;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + g * CYLLM_R16 * rb + b * CYLLM_R16 * bb;
            for (int i = 0; i < CYLLM_R16; i++) {
                const uint8_t *s = src + (g * CYLLM_R16 + i) * rb + b * bb;
                for (int f = 0; f < nf; f++) memcpy(o + 32 * f + 2 * i, s + 2 * f, 2);
                for (int c = 0; c < nc; c++) memcpy(o + 32 * nf + 64 * c + 4 * i, s + 2 * nf + 4 * c, 4);
            }
        }
}

static void b32_r16_gather(int fmt, uint8_t *out, const uint8_t *w, int64_t rb, int64_t r, int64_t b) {
    const int bb = INFO[fmt].block_bytes, nc = b32_chunks(fmt), nf = b32_fields(fmt);
    const uint8_t *p = w + (r / CYLLM_R16) * CYLLM_R16 * rb + b * CYLLM_R16 * bb;
    const int i = (int)(r % CYLLM_R16);
    for (int f = 0; f < nf; f++) memcpy(out + 2 * f, p + 32 * f + 2 * i, 2);
    for (int c = 0; c < nc; c++) memcpy(out + 2 * nf + 4 * c, p + 32 * nf + 64 * c + 4 * i, 4);
}

int cyllm_r16_layout(int fmt) {
    switch (fmt) {
    case CYLLM_QF_Q4_K: return CYLLM_QF_Q4_K_R16;
    case CYLLM_QF_Q4_0: return CYLLM_QF_Q4_0_R16;
    case CYLLM_QF_Q8_0: return CYLLM_QF_Q8_0_R16;
    case CYLLM_QF_Q4_1: return CYLLM_QF_Q4_1_R16;
    case CYLLM_QF_Q6_K: return CYLLM_QF_Q6_K_R16;
    case CYLLM_QF_Q5_K: return CYLLM_QF_Q5_K_R16;
    case CYLLM_QF_Q5_0: return CYLLM_QF_Q5_0_R16;
    case CYLLM_QF_Q5_1: return CYLLM_QF_Q5_1_R16;
    default: return -1;
    }
}

void cyllm_r16_repack(int fmt, uint8_t *dst, const uint8_t *src, int64_t rb, int64_t g0, int64_t g1) {
    if (fmt == CYLLM_QF_Q4_K || fmt == CYLLM_QF_Q5_K) k45_r16_repack(fmt == CYLLM_QF_Q5_K, dst, src, rb, g0, g1);
    else if (fmt == CYLLM_QF_Q6_K) q6k_r16_repack(dst, src, rb, g0, g1);
    else b32_r16_repack(fmt, dst, src, rb, g0, g1);
}

/* ---- the r16 layouts' portable entries (every table's but the AVX512-VNNI one's, which has
 * its own kernels; the backend repacks only for that one) ----------------------------- */

void cyllm_r16_gather(int fmt, uint8_t *out, const uint8_t *w, int64_t rb, int64_t r, int64_t b) {
    if (fmt == CYLLM_QF_Q4_K || fmt == CYLLM_QF_Q5_K) k45_r16_gather(fmt == CYLLM_QF_Q5_K, out, w, rb, r, b);
    else if (fmt == CYLLM_QF_Q6_K) q6k_r16_gather(out, w, rb, r, b);
    else b32_r16_gather(fmt, out, w, rb, r, b);
}

/* a row's dot product: each block gathered back, then the file format's own dot (its bits) */
static float dot_r16(int fmt, const uint8_t *w, int64_t rb, int64_t r, const cyllm_qact_view *a, int64_t nb) {
    uint8_t blk[QB_Q6_K];                   /* the largest block of the six formats */
    const int blen = INFO[fmt].block;
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        cyllm_r16_gather(fmt, blk, w, rb, r, b);
        cyllm_qact_view ab = *a;
        ab.q += b * blen;
        ab.d += b;
        if (blen == QK_K) ab.bsum += 16 * b;
        else ab.sum += b;
        s += fmt == CYLLM_QF_Q4_K ? dot_q4_k(blk, &ab, 1) : fmt == CYLLM_QF_Q6_K ? dot_q6_k(blk, &ab, 1)
           : fmt == CYLLM_QF_Q5_K ? dot_q5_k(blk, &ab, 1)
           : fmt == CYLLM_QF_Q8_0 ? dot_q8_0(blk, &ab, 1)
           : fmt == CYLLM_QF_Q4_1 ? dot_q4_1(blk, &ab, 1) : fmt == CYLLM_QF_Q5_0 ? dot_q5_0(blk, &ab, 1)
           : fmt == CYLLM_QF_Q5_1 ? dot_q5_1(blk, &ab, 1) : dot_q4_0(blk, &ab, 1);
    }
    return s;
}

/* the five entries of the r16 layout of file format FMT (F: q4k, q40, q80, q41, q6k, q5k, q50, q51) */
#define R16_FUNCS(F, FMT)                                                                       \
void cyllm_##F##_r16_deq16(uint16_t *out, const uint8_t *w, int64_t rb, int64_t n, int64_t r0, int64_t r1) { \
    const int blen = INFO[FMT].block;                                                         \
    uint8_t blk[QB_Q6_K];                                                                     \
    float y[QK_K];                                                                            \
    for (int64_t r = r0; r < r1; r++)                                                         \
        for (int64_t b = 0; b < n / blen; b++) {                                              \
            cyllm_r16_gather(FMT, blk, w, rb, r, b);                                                \
            dequant_block(FMT, y, blk);                                                       \
            for (int i = 0; i < blen; i++) out[(r - r0) * n + b * blen + i] = cyllm_f2h(y[i]); \
        }                                                                                     \
}                                                                                             \
void cyllm_##F##_r16_deq32(float *out, const uint8_t *w, int64_t rb, int64_t r, int64_t n) { \
    const int blen = INFO[FMT].block;                                                         \
    uint8_t blk[QB_Q6_K];                                                                     \
    for (int64_t b = 0; b < n / blen; b++) {                                                  \
        cyllm_r16_gather(FMT, blk, w, rb, r, b);                                                    \
        dequant_block(FMT, out + b * blen, blk);                                              \
    }                                                                                         \
}                                                                                             \
void cyllm_##F##_r16_matvec_generic(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                                    int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) { \
    (void)nx; (void)nxb;                                                                      \
    cyllm_qact_view a = cyllm_qact_split(xq, n, INFO[FMT].act);                               \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        float s = dot_r16(FMT, w, rb, r, &a, n / INFO[FMT].block);                            \
        out[r] = add ? out[r] + s : s;                                                        \
    }                                                                                         \
}                                                                                             \
void cyllm_##F##_r16_gate_up_generic(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb, \
                                     const void *xq, int64_t n, int64_t r0, int64_t r1, int act, \
                                     const void *nx, int64_t nxb) {                           \
    (void)nx; (void)nxb;                                                                      \
    cyllm_qact_view a = cyllm_qact_split(xq, n, INFO[FMT].act);                               \
    for (int64_t r = r0; r < r1; r++)                                                         \
        out[r] = cyllm_qact_apply(act, dot_r16(FMT, wg, rb, r, &a, n / INFO[FMT].block))      \
                 * dot_r16(FMT, wu, rb, r, &a, n / INFO[FMT].block);                          \
}                                                                                             \
void cyllm_##F##_r16_gemm_generic(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                                  int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) { \
    for (int64_t t = 0; t < T; t++) {                                                         \
        cyllm_qact_view a = cyllm_qact_split((const char *)xq + t * xs, n, INFO[FMT].act);    \
        float *o = out + t * ldo;                                                             \
        for (int64_t r = r0; r < r1; r++) {                                                   \
            float s = dot_r16(FMT, w, rb, r, &a, n / INFO[FMT].block);                        \
            o[r] = add ? o[r] + s : s;                                                        \
        }                                                                                     \
    }                                                                                         \
}

R16_FUNCS(q4k, CYLLM_QF_Q4_K)
R16_FUNCS(q40, CYLLM_QF_Q4_0)
R16_FUNCS(q80, CYLLM_QF_Q8_0)
R16_FUNCS(q41, CYLLM_QF_Q4_1)
R16_FUNCS(q6k, CYLLM_QF_Q6_K)
R16_FUNCS(q5k, CYLLM_QF_Q5_K)
R16_FUNCS(q50, CYLLM_QF_Q5_0)
R16_FUNCS(q51, CYLLM_QF_Q5_1)

/* ---- the table: five functions per format from its dot ----------------------------- */

#define QFUNCS(F, FMT, ACT, BLK)                                                            \
static void matvec_##F(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n,  \
                       int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {       \
    (void)nx; (void)nxb;                                                                      \
    cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                         \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        float s = dot_##F(w + r * rb, &a, n / BLK);                                           \
        out[r] = add ? out[r] + s : s;                                                        \
    }                                                                                         \
}                                                                                             \
static void gate_up_##F(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,        \
                        const void *xq, int64_t n, int64_t r0, int64_t r1, int act,          \
                        const void *nx, int64_t nxb) {                                        \
    (void)nx; (void)nxb;                                                                      \
    cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                         \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        float g = dot_##F(wg + r * rb, &a, n / BLK);                                          \
        float u = dot_##F(wu + r * rb, &a, n / BLK);                                          \
        out[r] = cyllm_qact_apply(act, g) * u;                                                \
    }                                                                                         \
}                                                                                             \
static void gemm_##F(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,  \
                     int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {    \
    for (int64_t t = 0; t < T; t++) {                                                         \
        cyllm_qact_view a = cyllm_qact_split((const char *)xq + t * xs, n, ACT);              \
        float *o = out + t * ldo;                                                             \
        for (int64_t r = r0; r < r1; r++) {                                                   \
            float s = dot_##F(w + r * rb, &a, n / BLK);                                       \
            o[r] = add ? o[r] + s : s;                                                        \
        }                                                                                     \
    }                                                                                         \
}                                                                                             \
static void deq16_##F(uint16_t *out, const uint8_t *w, int64_t rb, int64_t n, int64_t r0,    \
                      int64_t r1) {                                                           \
    cyllm_qdequant_rows_f16_generic(FMT, out, w, rb, n, r0, r1);                              \
}                                                                                             \
static void deq32_##F(float *out, const uint8_t *w, int64_t rb, int64_t r, int64_t n) {     \
    cyllm_qdequant_row_f32_generic(FMT, out, w + r * rb, n);                                  \
}

QFUNCS(q8_0, CYLLM_QF_Q8_0, CYLLM_QA_Q8_0, 32)
QFUNCS(q4_0, CYLLM_QF_Q4_0, CYLLM_QA_Q8_0, 32)
QFUNCS(q4_1, CYLLM_QF_Q4_1, CYLLM_QA_Q8_0, 32)
QFUNCS(q5_0, CYLLM_QF_Q5_0, CYLLM_QA_Q8_0, 32)
QFUNCS(q5_1, CYLLM_QF_Q5_1, CYLLM_QA_Q8_0, 32)
QFUNCS(q4_k, CYLLM_QF_Q4_K, CYLLM_QA_Q8_K, QK_K)
QFUNCS(q5_k, CYLLM_QF_Q5_K, CYLLM_QA_Q8_K, QK_K)
QFUNCS(q6_k, CYLLM_QF_Q6_K, CYLLM_QA_Q8_K, QK_K)

#define QENTRY(F) {matvec_##F, gate_up_##F, gemm_##F, deq16_##F, deq32_##F}

const cyllm_qkernels cyllm_qkernels_generic = {
    "generic",
    quantize_act_generic,
    {QENTRY(q8_0), QENTRY(q4_0), QENTRY(q4_1), QENTRY(q5_0), QENTRY(q5_1),
     QENTRY(q4_k), QENTRY(q5_k), QENTRY(q6_k),
     R16_ENTRY_GENERIC(q4k), R16_ENTRY_GENERIC(q40), R16_ENTRY_GENERIC(q80), R16_ENTRY_GENERIC(q41),
     R16_ENTRY_GENERIC(q6k), R16_ENTRY_GENERIC(q5k), R16_ENTRY_GENERIC(q50), R16_ENTRY_GENERIC(q51)},
};
