/* AVX-512F batched GEMM (prefill). Compiled alone with -mavx512f -mavx2 -mfma -mf16c
 * (setup.py) and only entered after dispatch.c has seen AVX-512F (with OS support
 * for the zmm state) besides the AVX2 set. The avx512 kernel table is the avx2 one
 * with this GEMM swapped in (dispatch.c): decode matvecs are memory-bound and
 * gain nothing from wider vectors, prompt processing is arithmetic-bound.
 *
 * Same scheme as gemm_rows_avx2 (kernels_avx2.c) at twice the width: panels of
 * 32 weight rows, micro-kernel of 12 tokens x 32 outputs in 24 zmm accumulators.
 * Every output element is one FMA chain over j = 0..n-1, exactly as in the AVX2
 * kernel, so both variants give the same bits.
 *
 * Reference: backends/numpy_ref.py (matmul, attention_batch). Tests:
 * tests/test_backend_ops.py (every variant against the reference). Benchmarks:
 * bench/bench_gemm.py, bench/bench_attention.py.
 */
#include <immintrin.h>
#include <math.h>
#include "kernels.h"
#include "gemm_pack.h"

#define NR 32
#define MR 12
#ifndef KC
#define KC 256                 /* panel 32 KiB: L1 resident (two for gate_up spill to L2: measured as fast) */
#endif
#ifndef TB
#define TB 256                 /* tokens per block: a whole prefill chunk of the model */
#endif

/* e^x, Cephes-style polynomial (~1-2 ulp); x clamped to [-87.3, 88.3] (no inf/denormal) */
static inline __m512 exp16(__m512 x) {
    /* the constant first: a NaN input stays NaN (see exp8 in kernels_avx2.c) */
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* silu(g) * u = g * u / (1 + e^-g), 16 lanes */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    return _mm512_div_ps(_mm512_mul_ps(g, u), den);
}

static inline __attribute__((always_inline)) void ukr512(
        const int M, const float *x, int64_t ldx, const float *wp, int64_t kc,
        float *c, int first) {
    __m512 a0[MR], a1[MR];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < M; i++) {
        if (first) { a0[i] = _mm512_setzero_ps(); a1[i] = _mm512_setzero_ps(); }
        else { a0[i] = _mm512_load_ps(c + i * NR); a1[i] = _mm512_load_ps(c + i * NR + 16); }
    }
    for (int64_t j = 0; j < kc; j++) {
        __m512 w0 = _mm512_load_ps(wp + j * NR), w1 = _mm512_load_ps(wp + j * NR + 16);
        _Pragma("GCC unroll 16")
    for (int i = 0; i < M; i++) {
            __m512 xb = _mm512_set1_ps(x[i * ldx + j]);
            a0[i] = _mm512_fmadd_ps(w0, xb, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, xb, a1[i]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < M; i++) {
        _mm512_store_ps(c + i * NR, a0[i]);
        _mm512_store_ps(c + i * NR + 16, a1[i]);
    }
}

static void ukr512_any(int m, const float *x, int64_t ldx, const float *wp, int64_t kc,
                       float *c, int first) {
    switch (m) {
    case 12: ukr512(12, x, ldx, wp, kc, c, first); break;
    case 11: ukr512(11, x, ldx, wp, kc, c, first); break;
    case 10: ukr512(10, x, ldx, wp, kc, c, first); break;
    case 9: ukr512(9, x, ldx, wp, kc, c, first); break;
    case 8: ukr512(8, x, ldx, wp, kc, c, first); break;
    case 7: ukr512(7, x, ldx, wp, kc, c, first); break;
    case 6: ukr512(6, x, ldx, wp, kc, c, first); break;
    case 5: ukr512(5, x, ldx, wp, kc, c, first); break;
    case 4: ukr512(4, x, ldx, wp, kc, c, first); break;
    case 3: ukr512(3, x, ldx, wp, kc, c, first); break;
    case 2: ukr512(2, x, ldx, wp, kc, c, first); break;
    default: ukr512(1, x, ldx, wp, kc, c, first); break;
    }
}

void cyllm_gemm_rows_avx512(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                            int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                            int mode) {
    _Alignas(64) float wp[KC * NR];
    _Alignas(64) float up[KC * NR];
    _Alignas(64) float cg[TB * NR];
    _Alignas(64) float cu[TB * NR];
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
        int64_t tb = T - t0 < TB ? T - t0 : TB;
        const float *xt = x + t0 * ldx;
        for (int64_t r = r0; r < r1; r += NR) {
            int64_t rmax = r + NR < r1 ? r + NR : r1;
            for (int64_t k0 = 0; k0 < n; k0 += KC) {
                int64_t kc = n - k0 < KC ? n - k0 : KC;
                pack_panel_avx2(wp, NR, w, n, r, rmax, k0, kc);
                if (mode >= 2) pack_panel_avx2(up, NR, wu, n, r, rmax, k0, kc);
                gp_next next;
                gp_next_init(&next, NR, n, r, rmax, r1, k0, kc, KC, (tb + MR - 1) / MR);
                for (int64_t t = 0; t < tb; t += MR) {
                    int m = (int)(tb - t < MR ? tb - t : MR);
                    gp_prefetch_next(&next, w, mode >= 2 ? wu : NULL);
                    ukr512_any(m, xt + t * ldx + k0, ldx, wp, kc, cg + t * NR, k0 == 0);
                    if (mode >= 2) ukr512_any(m, xt + t * ldx + k0, ldx, up, kc, cu + t * NR, k0 == 0);
                }
            }
            int nr = (int)(rmax - r);
            for (int64_t t = 0; t < tb; t++) {
                float *o = out + (t0 + t) * d + r;
                const float *s = cg + t * NR;
                if (mode == 0)      for (int i = 0; i < nr; i++) o[i] = s[i];
                else if (mode == 1) for (int i = 0; i < nr; i++) o[i] += s[i];
                else if (mode == 2 && nr == NR) {          /* vector SiLU: scalar expf would cost ~1/3 of the GEMM */
                    const float *u = cu + t * NR;
                    _mm512_storeu_ps(o, silu_mul16(_mm512_load_ps(s), _mm512_load_ps(u)));
                    _mm512_storeu_ps(o + 16, silu_mul16(_mm512_load_ps(s + 16), _mm512_load_ps(u + 16)));
                } else {
                    const float *u = cu + t * NR;
                    for (int i = 0; i < nr; i++) o[i] = cyllm_act(s[i], mode - 2) * u[i];
                }
            }
        }
    }
}

/* ---- causal attention of up to MR query rows of one head, GEMM-shaped (prefill) ----
 *
 * Row i (q + i * ldq) attends to cache positions 0 .. len0 + i - 1. With the whole
 * score row at hand there is no online rescaling: S = Q K^T with the GEMM
 * micro-kernel (K packed transposed in panels of 32 positions), an exact softmax per
 * row (vector exp), then O = P V with V widened row by row into panels of 32
 * columns. work: cyllm_attention_rows_work(len0 + rows - 1) floats, any alignment. */
int64_t cyllm_attention_rows_work_avx512(int64_t t_max) {
    return (int64_t)MR * (((t_max + NR - 1) / NR) * NR);
}

void cyllm_attention_rows_avx512(float *out, const float *q, int64_t ldq, const uint16_t *k,
                                 const uint16_t *v, int64_t hd, float scale, float softcap, int64_t rows,
                                 int64_t len0, float *work) {
    _Alignas(64) float wp[KC * NR];
    _Alignas(64) float ct[MR * NR];
    const int m = (int)rows;
    const int64_t L = len0 + rows - 1;                   /* longest row */
    const int64_t ldp = ((L + NR - 1) / NR) * NR;
    float *S = work;                                      /* (rows, ldp) scores, then P */
    /* S = Q K^T, position panels of NR; hd in column blocks of KC */
    for (int64_t p0 = 0; p0 < L; p0 += NR) {
        int64_t pm = p0 + NR < L ? p0 + NR : L;
        for (int64_t k0 = 0; k0 < hd; k0 += KC) {
            int64_t kc = hd - k0 < KC ? hd - k0 : KC;
            pack_panel_avx2(wp, NR, k, hd, p0, pm, k0, kc);
            ukr512_any(m, q + k0, ldq, wp, kc, ct, k0 == 0);
        }
        for (int i = 0; i < m; i++)
            for (int j = 0; j < NR; j++) S[i * ldp + p0 + j] = ct[i * NR + j];
    }
    /* softmax per row over its len0 + i positions; the rest of the row is 0 */
    float inv_l[MR];
    /* soft-capped scores are scaled as they are capped, the rest inside the exp */
    const float sc = softcap > 0.0f ? 1.0f : scale;
    const __m512 vscale = _mm512_set1_ps(sc);
    for (int i = 0; i < m; i++) {
        float *s = S + i * ldp;
        int64_t len = len0 + i, j;
        if (softcap > 0.0f)
            for (j = 0; j < len; j++) s[j] = cyllm_softcap(s[j] * scale, softcap);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (j = 0; j + 16 <= len; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
        float mm = _mm512_reduce_max_ps(mx);
        for (; j < len; j++) mm = s[j] > mm ? s[j] : mm;
        const __m512 vm = _mm512_set1_ps(mm * sc);
        __m512 sum = _mm512_setzero_ps();
        for (j = 0; j + 16 <= len; j += 16) {
            __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vm));
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(s + j, p);
        }
        float l = _mm512_reduce_add_ps(sum);
        if (j < len) {
            __mmask16 km = (__mmask16)((1u << (len - j)) - 1u);
            __m512 p = exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(km, s + j), vscale, vm));
            p = _mm512_maskz_mov_ps(km, p);
            l += _mm512_reduce_add_ps(p);
            _mm512_storeu_ps(s + j, p);                  /* zeros past len (ldp >= j + 16) */
            j += 16;
        }
        for (; j < ldp; j++) s[j] = 0.0f;
        inv_l[i] = 1.0f / l;
    }
    /* O = P V: output column panels of NR, positions in blocks of KC */
    for (int64_t c0 = 0; c0 < hd; c0 += NR) {
        int nc = (int)(hd - c0 < NR ? hd - c0 : NR);
        for (int64_t k0 = 0; k0 < L; k0 += KC) {
            int64_t kc = L - k0 < KC ? L - k0 : KC;
            for (int64_t j = 0; j < kc; j++) {           /* widen V rows: wp[j][c] = V[k0+j][c0+c] */
                const uint16_t *vr = v + (k0 + j) * hd + c0;
                if (nc == NR) {
                    _mm512_store_ps(wp + j * NR, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)vr)));
                    _mm512_store_ps(wp + j * NR + 16,
                                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vr + 16))));
                } else {
                    for (int c = 0; c < NR; c++) wp[j * NR + c] = c < nc ? gp_h2f(vr[c]) : 0.0f;
                }
            }
            ukr512_any(m, S + k0, ldp, wp, kc, ct, k0 == 0);
        }
        for (int i = 0; i < m; i++)
            for (int c = 0; c < nc; c++) out[i * ldq + c0 + c] = ct[i * NR + c] * inv_l[i];
    }
}
