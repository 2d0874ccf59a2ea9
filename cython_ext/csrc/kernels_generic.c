/* Generic (portable) kernels: plain C, no intrinsics, compiles on any target.
 *
 * The fallback for CPUs without AVX2/F16C and for non-x86 machines, and the
 * variant CYLLM_KERNELS=generic forces. Written so GCC/Clang can SLP-vectorize
 * the 8-lane accumulator loops at the baseline ISA; summation order is fixed per
 * row/head, so results do not depend on the thread count.
 *
 * Reference: backends/numpy_ref.py (float32). Tests: tests/test_backend_ops.py (every op,
 * every variant, against the reference), tests/test_ops.py, tests/test_cpu_fused.py (decode
 * program bitwise equal to op by op). Benchmarks: bench/bench_matvec.py (matvec),
 * bench/bench_gemm.py (prefill GEMM), bench/bench_attention.py, bench/bench_norm_rope.py.
 */
#include <math.h>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#include "kernels.h"
#include "fp16.h"

#define LANES 8


/* 8 KiB as the quantized matvecs (quant_generic.c); whether it pays depends on the CPU
 * (Zen 5: +40-70% on single F16 matrices, Zen 4: -10-25% on F16 decode), so the decode
 * steps measure it (backends/step_tuner.py) */
int64_t cyllm_pf_bytes = 8192;
/* wide rows (kernels_avx2.c): x of at least this many bytes (half of L1d: cyllm_pf_init)
 * has its matrix prefetched into L2 this far ahead, whatever cyllm_pf_bytes says */
int64_t cyllm_pf_wide_x = 16384;
int64_t cyllm_pf_wide_bytes = 8192;

void cyllm_pf_init(void) {
#ifdef _SC_LEVEL1_DCACHE_SIZE
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);   /* 0 or -1 where unknown (some VMs) */
    if (l1 >= 8192 && l1 <= (1L << 20)) cyllm_pf_wide_x = l1 / 2;
#endif
}

float cyllm_silu(float x) { return x / (1.0f + expf(-x)); }

float cyllm_act(float x, int act) {
    if (act == CYLLM_ACT_GELU_TANH) {
        /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
        const float k = 0.7978845608028654f;
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    return cyllm_silu(x);
}

void cyllm_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    /* 8 independent partial sums (vectorizable, no 4-cycle add chain per element),
     * combined in a fixed order */
    double acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += (double)x[i + l] * (double)x[i + l];
    double ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) ss += (double)x[i] * (double)x[i];
    /* mean in double, then one f32 scale, applied as (x * scale) * w like the reference */
    float scale = (float)(1.0 / sqrt((double)((float)(ss / (double)n) + eps)));
    for (i = 0; i < n; i++) out[i] = (x[i] * scale) * w[i];
}

void cyllm_rope_rows(float *v, int64_t heads, int64_t hd, int64_t half, const float *c, const float *s) {
    /* rotate-half: element i pairs with i + half inside each head; dims past 2*half stay */
    for (int64_t h = 0; h < heads; h++) {
        float *row = v + h * hd;
        for (int64_t i = 0; i < half; i++) {
            float x1 = row[i], x2 = row[i + half];
            row[i] = x1 * c[i] - x2 * s[i];
            row[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

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
                                int64_t n, int64_t r0, int64_t r1, int add,
                                const void *nx, int64_t nx_bytes) {
    (void)nx; (void)nx_bytes;
    for (int64_t r = r0; r < r1; r++) {
        float s = dot_row(w + r * n, x, n);
        out[r] = add ? out[r] + s : s;
    }
}

static void gate_up_rows_generic(float *out, const uint16_t *wg, const uint16_t *wu,
                                 const float *x, int64_t n, int64_t r0, int64_t r1, int act,
                                 const void *nx, int64_t nx_bytes) {
    (void)nx; (void)nx_bytes;
    for (int64_t r = r0; r < r1; r++) {
        float g = dot_row(wg + r * n, x, n);
        float u = dot_row(wu + r * n, x, n);
        out[r] = cyllm_act(g, act) * u;
    }
}

static void rows2_generic(float *out, int64_t ldo, const uint16_t *w, const uint16_t *wu,
                          const float *x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, int mode) {
    for (int i = 0; i < 2; i++) {
        if (mode >= 2) gate_up_rows_generic(out + i * ldo, w, wu, x + i * ldx, n, r0, r1, mode - 2, NULL, 0);
        else matvec_rows_generic(out + i * ldo, w, x + i * ldx, n, r0, r1, mode, NULL, 0);
    }
}

static void attention_head_generic(float *out, const float *q, const uint16_t *k,
                                   const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                                   float softcap, float *ml) {
    /* online softmax: running max m, running denominator l, out holds the
     * unnormalised weighted sum of V, rescaled whenever the max grows */
    float m = -INFINITY, l = 0.0f;
    for (int64_t d = 0; d < hd; d++) out[d] = 0.0f;
    for (int64_t t = 0; t < t_len; t++) {
        float s = dot_row(k + t * hd, q, hd) * scale;
        if (softcap > 0.0f) s = cyllm_softcap(s, softcap);
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
    if (ml) { ml[0] = m; ml[1] = l; return; }   /* a partial result: left unnormalised */
    float inv = 1.0f / l;
    for (int64_t d = 0; d < hd; d++) out[d] *= inv;
}

static void attention_group_generic(float *out, const float *q, const uint16_t *k,
                                    const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                                    float softcap, int64_t n_q, float *ml) {
    for (int64_t h = 0; h < n_q; h++)
        attention_head_generic(out + h * hd, q + h * hd, k, v, t_len, hd, scale, softcap,
                               ml ? ml + 2 * h : NULL);
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

/* Batched GEMM, portable: each weight row is widened once per block of GT tokens
 * (in chunks of GK columns) and dotted with those tokens' x; 8-lane partial sums. */
#define GT 8
#define GK 512
static void gemm_rows_generic(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                              int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                              int mode) {
    float wb[GK], ub[GK];
    for (int64_t t0 = 0; t0 < T; t0 += GT) {
        int64_t tb = T - t0 < GT ? T - t0 : GT;
        for (int64_t r = r0; r < r1; r++) {
            float sg[GT] = {0}, su[GT] = {0};
            for (int64_t k0 = 0; k0 < n; k0 += GK) {
                int64_t kc = n - k0 < GK ? n - k0 : GK;
                for (int64_t j = 0; j < kc; j++) wb[j] = cyllm_h2f(w[r * n + k0 + j]);
                if (mode >= 2)
                    for (int64_t j = 0; j < kc; j++) ub[j] = cyllm_h2f(wu[r * n + k0 + j]);
                for (int64_t t = 0; t < tb; t++) {
                    const float *xt = x + (t0 + t) * ldx + k0;
                    float acc[LANES] = {0}, acu[LANES] = {0};
                    int64_t j = 0;
                    for (; j + LANES <= kc; j += LANES)
                        for (int l = 0; l < LANES; l++) acc[l] += wb[j + l] * xt[j + l];
                    if (mode >= 2)
                        for (int64_t jj = 0; jj + LANES <= kc; jj += LANES)
                            for (int l = 0; l < LANES; l++) acu[l] += ub[jj + l] * xt[jj + l];
                    float a = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                    float b = ((acu[0] + acu[4]) + (acu[1] + acu[5])) + ((acu[2] + acu[6]) + (acu[3] + acu[7]));
                    for (int64_t jj = j; jj < kc; jj++) {
                        a += wb[jj] * xt[jj];
                        if (mode >= 2) b += ub[jj] * xt[jj];
                    }
                    sg[t] += a;
                    su[t] += b;
                }
            }
            for (int64_t t = 0; t < tb; t++) {
                float *o = out + (t0 + t) * d + r;
                if (mode == 0) *o = sg[t];
                else if (mode == 1) *o += sg[t];
                else *o = cyllm_act(sg[t], mode - 2) * su[t];
            }
        }
    }
}

const cyllm_kernels cyllm_generic_kernels = {
    "generic",
    matvec_rows_generic,
    gate_up_rows_generic,
    attention_group_generic,
    f16_to_f32_generic,
    f32_to_f16_generic,
    sum_f32_generic,
    gemm_rows_generic,
    8,
    NULL,
    NULL,
    0,
    rows2_generic,
};
