/* Generic (portable) kernels: plain C, no intrinsics, compiles on any target.
 *
 * The fallback for CPUs without AVX2/F16C and for non-x86 machines, and the
 * variant CYLLM_KERNELS=generic forces. Written so GCC/Clang can SLP-vectorize
 * the 8-lane accumulator loops at the baseline ISA; summation order is fixed per
 * row/head, so results do not depend on the thread count.
 */
#include <math.h>
#include "kernels.h"
#include "fp16.h"

#define LANES 8

float cyllm_silu(float x) { return x / (1.0f + expf(-x)); }

/* dot of one f16 row with x: 8 partial sums, then a fixed-order reduction */
static inline float dot_row(const uint16_t *w, const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += cyllm_h2f(w[j + l]) * x[j + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < n; j++)
        s += cyllm_h2f(w[j]) * x[j];
    return s;
}

static void matvec_rows_generic(float *out, const uint16_t *w, const float *x,
                                int64_t n, int64_t r0, int64_t r1, int add) {
    for (int64_t r = r0; r < r1; r++) {
        float s = dot_row(w + r * n, x, n);
        out[r] = add ? out[r] + s : s;
    }
}

static void gate_up_rows_generic(float *out, const uint16_t *wg, const uint16_t *wu,
                                 const float *x, int64_t n, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        float g = dot_row(wg + r * n, x, n);
        float u = dot_row(wu + r * n, x, n);
        out[r] = cyllm_silu(g) * u;
    }
}

static void attention_head_generic(float *out, const float *q, const uint16_t *k,
                                   const uint16_t *v, int64_t t_len, int64_t hd, float scale) {
    /* online softmax: running max m, running denominator l, out holds the
     * unnormalised weighted sum of V, rescaled whenever the max grows */
    float m = -INFINITY, l = 0.0f;
    for (int64_t d = 0; d < hd; d++) out[d] = 0.0f;
    for (int64_t t = 0; t < t_len; t++) {
        float s = dot_row(k + t * hd, q, hd) * scale;
        if (s > m) {
            float c = expf(m - s);                  /* 0 on the first step (m = -inf) */
            l *= c;
            for (int64_t d = 0; d < hd; d++) out[d] *= c;
            m = s;
        }
        float p = expf(s - m);
        l += p;
        const uint16_t *vt = v + t * hd;
        for (int64_t d = 0; d < hd; d++) out[d] += p * cyllm_h2f(vt[d]);
    }
    float inv = 1.0f / l;
    for (int64_t d = 0; d < hd; d++) out[d] *= inv;
}

static void attention_group_generic(float *out, const float *q, const uint16_t *k,
                                    const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                                    int64_t n_q) {
    for (int64_t h = 0; h < n_q; h++)
        attention_head_generic(out + h * hd, q + h * hd, k, v, t_len, hd, scale);
}

static void f16_to_f32_generic(float *out, const uint16_t *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = cyllm_h2f(in[i]);
}

static void f32_to_f16_generic(uint16_t *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = cyllm_f2h(in[i]);
}

static double sum_f32_generic(const float *p, int64_t n) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += p[j + l];
    double s = 0.0;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; j < n; j++) s += p[j];
    return s;
}

const cyllm_kernels cyllm_generic_kernels = {
    "generic",
    matvec_rows_generic,
    gate_up_rows_generic,
    attention_group_generic,
    f16_to_f32_generic,
    f32_to_f16_generic,
    sum_f32_generic,
};
