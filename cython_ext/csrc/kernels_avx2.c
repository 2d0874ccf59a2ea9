/* AVX2 + FMA + F16C kernels. Compiled alone with -mavx2 -mfma -mf16c (setup.py),
 * and only ever called after dispatch.c has seen those features on the CPU.
 *
 * matvec: row by row (one linear stream through the weights, which the hardware
 *   prefetcher follows best), 4 x 8-lane FMA accumulators over 32 columns per step,
 *   F16C widens 8 halfs per vcvtph2ps, and a software prefetch cyllm_pf_bytes ahead
 *   that continues into the next op's weights near the end of the rows (on or off per
 *   decode step: backends/step_tuner.py).
 *   Measured +23% over the former 4-rows-at-once kernel on SmolLM2's matrices and
 *   ~95% of the plain-load read probe (bench/results/cpu_speed.md).
 *   Wide rows: where x (4n bytes) takes half of L1d or more, the weight stream evicts it
 *   from L1 on every row and the matvec falls to half the read bandwidth (Zen 4, 1 thread,
 *   2048 rows: 25 GB/s at n = 2048, 15 at 5632, 11 at 8192). Such matrices always prefetch
 *   their weights cyllm_pf_wide_bytes ahead into L2 only (prefetcht1), so the demand loads
 *   hit L2 and x stays in L1: 24 GB/s at n = 5632, 26 at 8192 (bench_matvec.py
 *   --wide-prefetch both; bench/results/cpu_quant_epyc_zen4.md, twelfth session).
 * attention: 8 cached positions per step; 8 scores come out of one hadd tree,
 *   one vector exp per 8 positions, V accumulated into `out` in one pass.
 *
 * Reference: backends/numpy_ref.py (float32). Tests: tests/test_backend_ops.py (every op,
 * every variant, against the reference), tests/test_ops.py, tests/test_cpu_fused.py (decode
 * program bitwise equal to op by op). Benchmarks: bench/bench_matvec.py (matvec),
 * bench/bench_gemm.py (prefill GEMM), bench/bench_attention.py, bench/bench_norm_rope.py.
 */
#include <immintrin.h>
#include <math.h>
#include "kernels.h"
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif

static inline __m256 load8h(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot1(const uint16_t *w, const float *x, int64_t n) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        a = _mm256_fmadd_ps(load8h(w + j), _mm256_loadu_ps(x + j), a);
        b = _mm256_fmadd_ps(load8h(w + j + 8), _mm256_loadu_ps(x + j + 8), b);
    }
    if (j + 8 <= n) {
        a = _mm256_fmadd_ps(load8h(w + j), _mm256_loadu_ps(x + j), a);
        j += 8;
    }
    float s = hsum8(_mm256_add_ps(a, b));
    for (; j < n; j++) s += h2f(w[j]) * x[j];
    return s;
}

/* one line of the linear weight stream ahead: into L1 and L2, or (l2) L2 only */
static inline __attribute__((always_inline)) void pf_line(const char *p, const int l2) {
    if (l2) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

/* one row, 4 accumulators over 32 columns per step; prefetch one line per 32 columns
 * at `pf` (the linear stream `dist` bytes ahead), into L1 and L2 or (l2) L2 only */
static inline __attribute__((always_inline)) float dot1_lin(const uint16_t *w, const float *x, int64_t n,
                                                            const char *pf, const int l2) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        if (pf) pf_line(pf + j * 2, l2);
        a = _mm256_fmadd_ps(load8h(w + j), _mm256_loadu_ps(x + j), a);
        b = _mm256_fmadd_ps(load8h(w + j + 8), _mm256_loadu_ps(x + j + 8), b);
        c = _mm256_fmadd_ps(load8h(w + j + 16), _mm256_loadu_ps(x + j + 16), c);
        d = _mm256_fmadd_ps(load8h(w + j + 24), _mm256_loadu_ps(x + j + 24), d);
    }
    for (; j + 8 <= n; j += 8) a = _mm256_fmadd_ps(load8h(w + j), _mm256_loadu_ps(x + j), a);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    for (; j < n; j++) s += h2f(w[j]) * x[j];
    return s;
}

/* prefetch address `dist` bytes past `p` in the stream [.., end) that continues in
 * (nx, nx_bytes); NULL when beyond both */
static inline const char *pf_at(const char *p, int64_t dist, const char *end, const void *nx,
                                int64_t nx_bytes, int64_t len) {
    if (dist == 0) return NULL;
    const char *q = p + dist;
    if (q + len <= end) return q;
    int64_t off = q - end;
    return (nx && off >= 0 && off + len <= nx_bytes) ? (const char *)nx + off : NULL;
}

/* a row of n columns is wide when x (4n bytes) takes half of L1d or more (header) */
static inline int wide_row(int64_t n) { return 4 * n >= cyllm_pf_wide_x; }

static inline __attribute__((always_inline)) void matvec_rows_pf(
        float *out, const uint16_t *w, const float *x, int64_t n, int64_t r0, int64_t r1, int add,
        const void *nx, int64_t nx_bytes, const int64_t dist, const int l2) {
    const char *end = (const char *)(w + r1 * n);
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * n;
        float s = dot1_lin(wr, x, n, pf_at((const char *)wr, dist, end, nx, nx_bytes, n * 2), l2);
        out[r] = add ? out[r] + s : s;
    }
}

static void matvec_rows_avx2(float *out, const uint16_t *w, const float *x, int64_t n,
                             int64_t r0, int64_t r1, int add, const void *nx, int64_t nx_bytes) {
    if (wide_row(n)) matvec_rows_pf(out, w, x, n, r0, r1, add, nx, nx_bytes, cyllm_pf_wide_bytes, 1);
    else matvec_rows_pf(out, w, x, n, r0, r1, add, nx, nx_bytes, cyllm_pf_bytes, 0);
}

static inline __attribute__((always_inline)) void gate_up_rows_pf(
        float *out, const uint16_t *wg, const uint16_t *wu, const float *x, int64_t n, int64_t r0,
        int64_t r1, int act, const void *nx, int64_t nx_bytes, const int64_t dist, const int l2) {
    const char *eg = (const char *)(wg + r1 * n), *eu = (const char *)(wu + r1 * n);
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *g = wg + r * n, *u = wu + r * n;
        float a = dot1_lin(g, x, n, pf_at((const char *)g, dist, eg, nx, nx_bytes, n * 2), l2);
        float b = dot1_lin(u, x, n, pf_at((const char *)u, dist, eu, NULL, 0, n * 2), l2);
        out[r] = cyllm_act(a, act) * b;
    }
}

static void gate_up_rows_avx2(float *out, const uint16_t *wg, const uint16_t *wu, const float *x,
                             int64_t n, int64_t r0, int64_t r1, int act, const void *nx, int64_t nx_bytes) {
    if (wide_row(n)) gate_up_rows_pf(out, wg, wu, x, n, r0, r1, act, nx, nx_bytes, cyllm_pf_wide_bytes, 1);
    else gate_up_rows_pf(out, wg, wu, x, n, r0, r1, act, nx, nx_bytes, cyllm_pf_bytes, 0);
}

/* dot1_lin for two tokens at once, the row's weights widened once: each sum is dot1_lin's,
 * the same FMAs in the same order (no bit differs; tests/test_ops.py) */
static inline __attribute__((always_inline)) void dot2_lin(const uint16_t *w, const float *x0,
                                                           const float *x1, int64_t n, const char *pf,
                                                           const int l2, float *s0, float *s1) {
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), c0 = _mm256_setzero_ps(), d0 = _mm256_setzero_ps();
    __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        if (pf) pf_line(pf + j * 2, l2);
        const __m256 w0 = load8h(w + j), w1 = load8h(w + j + 8), w2 = load8h(w + j + 16), w3 = load8h(w + j + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + j), a0);
        b0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + j + 8), b0);
        c0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + j + 16), c0);
        d0 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + j + 24), d0);
        a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + j), a1);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + j + 8), b1);
        c1 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + j + 16), c1);
        d1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + j + 24), d1);
    }
    for (; j + 8 <= n; j += 8) {
        const __m256 w0 = load8h(w + j);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + j), a0);
        a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + j), a1);
    }
    float t0 = hsum8(_mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0)));
    float t1 = hsum8(_mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1)));
    for (; j < n; j++) {
        t0 += h2f(w[j]) * x0[j];
        t1 += h2f(w[j]) * x1[j];
    }
    *s0 = t0;
    *s1 = t1;
}

static inline __attribute__((always_inline)) void rows2_pf(
        float *out, int64_t ldo, const uint16_t *w, const uint16_t *wu, const float *x, int64_t ldx,
        int64_t n, int64_t r0, int64_t r1, int mode, const int64_t dist, const int l2) {
    const char *end = (const char *)(w + r1 * n), *eu = wu ? (const char *)(wu + r1 * n) : NULL;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * n;
        float s0, s1;
        dot2_lin(wr, x, x + ldx, n, pf_at((const char *)wr, dist, end, NULL, 0, n * 2), l2, &s0, &s1);
        if (mode >= 2) {
            const uint16_t *ur = wu + r * n;
            float u0, u1;
            dot2_lin(ur, x, x + ldx, n, pf_at((const char *)ur, dist, eu, NULL, 0, n * 2), l2, &u0, &u1);
            out[r] = cyllm_act(s0, mode - 2) * u0;
            out[ldo + r] = cyllm_act(s1, mode - 2) * u1;
        } else {
            out[r] = mode ? out[r] + s0 : s0;
            out[ldo + r] = mode ? out[ldo + r] + s1 : s1;
        }
    }
}

static void rows2_avx2(float *out, int64_t ldo, const uint16_t *w, const uint16_t *wu, const float *x,
                       int64_t ldx, int64_t n, int64_t r0, int64_t r1, int mode) {
    if (wide_row(n)) rows2_pf(out, ldo, w, wu, x, ldx, n, r0, r1, mode, cyllm_pf_wide_bytes, 1);
    else rows2_pf(out, ldo, w, wu, x, ldx, n, r0, r1, mode, cyllm_pf_bytes, 0);
}

/* e^x (softmax weights, SiLU), Cephes-style: 2^round(x log2 e) * poly; ~1-2 ulp.
 * Inputs below -87.3 give ~1e-38 instead of 0, which no softmax sum notices; inputs
 * are capped at 88.3 (below float overflow). */
static inline __m256 exp8(__m256 x) {
    /* the constant first: MAXPS/MINPS return their second operand when one is NaN, so a NaN
     * input stays NaN (bad weights then reach the logits' finiteness check, not text) */
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* cyllm_softcap of 8 scores, as cap * (1 - 2 / (e^(2s/cap) + 1)): exp8's clamp keeps the
 * result within +-cap however large |s| is */
static inline __m256 softcap8(__m256 s, float cap) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = exp8(_mm256_mul_ps(s, _mm256_set1_ps(2.0f / cap)));
    __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(t, _mm256_set1_ps(cap));
}

static void attention_head_avx2(float *out, const float *q, const uint16_t *k,
                                const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                                float softcap, float *ml) {
    float m = -INFINITY, l = 0.0f;
    const int64_t hd8 = hd & ~(int64_t)7;
    for (int64_t d = 0; d < hd; d++) out[d] = 0.0f;
    int64_t t = 0;
    for (; t + 8 <= t_len; t += 8) {
        const uint16_t *kt = k + t * hd, *vt = v + t * hd;
        /* scores of positions t..t+7: 8 partial-sum vectors, reduced by an hadd tree */
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
        __m256 c4 = _mm256_setzero_ps(), c5 = _mm256_setzero_ps(), c6 = _mm256_setzero_ps(), c7 = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd8; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            c0 = _mm256_fmadd_ps(load8h(kt + d), qd, c0);
            c1 = _mm256_fmadd_ps(load8h(kt + hd + d), qd, c1);
            c2 = _mm256_fmadd_ps(load8h(kt + 2 * hd + d), qd, c2);
            c3 = _mm256_fmadd_ps(load8h(kt + 3 * hd + d), qd, c3);
            c4 = _mm256_fmadd_ps(load8h(kt + 4 * hd + d), qd, c4);
            c5 = _mm256_fmadd_ps(load8h(kt + 5 * hd + d), qd, c5);
            c6 = _mm256_fmadd_ps(load8h(kt + 6 * hd + d), qd, c6);
            c7 = _mm256_fmadd_ps(load8h(kt + 7 * hd + d), qd, c7);
        }
        __m256 h01 = _mm256_hadd_ps(c0, c1), h23 = _mm256_hadd_ps(c2, c3);
        __m256 h45 = _mm256_hadd_ps(c4, c5), h67 = _mm256_hadd_ps(c6, c7);
        __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                 _mm256_permute2f128_ps(h0123, h4567, 0x31));
        if (hd8 < hd) {                       /* head_dim not a multiple of 8 */
            float tail[8];
            for (int i = 0; i < 8; i++) {
                float acc = 0.0f;
                for (int64_t d = hd8; d < hd; d++) acc += h2f(kt[i * hd + d]) * q[d];
                tail[i] = acc;
            }
            s = _mm256_add_ps(s, _mm256_loadu_ps(tail));
        }
        s = _mm256_mul_ps(s, _mm256_set1_ps(scale));
        if (softcap > 0.0f) s = softcap8(s, softcap);
        /* block max -> rescale the running sums once per 8 positions */
        __m128 mx = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
        float bm = _mm_cvtss_f32(mx);
        float c = 1.0f;
        if (bm > m) { c = expf(m - bm); m = bm; l *= c; }
        __m256 p = exp8(_mm256_sub_ps(s, _mm256_set1_ps(m)));
        l += hsum8(p);
        float pa[8];
        _mm256_storeu_ps(pa, p);
        __m256 p0 = _mm256_set1_ps(pa[0]), p1 = _mm256_set1_ps(pa[1]), p2 = _mm256_set1_ps(pa[2]), p3 = _mm256_set1_ps(pa[3]);
        __m256 p4 = _mm256_set1_ps(pa[4]), p5 = _mm256_set1_ps(pa[5]), p6 = _mm256_set1_ps(pa[6]), p7 = _mm256_set1_ps(pa[7]);
        __m256 cv = _mm256_set1_ps(c);
        for (int64_t d = 0; d < hd8; d += 8) {
            __m256 o = _mm256_mul_ps(_mm256_loadu_ps(out + d), cv);
            o = _mm256_fmadd_ps(p0, load8h(vt + d), o);
            o = _mm256_fmadd_ps(p1, load8h(vt + hd + d), o);
            o = _mm256_fmadd_ps(p2, load8h(vt + 2 * hd + d), o);
            o = _mm256_fmadd_ps(p3, load8h(vt + 3 * hd + d), o);
            o = _mm256_fmadd_ps(p4, load8h(vt + 4 * hd + d), o);
            o = _mm256_fmadd_ps(p5, load8h(vt + 5 * hd + d), o);
            o = _mm256_fmadd_ps(p6, load8h(vt + 6 * hd + d), o);
            o = _mm256_fmadd_ps(p7, load8h(vt + 7 * hd + d), o);
            _mm256_storeu_ps(out + d, o);
        }
        for (int64_t d = hd8; d < hd; d++) {
            float o = out[d] * c;
            for (int i = 0; i < 8; i++) o += pa[i] * h2f(vt[i * hd + d]);
            out[d] = o;
        }
    }
    for (; t < t_len; t++) {                  /* the last t_len % 8 positions, one by one */
        const uint16_t *kt = k + t * hd, *vt = v + t * hd;
        float s = dot1(kt, q, hd) * scale;
        if (softcap > 0.0f) s = cyllm_softcap(s, softcap);
        float c = 1.0f;
        if (s > m) { c = expf(m - s); m = s; l *= c; }
        float p = expf(s - m);
        l += p;
        __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
        int64_t d = 0;
        for (; d < hd8; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8h(vt + d),
                                                      _mm256_mul_ps(_mm256_loadu_ps(out + d), cv)));
        for (; d < hd; d++) out[d] = out[d] * c + p * h2f(vt[d]);
    }
    if (ml) { ml[0] = m; ml[1] = l; return; }   /* a partial result: left unnormalised */
    __m256 inv = _mm256_set1_ps(1.0f / l);
    int64_t d = 0;
    for (; d < hd8; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), inv));
    for (; d < hd; d++) out[d] *= 1.0f / l;
}

/* GQA: the n_q query heads that share one kv head read K and V together, in tiles
 * of 32 positions widened to f32 once (on the stack, 2 x 32 KiB at head_dim 256).
 * Per head and tile: 32 scores from four hadd trees, one max / rescale, a vector
 * exp, then V accumulated with `out` loaded and stored once per tile -- the
 * per-tile serial softmax work is what bounds attention over an L2/L3-resident
 * cache. A head's arithmetic does not depend on n_q, so any split of a group over
 * threads gives bitwise the same result. */
#define GQA_MAX_HD 256
#define GQA_MAX_Q 16
#define TILE 32

static inline __m256 scores8(const float *kb, const float *qh, int64_t hd) {
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    __m256 c4 = _mm256_setzero_ps(), c5 = _mm256_setzero_ps(), c6 = _mm256_setzero_ps(), c7 = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
        __m256 qd = _mm256_loadu_ps(qh + d);
        c0 = _mm256_fmadd_ps(_mm256_load_ps(kb + d), qd, c0);
        c1 = _mm256_fmadd_ps(_mm256_load_ps(kb + hd + d), qd, c1);
        c2 = _mm256_fmadd_ps(_mm256_load_ps(kb + 2 * hd + d), qd, c2);
        c3 = _mm256_fmadd_ps(_mm256_load_ps(kb + 3 * hd + d), qd, c3);
        c4 = _mm256_fmadd_ps(_mm256_load_ps(kb + 4 * hd + d), qd, c4);
        c5 = _mm256_fmadd_ps(_mm256_load_ps(kb + 5 * hd + d), qd, c5);
        c6 = _mm256_fmadd_ps(_mm256_load_ps(kb + 6 * hd + d), qd, c6);
        c7 = _mm256_fmadd_ps(_mm256_load_ps(kb + 7 * hd + d), qd, c7);
    }
    __m256 h01 = _mm256_hadd_ps(c0, c1), h23 = _mm256_hadd_ps(c2, c3);
    __m256 h45 = _mm256_hadd_ps(c4, c5), h67 = _mm256_hadd_ps(c6, c7);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

static void attention_group_avx2(float *out, const float *q, const uint16_t *k,
                                 const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                                 float softcap, int64_t n_q, float *ml) {
    if ((hd & 7) || hd > GQA_MAX_HD) {
        for (int64_t h = 0; h < n_q; h++)
            attention_head_avx2(out + h * hd, q + h * hd, k, v, t_len, hd, scale, softcap,
                                ml ? ml + 2 * h : NULL);
        return;
    }
    while (n_q > GQA_MAX_Q) {
        attention_group_avx2(out, q, k, v, t_len, hd, scale, softcap, GQA_MAX_Q, ml);
        out += GQA_MAX_Q * hd; q += GQA_MAX_Q * hd; n_q -= GQA_MAX_Q;
        if (ml) ml += 2 * GQA_MAX_Q;
    }
    float m[GQA_MAX_Q], l[GQA_MAX_Q];
    _Alignas(32) float kb[TILE * GQA_MAX_HD];
    _Alignas(32) float vb[TILE * GQA_MAX_HD];
    _Alignas(32) float pa[TILE];
    for (int64_t h = 0; h < n_q; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    for (int64_t d = 0; d < n_q * hd; d++) out[d] = 0.0f;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < t_len; t += TILE) {
        int nb = (int)(t_len - t < TILE ? t_len - t : TILE);
        int nsub = (nb + 7) / 8;
        const uint16_t *kt = k + t * hd, *vt = v + t * hd;
        const int64_t ahead = (int64_t)TILE * hd;      /* the next tile's K and V */
        for (int64_t i = 0; i < nb * hd; i += 8) {
            if (!(i & 31) && t + TILE < t_len) {         /* a line per 32 halfs, each stream */
                _mm_prefetch((const char *)(kt + ahead + i), _MM_HINT_T0);
                _mm_prefetch((const char *)(vt + ahead + i), _MM_HINT_T0);
            }
            _mm256_store_ps(kb + i, load8h(kt + i));
            _mm256_store_ps(vb + i, load8h(vt + i));
        }
        for (int64_t i = nb * hd; i < nsub * 8 * hd; i += 8) {   /* past the end: zeros, masked */
            _mm256_store_ps(kb + i, _mm256_setzero_ps());
            _mm256_store_ps(vb + i, _mm256_setzero_ps());
        }
        for (int64_t h = 0; h < n_q; h++) {
            const float *qh = q + h * hd;
            float *oh = out + h * hd;
            __m256 s[TILE / 8];
            __m256 bmv = ninf;
            for (int sb = 0; sb < nsub; sb++) {
                __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb - 8 * sb), lane));
                __m256 sc = _mm256_mul_ps(scores8(kb + sb * 8 * hd, qh, hd), vscale);
                if (softcap > 0.0f) sc = softcap8(sc, softcap);
                s[sb] = _mm256_blendv_ps(ninf, sc, valid);
                bmv = _mm256_max_ps(bmv, s[sb]);
            }
            __m128 mx = _mm_max_ps(_mm256_castps256_ps128(bmv), _mm256_extractf128_ps(bmv, 1));
            mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
            mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
            float bm = _mm_cvtss_f32(mx);
            float c = 1.0f;
            if (bm > m[h]) { c = expf(m[h] - bm); m[h] = bm; l[h] *= c; }
            __m256 mv = _mm256_set1_ps(m[h]), psum = _mm256_setzero_ps();
            for (int sb = 0; sb < nsub; sb++) {
                __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb - 8 * sb), lane));
                __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s[sb], mv)), valid);
                psum = _mm256_add_ps(psum, p);
                _mm256_store_ps(pa + 8 * sb, p);
            }
            l[h] += hsum8(psum);
            const int np = nsub * 8;            /* padded rows have p = 0 and v = 0 */
            __m256 cv = _mm256_set1_ps(c);
            /* O += P V with 64 output columns held in 8 accumulators across the tile's
             * positions: 8 independent FMA chains (a chain per column block would wait
             * on FMA latency), one broadcast of p per position */
            int64_t d0 = 0;
            for (; d0 + 64 <= hd; d0 += 64) {
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0), cv);
                __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 8), cv);
                __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 16), cv);
                __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 24), cv);
                __m256 o4 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 32), cv);
                __m256 o5 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 40), cv);
                __m256 o6 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 48), cv);
                __m256 o7 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0 + 56), cv);
                for (int i = 0; i < np; i++) {
                    const __m256 p = _mm256_broadcast_ss(pa + i);
                    const float *vr = vb + i * hd + d0;
                    o0 = _mm256_fmadd_ps(p, _mm256_load_ps(vr), o0);
                    o1 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 8), o1);
                    o2 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 16), o2);
                    o3 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 24), o3);
                    o4 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 32), o4);
                    o5 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 40), o5);
                    o6 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 48), o6);
                    o7 = _mm256_fmadd_ps(p, _mm256_load_ps(vr + 56), o7);
                }
                _mm256_storeu_ps(oh + d0, o0); _mm256_storeu_ps(oh + d0 + 8, o1);
                _mm256_storeu_ps(oh + d0 + 16, o2); _mm256_storeu_ps(oh + d0 + 24, o3);
                _mm256_storeu_ps(oh + d0 + 32, o4); _mm256_storeu_ps(oh + d0 + 40, o5);
                _mm256_storeu_ps(oh + d0 + 48, o6); _mm256_storeu_ps(oh + d0 + 56, o7);
            }
            for (; d0 < hd; d0 += 8) {          /* head_dim % 64: 8 columns at a time */
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(oh + d0), cv), o1 = _mm256_setzero_ps();
                for (int i = 0; i < np; i += 2) {
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + i), _mm256_load_ps(vb + i * hd + d0), o0);
                    o1 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + i + 1), _mm256_load_ps(vb + (i + 1) * hd + d0), o1);
                }
                _mm256_storeu_ps(oh + d0, _mm256_add_ps(o0, o1));
            }
        }
    }
    if (ml) {                                   /* partial results: left unnormalised */
        for (int64_t h = 0; h < n_q; h++) { ml[2 * h] = m[h]; ml[2 * h + 1] = l[h]; }
        return;
    }
    for (int64_t h = 0; h < n_q; h++) {
        __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        for (int64_t d = 0; d < hd; d += 8)
            _mm256_storeu_ps(out + h * hd + d, _mm256_mul_ps(_mm256_loadu_ps(out + h * hd + d), inv));
    }
}

static void f16_to_f32_avx2(float *out, const uint16_t *in, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8h(in + i));
    for (; i < n; i++) out[i] = h2f(in[i]);
}

static void f32_to_f16_avx2(uint16_t *out, const float *in, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = _cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT);
}

#ifndef PROBE_PF_BYTES
#define PROBE_PF_BYTES 8192
#endif
/* The read probe streams like the matvec does (software prefetch ahead of the loads),
 * so the roofline compares the kernels against what the memory can deliver to them. */
static double sum_f32_avx2(const float *p, int64_t n) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
    const int64_t ahead = PROBE_PF_BYTES / 4;     /* floats */
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        if (i + ahead + 32 <= n) {
            _mm_prefetch((const char *)(p + i + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i + ahead + 16), _MM_HINT_T0);
        }
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
        b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
        c = _mm256_add_ps(c, _mm256_loadu_ps(p + i + 16));
        d = _mm256_add_ps(d, _mm256_loadu_ps(p + i + 24));
    }
    double s = hsum8(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    for (; i < n; i++) s += p[i];
    return s;
}


/* ---- batched prefill: out (T, d) = x (T, n) @ W.T, W (d, n) f16 -------------------
 *
 * BLIS-style blocking. A panel of GEMM_NR = 16 weight rows x GEMM_KC columns is
 * widened to f32 once and stored transposed (wp[j][16], 16 KiB at KC = 256, L1
 * resident); the micro-kernel then streams GEMM_MR = 6 tokens of x against it:
 * per column j two panel loads, six broadcasts and twelve FMAs into 6 x 2 ymm
 * accumulators (12 of the 16 registers). Each output element is one lane of one
 * accumulator: its sum is a single FMA chain over j = 0..n-1 in order, so the
 * result does not depend on the blocking, the thread split or the vector width
 * (the avx512 variant uses the same chain and gives the same bits).
 * Results go through a per-panel scratch tile (TB x 16), then the epilogue writes
 * out = s, out += s, or for gate_up out = silu(g) * u.
 */
#define GEMM_NR 16
#define GEMM_MR 6
#define GEMM_KC 256
#define GEMM_TB 256            /* tokens per block: a whole prefill chunk of the model */

#include "gemm_pack.h"

/* c[i][0..15] (+)= sum_j wp[j][0..15] * x[i][j] for i < MR; c has row stride 16 */
static inline __attribute__((always_inline)) void ukr_avx2(
        const int MR, const float *x, int64_t ldx, const float *wp, int64_t kc,
        float *c, int first) {
    __m256 a0[GEMM_MR], a1[GEMM_MR];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; i++) {
        if (first) { a0[i] = _mm256_setzero_ps(); a1[i] = _mm256_setzero_ps(); }
        else { a0[i] = _mm256_load_ps(c + i * 16); a1[i] = _mm256_load_ps(c + i * 16 + 8); }
    }
    for (int64_t j = 0; j < kc; j++) {
        __m256 w0 = _mm256_load_ps(wp + j * 16), w1 = _mm256_load_ps(wp + j * 16 + 8);
        _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; i++) {
            __m256 xb = _mm256_broadcast_ss(x + i * ldx + j);
            a0[i] = _mm256_fmadd_ps(w0, xb, a0[i]);
            a1[i] = _mm256_fmadd_ps(w1, xb, a1[i]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; i++) {
        _mm256_store_ps(c + i * 16, a0[i]);
        _mm256_store_ps(c + i * 16 + 8, a1[i]);
    }
}

static void ukr_any_avx2(int mr, const float *x, int64_t ldx, const float *wp, int64_t kc,
                         float *c, int first) {
    switch (mr) {
    case 6: ukr_avx2(6, x, ldx, wp, kc, c, first); break;
    case 5: ukr_avx2(5, x, ldx, wp, kc, c, first); break;
    case 4: ukr_avx2(4, x, ldx, wp, kc, c, first); break;
    case 3: ukr_avx2(3, x, ldx, wp, kc, c, first); break;
    case 2: ukr_avx2(2, x, ldx, wp, kc, c, first); break;
    default: ukr_avx2(1, x, ldx, wp, kc, c, first); break;
    }
}

static void gemm_rows_avx2(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                           int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                           int mode) {
    _Alignas(64) float wp[GEMM_KC * GEMM_NR];
    _Alignas(64) float up[GEMM_KC * GEMM_NR];
    _Alignas(64) float cg[GEMM_TB * GEMM_NR];
    _Alignas(64) float cu[GEMM_TB * GEMM_NR];
    for (int64_t t0 = 0; t0 < T; t0 += GEMM_TB) {
        int64_t tb = T - t0 < GEMM_TB ? T - t0 : GEMM_TB;
        const float *xt = x + t0 * ldx;
        for (int64_t r = r0; r < r1; r += GEMM_NR) {
            int64_t rmax = r + GEMM_NR < r1 ? r + GEMM_NR : r1;
            for (int64_t k0 = 0; k0 < n; k0 += GEMM_KC) {
                int64_t kc = n - k0 < GEMM_KC ? n - k0 : GEMM_KC;
                pack_panel_avx2(wp, GEMM_NR, w, n, r, rmax, k0, kc);
                if (mode >= 2) pack_panel_avx2(up, GEMM_NR, wu, n, r, rmax, k0, kc);
                gp_next next;
                gp_next_init(&next, GEMM_NR, n, r, rmax, r1, k0, kc, GEMM_KC, (tb + GEMM_MR - 1) / GEMM_MR);
                for (int64_t t = 0; t < tb; t += GEMM_MR) {
                    int mr = (int)(tb - t < GEMM_MR ? tb - t : GEMM_MR);
                    gp_prefetch_next(&next, w, mode >= 2 ? wu : NULL);
                    ukr_any_avx2(mr, xt + t * ldx + k0, ldx, wp, kc, cg + t * GEMM_NR, k0 == 0);
                    if (mode >= 2)
                        ukr_any_avx2(mr, xt + t * ldx + k0, ldx, up, kc, cu + t * GEMM_NR, k0 == 0);
                }
            }
            int nr = (int)(rmax - r);
            for (int64_t t = 0; t < tb; t++) {
                float *o = out + (t0 + t) * d + r;
                const float *s = cg + t * GEMM_NR;
                if (mode == 0)      for (int i = 0; i < nr; i++) o[i] = s[i];
                else if (mode == 1) for (int i = 0; i < nr; i++) o[i] += s[i];
                else if (mode == 2 && nr == GEMM_NR) {     /* vector SiLU: scalar expf would cost ~1/3 of the GEMM */
                    const float *u = cu + t * GEMM_NR;
                    for (int i = 0; i < GEMM_NR; i += 8) {
                        __m256 g = _mm256_load_ps(s + i);
                        __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
                        _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(g, _mm256_load_ps(u + i)), den));
                    }
                } else {
                    const float *u = cu + t * GEMM_NR;
                    for (int i = 0; i < nr; i++) o[i] = cyllm_act(s[i], mode - 2) * u[i];
                }
            }
        }
    }
}


/* ---- causal attention of up to GEMM_MR query rows of one head, GEMM-shaped ----
 * The AVX2 twin of cyllm_attention_rows_avx512 (kernels_avx512.c): S = Q K^T with the
 * GEMM micro-kernel, an exact softmax per row, O = P V with V rows widened into
 * panels. work: attention_rows_work_avx2(len0 + rows - 1) floats. */
static int64_t attention_rows_work_avx2(int64_t t_max) {
    return (int64_t)GEMM_MR * (((t_max + GEMM_NR - 1) / GEMM_NR) * GEMM_NR);
}

static void attention_rows_avx2(float *out, const float *q, int64_t ldq, const uint16_t *k,
                                const uint16_t *v, int64_t hd, float scale, float softcap, int64_t rows,
                                int64_t len0, float *work) {
    _Alignas(64) float wp[GEMM_KC * GEMM_NR];
    _Alignas(64) float ct[GEMM_MR * GEMM_NR];
    const int m = (int)rows;
    const int64_t L = len0 + rows - 1;
    const int64_t ldp = ((L + GEMM_NR - 1) / GEMM_NR) * GEMM_NR;
    float *S = work;
    for (int64_t p0 = 0; p0 < L; p0 += GEMM_NR) {
        int64_t pm = p0 + GEMM_NR < L ? p0 + GEMM_NR : L;
        for (int64_t k0 = 0; k0 < hd; k0 += GEMM_KC) {
            int64_t kc = hd - k0 < GEMM_KC ? hd - k0 : GEMM_KC;
            pack_panel_avx2(wp, GEMM_NR, k, hd, p0, pm, k0, kc);
            ukr_any_avx2(m, q + k0, ldq, wp, kc, ct, k0 == 0);
        }
        for (int i = 0; i < m; i++)
            for (int j = 0; j < GEMM_NR; j++) S[i * ldp + p0 + j] = ct[i * GEMM_NR + j];
    }
    float inv_l[GEMM_MR];
    /* soft-capped scores are scaled as they are capped, the rest inside the exp */
    const float sc = softcap > 0.0f ? 1.0f : scale;
    const __m256 vscale = _mm256_set1_ps(sc);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < m; i++) {
        float *s = S + i * ldp;
        int64_t len = len0 + i, j;
        if (softcap > 0.0f)
            for (j = 0; j < len; j++) s[j] = cyllm_softcap(s[j] * scale, softcap);
        float mm = -INFINITY;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (j = 0; j + 8 <= len; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
        float mb[8];
        _mm256_storeu_ps(mb, mx);
        for (int c = 0; c < 8; c++) mm = mb[c] > mm ? mb[c] : mm;
        for (; j < len; j++) mm = s[j] > mm ? s[j] : mm;
        const __m256 vm = _mm256_set1_ps(mm * sc);
        __m256 sum = _mm256_setzero_ps();
        for (j = 0; j + 8 <= len; j += 8) {
            __m256 p = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vscale, vm));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(s + j, p);
        }
        if (j < len) {                                    /* ldp >= j + 8: in bounds */
            __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - j)), lane));
            __m256 p = _mm256_and_ps(exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vscale, vm)), valid);
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(s + j, p);
            j += 8;
        }
        for (; j < ldp; j++) s[j] = 0.0f;
        inv_l[i] = 1.0f / hsum8(sum);
    }
    for (int64_t c0 = 0; c0 < hd; c0 += GEMM_NR) {
        int nc = (int)(hd - c0 < GEMM_NR ? hd - c0 : GEMM_NR);
        for (int64_t k0 = 0; k0 < L; k0 += GEMM_KC) {
            int64_t kc = L - k0 < GEMM_KC ? L - k0 : GEMM_KC;
            for (int64_t j = 0; j < kc; j++) {
                const uint16_t *vr = v + (k0 + j) * hd + c0;
                if (nc == GEMM_NR) {
                    _mm256_store_ps(wp + j * GEMM_NR, load8h(vr));
                    _mm256_store_ps(wp + j * GEMM_NR + 8, load8h(vr + 8));
                } else {
                    for (int c = 0; c < GEMM_NR; c++) wp[j * GEMM_NR + c] = c < nc ? h2f(vr[c]) : 0.0f;
                }
            }
            ukr_any_avx2(m, S + k0, ldp, wp, kc, ct, k0 == 0);
        }
        for (int i = 0; i < m; i++)
            for (int c = 0; c < nc; c++) out[i * ldq + c0 + c] = ct[i * GEMM_NR + c] * inv_l[i];
    }
}

const cyllm_kernels cyllm_avx2_kernels = {
    "avx2",
    matvec_rows_avx2,
    gate_up_rows_avx2,
    attention_group_avx2,
    f16_to_f32_avx2,
    f32_to_f16_avx2,
    sum_f32_avx2,
    gemm_rows_avx2,
    GEMM_NR,
    attention_rows_avx2,
    attention_rows_work_avx2,
    GEMM_MR,
    rows2_avx2,
};
