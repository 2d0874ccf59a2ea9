/* AVX2 + FMA + F16C kernels. Compiled alone with -mavx2 -mfma -mf16c (setup.py),
 * and only ever called after dispatch.c has seen those features on the CPU.
 *
 * matvec: 4 rows x 16 columns per step -- x is loaded once for 4 rows, each row
 *   keeps two 8-lane FMA accumulators (8 independent chains hide FMA latency),
 *   F16C widens 8 halfs per vcvtph2ps. Measured ~2x the generic C at 1 thread
 *   and near the DRAM read bandwidth at 2 threads (bench/results/matvec_cpu.md).
 * attention: 8 cached positions per step; 8 scores come out of one hadd tree,
 *   one vector exp per 8 positions, V accumulated into `out` in one pass.
 */
#include <immintrin.h>
#include <math.h>
#include "kernels.h"

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

/* out4[i] = dot(w_i, x) for 4 rows of length n (any 4 rows: matvec passes
 * consecutive rows, gate_up two gate rows and their two up rows).
 * Per row the arithmetic is exactly that of dot1 below. */
static inline void dot4(const uint16_t *w0, const uint16_t *w1, const uint16_t *w2,
                        const uint16_t *w3, const float *x, int64_t n, float out4[4]) {
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
    __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m256 xa = _mm256_loadu_ps(x + j), xb = _mm256_loadu_ps(x + j + 8);
        a0 = _mm256_fmadd_ps(load8h(w0 + j), xa, a0); b0 = _mm256_fmadd_ps(load8h(w0 + j + 8), xb, b0);
        a1 = _mm256_fmadd_ps(load8h(w1 + j), xa, a1); b1 = _mm256_fmadd_ps(load8h(w1 + j + 8), xb, b1);
        a2 = _mm256_fmadd_ps(load8h(w2 + j), xa, a2); b2 = _mm256_fmadd_ps(load8h(w2 + j + 8), xb, b2);
        a3 = _mm256_fmadd_ps(load8h(w3 + j), xa, a3); b3 = _mm256_fmadd_ps(load8h(w3 + j + 8), xb, b3);
    }
    if (j + 8 <= n) {
        __m256 xa = _mm256_loadu_ps(x + j);
        a0 = _mm256_fmadd_ps(load8h(w0 + j), xa, a0);
        a1 = _mm256_fmadd_ps(load8h(w1 + j), xa, a1);
        a2 = _mm256_fmadd_ps(load8h(w2 + j), xa, a2);
        a3 = _mm256_fmadd_ps(load8h(w3 + j), xa, a3);
        j += 8;
    }
    float s0 = hsum8(_mm256_add_ps(a0, b0)), s1 = hsum8(_mm256_add_ps(a1, b1));
    float s2 = hsum8(_mm256_add_ps(a2, b2)), s3 = hsum8(_mm256_add_ps(a3, b3));
    for (; j < n; j++) {
        float xj = x[j];
        s0 += h2f(w0[j]) * xj; s1 += h2f(w1[j]) * xj;
        s2 += h2f(w2[j]) * xj; s3 += h2f(w3[j]) * xj;
    }
    out4[0] = s0; out4[1] = s1; out4[2] = s2; out4[3] = s3;
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

static void matvec_rows_avx2(float *out, const uint16_t *w, const float *x,
                             int64_t n, int64_t r0, int64_t r1, int add) {
    int64_t r = r0;
    /* groups of 4 start at multiples of 4 so the grouping never depends on r0 */
    for (; r < r1 && (r & 3); r++) {
        float s = dot1(w + r * n, x, n);
        out[r] = add ? out[r] + s : s;
    }
    for (; r + 4 <= r1; r += 4) {
        float s[4];
        const uint16_t *wr = w + r * n;
        dot4(wr, wr + n, wr + 2 * n, wr + 3 * n, x, n, s);
        if (add) { out[r] += s[0]; out[r + 1] += s[1]; out[r + 2] += s[2]; out[r + 3] += s[3]; }
        else     { out[r] = s[0];  out[r + 1] = s[1];  out[r + 2] = s[2];  out[r + 3] = s[3]; }
    }
    for (; r < r1; r++) {
        float s = dot1(w + r * n, x, n);
        out[r] = add ? out[r] + s : s;
    }
}

static void gate_up_rows_avx2(float *out, const uint16_t *wg, const uint16_t *wu,
                              const float *x, int64_t n, int64_t r0, int64_t r1) {
    /* Two gate rows and the two matching up rows share one x load (4 streams).
     * Pairs start at even rows so the grouping never depends on r0. */
    int64_t r = r0;
    if (r < r1 && (r & 1)) {
        out[r] = cyllm_silu(dot1(wg + r * n, x, n)) * dot1(wu + r * n, x, n);
        r++;
    }
    for (; r + 2 <= r1; r += 2) {
        float s[4];
        const uint16_t *g = wg + r * n, *u = wu + r * n;
        dot4(g, g + n, u, u + n, x, n, s);
        out[r] = cyllm_silu(s[0]) * s[2];
        out[r + 1] = cyllm_silu(s[1]) * s[3];
    }
    if (r < r1)
        out[r] = cyllm_silu(dot1(wg + r * n, x, n)) * dot1(wu + r * n, x, n);
}

/* exp for x <= 0 (softmax weights), Cephes-style: 2^round(x log2 e) * poly; ~1-2 ulp.
 * Inputs below -87.3 give ~1e-38 instead of 0, which no softmax sum notices. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
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

static void attention_head_avx2(float *out, const float *q, const uint16_t *k,
                                const uint16_t *v, int64_t t_len, int64_t hd, float scale) {
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
                                 int64_t n_q) {
    if ((hd & 7) || hd > GQA_MAX_HD) {
        for (int64_t h = 0; h < n_q; h++)
            attention_head_avx2(out + h * hd, q + h * hd, k, v, t_len, hd, scale);
        return;
    }
    while (n_q > GQA_MAX_Q) {
        attention_group_avx2(out, q, k, v, t_len, hd, scale, GQA_MAX_Q);
        out += GQA_MAX_Q * hd; q += GQA_MAX_Q * hd; n_q -= GQA_MAX_Q;
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
        for (int64_t i = 0; i < nb * hd; i += 8) {
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
                s[sb] = _mm256_blendv_ps(ninf, _mm256_mul_ps(scores8(kb + sb * 8 * hd, qh, hd), vscale), valid);
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
            for (int64_t d = 0; d < hd; d += 8) {
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(oh + d), cv), o1 = _mm256_setzero_ps();
                for (int i = 0; i < np; i += 2) {
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + i), _mm256_load_ps(vb + i * hd + d), o0);
                    o1 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + i + 1), _mm256_load_ps(vb + (i + 1) * hd + d), o1);
                }
                _mm256_storeu_ps(oh + d, _mm256_add_ps(o0, o1));
            }
        }
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

static double sum_f32_avx2(const float *p, int64_t n) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
        b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
        c = _mm256_add_ps(c, _mm256_loadu_ps(p + i + 16));
        d = _mm256_add_ps(d, _mm256_loadu_ps(p + i + 24));
    }
    double s = hsum8(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    for (; i < n; i++) s += p[i];
    return s;
}

const cyllm_kernels cyllm_avx2_kernels = {
    "avx2",
    matvec_rows_avx2,
    gate_up_rows_avx2,
    attention_group_avx2,
    f16_to_f32_avx2,
    f32_to_f16_avx2,
    sum_f32_avx2,
};
