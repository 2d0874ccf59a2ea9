/* Body of the x86 quantized kernels, compiled three times:
 *   quant_avx2.c     QX_VNNI 0: u8 x s8 products by vpmaddubsw + vpmaddwd (AVX2), ymm
 *   quant_avxvnni.c  QX_VNNI 1: vpdpbusd / vpdpwssd, VEX encoding (AVX-VNNI), ymm
 *   quant_avx512.c   QX_VNNI 2: vpdpbusd / vpdpwssd, EVEX (AVX512_VNNI + BW + VL): zmm
 *                    kernels for q8_0, q4_0/q4_1/q5_0/q5_1, q4_k and q6_k (the "zmm"
 *                    sections below: register tiles of rows x tokens in prefill) and q5_k
 *                    (exact superblock totals; prefill with 16 tokens in a zmm's lanes);
 *                    rows past the zmm kernels' stack-prepared activations take the ymm
 *                    kernels. These serve the file's layout; matrices the backend
 *                    reorders at load (the r16 layouts: q4_k, q4_0, q8_0, q4_1, q6_k and
 *                    q5_k with rows by 16) run the r16 kernels at the end, 16 rows a lane
 *                    each (q6_k's and q5_k's prefill: 16 tokens in a zmm's lanes,
 *                    k6t and k45t).
 * The including file defines QX_VNNI, QX_NAME and QX_TABLE. All three compute the
 * same integers (no int16 saturation is reachable: see the bounds next to DOT2).
 *
 * Shape of the work (decode is memory-bound, so the aim is few uops per weight byte):
 * - one row at a time against C activations (C = 1 in decode, QX_C tokens in prefill,
 *   where the row's unpacking serves C tokens); each token's operations run in the same
 *   order whatever C, so decode and prefill give a (row, token) the same bits.
 * - 32-blocks go in pairs (64 weights): the two 16-byte nibble runs fill one 256-bit
 *   register; low nibbles meet x[0:16] of each block, high nibbles x[16:32]. The
 *   q4_0/q5_0 offsets (-8, -16) come from x's block sums (the integer accumulator
 *   starts at -offset*sum/4 in each of a block's 4 lanes), so nibbles stay unsigned
 *   and no sign trick is needed. q8_0 computes exact block totals (the sign trick,
 *   |w| x sign(x, w), below 512 bits) and prefills with 8 tokens in a ymm's lanes.
 * - K-quants: the 6-bit (q4_k/q5_k) or int8 (q6_k) sub-block scales are applied as
 *   int16 multipliers on the pair sums (vpmaddwd / vpdpwssd); mins (q4_k/q5_k) and
 *   q6_k's -32 come from x's 16-element sums. Below 512 bits (and q5_k everywhere) each
 *   (row, token, superblock) is reduced to exact integer totals that one FMA chain takes
 *   (lane s % 8), so prefill can put tokens in a vector's lanes (8 in a ymm; 16 in a zmm
 *   for q5_k); the AVX512-VNNI q4_k and q6_k tiles keep one FMA per superblock on lanes.
 * - q8_0 and the K-quants below 512 bits: decode reduces 8 blocks' integer lanes at a
 *   time (hsum8i_x8), and short prefills run the decode rows with QX_RC tokens a row.
 * - software prefetch cyllm_qpf_bytes ahead in the row stream, continuing into the
 *   next op's weights (nx) near the end.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdlib.h>
#include "quant_impl.h"

/* Decode runs one row at a time: sharing x's loads between rows paid only while the
 * weights came from cache, and decode streams them from DRAM, where grouped rows were
 * slower for every format (AMD EPYC family 25 model 17, 1 thread, 5632x2048 rotated over
 * 300 MB: q4_k 10.5 -> 15.5 GB/s one row at a time, q8_0 10.4 -> 16.7, q4_0 8.6 -> 12.9;
 * TinyLlama-shape Q4_K_M decode 25 -> 35 tok/s at 2 threads).
 * Prefill shares the other way: one row's unpacked weights serve QX_C tokens at once (the
 * zmm kernels: tiles of R rows x C tokens, where x's loads serve R rows as well). */
#define QX_C 4              /* tokens per kernel call in the prefill GEMM */
#define QX_TB 32            /* tokens per block of the GEMM (their activations stay cached) */

#if QX_VNNI == 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#elif QX_VNNI == 2
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#else
#define DPBUSD(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

/* acc + sum of u1*s1 + u2*s2 over each 4 bytes (u unsigned <= 31, |s| <= 127: each
 * vpmaddubsw pair <= 2*31*127 = 7874, two of them <= 15748 < 32767) */
#if QX_VNNI
#define DOT2(acc, u1, s1, u2, s2) DPBUSD(DPBUSD((acc), (u1), (s1)), (u2), (s2))
#else
#define DOT2(acc, u1, s1, u2, s2) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((u1), (s1)), \
                                              _mm256_maddubs_epi16((u2), (s2))), _mm256_set1_epi16(1)))
#endif

#define QX_CAT2(a, b) a##b
#define QX_CAT(a, b) QX_CAT2(a, b)
#define QF(name) QX_CAT(name, QX_VNNI)
#define ALWAYS static inline __attribute__((always_inline))

static const uint16_t qx_zero_h = 0;

ALWAYS float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* w[i] = [4 lanes of row i | 4 lanes of row i + 4] (i < 4) -> lane r = the sum of row r's */
ALWAYS __m256i hsum_pairs_x4(const __m256i w[4]) {
    /* [rows 0, 1 | rows 4, 5] and [rows 2, 3 | rows 6, 7], two partial sums each */
    const __m256i x01 = _mm256_add_epi32(_mm256_unpacklo_epi64(w[0], w[1]), _mm256_unpackhi_epi64(w[0], w[1]));
    const __m256i x23 = _mm256_add_epi32(_mm256_unpacklo_epi64(w[2], w[3]), _mm256_unpackhi_epi64(w[2], w[3]));
    const __m256 f01 = _mm256_castsi256_ps(x01), f23 = _mm256_castsi256_ps(x23);
    return _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(f01, f23, _MM_SHUFFLE(2, 0, 2, 0))),
                            _mm256_castps_si256(_mm256_shuffle_ps(f01, f23, _MM_SHUFFLE(3, 1, 3, 1))));
}

/* lane i <- the sum of v[i]'s 8 lanes, by a transpose of blends, 64-bit unpacks and
 * shuffles (10 shuffle ops for 8 vectors; a vphaddd tree takes 6 two-shuffle hadds + 2) */
ALWAYS __m256i hsum8i_x8(const __m256i v[8]) {
    __m256i w[4];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++)             /* [v_i folded to 4 lanes | v_i+4 folded] */
        w[i] = _mm256_add_epi32(_mm256_blend_epi32(v[i], v[i + 4], 0xF0),
                                _mm256_permute2x128_si256(v[i], v[i + 4], 0x21));
    return hsum_pairs_x4(w);
}

/* lane i <- the sum of v[i]'s 4 lanes */
ALWAYS __m256i hsum4i_x8(const __m128i v[8]) {
    __m256i w[4];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++) w[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(v[i]), v[i + 4], 1);
    return hsum_pairs_x4(w);
}

ALWAYS __m256i load2x128(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* lanes 0-3 <- element 0 of v, lanes 4-7 <- element 1 */
#define IDX01 _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)

/* two f16 at p0, p1 -> [f(p0) x4, f(p1) x4] */
ALWAYS __m256 h2x4(const uint8_t *p0, const uint8_t *p1) {
    __m128i h = _mm_insert_epi16(_mm_cvtsi32_si128(cyllm_rd16(p0)), cyllm_rd16(p1), 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(h)), IDX01);
}

/* Software prefetch: one pointer per group of rows, `dist` bytes ahead of the group's
 * first row in the stream that ends at `end` and continues at nx (the next op's
 * weights); inside the rows the kernels prefetch at the same offsets from it, with no
 * per-iteration checks. Past both streams it points at the rows themselves (a no-op). */
typedef struct {
    const uint8_t *end;     /* end of this call's row stream */
    const void *nx;         /* next op's weights, NULL: none */
    int64_t nx_bytes;
    int64_t dist;           /* bytes ahead (0: off) */
} qx_pf;

ALWAYS const uint8_t *pf_base(const uint8_t *w0, const qx_pf *pf) {
    if (pf->dist == 0) return w0;
    const uint8_t *q = w0 + pf->dist;
    if (q < pf->end) return q;
    int64_t off = q - pf->end;
    return (pf->nx && off < pf->nx_bytes) ? (const uint8_t *)pf->nx + off : w0;
}

#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* matvec_##F and gate_up_##F (decode) of a kernel whose rows [r0, r1) of one activation
 * F##_range(o, w, rb, a, n, r0, r1, add, pf) computes, one linear stream */
#define QX_DECODE(F, ACT)                                                                       \
static void QF(matvec_##F)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                           int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {   \
    const cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                   \
    const qx_pf pf = {w + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                 \
    F##_range(out + r0, w, rb, &a, n, r0, r1, add, &pf);                                      \
}                                                                                             \
static void QF(gate_up_##F)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,   \
                            const void *xq, int64_t n, int64_t r0, int64_t r1, int act,      \
                            const void *nx, int64_t nxb) {                                    \
    const cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                   \
    const qx_pf pg = {wg + r1 * rb, 0, 0, cyllm_qpf_bytes};                                   \
    const qx_pf pu = {wu + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                \
    float g[16], u[16];                                                                       \
    for (int64_t r = r0; r < r1; r += 16) {                                                   \
        const int64_t e = r + 16 < r1 ? r + 16 : r1;                                          \
        F##_range(g, wg, rb, &a, n, r, e, 0, &pg);                                            \
        F##_range(u, wu, rb, &a, n, r, e, 0, &pu);                                            \
        for (int64_t i = r; i < e; i++) out[i] = cyllm_qact_apply(act, g[i - r]) * u[i - r]; \
    }                                                                                         \
}

/* Row kernels that compute exact block totals (q8_0, q5_0, q5_1 and the K-quants below 512
 * bits, q5_k everywhere) serve prefills too short for their tiles: a row against up to QX_RC
 * tokens per load and unpacking of the row, with the tiles' bits. ROW(C, o, ldo, w0, a, nb, add, pfp) runs one
 * row against C tokens; F##_gemm_rows is the GEMM of those rows. */
#define QX_RC 4
#define QX_GEMM_ROWS(F, ACT, BLK, ROW)                                                           \
static void F##_gemm_rows(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                          int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {  \
    const int64_t nb = n / (BLK);                                                               \
    for (int64_t t0 = 0; t0 < T; t0 += QX_RC) {                                                 \
        const int C = T - t0 < QX_RC ? (int)(T - t0) : QX_RC;                                   \
        cyllm_qact_view a[QX_RC];                                                               \
        for (int t = 0; t < C; t++) a[t] = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, ACT); \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            float *o = out + t0 * ldo + r;                                                      \
            const uint8_t *wr = w + r * rb;                                                     \
            switch (C) {                                                                        \
            case 4: ROW(4, o, ldo, wr, a, nb, add, wr); break;                                  \
            case 3: ROW(3, o, ldo, wr, a, nb, add, wr); break;                                  \
            case 2: ROW(2, o, ldo, wr, a, nb, add, wr); break;                                  \
            default: ROW(1, o, ldo, wr, a, nb, add, wr); break;                                 \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

/* one row against C tokens (decode: C = 1; short prefills), 8 blocks at a time through
 * GROUP(C, kind, m, A, B, w0, a, b0, pfp), the accumulators of chains A and B; o[t * ldo]
 * gets hsum8(A) + SB hsum8(B) (SB: -1, +1, or 0 where a format has one chain) */
#define QX_LANES_ROW(NAME, GROUP, SB)                                                            \
ALWAYS void NAME(const int C, const int kind, float *o, int64_t ldo, const uint8_t *w0,        \
                 const cyllm_qact_view *a, int64_t nb, int add, const uint8_t *pfp) {           \
    __m256 A[QX_RC], B[QX_RC];                                                                  \
    for (int t = 0; t < C; t++) A[t] = B[t] = _mm256_setzero_ps();                              \
    int64_t b = 0;                                                                              \
    for (; b + 8 <= nb; b += 8) GROUP(C, kind, 8, A, B, w0, a, b, pfp);                        \
    if (b < nb) GROUP(C, kind, (int)(nb - b), A, B, w0, a, b, pfp);                            \
    for (int t = 0; t < C; t++) {                                                               \
        const float r = (SB) < 0 ? hsum8(A[t]) - hsum8(B[t])                                    \
                        : (SB) > 0 ? hsum8(A[t]) + hsum8(B[t]) : hsum8(A[t]);                   \
        o[t * ldo] = add ? o[t * ldo] + r : r;                                                  \
    }                                                                                           \
}

/* The decode side of a row kernel ROW(C, o, ldo, w0, a, nb, add, pfp) (one row against C
 * tokens): F##_range (rows [r0, r1) of one activation, one linear stream), the decode
 * entries (QX_DECODE) and the row prefill F##_gemm_rows (QX_GEMM_ROWS) */
#define QX_ROW_ENTRIES(F, ACT, BLK, ROW)                                                         \
static void F##_range(float *o, const uint8_t *w, int64_t rb, const cyllm_qact_view *a, int64_t n, \
                      int64_t r0, int64_t r1, int add, const qx_pf *pf) {                       \
    for (int64_t r = r0; r < r1; r++)                                                           \
        ROW(1, o + (r - r0), 0, w + r * rb, a, n / (BLK), add, pf_base(w + r * rb, pf));         \
}                                                                                               \
QX_DECODE(F, ACT)                                                                               \
QX_GEMM_ROWS(F, ACT, BLK, ROW)

/* 8 f16 (the low word of each h[i]) -> 8 floats, in registers (a store of 8 words and a
 * vector load of them would stall on store forwarding) */
ALWAYS __m256 h8x8(const __m128i h[8]) {
    const __m128i h01 = _mm_unpacklo_epi16(h[0], h[1]), h23 = _mm_unpacklo_epi16(h[2], h[3]);
    const __m128i h45 = _mm_unpacklo_epi16(h[4], h[5]), h67 = _mm_unpacklo_epi16(h[6], h[7]);
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_unpacklo_epi32(h01, h23), _mm_unpacklo_epi32(h45, h67)));
}

/* token j of `lanes` tokens into lines of x transposed: elements 4g..4g+3 of token j go to
 * q + 4 (lanes g + j), so one line holds 4 elements of every token */
static void xpose_lines(uint8_t *q, const int8_t *x, int64_t n, int lanes, int j) {
    for (int64_t g = 0; g < n / 4; g++) memcpy(q + 4 * (lanes * g + j), x + 4 * g, 4);
}

/* live lanes of a group of m <= 8 blocks */
ALWAYS __m256i live8(const int m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* x's scales of blocks b0 .. b0+m-1 (past the row's end: 0, so an exact +0 joins those lanes) */
ALWAYS __m256 dx8(const cyllm_qact_view *a, int64_t b0, const int m) {
    return m == 8 ? _mm256_loadu_ps(a->d + b0) : _mm256_maskload_ps(a->d + b0, live8(m));
}

/* the end of a group of m blocks with one chain: token t's A takes the blocks' exact totals
 * (hsum8i_x8 of their int32 lanes v[t][.]) times d dx, block b0 + i in lane i */
ALWAYS void chain1(const int C, const int m, __m256 *A, __m256i v[][8], const __m128i dd[8],
                   const cyllm_qact_view *a, int64_t b0) {
    const __m256 d = h8x8(dd);
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++)
        A[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8i_x8(v[t])), _mm256_mul_ps(d, dx8(&a[t], b0, m)), A[t]);
}

/* Prefill with 8 tokens in a ymm's lanes (q8_0, q5_0, q5_1 and the K-quants below 512
 * bits): up to QX_LTOKENS tokens transposed at a time (PFX##_xprep), QX_LR
 * rows unpacked at a time (PFX##_wprep) and run against every block of 8 tokens
 * (PFX##_tile). The body of a GEMM entry (its parameters: out, ldo, w, rb, xq, xs, T, n, r0,
 * r1, add). The buffers are malloc'd per call and thread; without them, or with fewer than
 * TILE_MIN tokens (the tile's lanes would idle), ROWS, the decode rows, gives the same bits. */
#define QX_LR 4             /* rows of a lanes tile (x 8 tokens) */
#define QX_LTOKENS 128      /* tokens whose x is transposed at a time */
#define QX_LANES_GEMM(PFX, KIND, ROWS, TILE_MIN)                                                 \
    const int64_t tc = T < QX_LTOKENS ? T : QX_LTOKENS;                                          \
    const int64_t nblk = (tc + 7) / 8;                                                           \
    const size_t xb = PFX##_x_bytes(n), wb = PFX##_w_bytes(n);                                   \
    uint8_t *buf = T < (TILE_MIN) ? NULL : (uint8_t *)_mm_malloc((size_t)nblk * xb + wb, 64);    \
    if (!buf) {                                                                                  \
        ROWS(out, ldo, w, rb, xq, xs, T, n, r0, r1, add);                                        \
        return;                                                                                  \
    }                                                                                            \
    PFX##_w wp = PFX##_w_at(buf + nblk * xb, n);                                                 \
    for (int64_t t0 = 0; t0 < T; t0 += tc) {                                                     \
        const int64_t tn = T - t0 < tc ? T - t0 : tc;                                            \
        for (int64_t k = 0; k * 8 < tn; k++) {                                                   \
            PFX##_x x = PFX##_x_at(buf + k * xb, n);                                             \
            PFX##_xprep(&x, xq, xs, t0 + 8 * k, tn - 8 * k < 8 ? (int)(tn - 8 * k) : 8, n);      \
        }                                                                                        \
        for (int64_t r = r0; r < r1; r += QX_LR) {                                               \
            const int nr = r1 - r < QX_LR ? (int)(r1 - r) : QX_LR;                               \
            PFX##_wprep(KIND, &wp, w, rb, r, nr, n);                                             \
            for (int64_t k = 0; k * 8 < tn; k++) {                                               \
                const PFX##_x x = PFX##_x_at(buf + k * xb, n);                                   \
                PFX##_tile(KIND, out + (t0 + 8 * k) * ldo + r, ldo, &wp, &x, n, nr,              \
                           tn - 8 * k < 8 ? (int)(tn - 8 * k) : 8, add);                         \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    _mm_free(buf);

/* ---- activation quantization (same bytes as quantize_act_generic) ------------------- */

/* 32 floats -> 32 int8 at q (given the inverse scale); returns the int32 lanes' sums
 * of elements 0-15 (*s0) and 16-31 (*s1) */
ALWAYS void q32(int8_t *q, const float *x, float id, int32_t *s0, int32_t *s1) {
    const __m256 v = _mm256_set1_ps(id);
    const int rm = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), v), rm));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8), v), rm));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16), v), rm));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 24), v), rm));
    *s0 = hsum8i(_mm256_add_epi32(i0, i1));
    *s1 = hsum8i(_mm256_add_epi32(i2, i3));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
}

static void QF(quantize_act_x86_)(void *xq, const float *x, int64_t n, int act, int64_t b0, int64_t b1) {
    const int blk = act == CYLLM_QA_Q8_K ? QK_K : 32;
    char *p = (char *)xq;
    const int64_t nb = n / blk;
    float *d = (float *)(p + n);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * blk;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < blk; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + i), absmask));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        int8_t *qb = (int8_t *)p + b * blk;
        int32_t s0, s1;
        if (act == CYLLM_QA_Q8_0) {
            q32(qb, xb, id, &s0, &s1);
            ((int32_t *)(p + n + 4 * nb))[b] = s0 + s1;
        } else {
            int16_t *bs = (int16_t *)(p + n + 4 * nb) + b * 16;
            for (int g = 0; g < 8; g++) {
                q32(qb + 32 * g, xb + 32 * g, id, &s0, &s1);
                bs[2 * g] = (int16_t)s0;
                bs[2 * g + 1] = (int16_t)s1;
            }
        }
    }
}

/* ---- 32-block formats ---------------------------------------------------------------
 * Every kernel computes ONE row against C activations (tokens): C = 1 in decode, QX_C in
 * the prefill GEMM, where the row's unpacking (nibbles, 5th bits, scales) is done once
 * for C tokens. Each token's own operations run in the same order for every C, so a
 * (row, token) result has the same bits in decode and prefill. o[j * ldo] gets token j.
 * kind: 0 q4_0, 1 q4_1, 2 q5_0, 3 q5_1 (nibble formats); q8_0 has its own kernels. */

/* 5th bits of one pair of q5 blocks -> bytes 0x10 where set: lo (elements 0-15 of both
 * blocks, 128-bit lanes = blocks) and hi (elements 16-31) */
ALWAYS void q5_bits(uint32_t h0, uint32_t h1, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_setr_epi32((int)h0, (int)h0, (int)h0, (int)h0, (int)h1, (int)h1, (int)h1, (int)h1);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sel_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i sel_hi = _mm256_add_epi8(sel_lo, _mm256_set1_epi8(2));
    const __m256i x10 = _mm256_set1_epi8(0x10);
    __m256i a = _mm256_and_si256(_mm256_shuffle_epi8(v, sel_lo), bit);
    __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(v, sel_hi), bit);
    *lo = _mm256_and_si256(_mm256_cmpeq_epi8(a, bit), x10);
    *hi = _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), x10);
}

/* The activation side of block pair (b, b+1) of the nibble formats, as the dot product
 * wants it: x's bytes in the nibbles' order (lo: elements 0-15 of both blocks, hi: 16-31),
 * x's scale per block in lanes 0-3 / 4-7, and aux: the integer accumulator's start
 * (q4_0/q5_0: -offset * sum(q_x) / 4 per lane) or the min term's x factor (q4_1/q5_1:
 * d_x * sum(q_x) / 4, as float bits). The same for every row: decode prepares it once per
 * call (qx_xprep), prefill per token and row; the arithmetic is the same either way. */
typedef struct { __m256i lo, hi, aux; __m256 dx; } qx_xpair;

ALWAYS qx_xpair x_pair(const int kind, const cyllm_qact_view *a, int64_t b, int two) {
    const int has_min = kind == 1 || kind == 3;
    const int shift = kind == 0 ? 1 : 2;             /* offset/4 = 2 (q4_0) or 4 (q5_0) */
    const int8_t *xb = a->q + b * 32;
    qx_xpair p;
    __m256i s;
    if (two) {
        p.lo = load2x128((const uint8_t *)xb, (const uint8_t *)(xb + 32));
        p.hi = load2x128((const uint8_t *)(xb + 16), (const uint8_t *)(xb + 48));
        p.dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(
                   _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a->d + b)))), IDX01);
        s = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(
                _mm_loadl_epi64((const __m128i *)(a->sum + b))), IDX01);
    } else {
        p.lo = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)xb));
        p.hi = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
        p.dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ss(a->d + b)), IDX01);
        s = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_cvtsi32_si128(a->sum[b])), IDX01);
    }
    if (!has_min) p.aux = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, shift));
    else p.aux = _mm256_castps_si256(_mm256_mul_ps(p.dx, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(0.25f))));
    return p;
}

/* one row against C activations whose block pairs come from `pair(j, b, two)` */
#define ROWS32_BODY(PAIR)                                                                    \
    const int bb = kind == 0 ? QB_Q4_0 : kind == 1 ? QB_Q4_1 : kind == 2 ? QB_Q5_0 : QB_Q5_1; \
    const int qs_off = kind == 0 ? 2 : kind == 1 ? 4 : kind == 2 ? 6 : 8;                   \
    const int has_min = kind == 1 || kind == 3;                                              \
    const int five = kind >= 2;                                                              \
    const __m256i m15 = _mm256_set1_epi8(15);                                                \
    __m256 acc[QX_C], accm[QX_C];                                                            \
    _Pragma("GCC unroll 4")                                                                  \
    for (int j = 0; j < C; j++) { acc[j] = _mm256_setzero_ps(); accm[j] = _mm256_setzero_ps(); } \
    for (int64_t b = 0; b < nb; b += 2) {                                                    \
        const int two = b + 1 < nb;                                                          \
        const uint8_t *p0 = w0 + b * bb;                                                     \
        const uint8_t *p1 = two ? p0 + bb : p0;                                              \
        PREFETCH(pfp + b * bb);                                                              \
        __m256i v = load2x128(p0 + qs_off, p1 + qs_off);                                     \
        __m256i lo = _mm256_and_si256(v, m15);                                               \
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);                         \
        if (five) {                                                                          \
            __m256i hl, hh;                                                                  \
            q5_bits(cyllm_rd32(p0 + (kind == 2 ? 2 : 4)), two ? cyllm_rd32(p1 + (kind == 2 ? 2 : 4)) : 0, \
                    &hl, &hh);                                                               \
            lo = _mm256_or_si256(lo, hl);                                                    \
            hi = _mm256_or_si256(hi, hh);                                                    \
        }                                                                                    \
        const __m256 wd = h2x4(p0, two ? p1 : (const uint8_t *)&qx_zero_h);                  \
        const __m256 wm = has_min ? h2x4(p0 + 2, two ? p1 + 2 : (const uint8_t *)&qx_zero_h) : wd; \
        _Pragma("GCC unroll 4")                                                              \
        for (int j = 0; j < C; j++) {                                                        \
            const qx_xpair xp = PAIR;                                                        \
            __m256i isum = DOT2(has_min ? _mm256_setzero_si256() : xp.aux, lo, xp.lo, hi, xp.hi); \
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(wd, xp.dx), acc[j]); \
            if (has_min) accm[j] = _mm256_fmadd_ps(wm, _mm256_castsi256_ps(xp.aux), accm[j]);  \
        }                                                                                    \
    }                                                                                        \
    _Pragma("GCC unroll 4")                                                                  \
    for (int j = 0; j < C; j++) {                                                            \
        float r = hsum8(has_min ? _mm256_add_ps(acc[j], accm[j]) : acc[j]);                  \
        o[j * ldo] = add ? o[j * ldo] + r : r;                                               \
    }

ALWAYS void rows32(const int C, const int kind, float *o, int64_t ldo, const uint8_t *w0,
                   const cyllm_qact_view *a, int64_t nb, int add, const uint8_t *pfp) {
    ROWS32_BODY(x_pair(kind, &a[j], b, two))
}

/* decode: one row against the pairs qx_xprep prepared (C = 1) */
ALWAYS void rows32p(const int kind, float *o, const uint8_t *w0, const qx_xpair *xps,
                    int64_t nb, int add, const uint8_t *pfp) {
    const int C = 1;
    const int64_t ldo = 0;
    ROWS32_BODY(xps[b >> 1])
}

/* prefill: one row against C activations, activation j's pairs at xps + j * np */
ALWAYS void rows32pc(const int C, const int kind, float *o, int64_t ldo, const uint8_t *w0,
                     const qx_xpair *xps, int64_t np, int64_t nb, int add) {
    const uint8_t *pfp = w0;
    ROWS32_BODY(xps[j * np + (b >> 1)])
}

/* the pairs of a whole activation, once per call: at most QX_XPAIRS of them (128 bytes
 * each, on the stack); longer rows take the per-row path */
#define QX_XPAIRS 256
ALWAYS void qx_xprep(const int kind, qx_xpair *xp, const cyllm_qact_view *a, int64_t nb) {
    for (int64_t b = 0; b < nb; b += 2) xp[b >> 1] = x_pair(kind, a, b, b + 1 < nb);
}

#if QX_VNNI < 2
/* ---- ymm q8_0: exact block totals -----------------------------------------------------
 * Decode and prefill compute, for each (row, token) and block b, the exact integer
 * S_b = sum_k w_k x_k, and then one float chain: lane b % 8 of an 8-lane accumulator takes
 * fma(S_b, d_b dx_b); the result is hsum8 of it. The integers can be summed in any order,
 * so the two paths are free to compute them their own way:
 * - decode (one row, one token, weights streamed from DRAM) takes the sign trick's 8 int32
 *   lanes per block and reduces 8 blocks at a time (hsum8i_x8); prefills of fewer than
 *   K8T_TILE_MIN tokens run these rows too, up to QX_RC tokens per load of a row;
 * - prefill puts 8 tokens in the lanes of a ymm: x is transposed (one 32-byte line holds
 *   elements 4g..4g+3 of 8 tokens) and one DPBUSD takes a row's 4 |w| (broadcast) against
 *   the line signed by the 4 w (broadcast), so a block's 8 DPBUSD give the 8 tokens' S_b
 *   with nothing to reduce, and the float work (cvt, scale, FMA) is once per (row, block,
 *   8 tokens) instead of once per (row, block, token): the row-major kernel it replaces
 *   spent half its instructions there.
 * Bounds: |w| <= 128, |x| <= 127: maddubs pairs <= 32512; |S_b| <= 32 * 128 * 127 < 2^19,
 * exact in float. */
#ifndef K8T_TILE_MIN
#define K8T_TILE_MIN 16     /* fewer tokens take the rows (avx2, 5632x2048, 1 thread: T = 12
                               rows 3.07 ms, tile 3.92; T = 16 rows 4.11, tile 3.89) */
#endif

/* blocks b0 .. b0+m-1 (m <= 8) of one row into the chains' accumulators of C tokens */
ALWAYS void k8t_group(const int C, const int kind, const int m, __m256 *A, __m256 *B, const uint8_t *w0,
                      const cyllm_qact_view *a, int64_t b0, const uint8_t *pfp) {
    (void)kind, (void)B;                    /* one format, one chain */
    __m256i v[QX_RC][8];
    __m128i dd[8];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) {
        if (i < m) {
            const uint8_t *p = w0 + (b0 + i) * QB_Q8_0;
            if ((i & 1) == 0) PREFETCH(pfp + (b0 + i) * QB_Q8_0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(p + 2));
            const __m256i wabs = _mm256_sign_epi8(w, w);
            _Pragma("GCC unroll 4")
            for (int t = 0; t < C; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a[t].q + (b0 + i) * 32));
                v[t][i] = DPBUSD(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(x, w));
            }
            dd[i] = _mm_cvtsi32_si128(cyllm_rd16(p));
        } else {
            for (int t = 0; t < C; t++) v[t][i] = _mm256_setzero_si256();
            dd[i] = _mm_setzero_si128();
        }
    }
    chain1(C, m, A, v, dd, a, b0);
}


QX_LANES_ROW(k8t_row, k8t_group, 0)
#define K8T_ROW(C, o, ldo, w0, a, nb, add, pfp) k8t_row(C, 0, o, ldo, w0, a, nb, add, pfp)
QX_ROW_ENTRIES(k8t, CYLLM_QA_Q8_0, 32, K8T_ROW)

/* 8 tokens of x, transposed (token j in lane j; tokens past the end: zeros) */
typedef struct {
    uint8_t *q;             /* (n / 4, 8, 4): elements 4g..4g+3 of token j at 32 g + 4 j */
    float *dx;              /* (nb, 8) */
} k8t_x;

/* QX_LR rows: w, |w| and the block scales as floats (rows past the group's end: zeros) */
typedef struct {
    uint8_t *w, *abs;       /* (QX_LR, n) each */
    float *d;               /* (QX_LR, nb) */
} k8t_w;

static size_t k8t_x_bytes(int64_t n) { return (size_t)8 * n + (size_t)(n / 32) * 32; }
static size_t k8t_w_bytes(int64_t n) { return (size_t)QX_LR * (2 * n + (n / 32) * 4); }

static k8t_x k8t_x_at(uint8_t *p, int64_t n) {
    k8t_x x = {p, (float *)(p + 8 * n)};
    return x;
}

static k8t_w k8t_w_at(uint8_t *p, int64_t n) {
    k8t_w w = {p, p + (size_t)QX_LR * n, (float *)(p + (size_t)2 * QX_LR * n)};
    return w;
}

/* tokens t .. t+nt-1 (nt <= 8) of xq -> x */
static void k8t_xprep(k8t_x *x, const void *xq, int64_t xs, int64_t t, int nt, int64_t n) {
    const int64_t nb = n / 32;
    if (nt < 8) {
        memset(x->q, 0, (size_t)8 * n);
        memset(x->dx, 0, (size_t)nb * 32);
    }
    for (int j = 0; j < nt; j++) {
        const cyllm_qact_view a = cyllm_qact_split((const char *)xq + (t + j) * xs, n, CYLLM_QA_Q8_0);
        xpose_lines(x->q, a.q, n, 8, j);
        for (int64_t b = 0; b < nb; b++) x->dx[8 * b + j] = a.d[b];
    }
}

/* rows r .. r+nr-1 (nr <= QX_LR) of w -> the panel */
static void k8t_wprep(const int kind, k8t_w *p, const uint8_t *w, int64_t rb, int64_t r, int nr, int64_t n) {
    (void)kind;                             /* q8_0 only */
    const int64_t nb = n / 32;
    for (int i = 0; i < QX_LR; i++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *q = p->w + i * n + 32 * b, *qa = p->abs + i * n + 32 * b;
            if (i >= nr) {
                memset(q, 0, 32);
                memset(qa, 0, 32);
                p->d[i * nb + b] = 0.0f;
                continue;
            }
            const uint8_t *blk = w + (r + i) * rb + b * QB_Q8_0;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 2));
            _mm256_storeu_si256((__m256i *)q, v);
            _mm256_storeu_si256((__m256i *)qa, _mm256_sign_epi8(v, v));
            p->d[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk));
        }
    }
}

/* QX_LR rows (nr of them real) x 8 tokens (nt real) over every block; o[j * ldo + i] gets
 * (row i, token j) */
static void k8t_tile(const int kind, float *o, int64_t ldo, const k8t_w *p, const k8t_x *x, int64_t n, int nr,
                     int nt, int add) {
    (void)kind;
    const int64_t nb = n / 32;
    __m256 acc[QX_LR][8];                   /* row i, lane b % 8: tokens in lanes */
    for (int i = 0; i < QX_LR; i++)
        for (int l = 0; l < 8; l++) acc[i][l] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i S[QX_LR];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++) S[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 8; g++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (32 * b + 4 * g) * 8));
            _Pragma("GCC unroll 8")
            for (int i = 0; i < QX_LR; i++) {
                const __m256i ws = _mm256_set1_epi32((int)cyllm_rd32(p->w + i * n + 32 * b + 4 * g));
                const __m256i wa = _mm256_set1_epi32((int)cyllm_rd32(p->abs + i * n + 32 * b + 4 * g));
                S[i] = DPBUSD(S[i], wa, _mm256_sign_epi8(xv, ws));
            }
        }
        const __m256 dx = _mm256_loadu_ps(x->dx + 8 * b);
        const int l = (int)(b & 7);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++)
            acc[i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[i]), _mm256_mul_ps(_mm256_set1_ps(p->d[i * nb + b]), dx),
                                        acc[i][l]);
    }
    for (int i = 0; i < nr; i++) {
        const __m256 *v = acc[i];           /* hsum8's tree, lane by lane */
        const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                                       _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));
        float r[8];
        _mm256_storeu_ps(r, t);
        for (int j = 0; j < nt; j++) o[j * ldo + i] = add ? o[j * ldo + i] + r[j] : r[j];
    }
}

static void QF(gemm_k8t)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {
    QX_LANES_GEMM(k8t, 0, k8t_gemm_rows, K8T_TILE_MIN)
}
#endif

#if QX_VNNI < 2
/* ---- ymm q5_0 / q5_1: exact block totals ---------------------------------------------------
 * As q8_0 above: for each (row, token) and block b the exact integer S_b = sum q x of the
 * codes (0..31), less 16 times x's block sum for q5_0; chain A takes fma(S_b, d_b dx_b) in
 * lane b % 8, and for q5_1 chain B takes fma(sum_x, m_b dx_b) (the min term); the result is
 * hsum8(A) (+ hsum8(B)). Decode reduces 8 blocks' int32 lanes at a time; prefill puts 8
 * tokens in a ymm's lanes (a vpmaddubsw per 4 codes of a row against 8 tokens, 4 lines
 * added in int16 before one vpmaddwd: 4 x 2 * 31 * 127 = 31496).
 * The code takes the nibble formats' kind (0 q4_0, 1 q4_1, 2 q5_0, 3 q5_1; 4-bit codes add
 * 8 lines in int16), but q4_0 and q4_1 keep their row kernels (rows32: two blocks a
 * register, x's pairs prepared once a call): on these, TinyLlama Q4_0's decode at 1 thread
 * ran 0.875x the row kernel's (prefill 1.16x; Zen 4 on the avx2 tables), where q5_0's
 * prefill gained 1.70x for a decode of 0.98x.
 * Bounds: |S_b| <= 32 * 31 * 127 + 16 * 32 * 127. */
#ifndef K32_TILE_MIN
#define K32_TILE_MIN 8      /* fewer tokens take the rows */
#endif

/* 5th bits h (bit j: element j) -> bytes 0x10 where set, element j in byte j */
ALWAYS __m256i q5_bits32(uint32_t h) {
    const __m256i v = _mm256_set1_epi32((int)h);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i a = _mm256_and_si256(_mm256_shuffle_epi8(v, sel), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(a, bit), _mm256_set1_epi8(0x10));
}

/* the 32 codes of one block at p, element j in byte j */
ALWAYS __m256i k32_codes(const int kind, const uint8_t *p) {
    const int qs = kind == 0 ? 2 : kind == 1 ? 4 : kind == 2 ? 6 : 8;
    const __m128i v = _mm_loadu_si128((const __m128i *)(p + qs)), m15 = _mm_set1_epi8(15);
    const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m15)),
                                              _mm_and_si128(_mm_srli_epi16(v, 4), m15), 1);
    return kind >= 2 ? _mm256_or_si256(c, q5_bits32(cyllm_rd32(p + (kind == 2 ? 2 : 4)))) : c;
}

ALWAYS int k32_bytes(const int kind) { return kind == 0 ? QB_Q4_0 : kind == 1 ? QB_Q4_1 : kind == 2 ? QB_Q5_0 : QB_Q5_1; }

/* blocks b0 .. b0+m-1 (m <= 8) of one row into the chains' accumulators of C tokens */
ALWAYS void k32_group(const int C, const int kind, const int m, __m256 *A, __m256 *B, const uint8_t *w0,
                      const cyllm_qact_view *a, int64_t b0, const uint8_t *pfp) {
    const int bb = k32_bytes(kind), has_min = kind & 1, off = kind == 0 ? 3 : kind == 2 ? 4 : 0;
    __m256i v[QX_RC][8];
    __m128i dd[8], mm[8];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) {
        if (i < m) {
            const uint8_t *p = w0 + (b0 + i) * bb;
            if ((i & 1) == 0) PREFETCH(pfp + (b0 + i) * bb);
            const __m256i cod = k32_codes(kind, p);
            _Pragma("GCC unroll 4")
            for (int t = 0; t < C; t++)
                v[t][i] = DPBUSD(_mm256_setzero_si256(), cod,
                                 _mm256_loadu_si256((const __m256i *)(a[t].q + (b0 + i) * 32)));
            dd[i] = _mm_cvtsi32_si128(cyllm_rd16(p));
            mm[i] = has_min ? _mm_cvtsi32_si128(cyllm_rd16(p + 2)) : _mm_setzero_si128();
        } else {
            for (int t = 0; t < C; t++) v[t][i] = _mm256_setzero_si256();
            dd[i] = mm[i] = _mm_setzero_si128();
        }
    }
    const __m256 d = h8x8(dd);
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        /* past the row's end the scales and sums read as 0 */
        const __m256 dx = dx8(&a[t], b0, m);
        const __m256i sx = m == 8 ? _mm256_loadu_si256((const __m256i *)(a[t].sum + b0))
                                  : _mm256_maskload_epi32(a[t].sum + b0, live8(m));
        __m256i S = hsum8i_x8(v[t]);
        if (off) S = _mm256_sub_epi32(S, _mm256_slli_epi32(sx, off));
        A[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, dx), A[t]);
        if (has_min) B[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sx), _mm256_mul_ps(h8x8(mm), dx), B[t]);
    }
}


QX_LANES_ROW(k32_row, k32_group, (kind & 1))

/* 8 tokens of x, transposed (token j in lane j; tokens past the end: zeros) */
typedef struct {
    uint8_t *q;             /* (n / 4, 8, 4): elements 4g..4g+3 of token j at 32 g + 4 j */
    int32_t *sum;           /* (nb, 8): x's block sums */
    float *sumf;            /* (nb, 8): the same as floats (the min term) */
    float *dx;              /* (nb, 8) */
} k32_x;

/* QX_LR rows unpacked (rows past the group's end: zeros) */
typedef struct {
    uint8_t *q;             /* (QX_LR, n): codes */
    float *d, *m;           /* (QX_LR, nb) */
} k32_w;

static size_t k32_x_bytes(int64_t n) { return (size_t)8 * n + (size_t)(n / 32) * 96; }
static size_t k32_w_bytes(int64_t n) { return (size_t)QX_LR * (n + (size_t)(n / 32) * 8); }

static k32_x k32_x_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / 32;
    k32_x x;
    x.q = p;
    x.sum = (int32_t *)(p + 8 * n);
    x.sumf = (float *)(x.sum + 8 * nb);
    x.dx = x.sumf + 8 * nb;
    return x;
}

static k32_w k32_w_at(uint8_t *p, int64_t n) {
    k32_w w = {p, (float *)(p + QX_LR * n), (float *)(p + QX_LR * n) + QX_LR * (n / 32)};
    return w;
}

/* tokens t .. t+nt-1 (nt <= 8) of xq -> x */
static void k32_xprep(k32_x *x, const void *xq, int64_t xs, int64_t t, int nt, int64_t n) {
    const int64_t nb = n / 32;
    if (nt < 8) memset(x->q, 0, k32_x_bytes(n));
    for (int j = 0; j < nt; j++) {
        const cyllm_qact_view a = cyllm_qact_split((const char *)xq + (t + j) * xs, n, CYLLM_QA_Q8_0);
        xpose_lines(x->q, a.q, n, 8, j);
        for (int64_t b = 0; b < nb; b++) {
            x->sum[8 * b + j] = a.sum[b];
            x->sumf[8 * b + j] = (float)a.sum[b];
            x->dx[8 * b + j] = a.d[b];
        }
    }
}

/* rows r .. r+nr-1 (nr <= QX_LR) of w -> the panel */
static void k32_wprep(const int kind, k32_w *p, const uint8_t *w, int64_t rb, int64_t r, int nr, int64_t n) {
    const int64_t nb = n / 32;
    const int bb = k32_bytes(kind);
    if (nr < QX_LR) memset(p->q, 0, k32_w_bytes(n));    /* rows past the end: zeros */
    for (int i = 0; i < nr; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (r + i) * rb + b * bb;
            _mm256_storeu_si256((__m256i *)(p->q + i * n + 32 * b), k32_codes(kind, blk));
            p->d[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk));
            p->m[i * nb + b] = (kind & 1) ? _cvtsh_ss(cyllm_rd16(blk + 2)) : 0.0f;
        }
    }
}

/* QX_LR rows (nr real) x 8 tokens (nt real) over every block; o[j * ldo + i] gets (row i,
 * token j) */
ALWAYS void k32_tile(const int kind, float *o, int64_t ldo, const k32_w *w, const k32_x *x, int64_t n, int nr,
                     int nt, int add) {
    const int64_t nb = n / 32;
    const int run = kind >= 2 ? 4 : 8, has_min = kind & 1, off = kind == 0 ? 3 : kind == 2 ? 4 : 0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][QX_LR][8];                 /* A, B of row i, lane b % 8: tokens in lanes */
    for (int h = 0; h < 1 + has_min; h++)
        for (int i = 0; i < QX_LR; i++)
            for (int l = 0; l < 8; l++) acc[h][i][l] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *xb = x->q + b * 32 * 8;
        __m256i S[QX_LR];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++) S[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 2")
        for (int r0 = 0; r0 < 8; r0 += run) {
            __m256i h[QX_LR];
            _Pragma("GCC unroll 8")
            for (int g = 0; g < run; g++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + 32 * (r0 + g)));
                _Pragma("GCC unroll 8")
                for (int i = 0; i < QX_LR; i++) {
                    const __m256i pr = _mm256_maddubs_epi16(
                        _mm256_set1_epi32((int)cyllm_rd32(w->q + i * n + 32 * b + 4 * (r0 + g))), xv);
                    h[i] = g ? _mm256_add_epi16(h[i], pr) : pr;
                }
            }
            _Pragma("GCC unroll 8")
            for (int i = 0; i < QX_LR; i++) S[i] = _mm256_add_epi32(S[i], _mm256_madd_epi16(h[i], ones));
        }
        const __m256 dx = _mm256_loadu_ps(x->dx + 8 * b);
        const __m256i so = off ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(x->sum + 8 * b)), off)
                               : _mm256_setzero_si256();
        const int l = (int)(b & 7);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++) {
            const __m256i Si = off ? _mm256_sub_epi32(S[i], so) : S[i];
            acc[0][i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Si), _mm256_mul_ps(_mm256_set1_ps(w->d[i * nb + b]), dx),
                                           acc[0][i][l]);
            if (has_min)
                acc[1][i][l] = _mm256_fmadd_ps(_mm256_loadu_ps(x->sumf + 8 * b),
                                               _mm256_mul_ps(_mm256_set1_ps(w->m[i * nb + b]), dx), acc[1][i][l]);
        }
    }
    for (int i = 0; i < nr; i++) {
        __m256 t[2];
        for (int h = 0; h < 1 + has_min; h++) {     /* hsum8's tree, lane by lane */
            const __m256 *v = acc[h][i];
            t[h] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                                 _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));
        }
        float r[8];
        _mm256_storeu_ps(r, has_min ? _mm256_add_ps(t[0], t[1]) : t[0]);
        for (int j = 0; j < nt; j++) o[j * ldo + i] = add ? o[j * ldo + i] + r[j] : r[j];
    }
}

#define K32_FORMAT(F, KIND)                                                                       \
QX_ROW_ENTRIES(F, CYLLM_QA_Q8_0, 32, F##_ROW)                                                   \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {  \
    QX_LANES_GEMM(k32, KIND, F##_gemm_rows, K32_TILE_MIN)                                       \
}
#define q5_0y_ROW(C, o, ldo, w0, a, nb, add, pfp) k32_row(C, 2, o, ldo, w0, a, nb, add, pfp)
#define q5_1y_ROW(C, o, ldo, w0, a, nb, add, pfp) k32_row(C, 3, o, ldo, w0, a, nb, add, pfp)
K32_FORMAT(q5_0y, 2)
K32_FORMAT(q5_1y, 3)
#endif

/* ---- K-quants --------------------------------------------------------------------- */

/* int16 element j of each 128-bit lane, broadcast across the lane */
#define BCAST16(v, j) _mm256_shuffle_epi8((v), _mm256_set1_epi16((short)((2 * (j)) | ((2 * (j) + 1) << 8))))

ALWAYS void k_scales16(const uint8_t *s, __m256i *sc16, __m128i *m16) {
    uint32_t a0 = cyllm_rd32(s), a1 = cyllm_rd32(s + 4), a2 = cyllm_rd32(s + 8);
    uint64_t sc = (uint64_t)(a0 & 0x3f3f3f3fu)
                  | ((uint64_t)((a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4)) << 32);
    uint64_t m = (uint64_t)(a1 & 0x3f3f3f3fu)
                 | ((uint64_t)(((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4)) << 32);
    *sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    *m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m));
}

/* q5_k's 8 sub-blocks of one superblock (at p) as 32 codes each (0..31): the nibbles of qs
 * and qh's bits 2c (sub-block 2c) and 2c + 1 (sub-block 2c + 1) */
ALWAYS void k5_codes(__m256i cod[8], const uint8_t *p) {
    const __m256i m15 = _mm256_set1_epi8(15), x10 = _mm256_set1_epi8(16);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) {       /* qh's bits 2c, 2c + 1 of each byte -> 16 (the bits
                                           shifted in from the byte above land past bit 1) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * c));
        cod[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), x10));
        cod[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15),
                                         _mm256_and_si256(_mm256_slli_epi16(qh, 3), x10));
        qh = _mm256_srli_epi16(qh, 2);
    }
}

/* q4_k (five = 0) / q5_k (five = 1) */
/* x's sums per 32 of superblock b (|.| <= 32 * 127: int16) as int32-packed pairs
 * (bs_2i, bs_2i+1), i = 0..3: the x side of a K-quant's min term in the r16-style kernels */
ALWAYS void x_sum_pairs(const cyllm_qact_view *a, int64_t b, int32_t pr[4]) {
    const __m128i ones = _mm_set1_epi16(1);
    const int16_t *bs = a->bsum + 16 * b;
    _mm_storeu_si128((__m128i *)pr, _mm_packs_epi32(
        _mm_madd_epi16(_mm_loadu_si128((const __m128i *)bs), ones),
        _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(bs + 8)), ones)));
}

/* ---- q4_k and q5_k: exact superblock totals ---------------------------------------------
 * Decode and prefill compute, for each (row, token) and superblock s, the exact integers
 * L_s = sum_k sc_k (q_k . x_k) and M_s = sum_k m_k bs_k (bs_k: x's codes summed over
 * sub-block k), and then one float chain: lane s % 8 of two 8-lane accumulators takes
 * A = fma(L_s, d_s dx_s, A) and B = fma(M_s, dmin_s dx_s, B); the result is
 * hsum8(A) - hsum8(B). The integers can be summed in any order, so each path computes them
 * its own way:
 * - decode (one row, one token, weights streamed from DRAM) takes 8 int32 lanes (L) and 4
 *   (M) per superblock from vpmaddubsw and vpmaddwd (vpdpwssd), the sub-block scales as
 *   int16 multipliers, and reduces 8 superblocks at a time (a transpose of blends and
 *   shuffles); prefills too short for a tile run these rows too, up to QX_RC tokens per
 *   unpacking of a row. Every table decodes q5_k so, and the ymm tables q4_k (AVX512-VNNI
 *   keeps its zmm q4_k kernels, k4z);
 * - prefill puts tokens in the lanes of a vector (8 in a ymm below 512 bits, k45y; 16 in a
 *   zmm for q5_k on AVX512-VNNI, k5t): x is transposed once per call (one line holds
 *   elements 4g..4g+3 of every token), rows are unpacked to codes, and one multiply-add
 *   takes a row's 4 codes (broadcast) against a line; the sub-block scale multiplies exact
 *   sub-block sums once per 32 elements. Each token lane then runs decode's float chain,
 *   so a token gets decode's bits.
 * Bounds: q . x over a sub-block <= 32 * 31 * 127 = 125984; times sc <= 63, over 8
 * sub-blocks: < 2^26. M: 8 * 63 * 32 * 127 < 2^21. */

/* the codes of one q4_k (five = 0) or q5_k superblock at p: cod[k] = sub-block k's 32 */
ALWAYS void k45_codes(const int five, __m256i cod[8], const uint8_t *p) {
    if (five) {
        k5_codes(cod, p);
        return;
    }
    const __m256i m15 = _mm256_set1_epi8(15);
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
        cod[2 * c] = _mm256_and_si256(v, m15);
        cod[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    }
}

/* superblock b of one row (at p) against C tokens (views a[0..C-1]): per token, 8 int32
 * lanes summing to L and 4 summing to M, into li[t][i] and mi[t][i].
 * In ymm registers also on AVX512-VNNI: the zmm form (two sub-blocks a register) needs a
 * 256-bit broadcast per pair of sub-blocks, and the shuffle ports bound this kernel on Zen
 * 4 (7% slower from cache). */
ALWAYS void k45_parts(const int C, const int five, const uint8_t *p, const cyllm_qact_view *a, int64_t b,
                      __m256i li[][8], __m128i mi[][8], int i) {
    __m256i sc16, cod[8];
    __m128i m16;
    k_scales16(p + 4, &sc16, &m16);         /* unpacked once for the C tokens */
    k45_codes(five, cod, p);
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        const int8_t *xb = a[t].q + b * QK_K;
        __m256i s = _mm256_setzero_si256();
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(xb + 64 * c));
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(xb + 64 * c + 32));
            /* pairs <= 2 * 31 * 127 = 7874 */
            s = DPWSSD(s, _mm256_maddubs_epi16(cod[2 * c], xl), BCAST16(sc16, 2 * c));
            s = DPWSSD(s, _mm256_maddubs_epi16(cod[2 * c + 1], xh), BCAST16(sc16, 2 * c + 1));
        }
        li[t][i] = s;
        /* x's sums per 32 from its 16 per-16 sums, against the 8 mins */
        const __m128i bs32 = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(a[t].bsum + 16 * b)),
                                            _mm_loadu_si128((const __m128i *)(a[t].bsum + 16 * b + 8)));
        mi[t][i] = _mm_madd_epi16(m16, bs32);
    }
}

/* superblocks b0 .. b0+m-1 (m <= 8) of one row into the chains' accumulators of C tokens */
ALWAYS void k45_group(const int C, const int five, const int m, __m256 *A, __m256 *B, const uint8_t *w0,
                      const cyllm_qact_view *a, int64_t b0, const uint8_t *pfp) {
    const int bb = five ? QB_Q5_K : QB_Q4_K;
    __m256i li[QX_RC][8];
    __m128i mi[QX_RC][8], dd[8];
    /* a loop, not unrolled: unrolled (the 8 superblocks' work interleaved), q5_k's decode
       in the model ran 15-20% slower at 1 thread although the isolated matvec was 1-2%
       faster (AVX512-VNNI, Zen 4) */
    _Pragma("GCC unroll 1")
    for (int i = 0; i < 8; i++) {
        if (i < m) {
            const uint8_t *p = w0 + (b0 + i) * bb;
            const uint8_t *f = pfp + (b0 + i) * bb;
            PREFETCH(f);
            PREFETCH(f + 64);
            PREFETCH(f + 128);
            k45_parts(C, five, p, a, b0 + i, li, mi, i);
            dd[i] = _mm_cvtsi32_si128((int)cyllm_rd32(p));     /* d, dmin (f16) */
        } else {
            for (int t = 0; t < C; t++) {
                li[t][i] = _mm256_setzero_si256();
                mi[t][i] = _mm_setzero_si128();
            }
            dd[i] = _mm_setzero_si128();
        }
    }
    /* the 8 (d, dmin) words into one vector in registers (a store of 8 words and a vector
       load of them would stall on store forwarding) */
    const __m128i d03 = _mm_unpacklo_epi64(_mm_unpacklo_epi32(dd[0], dd[1]), _mm_unpacklo_epi32(dd[2], dd[3]));
    const __m128i d47 = _mm_unpacklo_epi64(_mm_unpacklo_epi32(dd[4], dd[5]), _mm_unpacklo_epi32(dd[6], dd[7]));
    const __m256i ddv = _mm256_inserti128_si256(_mm256_castsi128_si256(d03), d47, 1);
    /* the low and high f16 of each 32-bit lane, as 8 floats each */
    const __m256i lo16 = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i hi16 = _mm256_add_epi8(lo16, _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(ddv, lo16), 0x08)));
    const __m256 dm = _mm256_cvtph_ps(_mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(ddv, hi16), 0x08)));
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        const __m256 dx = dx8(&a[t], b0, m);
        A[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8i_x8(li[t])), _mm256_mul_ps(d, dx), A[t]);
        B[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum4i_x8(mi[t])), _mm256_mul_ps(dm, dx), B[t]);
    }
}

QX_LANES_ROW(k45_row, k45_group, -1)
#define K4_ROW(C, o, ldo, w0, a, nb, add, pfp) k45_row(C, 0, o, ldo, w0, a, nb, add, pfp)
#define K5_ROW(C, o, ldo, w0, a, nb, add, pfp) k45_row(C, 1, o, ldo, w0, a, nb, add, pfp)
QX_ROW_ENTRIES(k5, CYLLM_QA_Q8_K, QK_K, K5_ROW)
#if QX_VNNI < 2
QX_ROW_ENTRIES(k4, CYLLM_QA_Q8_K, QK_K, K4_ROW)
#endif

/* ---- q6_k: exact superblock totals --------------------------------------------------------
 * As q4_k / q5_k above, with one integer per (row, token) and superblock s:
 * L_s = sum_k sc_k (q_k . x_k) - 32 sum_k sc_k bs_k (16 sub-blocks of 16, int8 scales,
 * codes 0..63, bs_k: x's codes summed over sub-block k), and one float chain: lane s % 8
 * of an 8-lane accumulator takes fma(L_s, d_s dx_s); the result is hsum8. Decode (all
 * tables but AVX512-VNNI, which keeps its zmm q6_k kernels) reduces 8 superblocks' int32
 * lanes at a time; the ymm prefill tile (k6y) puts 8 tokens in a ymm's lanes.
 * Bounds: |q . x| over a sub-block <= 16 * 63 * 127 = 128016, times |sc| <= 128, over 16
 * sub-blocks: < 2^28; the offset 32 * 16 * 128 * 16 * 127 < 2^27. L is exact in int32; its
 * conversion to float rounds, the same in both paths. */

/* the codes (0..63) of one q6_k superblock at p: cod[k] = elements 32k .. 32k+31 */
ALWAYS void k6_codes(__m256i cod[8], const uint8_t *p) {
    const __m256i m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        cod[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        cod[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        cod[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m30));
        cod[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
}

#if QX_VNNI < 2
/* superblock b of one row (at p) against C tokens: per token, 8 int32 lanes summing to L,
 * into li[t][i] */
ALWAYS void k6_parts(const int C, const uint8_t *p, const cyllm_qact_view *a, int64_t b, __m256i li[][8], int i) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    __m256i cod[8], acc[QX_RC];             /* in registers: li[.][i] is memory (i varies) */
    k6_codes(cod, p);
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(a[t].bsum + 16 * b));
        /* the -32 of every weight: 32 * sum_k sc_k * xsum_k */
        acc[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
    }
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        /* this half's 8 scales in both lanes; element 16j + e of a 32-run has scale 2j (low
           lane) or 2j + 1 (high lane) of its pair */
        const __m256i sh = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            const __m256i s = _mm256_shuffle_epi8(sh, _mm256_setr_epi8(
                4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1,
                4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1,
                4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3,
                4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3));
            _Pragma("GCC unroll 4")
            for (int t = 0; t < C; t++) {
                const int8_t *xb = a[t].q + b * QK_K + 128 * h + 32 * c;
                /* q in 0..63 unsigned: pairs <= 2 * 63 * 127 = 16002 */
                acc[t] = DPWSSD(acc[t], _mm256_maddubs_epi16(cod[4 * h + c], _mm256_loadu_si256((const __m256i *)xb)), s);
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) li[t][i] = acc[t];
}

/* superblocks b0 .. b0+m-1 (m <= 8) of one row into the chains' accumulators of C tokens */
ALWAYS void k6_group(const int C, const int kind, const int m, __m256 *A, __m256 *B, const uint8_t *w0,
                     const cyllm_qact_view *a, int64_t b0, const uint8_t *pfp) {
    (void)kind, (void)B;                    /* one format, one chain */
    __m256i li[QX_RC][8];
    __m128i dd[8];
    _Pragma("GCC unroll 1")
    for (int i = 0; i < 8; i++) {
        if (i < m) {
            const uint8_t *p = w0 + (b0 + i) * QB_Q6_K;
            const uint8_t *f = pfp + (b0 + i) * QB_Q6_K;
            PREFETCH(f);
            PREFETCH(f + 64);
            PREFETCH(f + 128);
            PREFETCH(f + 192);
            k6_parts(C, p, a, b0 + i, li, i);
            dd[i] = _mm_cvtsi32_si128(cyllm_rd16(p + 208));
        } else {
            for (int t = 0; t < C; t++) li[t][i] = _mm256_setzero_si256();
            dd[i] = _mm_setzero_si128();
        }
    }
    chain1(C, m, A, li, dd, a, b0);
}

QX_LANES_ROW(k6_row, k6_group, 0)
#define K6_ROW(C, o, ldo, w0, a, nb, add, pfp) k6_row(C, 0, o, ldo, w0, a, nb, add, pfp)
QX_ROW_ENTRIES(k6, CYLLM_QA_Q8_K, QK_K, K6_ROW)
#endif

#if QX_VNNI < 2
/* ---- ymm K-quant prefill: 8 tokens in a ymm's lanes ---------------------------------------
 * (the exact superblock totals above). x is transposed once per call (one 32-byte line
 * holds elements 4g..4g+3 of 8 tokens), QX_LR rows are unpacked to codes at a time, and a
 * vpmaddubsw takes a row's 4 codes (broadcast) against a line: 32 multiply-adds. The int16
 * pairs of a run of lines add up exactly before one vpmaddwd by its sub-block's scale:
 * q4_k 8 lines (8 x 2 * 15 * 127 = 30480), q5_k 4 (4 x 2 * 31 * 127 = 31496), q6_k 2
 * (2 x 2 * 63 * 127 = 32004). */
#ifndef KY_TILE_MIN
#define KY_TILE_MIN 8       /* fewer tokens take the rows (avx2, q4_k 5632x2048, 1 thread: T = 8
                               rows 2.02 ms, tile 1.81; T = 12 3.07 and 3.11) */
#endif

/* 8 tokens of x, transposed (token j in lane j; tokens past the end: zeros) */
typedef struct {
    uint8_t *q;             /* (n / 4, 8, 4): elements 4g..4g+3 of token j at 32 g + 4 j */
    int32_t *bs32;          /* (nb, 4, 8): x's sums per 32, (bs_2i, bs_2i+1) as int16 pairs */
    int32_t *bs16;          /* (nb, 8, 8): x's sums per 16, the same way */
    float *dx;              /* (nb, 8) */
} ky_x;

/* QX_LR rows unpacked (rows past the group's end: zeros). q4_k/q5_k: 8 scales and 4 pairs
 * of mins a superblock; q6_k: 16 scales and their 8 pairs */
typedef struct {
    uint8_t *q;             /* (QX_LR, n): codes */
    int16_t *sc;            /* (QX_LR, nb, 16) */
    int32_t *mp;            /* (QX_LR, nb, 8): (m_2i, m_2i+1) or (sc_2i, sc_2i+1) as int16 pairs */
    float *d, *dm;          /* (QX_LR, nb) */
} ky_w;

static size_t ky_x_bytes(int64_t n) { return (size_t)8 * n + (size_t)(n / QK_K) * (128 + 256 + 32); }
static size_t ky_w_bytes(int64_t n) { return (size_t)QX_LR * (n + (size_t)(n / QK_K) * (32 + 32 + 8)); }

static ky_x ky_x_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / QK_K;
    ky_x x;
    x.q = p;
    x.bs32 = (int32_t *)(p + 8 * n);
    x.bs16 = x.bs32 + nb * 32;
    x.dx = (float *)(x.bs16 + nb * 64);
    return x;
}

static ky_w ky_w_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / QK_K;
    ky_w w;
    w.q = p;
    w.sc = (int16_t *)(p + QX_LR * n);
    w.mp = (int32_t *)(w.sc + QX_LR * nb * 16);
    w.d = (float *)(w.mp + QX_LR * nb * 8);
    w.dm = w.d + QX_LR * nb;
    return w;
}

/* tokens t .. t+nt-1 (nt <= 8) of xq -> x */
static void ky_xprep(ky_x *x, const void *xq, int64_t xs, int64_t t, int nt, int64_t n) {
    const int64_t nb = n / QK_K;
    if (nt < 8) memset(x->q, 0, ky_x_bytes(n));
    for (int j = 0; j < nt; j++) {
        const cyllm_qact_view a = cyllm_qact_split((const char *)xq + (t + j) * xs, n, CYLLM_QA_Q8_K);
        xpose_lines(x->q, a.q, n, 8, j);
        for (int64_t b = 0; b < nb; b++) {
            int32_t pr[4];
            x_sum_pairs(&a, b, pr);
            x->dx[8 * b + j] = a.d[b];
            for (int i = 0; i < 4; i++) x->bs32[(4 * b + i) * 8 + j] = pr[i];
            for (int i = 0; i < 8; i++) memcpy(&x->bs16[(8 * b + i) * 8 + j], a.bsum + 16 * b + 2 * i, 4);
        }
    }
}

/* rows r .. r+nr-1 (nr <= QX_LR) of w (kind 0 q4_k, 1 q5_k, 2 q6_k) -> the panel */
static void ky_wprep(const int kind, ky_w *p, const uint8_t *w, int64_t rb, int64_t r, int nr, int64_t n) {
    const int64_t nb = n / QK_K;
    const int bb = kind == 2 ? QB_Q6_K : kind == 1 ? QB_Q5_K : QB_Q4_K;
    if (nr < QX_LR) memset(p->q, 0, ky_w_bytes(n));     /* rows past the end: zeros */
    for (int i = 0; i < nr; i++) {
        for (int64_t b = 0; b < nb; b++) {
            int16_t *sc = p->sc + (i * nb + b) * 16;
            int32_t *mp = p->mp + (i * nb + b) * 8;
            uint8_t *q = p->q + i * n + b * QK_K;
            const uint8_t *blk = w + (r + i) * rb + b * bb;
            __m256i cod[8];
            if (kind == 2) k6_codes(cod, blk);
            else k45_codes(kind, cod, blk);
            for (int k = 0; k < 8; k++) _mm256_storeu_si256((__m256i *)(q + 32 * k), cod[k]);
            if (kind == 2) {
                for (int k = 0; k < 16; k++) sc[k] = (int8_t)blk[192 + k];
                for (int k = 0; k < 8; k++) mp[k] = (int32_t)((uint32_t)(uint16_t)sc[2 * k] | ((uint32_t)(uint16_t)sc[2 * k + 1] << 16));
                p->d[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk + 208));
                continue;
            }
            uint8_t s8[8], m8[8];
            cyllm_k_scales(blk + 4, s8, m8);
            for (int k = 0; k < 8; k++) sc[k] = s8[k];
            for (int k = 0; k < 4; k++) mp[k] = (int32_t)((uint32_t)m8[2 * k] | ((uint32_t)m8[2 * k + 1] << 16));
            p->d[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk));
            p->dm[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk + 2));
        }
    }
}

/* QX_LR rows (nr real) x 8 tokens (nt real) over every superblock; o[j * ldo + i] gets
 * (row i, token j) */
ALWAYS void ky_tile(const int kind, float *o, int64_t ldo, const ky_w *w, const ky_x *x, int64_t n, int nr,
                    int nt, int add) {
    const int64_t nb = n / QK_K;
    /* lines a run adds in int16, and elements a scale covers */
    const int run = kind == 2 ? 2 : kind == 1 ? 4 : 8, sub = kind == 2 ? 16 : 32;
    const int nm = kind == 2 ? 1 : 2;       /* chains: L (q6_k: with its offset), M */
    __m256 acc[2][QX_LR][8];                 /* chain h of row i, lane s % 8: tokens in lanes */
    for (int h = 0; h < nm; h++)
        for (int i = 0; i < QX_LR; i++)
            for (int l = 0; l < 8; l++) acc[h][i][l] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        const uint8_t *xs = x->q + s * QK_K * 8;
        const uint8_t *ws = w->q + s * QK_K;
        __m256i L[QX_LR];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++) L[i] = _mm256_setzero_si256();
        for (int r0 = 0; r0 < 64; r0 += run) {          /* runs of lines (4 elements each) */
            __m256i h[QX_LR];
            _Pragma("GCC unroll 8")
            for (int g = 0; g < run; g++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + 32 * (r0 + g)));
                _Pragma("GCC unroll 8")
                for (int i = 0; i < QX_LR; i++) {
                    const __m256i pr = _mm256_maddubs_epi16(_mm256_set1_epi32((int)cyllm_rd32(ws + i * n + 4 * (r0 + g))), xv);
                    h[i] = g ? _mm256_add_epi16(h[i], pr) : pr;
                }
            }
            const int k = 4 * r0 / sub;                     /* the run's sub-block */
            _Pragma("GCC unroll 8")
            for (int i = 0; i < QX_LR; i++)
                L[i] = _mm256_add_epi32(L[i], _mm256_madd_epi16(h[i], _mm256_set1_epi16(w->sc[(i * nb + s) * 16 + k])));
        }
        const __m256 dx = _mm256_loadu_ps(x->dx + 8 * s);
        const int l = (int)(s & 7);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < QX_LR; i++) {
            /* q4_k, q5_k: M = sum_k m_k bs32_k; q6_k: its offset sum_k sc_k bs16_k */
            const int np = kind == 2 ? 8 : 4;
            const int32_t *bs = kind == 2 ? x->bs16 + 64 * s : x->bs32 + 32 * s;
            __m256i M = _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int q = 0; q < np; q++)
                M = _mm256_add_epi32(M, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + 8 * q)),
                                                          _mm256_set1_epi32(w->mp[(i * nb + s) * 8 + q])));
            const __m256 pd = _mm256_mul_ps(_mm256_set1_ps(w->d[i * nb + s]), dx);
            if (kind == 2) {
                const __m256i Lo = _mm256_sub_epi32(L[i], _mm256_slli_epi32(M, 5));
                acc[0][i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Lo), pd, acc[0][i][l]);
            } else {
                const __m256 pm = _mm256_mul_ps(_mm256_set1_ps(w->dm[i * nb + s]), dx);
                acc[0][i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(L[i]), pd, acc[0][i][l]);
                acc[1][i][l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), pm, acc[1][i][l]);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        __m256 t[2];
        for (int h = 0; h < nm; h++) {      /* hsum8's tree, lane by lane */
            const __m256 *v = acc[h][i];
            t[h] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                                 _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));
        }
        float r[8];
        _mm256_storeu_ps(r, nm == 2 ? _mm256_sub_ps(t[0], t[1]) : t[0]);
        for (int j = 0; j < nt; j++) o[j * ldo + i] = add ? o[j * ldo + i] + r[j] : r[j];
    }
}

#define KY_GEMM(F, KIND, ROWS)                                                                  \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {  \
    QX_LANES_GEMM(ky, KIND, ROWS, KY_TILE_MIN)                                                  \
}
KY_GEMM(k4y, 0, k4_gemm_rows)
KY_GEMM(k5y, 1, k5_gemm_rows)
KY_GEMM(k6y, 2, k6_gemm_rows)
#endif



#if QX_VNNI == 2
/* ---- AVX512-VNNI (zmm) q8_0 -----------------------------------------------------------
 * 512-bit: a pair of blocks (64 weights) per vpdpbusd. The weights go unsigned (w + 128,
 * one xor per row and pair, shared by every token) against x's signed bytes, so no sign
 * trick per (row, token); the +128 comes back from x's block sums: the integer accumulator
 * starts at -16 * sum(q_x) in each of a block's 8 lanes (8 * 16 * sum = 128 * sum). The
 * float work is then one cvt + one scale multiply + one FMA per (row, token, PAIR), half of
 * the ymm kernel's per block. Float accumulation: 16 lanes (block b in lanes 0-7, b+1 in
 * 8-15), reduced by _mm512_reduce_add_ps; the same for decode (R = C = 1) and the prefill
 * tile (R rows x C tokens, each (row, token) running its own FMA chain in the same order),
 * so a (row, token) has the same bits either way.
 * Bounds: (w + 128) <= 255 times |x| <= 127, 4 per lane: no int32 overflow (no saturation
 * in vpdpbusd). */
#define QZ_PAIRS 256        /* token-side pairs prepared on the stack (n <= 16384) */
#ifndef QZ_R
#define QZ_R 4              /* prefill tile: rows */
#endif
#ifndef QZ_C
#define QZ_C 4              /* prefill tile: tokens */
#endif

typedef struct { __m512i aux; __m512 dx; } qz_x;

/* the token side of block pair (b, b+1) (two == 0: block b alone, upper lanes 0) */
ALWAYS qz_x z8_tok(const cyllm_qact_view *a, int64_t b, int two) {
    qz_x r;
    __m512i s = _mm512_maskz_set1_epi32((__mmask16)0x00ff, a->sum[b]);
    __m512 d = _mm512_maskz_broadcastss_ps((__mmask16)0x00ff, _mm_load_ss(a->d + b));
    if (two) {
        s = _mm512_mask_set1_epi32(s, (__mmask16)0xff00, a->sum[b + 1]);
        d = _mm512_mask_broadcastss_ps(d, (__mmask16)0xff00, _mm_load_ss(a->d + b + 1));
    }
    r.aux = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 4));
    r.dx = d;
    return r;
}

ALWAYS void z8_prep(qz_x *xp, const cyllm_qact_view *a, int64_t nb) {
    for (int64_t b = 0; b < nb; b += 2) xp[b >> 1] = z8_tok(a, b, b + 1 < nb);
}

/* R rows (row i at w0 + i * rb) x C tokens (views a[j], prepared pairs xp + j * np, or
 * xp == NULL: computed here, the same values); o[i + j * ldo] gets (row i, token j) */
ALWAYS void z8_pair(const int R, const int C, __m512 (*acc)[QZ_C], const uint8_t *w0, int64_t rb,
                    const cyllm_qact_view *a, const qz_x *xp, int64_t np, int64_t b, const int two) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512i wu[QZ_R];
    __m512 wd[QZ_R];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        const uint8_t *p0 = w0 + i * rb + b * QB_Q8_0;
        __m512i w = two ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(p0 + 2 + QB_Q8_0)), 1)
                        : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 2)));
        wu[i] = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        __m128i h = _mm_cvtsi32_si128(cyllm_rd16(p0));
        if (two) h = _mm_insert_epi16(h, cyllm_rd16(p0 + QB_Q8_0), 1);
        wd[i] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
    }
    _Pragma("GCC unroll 8")
    for (int j = 0; j < C; j++) {
        const qz_x t = xp ? xp[j * np + (b >> 1)] : z8_tok(&a[j], b, two);
        const int8_t *xb = a[j].q + b * 32;
        const __m512i xv = two ? _mm512_loadu_si512((const void *)xb)
                               : _mm512_maskz_loadu_epi8((__mmask64)0xffffffffULL, xb);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            const __m512i isum = _mm512_dpbusd_epi32(t.aux, wu[i], xv);
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd[i], t.dx), acc[i][j]);
        }
    }
}

ALWAYS void z8_tile(const int R, const int C, float *o, int64_t ldo, const uint8_t *w0, int64_t rb,
                    const cyllm_qact_view *a, const qz_x *xp, int64_t np, int64_t nb, int add,
                    const uint8_t *pfp) {
    __m512 acc[QZ_R][QZ_C];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        if (pfp) PREFETCH(pfp + b * QB_Q8_0);
        z8_pair(R, C, acc, w0, rb, a, xp, np, b, 1);
    }
    if (b < nb) z8_pair(R, C, acc, w0, rb, a, xp, np, b, 0);
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) {
            const float r = _mm512_reduce_add_ps(acc[i][j]);
            o[i + j * ldo] = add ? o[i + j * ldo] + r : r;
        }
    }
}

/* rows [r0, r1) of one activation: one row at a time, one linear stream (decode) */
static void z8_range(float *o, const uint8_t *w, int64_t rb, const cyllm_qact_view *a, const qz_x *xp,
                     int64_t n, int64_t r0, int64_t r1, int add, const qx_pf *pf) {
    const int64_t nb = n / 32;
    for (int64_t r = r0; r < r1; r++)
        z8_tile(1, 1, o + (r - r0), 0, w + r * rb, rb, a, xp, 0, nb, add, pf_base(w + r * rb, pf));
}

static void QF(matvec_z8)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n,
                          int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);
    qx_pf pf = {w + r1 * rb, nx, nxb, cyllm_qpf_bytes};
    qz_x xp[QZ_PAIRS];
    const int prep = (n / 32 + 1) / 2 <= QZ_PAIRS;
    if (prep) z8_prep(xp, &a, n / 32);
    z8_range(out + r0, w, rb, &a, prep ? xp : NULL, n, r0, r1, add, &pf);
}

static void QF(gate_up_z8)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,
                           const void *xq, int64_t n, int64_t r0, int64_t r1, int act,
                           const void *nx, int64_t nxb) {
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);
    qx_pf pg = {wg + r1 * rb, 0, 0, cyllm_qpf_bytes};
    qx_pf pu = {wu + r1 * rb, nx, nxb, cyllm_qpf_bytes};
    qz_x xp[QZ_PAIRS];
    const int prep = (n / 32 + 1) / 2 <= QZ_PAIRS;
    if (prep) z8_prep(xp, &a, n / 32);
    float g[16], u[16];
    for (int64_t r = r0; r < r1; r += 16) {
        int64_t e = r + 16 < r1 ? r + 16 : r1;
        z8_range(g, wg, rb, &a, prep ? xp : NULL, n, r, e, 0, &pg);
        z8_range(u, wu, rb, &a, prep ? xp : NULL, n, r, e, 0, &pu);
        for (int64_t i = r; i < e; i++) out[i] = cyllm_qact_apply(act, g[i - r]) * u[i - r];
    }
}

/* prefill: QZ_C tokens' pairs prepared once, then tiles of QZ_R rows x QZ_C tokens */
static void QF(gemm_z8)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,
                        int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {
    const int64_t nb = n / 32, np = (nb + 1) / 2;
    const int prep = np <= QZ_PAIRS;
    qz_x xp[QZ_C * QZ_PAIRS];
    cyllm_qact_view a[QZ_C];
    for (int64_t t0 = 0; t0 < T; t0 += QZ_C) {
        const int64_t tn = T - t0 < QZ_C ? T - t0 : QZ_C;
        for (int64_t t = 0; t < tn; t++) {
            a[t] = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, CYLLM_QA_Q8_0);
            if (prep) z8_prep(xp + t * np, &a[t], nb);
        }
        const qz_x *p = prep ? xp : NULL;
        int64_t r = r0;
        float *o = out + t0 * ldo;
        if (tn == QZ_C) {
            for (; r + QZ_R <= r1; r += QZ_R)
                z8_tile(QZ_R, QZ_C, o + r, ldo, w + r * rb, rb, a, p, np, nb, add, NULL);
            for (; r < r1; r++)
                z8_tile(1, QZ_C, o + r, ldo, w + r * rb, rb, a, p, np, nb, add, NULL);
        } else {
            for (int64_t t = 0; t < tn; t++) {
                const qz_x *pt = prep ? xp + t * np : NULL;
                for (r = r0; r + QZ_R <= r1; r += QZ_R)
                    z8_tile(QZ_R, 1, o + t * ldo + r, ldo, w + r * rb, rb, a + t, pt, np, nb, add, NULL);
                for (; r < r1; r++)
                    z8_tile(1, 1, o + t * ldo + r, ldo, w + r * rb, rb, a + t, pt, np, nb, add, NULL);
            }
        }
    }
}
#endif

#if QX_VNNI == 2
/* ---- AVX512-VNNI (zmm) q4_k and q6_k --------------------------------------------------
 * 512-bit: 64 weights per vpmaddubsw + vpdpwssd (the sub-block scales as int16
 * multipliers, as in the ymm kernels). q4_k: one 32-byte run of nibbles is broadcast to
 * both halves and shifted by 0 / 4 bits, so a register holds sub-blocks 2c and 2c+1, i.e.
 * 64 consecutive weights against 64 consecutive x bytes; q6_k: 64 bytes of ql with the
 * matching qh bits (variable shifts per half) give weights 0-63 and 64-127 of each half.
 * Float work per (row, token, superblock): one cvt + FMA, plus the min term (q4_k: 4 lanes
 * per token of a separate accumulator, subtracted at the end), reduced at the end by a
 * fixed tree (zsum16 for q4_k, _mm512_reduce_add_ps for q6_k). Tiles of R rows x C tokens
 * share the row's unpacking across tokens and the x loads across rows; each (row, token)
 * runs the same chain in the same order for every R, C, so decode and prefill give the
 * same bits. q4_k decode runs that chain in ymm registers (k4z_row_ymm: Zen 4 splits zmm
 * instructions in two; 1 thread, 256x2048 from L2: 14.3 -> 12.6 us, TinyLlama Q4_K_M decode
 * 1 thread +4%, 2 threads unchanged). q5_k decodes with k45_row and prefills with 16
 * tokens in a zmm's lanes (k5t, below). */
#ifndef QZK_R
#define QZK_R 2             /* prefill tile: rows */
#endif
#ifndef QZK_C
#define QZK_C 4             /* prefill tile: tokens (2 x 4 beat 2 x 6, 3 x 4, 1 x 8 on Zen 5) */
#endif
#ifndef QZ6_R
#define QZ6_R 1             /* q6_k prefill tile: rows (measured: 1 x 6 beat 2 x 4 on Zen 5) */
#endif
#ifndef QZ6_C
#define QZ6_C 6             /* q6_k prefill tile: tokens */
#endif
#define QZK_MR 4            /* array bounds of the tiles (any R <= 4, C <= 8) */
#define QZK_MC 8

ALWAYS __m512i zlane4(void) { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }

/* byte shuffle that spreads int16 scale lo over the low 256 bits and hi over the high 256
 * bits of a register holding the 8 scales in each 128-bit lane (in-lane vpshufb: cheaper
 * than a cross-lane vpermw on Zen 4) */
ALWAYS __m512i zspread16(int lo, int hi) {
    const __m256i l = _mm256_set1_epi16((short)((2 * lo) | ((2 * lo + 1) << 8)));
    const __m256i h = _mm256_set1_epi16((short)((2 * hi) | ((2 * hi + 1) << 8)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}

/* The sum of 16 float lanes given as halves lo (lanes 0-7) and hi (8-15), in a fixed tree:
 * the two halves, then the two quarters, then pairs (2, 3, 0, 1), then the last two. The
 * zmm tile and the ymm decode row of q4_k both end with it, so they give the same bits
 * (a compiler's own _mm512_reduce_add_ps may choose another tree). */
ALWAYS float zsum16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

ALWAYS float zsum16z(__m512 v) {
    return zsum16(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* The x side of q4_k's min term for tokens 4g.. of a (C of them) and superblock b: the
 * tokens' sums per 32 (8 int16 each, lanes 4k..4k+3 as int32 pairs) and their d_x on the
 * matching lanes. It does not depend on the row, so a matvec / GEMM tile prepares it once
 * per call / token group (k4z_mx_prep) instead of once per row: on Zen 4 it was ~20% of
 * a decode row's instructions. Prepared or not, the vectors are the same bits. */
typedef struct { __m512i bs; __m512 dxl; } k4z_mx;
#define QZK_MXB 64          /* superblocks prepared (n <= 16384); longer rows compute inline */

ALWAYS void k4z_mx_one(const cyllm_qact_view *a, const int C, const int g, int64_t b, __m512i *bs_out,
                       __m512 *dxl_out) {
    __m512i bs = _mm512_setzero_si512();
    __m128 dx4 = _mm_setzero_ps();
    _Pragma("GCC unroll 4")
    for (int k = 0; k < 4 && 4 * g + k < C; k++) {
        const cyllm_qact_view *v = &a[4 * g + k];
        const __m128i b32 = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(v->bsum + 16 * b)),
                                           _mm_loadu_si128((const __m128i *)(v->bsum + 16 * b + 8)));
        bs = _mm512_inserti32x4(bs, b32, k);
        dx4 = _mm_insert_ps(dx4, _mm_load_ss(v->d + b), k << 4);
    }
    *bs_out = bs;
    *dxl_out = _mm512_permutexvar_ps(zlane4(), _mm512_castps128_ps512(dx4));
}

/* mx[g * nb + b] for the (C + 3) / 4 token groups of a; NULL when the rows are too long */
ALWAYS const k4z_mx *k4z_mx_prep(k4z_mx *mx, const cyllm_qact_view *a, const int C, int64_t nb) {
    if (nb > QZK_MXB) return NULL;
    for (int g = 0; g < (C + 3) / 4; g++)
        for (int64_t b = 0; b < nb; b++) k4z_mx_one(a, C, g, b, &mx[g * nb + b].bs, &mx[g * nb + b].dxl);
    return mx;
}

ALWAYS void k4z_prefetch(const uint8_t *f) {      /* one q4_k superblock (144 bytes) */
    PREFETCH(f);
    PREFETCH(f + 64);
    PREFETCH(f + 128);
}

ALWAYS void k4z_tile(const int R, const int C, float *o, int64_t ldo, const uint8_t *w0, int64_t rb,
                     const cyllm_qact_view *a, int64_t nb, int add, const uint8_t *pfp, const k4z_mx *mx) {
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i sh = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    const int G = (C + 3) / 4;                  /* token groups of the min term */
    __m512 acc[QZK_MR][QZK_MC];
    /* min term: lanes 4k..4k+3 of accm[i][g] belong to token 4g + k (the 4 int32 of
     * m . bsum32 per superblock), so one madd/cvt/mul/FMA serves 4 tokens */
    __m512 accm[QZK_MR][(QZK_MC + 3) / 4];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
        _Pragma("GCC unroll 2")
        for (int g = 0; g < G; g++) accm[i][g] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        if (pfp) k4z_prefetch(pfp + b * QB_Q4_K);
        __m256i sc16[QZK_MR];
        __m128i m16[QZK_MR];
        __m512i isum[QZK_MR][QZK_MC];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            __m256i s;
            k_scales16(w0 + i * rb + b * QB_Q4_K + 4, &s, &m16[i]);
            sc16[i] = s;
            _Pragma("GCC unroll 8")
            for (int j = 0; j < C; j++) isum[i][j] = _mm512_setzero_si512();
        }
        _Pragma("GCC unroll 8")
        for (int c = 0; c < 4; c++) {
            __m512i nib[QZK_MR], s[QZK_MR];
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                const uint8_t *q = w0 + i * rb + b * QB_Q4_K + 16 + 32 * c;
                nib[i] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(
                             _mm256_loadu_si256((const __m256i *)q)), sh), m15);
                s[i] = _mm512_shuffle_epi8(_mm512_broadcast_i64x4(sc16[i]), zspread16(2 * c, 2 * c + 1));
            }
            _Pragma("GCC unroll 8")
            for (int j = 0; j < C; j++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(a[j].q + b * QK_K + 64 * c));
                /* pairs <= 2*15*127 = 3810, times a scale <= 63, pair-summed in int32 */
                _Pragma("GCC unroll 8")
                for (int i = 0; i < R; i++)
                    isum[i][j] = _mm512_dpwssd_epi32(isum[i][j], _mm512_maddubs_epi16(nib[i], xv), s[i]);
            }
        }
        __m512 wd[QZK_MR], wm[QZK_MR];
        __m512i mm[QZK_MR];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            const __m128 wdd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)cyllm_rd32(w0 + i * rb + b * QB_Q4_K)));
            wd[i] = _mm512_broadcastss_ps(wdd);                                  /* d */
            wm[i] = _mm512_broadcastss_ps(_mm_movehdup_ps(wdd));                 /* dmin */
            mm[i] = _mm512_broadcast_i32x4(m16[i]);
        }
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) {
            const __m512 dx = _mm512_set1_ps(a[j].d[b]);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), _mm512_mul_ps(wd[i], dx), acc[i][j]);
        }
        _Pragma("GCC unroll 2")
        for (int g = 0; g < G; g++) {
            /* x sums per 32 (8 int16, from the 16 per-16 sums) and d_x of tokens 4g.. */
            __m512i bs;
            __m512 dxl;
            if (mx) {
                bs = mx[g * nb + b].bs;
                dxl = mx[g * nb + b].dxl;
            } else {
                k4z_mx_one(a, C, g, b, &bs, &dxl);
            }
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++)
                accm[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mm[i], bs)),
                                             _mm512_mul_ps(wm[i], dxl), accm[i][g]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        float mt[(QZK_MC + 3) / 4][16];
        _Pragma("GCC unroll 2")
        for (int g = 0; g < G; g++) _mm512_storeu_ps(mt[g], accm[i][g]);
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) {
            const __m128 m4 = _mm_loadu_ps(&mt[j >> 2][4 * (j & 3)]);
            const float r = zsum16z(acc[i][j]) - hsum4(m4);
            o[i + j * ldo] = add ? o[i + j * ldo] + r : r;
        }
    }
}

/* One row, one token of q4_k in 256-bit registers with k4z_tile(1, 1)'s bits: the low and
 * high nibble halves of each 32-byte run keep their own integer and float accumulators
 * (lanes 0-7 and 8-15 of the zmm tile's), the min term is lanes 0-3 of the tile's in xmm
 * registers (the same operations on each lane), and the end
 * is the same zsum16. Decode runs it: on Zen 4, which splits 512-bit instructions in two,
 * it is ~10% faster than the zmm tile for one row; prefill keeps the zmm tiles. */
ALWAYS void k4z_row_ymm(float *o, const uint8_t *w0, const cyllm_qact_view *a, int64_t nb, int add,
                        const uint8_t *pfp, const k4z_mx *mx) {
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (pfp) k4z_prefetch(pfp + b * QB_Q4_K);
        const uint8_t *p = w0 + b * QB_Q4_K;
        __m256i sc16;
        __m128i m16;
        k_scales16(p + 4, &sc16, &m16);
        __m256i ilo = _mm256_setzero_si256(), ihi = _mm256_setzero_si256();
        const int8_t *xb = a->q + b * QK_K;
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
            const __m256i lo = _mm256_and_si256(v, m15);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(xb + 64 * c));
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(xb + 64 * c + 32));
            ilo = DPWSSD(ilo, _mm256_maddubs_epi16(lo, xl), BCAST16(sc16, 2 * c));
            ihi = DPWSSD(ihi, _mm256_maddubs_epi16(hi, xh), BCAST16(sc16, 2 * c + 1));
        }
        const __m128 wdd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)cyllm_rd32(p)));   /* d, dmin */
        const __m256 wdx = _mm256_mul_ps(_mm256_broadcastss_ps(wdd), _mm256_set1_ps(a->d[b]));
        acc_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ilo), wdx, acc_lo);
        acc_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ihi), wdx, acc_hi);
        __m512i bs;
        __m512 dxl;
        if (mx) {
            bs = mx[b].bs;
            dxl = mx[b].dxl;
        } else {
            k4z_mx_one(a, 1, 0, b, &bs, &dxl);
        }
        const __m128i b32 = _mm512_castsi512_si128(bs);
        const __m128 dx = _mm512_castps512_ps128(dxl);
        accm = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(m16, b32)),
                            _mm_mul_ps(_mm_broadcastss_ps(_mm_movehdup_ps(wdd)), dx), accm);
    }
    const float r = zsum16(acc_lo, acc_hi) - hsum4(accm);
    *o = add ? *o + r : r;
}

ALWAYS void k6z_tile(const int R, const int C, float *o, int64_t ldo, const uint8_t *w0, int64_t rb,
                     const cyllm_qact_view *a, int64_t nb, int add, const uint8_t *pfp, const k4z_mx *mx) {
    (void)mx;                               /* q6_k has no min term */
    const __m512i m15 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    __m512 acc[QZK_MR][QZK_MC];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        if (pfp) {
            const uint8_t *f = pfp + b * QB_Q6_K;
            PREFETCH(f);
            PREFETCH(f + 64);
            PREFETCH(f + 128);
            PREFETCH(f + 192);
        }
        __m256i sc16[QZK_MR];
        __m512i isum[QZK_MR][QZK_MC];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            sc16[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + i * rb + b * QB_Q6_K + 192)));
            _Pragma("GCC unroll 8")
            for (int j = 0; j < C; j++) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(a[j].bsum + 16 * b));
                /* the -32 of every weight: 32 * sum_j sc_j * xsum_j */
                isum[i][j] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(sc16[i], bs), 5)));
            }
        }
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            __m512i g01[QZK_MR], g23[QZK_MR], s01[QZK_MR], s23[QZK_MR];
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                const uint8_t *p = w0 + i * rb + b * QB_Q6_K;
                const __m512i ql = _mm512_loadu_si512((const void *)(p + 64 * h));
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
                /* weights 128h + 0..63 and 128h + 64..127, values 0..63 */
                g01[i] = _mm512_or_si512(_mm512_and_si512(ql, m15), _mm512_and_si512(_mm512_sllv_epi64(qh, shl), m30));
                g23[i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(ql, 4), m15),
                                         _mm512_and_si512(_mm512_srlv_epi64(qh, shr), m30));
                const __m512i s = _mm512_castsi256_si512(sc16[i]);
                const __m512i i01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_epi16(
                    8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h,
                    8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1)),
                    _mm256_setr_epi16(8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2,
                                      8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3), 1);
                s01[i] = _mm512_permutexvar_epi16(i01, s);
                s23[i] = _mm512_permutexvar_epi16(_mm512_add_epi16(i01, _mm512_set1_epi16(4)), s);
            }
            _Pragma("GCC unroll 8")
            for (int j = 0; j < C; j++) {
                const int8_t *xb = a[j].q + b * QK_K + 128 * h;
                const __m512i x01 = _mm512_loadu_si512((const void *)xb);
                const __m512i x23 = _mm512_loadu_si512((const void *)(xb + 64));
                /* q in 0..63 unsigned: pairs <= 2*63*127 = 16002 */
                _Pragma("GCC unroll 8")
                for (int i = 0; i < R; i++) {
                    isum[i][j] = _mm512_dpwssd_epi32(isum[i][j], _mm512_maddubs_epi16(g01[i], x01), s01[i]);
                    isum[i][j] = _mm512_dpwssd_epi32(isum[i][j], _mm512_maddubs_epi16(g23[i], x23), s23[i]);
                }
            }
        }
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            const float wd = _cvtsh_ss(cyllm_rd16(w0 + i * rb + b * QB_Q6_K + 208));
            _Pragma("GCC unroll 8")
            for (int j = 0; j < C; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), _mm512_set1_ps(wd * a[j].d[b]), acc[i][j]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) {
            const float r = _mm512_reduce_add_ps(acc[i][j]);
            o[i + j * ldo] = add ? o[i + j * ldo] + r : r;
        }
    }
}


/* ---- AVX512-VNNI q5_k prefill: 16 tokens in a zmm's lanes --------------------------------
 * (the exact superblock totals of q4_k / q5_k above; decode and short prefills run k45_row).
 * x is transposed once per call (one 64-byte line holds elements 4g..4g+3 of 16 tokens),
 * each group of 8 rows is unpacked once to 5-bit codes, and one vpdpbusd takes a row's 4
 * codes (broadcast) against a line: 64 multiply-adds, nothing to pair or blend; the
 * sub-block scale multiplies the exact sub-block sums once per 32 elements (vpmulld). Each
 * token lane then runs decode's float chain, so a token gets decode's bits. */

/* q5_k's codes (0..31) of one superblock (at p), two sub-blocks per zmm: cod[c] holds
 * sub-block 2c (the low nibbles of qs[32c..32c+31]) in its low half and 2c + 1 (the high
 * nibbles) in its high half, each with its 5th bit from qh (bits 2c and 2c + 1 of each
 * byte). The shifts are per 64-bit lane; a bit moved to bit 4 of a byte comes from the
 * same byte (left by <= 4, right by <= 3), and everything else is masked off. */
ALWAYS void k5_codes_z(__m512i cod[4], const uint8_t *p) {
    const __m512i m15 = _mm512_set1_epi8(15), x10 = _mm512_set1_epi8(0x10);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)));
    const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i h[4] = {
        _mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 3, 3, 3, 3)),
        _mm512_sllv_epi64(qh, _mm512_setr_epi64(2, 2, 2, 2, 1, 1, 1, 1)),
        _mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1)),
        _mm512_srlv_epi64(qh, _mm512_setr_epi64(2, 2, 2, 2, 3, 3, 3, 3))};
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_srlv_epi64(
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 48 + 32 * c))), nib);
        /* (v & 15) | (h & 0x10) */
        cod[c] = _mm512_ternarylogic_epi32(v, _mm512_and_si512(h[c], x10), m15, 0xEC);
    }
}

/* prefill: 16 tokens of x, transposed (token j in lane j; tokens past the end: zeros). np
 * pairs of sums per superblock: 4 of x's 32-element sums (q5_k's mins), 8 of its 16-element
 * sums (q6_k's offset, its tile below). */
typedef struct {
    uint8_t *q;             /* (n / 4, 16, 4): elements 4g..4g+3 of token j at 64 g + 4 j */
    int32_t *bs;            /* (nb, np, 16): (bs_2i, bs_2i+1) as int16 pairs, token j in lane j */
    float *dx;              /* (nb, 16) */
} ktx;

/* 8 rows unpacked (rows past the group's end: zeros) */
typedef struct {
    uint8_t *q;             /* (8, n): 5-bit codes */
    int32_t *sc;            /* (8, nb, 8) */
    int32_t *mp;            /* (8, nb, 4): (m_2i, m_2i+1) as int16 pairs */
    float *d, *dm;          /* (8, nb) */
} k5t_w;

#define K5T_TOKENS 128      /* tokens whose x is transposed at a time */
#ifndef K5T_TILE_MIN
#define K5T_TILE_MIN 9      /* fewer tokens take the rows (5632x2048, 1 thread: T = 8 rows
                               1.49 ms, tile 1.58; T = 12 rows 3.12, tile 1.95) */
#endif

static size_t ktx_bytes(int64_t n, int np) { return (size_t)16 * n + (size_t)(n / QK_K) * (64 * np + 64); }
static size_t k5t_w_bytes(int64_t n) { return (size_t)8 * n + (size_t)(n / QK_K) * 8 * (32 + 16 + 8); }

static ktx ktx_at(uint8_t *p, int64_t n, int np) {
    ktx x = {p, (int32_t *)(p + 16 * n), (float *)(p + 16 * n + (n / QK_K) * 64 * np)};
    return x;
}

static k5t_w k5t_w_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / QK_K;
    k5t_w w;
    w.q = p;
    w.sc = (int32_t *)(p + 8 * n);
    w.mp = w.sc + 8 * nb * 8;
    w.d = (float *)(w.mp + 8 * nb * 4);
    w.dm = w.d + 8 * nb;
    return w;
}

/* tokens t .. t+nt-1 (nt <= 16) of xq -> x, with np (4 or 8) pairs of sums per superblock */
static void ktx_prep(ktx *x, const void *xq, int64_t xs, int64_t t, int nt, int64_t n, int np) {
    const int64_t nb = n / QK_K;
    memset(x->q, 0, (size_t)16 * n);
    memset(x->bs, 0, (size_t)nb * 64 * np);
    memset(x->dx, 0, (size_t)nb * 64);
    for (int j = 0; j < nt; j++) {
        const cyllm_qact_view a = cyllm_qact_split((const char *)xq + (t + j) * xs, n, CYLLM_QA_Q8_K);
        xpose_lines(x->q, a.q, n, 16, j);
        for (int64_t b = 0; b < nb; b++) {
            int32_t pr[8];
            if (np == 4) x_sum_pairs(&a, b, pr);
            else memcpy(pr, a.bsum + 16 * b, 32);   /* the 16 int16 sums, two per int32 */
            x->dx[16 * b + j] = a.d[b];
            for (int i = 0; i < np; i++) x->bs[(np * b + i) * 16 + j] = pr[i];
        }
    }
}

/* rows r .. r+nr-1 (nr <= 8) of w -> the panel */
static void k5t_wprep(k5t_w *p, const uint8_t *w, int64_t rb, int64_t r, int nr, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int i = 0; i < 8; i++) {
        for (int64_t b = 0; b < nb; b++) {
            int32_t *sc = p->sc + (i * nb + b) * 8, *mp = p->mp + (i * nb + b) * 4;
            uint8_t *q = p->q + i * n + b * QK_K;
            if (i >= nr) {
                memset(q, 0, QK_K);
                memset(sc, 0, 32);
                memset(mp, 0, 16);
                p->d[i * nb + b] = p->dm[i * nb + b] = 0.0f;
                continue;
            }
            const uint8_t *blk = w + (r + i) * rb + b * QB_Q5_K;
            __m512i cod[4];
            k5_codes_z(cod, blk);
            for (int c = 0; c < 4; c++) _mm512_storeu_si512((void *)(q + 64 * c), cod[c]);
            uint8_t s8[8], m8[8];
            cyllm_k_scales(blk + 4, s8, m8);
            for (int k = 0; k < 8; k++) sc[k] = s8[k];
            for (int k = 0; k < 4; k++) mp[k] = (int32_t)((uint32_t)m8[2 * k] | ((uint32_t)m8[2 * k + 1] << 16));
            p->d[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk));
            p->dm[i * nb + b] = _cvtsh_ss(cyllm_rd16(blk + 2));
        }
    }
}

/* 8 rows x 16 tokens over every superblock; o[j * ldo + i] gets (row i < nr, token j < nt) */
static void k5t_tile(float *o, int64_t ldo, const k5t_w *w, const ktx *x, int64_t n, int nr, int nt,
                     int add) {
    const int64_t nb = n / QK_K;
    __m512 acc[2][8][8];                    /* A, B of row i, lane s % 8: tokens in lanes */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++)
            for (int l = 0; l < 8; l++) acc[h][i][l] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        __m512i L[8];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) L[i] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {
            const uint8_t *xk = x->q + (s * QK_K + 32 * k) * 16;
            const uint8_t *wk = w->q + s * QK_K + 32 * k;
            __m512i D[8];
            _Pragma("GCC unroll 8")
            for (int i = 0; i < 8; i++) D[i] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int g = 0; g < 8; g++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xk + 64 * g));
                _Pragma("GCC unroll 8")
                for (int i = 0; i < 8; i++)
                    D[i] = _mm512_dpbusd_epi32(D[i], _mm512_set1_epi32((int)cyllm_rd32(wk + i * n + 4 * g)), xv);
            }
            _Pragma("GCC unroll 8")
            for (int i = 0; i < 8; i++)
                L[i] = _mm512_add_epi32(L[i], _mm512_mullo_epi32(D[i], _mm512_set1_epi32(w->sc[(i * nb + s) * 8 + k])));
        }
        const __m512 dx = _mm512_loadu_ps(x->dx + 16 * s);
        const int l = (int)(s & 7);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) {
            __m512i M = _mm512_setzero_si512();
            _Pragma("GCC unroll 4")
            for (int q = 0; q < 4; q++)
                M = _mm512_dpwssd_epi32(M, _mm512_loadu_si512((const void *)(x->bs + (4 * s + q) * 16)),
                                        _mm512_set1_epi32(w->mp[(i * nb + s) * 4 + q]));
            const __m512 pd = _mm512_mul_ps(_mm512_set1_ps(w->d[i * nb + s]), dx);
            const __m512 pm = _mm512_mul_ps(_mm512_set1_ps(w->dm[i * nb + s]), dx);
            acc[0][i][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(L[i]), pd, acc[0][i][l]);
            acc[1][i][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), pm, acc[1][i][l]);
        }
    }
    for (int i = 0; i < nr; i++) {
        __m512 t[2];
        for (int h = 0; h < 2; h++) {       /* hsum8's tree, lane by lane */
            const __m512 *v = acc[h][i];
            t[h] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6])),
                                 _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7])));
        }
        float r[16];
        _mm512_storeu_ps(r, _mm512_sub_ps(t[0], t[1]));
        for (int j = 0; j < nt; j++) o[j * ldo + i] = add ? o[j * ldo + i] + r[j] : r[j];
    }
}

/* prefill: up to K5T_TOKENS tokens transposed at a time, 8 rows unpacked at a time, each
 * group of 8 rows run against every block of 16 tokens. The buffers (x: ~17 bytes per
 * token and element, rows: ~8.2 per element) are malloc'd per call and thread; if that
 * fails, the decode rows give the same bits. */
static void QF(gemm_k5t)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {
    const int64_t tc = T < K5T_TOKENS ? T : K5T_TOKENS;
    const int64_t nblk = (tc + 15) / 16;
    const size_t xb = ktx_bytes(n, 4), wb = k5t_w_bytes(n);
    uint8_t *buf = T < K5T_TILE_MIN ? NULL : (uint8_t *)_mm_malloc((size_t)nblk * xb + wb, 64);
    if (!buf) {     /* few tokens (the tile's 16 lanes would idle), or no memory */
        k5_gemm_rows(out, ldo, w, rb, xq, xs, T, n, r0, r1, add);
        return;
    }
    k5t_w wp = k5t_w_at(buf + nblk * xb, n);
    for (int64_t t0 = 0; t0 < T; t0 += tc) {
        const int64_t tn = T - t0 < tc ? T - t0 : tc;
        for (int64_t k = 0; k * 16 < tn; k++) {
            ktx x = ktx_at(buf + k * xb, n, 4);
            ktx_prep(&x, xq, xs, t0 + 16 * k, tn - 16 * k < 16 ? (int)(tn - 16 * k) : 16, n, 4);
        }
        for (int64_t r = r0; r < r1; r += 8) {
            const int nr = r1 - r < 8 ? (int)(r1 - r) : 8;
            k5t_wprep(&wp, w, rb, r, nr, n);
            for (int64_t k = 0; k * 16 < tn; k++) {
                const ktx x = ktx_at(buf + k * xb, n, 4);
                k5t_tile(out + (t0 + 16 * k) * ldo + r, ldo, &wp, &x, n, nr,
                         tn - 16 * k < 16 ? (int)(tn - 16 * k) : 16, add);
            }
        }
    }
    _mm_free(buf);
}

/* matvec / gate_up / gemm of a K-quant zmm tile (TILE(R, C, o, ldo, w0, rb, a, nb, add, pfp,
 * mx)); MX: the tile takes the min term's x side prepared per call / token group (q4_k) */
#define QZK_DECODE(F, MX, ROW1)                                                               \
static void F##_range(float *o, const uint8_t *w, int64_t rb, const cyllm_qact_view *a, int64_t n, \
                      int64_t r0, int64_t r1, int add, const qx_pf *pf, const k4z_mx *mx) {   \
    for (int64_t r = r0; r < r1; r++)                                                         \
        ROW1(o + (r - r0), w + r * rb, rb, a, n / QK_K, add, pf_base(w + r * rb, pf), mx);    \
}                                                                                             \
static void QF(matvec_##F)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                           int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {   \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_K);                               \
    qx_pf pf = {w + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                       \
    k4z_mx mxb[MX ? QZK_MXB : 1];                                                             \
    const k4z_mx *mx = MX ? k4z_mx_prep(mxb, &a, 1, n / QK_K) : NULL;                         \
    F##_range(out + r0, w, rb, &a, n, r0, r1, add, &pf, mx);                                  \
}                                                                                             \
static void QF(gate_up_##F)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,   \
                            const void *xq, int64_t n, int64_t r0, int64_t r1, int act,      \
                            const void *nx, int64_t nxb) {                                    \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_K);                               \
    qx_pf pg = {wg + r1 * rb, 0, 0, cyllm_qpf_bytes};                                         \
    qx_pf pu = {wu + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                      \
    k4z_mx mxb[MX ? QZK_MXB : 1];                                                             \
    const k4z_mx *mx = MX ? k4z_mx_prep(mxb, &a, 1, n / QK_K) : NULL;                         \
    float g[16], u[16];                                                                       \
    for (int64_t r = r0; r < r1; r += 16) {                                                   \
        int64_t e = r + 16 < r1 ? r + 16 : r1;                                                \
        F##_range(g, wg, rb, &a, n, r, e, 0, &pg, mx);                                        \
        F##_range(u, wu, rb, &a, n, r, e, 0, &pu, mx);                                        \
        for (int64_t i = r; i < e; i++) out[i] = cyllm_qact_apply(act, g[i - r]) * u[i - r]; \
    }                                                                                         \
}
#define QZK_FORMAT(F, TILE, TR, TC, MX, ROW1)                                                 \
QZK_DECODE(F, MX, ROW1)                                                                       \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) { \
    const int64_t nb = n / QK_K;                                                              \
    cyllm_qact_view a[TC];                                                                 \
    k4z_mx mxb[MX ? (TC + 3) / 4 * QZK_MXB : 1];                                              \
    for (int64_t t0 = 0; t0 < T; t0 += TC) {                                               \
        const int64_t tn = T - t0 < TC ? T - t0 : TC;                                   \
        for (int64_t t = 0; t < tn; t++)                                                      \
            a[t] = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, CYLLM_QA_Q8_K);      \
        float *o = out + t0 * ldo;                                                            \
        int64_t r = r0;                                                                       \
        if (tn == TC) {                                                                    \
            const k4z_mx *mx = MX ? k4z_mx_prep(mxb, a, TC, nb) : NULL;                       \
            for (; r + TR <= r1; r += TR)                                               \
                TILE(TR, TC, o + r, ldo, w + r * rb, rb, a, nb, add, NULL, mx);         \
            for (; r < r1; r++)                                                               \
                TILE(1, TC, o + r, ldo, w + r * rb, rb, a, nb, add, NULL, mx);             \
        } else {                                                                              \
            for (int64_t t = 0; t < tn; t++) {                                                \
                const k4z_mx *mx = MX ? k4z_mx_prep(mxb, a + t, 1, nb) : NULL;                \
                for (r = r0; r + TR <= r1; r += TR)                                     \
                    TILE(TR, 1, o + t * ldo + r, ldo, w + r * rb, rb, a + t, nb, add, NULL, mx); \
                for (; r < r1; r++)                                                           \
                    TILE(1, 1, o + t * ldo + r, ldo, w + r * rb, rb, a + t, nb, add, NULL, mx); \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

/* decode rows (ROW1(o, w0, rb, a, nb, add, pfp, mx)) */
#define K4Z_ROW1(o, w0, rb, a, nb, add, pfp, mx) k4z_row_ymm(o, w0, a, nb, add, pfp, mx)
#define K6Z_ROW1(o, w0, rb, a, nb, add, pfp, mx) k6z_tile(1, 1, o, 0, w0, rb, a, nb, add, pfp, mx)
QZK_FORMAT(k4z, k4z_tile, QZK_R, QZK_C, 1, K4Z_ROW1)
QZK_FORMAT(k6z, k6z_tile, QZ6_R, QZ6_C, 0, K6Z_ROW1)
#endif

/* rows [r0, r1) -> f16 (the prefill's f16 panels, CYLLM_QPREFILL=f16): each block
 * dequantized by the generic code, the floats rounded to f16 (nearest even) 8 at a time by
 * F16C: the generic dequantizer's bits. Its per-element software conversion took a third of
 * the panel path's time (q8_0, T = 128); without it the panels run at the f16 GEMM's speed,
 * which in the avx2 table beats q8_0's int8 GEMM. */
static inline void deq16_rows_x86(int fmt, uint16_t *out, const uint8_t *w, int64_t rb, int64_t n,
                                  int64_t r0, int64_t r1) {
    const cyllm_qformat_info *fi = cyllm_qformat(fmt);
    const int64_t chunk_bytes = QK_K / fi->block * fi->block_bytes;   /* QK_K elements a call */
    float y[QK_K];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        uint16_t *o = out + (r - r0) * n;
        for (int64_t e = 0; e < n; e += QK_K) {
            const int64_t m = n - e < QK_K ? n - e : QK_K;       /* a multiple of the block, of 8 */
            cyllm_qdequant_row_f32_generic(fmt, y, row + e / QK_K * chunk_bytes, m);
            for (int64_t k = 0; k < m; k += 8)
                _mm_storeu_si128((__m128i *)(o + e + k),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(y + k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
}

/* ---- per-format entry points ---------------------------------------------------------
 * The nibble formats' row kernels (QX_NIB_FORMAT): one_##F(C, o, ldo, w0, a, nb, add, pf)
 * runs one row against C activations; range_##F runs rows [r0, r1) of one activation
 * (decode); the GEMM runs tokens in blocks of QX_TB (their activations stay in L1/L2 while
 * the thread's rows stream past), QX_C tokens per call. They serve q4_0 and q4_1 below 512
 * bits, and every nibble format's rows too long for the zmm kernels' prepared activations. */

/* the f16 panels and f32 rows of one format (deq16_##F, deq32_##F) */
#define QX_DEQ(F, FMT)                                                                          \
static void QF(deq16_##F)(uint16_t *out, const uint8_t *w, int64_t rb, int64_t n, int64_t r0, \
                          int64_t r1) {                                                       \
    deq16_rows_x86(FMT, out, w, rb, n, r0, r1);                                               \
}                                                                                             \
static void QF(deq32_##F)(float *out, const uint8_t *w, int64_t rb, int64_t r, int64_t n) { \
    cyllm_qdequant_row_f32_generic(FMT, out, w + r * rb, n);                                  \
}

#define QX_NIB_FORMAT(F, FMT, KIND)                                                             \
ALWAYS void one_##F(const int C, float *o, int64_t ldo, const uint8_t *w0,                  \
                    const cyllm_qact_view *a, int64_t nb, int add, const uint8_t *pfp) {       \
    rows32(C, KIND, o, ldo, w0, a, nb, add, pfp);                                              \
}                                                                                             \
/* rows [r0, r1) of one activation; xps: its prepared pairs (NULL: rows too long for them) */ \
static void range_##F(float *o, const uint8_t *w, int64_t rb, const cyllm_qact_view *a,     \
                      const qx_xpair *xps, int64_t n, int64_t r0, int64_t r1, int add,        \
                      const qx_pf *pf) {                                                      \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        if (xps)                                                                 \
            rows32p(KIND, o + (r - r0), w + r * rb, xps, n / 32, add,        \
                    pf_base(w + r * rb, pf));                                                 \
        else                                                                                  \
            one_##F(1, o + (r - r0), 0, w + r * rb, a, n / 32, add, pf_base(w + r * rb, pf)); \
    }                                                                                         \
}                                                                                             \
static void QF(matvec_##F)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                           int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {   \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);                                         \
    qx_pf pf = {w + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                       \
    qx_xpair xps[QX_XPAIRS];                                                  \
    const int prep = (n / 32 + 1) / 2 <= QX_XPAIRS;                             \
    if (prep) qx_xprep(KIND, xps, &a, n / 32);                                \
    range_##F(out + r0, w, rb, &a, prep ? xps : NULL, n, r0, r1, add, &pf);                   \
}                                                                                             \
static void QF(gate_up_##F)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,   \
                            const void *xq, int64_t n, int64_t r0, int64_t r1, int act,      \
                            const void *nx, int64_t nxb) {                                    \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);                                         \
    qx_pf pg = {wg + r1 * rb, 0, 0, cyllm_qpf_bytes};                                         \
    qx_pf pu = {wu + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                      \
    qx_xpair xps[QX_XPAIRS];                                                  \
    const int prep = (n / 32 + 1) / 2 <= QX_XPAIRS;                             \
    if (prep) qx_xprep(KIND, xps, &a, n / 32);                                \
    float g[16], u[16];                                                                       \
    for (int64_t r = r0; r < r1; r += 16) {                                                   \
        int64_t e = r + 16 < r1 ? r + 16 : r1;                                                \
        range_##F(g, wg, rb, &a, prep ? xps : NULL, n, r, e, 0, &pg);                         \
        range_##F(u, wu, rb, &a, prep ? xps : NULL, n, r, e, 0, &pu);                         \
        for (int64_t i = r; i < e; i++) out[i] = cyllm_qact_apply(act, g[i - r]) * u[i - r]; \
    }                                                                                         \
}                                                                                             \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) { \
    cyllm_qact_view a[QX_TB];                                                                 \
    const int64_t np = (n / 32 + 1) / 2;                                                     \
    if (np <= QX_XPAIRS) {                                                       \
        /* nibble formats: QX_C tokens' pairs prepared once, then every row of the range */   \
        qx_xpair xps[QX_C * QX_XPAIRS];                                       \
        for (int64_t t0 = 0; t0 < T; t0 += QX_C) {                                            \
            const int64_t tn = T - t0 < QX_C ? T - t0 : QX_C;                                 \
            for (int64_t t = 0; t < tn; t++) {                                                \
                cyllm_qact_view v = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, CYLLM_QA_Q8_0); \
                qx_xprep(KIND, xps + t * np, &v, n / 32);                     \
            }                                                                                 \
            for (int64_t r = r0; r < r1; r++) {                                               \
                float *o = out + t0 * ldo + r;                                                \
                if (tn == QX_C)                                                               \
                    rows32pc(QX_C, KIND, o, ldo, w + r * rb, xps, np, n / 32, add); \
                else                                                                          \
                    for (int64_t t = 0; t < tn; t++)                                          \
                        rows32pc(1, KIND, o + t * ldo, ldo, w + r * rb, xps + t * np, np, \
                                 n / 32, add);                                               \
            }                                                                                 \
        }                                                                                     \
        return;                                                                               \
    }                                                                                         \
    for (int64_t t0 = 0; t0 < T; t0 += QX_TB) {                                               \
        const int64_t tn = T - t0 < QX_TB ? T - t0 : QX_TB;                                   \
        for (int64_t t = 0; t < tn; t++)                                                      \
            a[t] = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, CYLLM_QA_Q8_0);                \
        for (int64_t r = r0; r < r1; r++) {                                                   \
            const uint8_t *wr = w + r * rb;                                                   \
            float *o = out + t0 * ldo + r;                                                    \
            int64_t t = 0;                                                                    \
            for (; t + QX_C <= tn; t += QX_C)                                                 \
                one_##F(QX_C, o + t * ldo, ldo, wr, a + t, n / 32, add, wr);                 \
            for (; t < tn; t++)                                                               \
                one_##F(1, o + t * ldo, ldo, wr, a + t, n / 32, add, wr);                    \
        }                                                                                     \
    }                                                                                         \
}                                                                                             \
QX_DEQ(F, FMT)

QX_DEQ(q8_0, CYLLM_QF_Q8_0)
QX_NIB_FORMAT(q4_0, CYLLM_QF_Q4_0, 0)
QX_NIB_FORMAT(q4_1, CYLLM_QF_Q4_1, 1)
#if QX_VNNI == 2            /* the zmm nibble kernels' rows past their prepared activations */
QX_NIB_FORMAT(q5_0, CYLLM_QF_Q5_0, 2)
QX_NIB_FORMAT(q5_1, CYLLM_QF_Q5_1, 3)
#else
QX_DEQ(q5_0, CYLLM_QF_Q5_0)
QX_DEQ(q5_1, CYLLM_QF_Q5_1)
#endif
QX_DEQ(q4_k, CYLLM_QF_Q4_K)
QX_DEQ(q5_k, CYLLM_QF_Q5_K)
QX_DEQ(q6_k, CYLLM_QF_Q6_K)

#if QX_VNNI == 2
/* ---- AVX512-VNNI (zmm) nibble formats: block quads ------------------------------------
 * q4_0/q4_1/q5_0/q5_1 four blocks (128 weights) per pair of vpdpbusd: the 16-byte nibble
 * runs of 4 blocks fill one zmm (128-bit lane k = block b+k); low nibbles meet x[0:16] of
 * each block, high nibbles x[16:32]. x's side of each quad (bytes in that order, scales,
 * the offset's start / min term from the block sums, as in x_pair) is prepared once per
 * call for decode and once per token group for prefill. One float accumulator of 16
 * lanes per (row, token); q4_1/q5_1's min term is a second FMA into the same one. Decode
 * (R = C = 1) and the prefill tiles run each (row, token)'s chain in the same order: same
 * bits. A row's last quad may hold 1-3 blocks (zero lanes beyond). */
typedef struct { __m512i lo, hi, aux; __m512 dx; } qz_xquad;
#define QZ_QUADS 128        /* quads prepared on the stack (n <= 16384) */
#ifndef QZN_R
#define QZN_R 2             /* prefill tile: rows */
#endif
#ifndef QZN_C
#define QZN_C 4             /* prefill tile: tokens */
#endif
#ifndef QZN_RN
#define QZN_RN 3            /* ... rows of the 4-token tiles (longer rows) */
#endif
#define QZN_MR (QZN_RN > QZN_R ? QZN_RN : QZN_R)
#ifndef QZN_CW
#define QZN_CW 8            /* ... for rows of at most QZN_WIDE_QUADS quads (their 8 tokens' */
#endif                      /* quads, <= 48 KiB, stay in L1; longer rows were slower with 8) */
#ifndef QZN_WIDE_QUADS
#define QZN_WIDE_QUADS 24
#endif
#define QZN_MC (QZN_CW > QZN_C ? QZN_CW : QZN_C)   /* array bound of the tiles' tokens */


ALWAYS qz_xquad zn_tok(const int kind, const cyllm_qact_view *a, int64_t b, int cnt) {
    const int has_min = kind == 1 || kind == 3;
    const int shift = kind == 0 ? 1 : 2;
    const __mmask64 m8 = cnt >= 2 ? ~(__mmask64)0 : (__mmask64)0xffffffffULL;
    const __mmask64 m8b = cnt >= 4 ? ~(__mmask64)0 : cnt == 3 ? (__mmask64)0xffffffffULL : 0;
    const __mmask8 m4 = (__mmask8)((1u << cnt) - 1);
    const int8_t *xb = a->q + b * 32;
    const __m512i x0 = _mm512_maskz_loadu_epi8(m8, xb);
    const __m512i x1 = _mm512_maskz_loadu_epi8(m8b, xb + 64);
    qz_xquad r;
    r.lo = _mm512_permutex2var_epi64(x0, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), x1);
    r.hi = _mm512_permutex2var_epi64(x0, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), x1);
    r.dx = _mm512_permutexvar_ps(zlane4(), _mm512_castps128_ps512(_mm_maskz_loadu_ps(m4, a->d + b)));
    const __m512i s = _mm512_permutexvar_epi32(zlane4(), _mm512_castsi128_si512(_mm_maskz_loadu_epi32(m4, a->sum + b)));
    if (!has_min) r.aux = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, shift));
    else r.aux = _mm512_castps_si512(_mm512_mul_ps(r.dx, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(0.25f))));
    return r;
}

ALWAYS void zn_prep(const int kind, qz_xquad *xq, const cyllm_qact_view *a, int64_t nb) {
    for (int64_t b = 0; b < nb; b += 4) xq[b >> 2] = zn_tok(kind, a, b, nb - b < 4 ? (int)(nb - b) : 4);
}

/* 4 f16 (blocks beyond cnt: 0) at p + k * bb -> lanes 4k..4k+3 */
ALWAYS __m512 zn_h4(const uint8_t *p, int bb, int cnt) {
    __m128i h = _mm_cvtsi32_si128(cyllm_rd16(p));
    if (cnt > 1) h = _mm_insert_epi16(h, cyllm_rd16(p + bb), 1);
    if (cnt > 2) h = _mm_insert_epi16(h, cyllm_rd16(p + 2 * bb), 2);
    if (cnt > 3) h = _mm_insert_epi16(h, cyllm_rd16(p + 3 * bb), 3);
    return _mm512_permutexvar_ps(zlane4(), _mm512_castps128_ps512(_mm_cvtph_ps(h)));
}

ALWAYS __m512i zn_ld16x4(const uint8_t *p, int bb, int cnt) {
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)p));
    if (cnt > 1) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + bb)), 1);
    if (cnt > 2) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * bb)), 2);
    if (cnt > 3) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * bb)), 3);
    return v;
}

/* one quad (cnt blocks from b) of R rows x C tokens */
ALWAYS void zn_quad(const int R, const int C, const int kind, __m512 (*acc)[QZN_MC], const uint8_t *w0,
                    int64_t rb, const qz_xquad *xq, int64_t nq, int64_t b, const int cnt) {
    const int bb = kind == 0 ? QB_Q4_0 : kind == 1 ? QB_Q4_1 : kind == 2 ? QB_Q5_0 : QB_Q5_1;
    const int qs_off = kind == 0 ? 2 : kind == 1 ? 4 : kind == 2 ? 6 : 8;
    const int has_min = kind == 1 || kind == 3;
    const int five = kind >= 2;
    const __m512i m15 = _mm512_set1_epi8(15);
    __m512i lo[QZN_MR], hi[QZN_MR];
    __m512 wd[QZN_MR], wm[QZN_MR];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        const uint8_t *p0 = w0 + i * rb + b * bb;
        const __m512i v = zn_ld16x4(p0 + qs_off, bb, cnt);
        lo[i] = _mm512_and_si512(v, m15);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
        if (five) {
            const int ho = kind == 2 ? 2 : 4;
            __m128i h = _mm_cvtsi32_si128((int)cyllm_rd32(p0 + ho));
            if (cnt > 1) h = _mm_insert_epi32(h, (int)cyllm_rd32(p0 + bb + ho), 1);
            if (cnt > 2) h = _mm_insert_epi32(h, (int)cyllm_rd32(p0 + 2 * bb + ho), 2);
            if (cnt > 3) h = _mm_insert_epi32(h, (int)cyllm_rd32(p0 + 3 * bb + ho), 3);
            const __m512i hv = _mm512_permutexvar_epi32(zlane4(), _mm512_castsi128_si512(h));
            const __m512i bit = _mm512_set1_epi64((long long)0x8040201008040201ULL);
            const __m512i sel_lo = _mm512_set4_epi32(0x01010101, 0x01010101, 0, 0);
            const __m512i sel_hi = _mm512_set4_epi32(0x03030303, 0x03030303, 0x02020202, 0x02020202);
            const __m512i x10 = _mm512_set1_epi8(0x10);
            lo[i] = _mm512_mask_add_epi8(lo[i], _mm512_test_epi8_mask(_mm512_shuffle_epi8(hv, sel_lo), bit), lo[i], x10);
            hi[i] = _mm512_mask_add_epi8(hi[i], _mm512_test_epi8_mask(_mm512_shuffle_epi8(hv, sel_hi), bit), hi[i], x10);
        }
        wd[i] = zn_h4(p0, bb, cnt);
        wm[i] = has_min ? zn_h4(p0 + 2, bb, cnt) : wd[i];
    }
    _Pragma("GCC unroll 8")
    for (int j = 0; j < C; j++) {
        const qz_xquad *t = xq + j * nq + (b >> 2);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) {
            /* lanes: u <= 31 times |x| <= 127, 8 products per lane: no overflow */
            __m512i isum = _mm512_dpbusd_epi32(has_min ? _mm512_setzero_si512() : t->aux, lo[i], t->lo);
            isum = _mm512_dpbusd_epi32(isum, hi[i], t->hi);
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd[i], t->dx), acc[i][j]);
            if (has_min) acc[i][j] = _mm512_fmadd_ps(wm[i], _mm512_castsi512_ps(t->aux), acc[i][j]);
        }
    }
}

ALWAYS void zn_tile(const int R, const int C, const int kind, float *o, int64_t ldo, const uint8_t *w0,
                    int64_t rb, const qz_xquad *xq, int64_t nq, int64_t nb, int add, const uint8_t *pfp) {
    const int bb = kind == 0 ? QB_Q4_0 : kind == 1 ? QB_Q4_1 : kind == 2 ? QB_Q5_0 : QB_Q5_1;
    __m512 acc[QZN_MR][QZN_MC];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        if (pfp) {
            PREFETCH(pfp + b * bb);
            PREFETCH(pfp + b * bb + 64);
        }
        zn_quad(R, C, kind, acc, w0, rb, xq, nq, b, 4);
    }
    if (b < nb) {
        const int cnt = (int)(nb - b);
        if (cnt == 1) zn_quad(R, C, kind, acc, w0, rb, xq, nq, b, 1);
        else if (cnt == 2) zn_quad(R, C, kind, acc, w0, rb, xq, nq, b, 2);
        else zn_quad(R, C, kind, acc, w0, rb, xq, nq, b, 3);
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < C; j++) {
            const float r = _mm512_reduce_add_ps(acc[i][j]);
            o[i + j * ldo] = add ? o[i + j * ldo] + r : r;
        }
    }
}

/* rows [r0, r1) of one activation, xq: its quads (decode: one row at a time) */
ALWAYS void zn_range(const int kind, float *o, const uint8_t *w, int64_t rb, const qz_xquad *xq,
                     int64_t n, int64_t r0, int64_t r1, int add, const qx_pf *pf) {
    for (int64_t r = r0; r < r1; r++)
        zn_tile(1, 1, kind, o + (r - r0), 0, w + r * rb, rb, xq, 0, n / 32, add, pf_base(w + r * rb, pf));
}

/* prefill of a nibble format: CG tokens' quads prepared (xp holds CG * nq), then tiles of
 * R rows x CG tokens */
ALWAYS void zn_gemm(const int R, const int CG, const int kind, qz_xquad *xp, float *out, int64_t ldo,
                    const uint8_t *w, int64_t rb, const void *xq, int64_t xs, int64_t T, int64_t n,
                    int64_t r0, int64_t r1, int add) {
    const int64_t nb = n / 32, nq = (nb + 3) / 4;
    for (int64_t t0 = 0; t0 < T; t0 += CG) {
        const int64_t tn = T - t0 < CG ? T - t0 : CG;
        for (int64_t t = 0; t < tn; t++) {
            cyllm_qact_view v = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, CYLLM_QA_Q8_0);
            zn_prep(kind, xp + t * nq, &v, nb);
        }
        float *o = out + t0 * ldo;
        int64_t r = r0;
        if (tn == CG) {
            for (; r + R <= r1; r += R)
                zn_tile(R, CG, kind, o + r, ldo, w + r * rb, rb, xp, nq, nb, add, NULL);
            for (; r < r1; r++)
                zn_tile(1, CG, kind, o + r, ldo, w + r * rb, rb, xp, nq, nb, add, NULL);
        } else {
            for (int64_t t = 0; t < tn; t++) {
                for (r = r0; r + R <= r1; r += R)
                    zn_tile(R, 1, kind, o + t * ldo + r, ldo, w + r * rb, rb, xp + t * nq, nq, nb, add, NULL);
                for (; r < r1; r++)
                    zn_tile(1, 1, kind, o + t * ldo + r, ldo, w + r * rb, rb, xp + t * nq, nq, nb, add, NULL);
            }
        }
    }
}

/* decode and prefill of a nibble format; rows of more than QZ_QUADS quads take the ymm
 * kernels (QX_NIB_FORMAT's) in decode and prefill alike */
#define QZN_FORMAT(F, KIND)                                                                     \
static void QF(matvec_##F##z)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                              int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) { \
    if ((n / 32 + 3) / 4 > QZ_QUADS) {                                                        \
        QF(matvec_##F)(out, w, rb, xq, n, r0, r1, add, nx, nxb);                              \
        return;                                                                               \
    }                                                                                         \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);                               \
    qx_pf pf = {w + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                       \
    qz_xquad xp[QZ_QUADS];                                                                    \
    zn_prep(KIND, xp, &a, n / 32);                                                            \
    zn_range(KIND, out + r0, w, rb, xp, n, r0, r1, add, &pf);                                 \
}                                                                                             \
static void QF(gate_up_##F##z)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb, \
                               const void *xq, int64_t n, int64_t r0, int64_t r1, int act,   \
                               const void *nx, int64_t nxb) {                                 \
    if ((n / 32 + 3) / 4 > QZ_QUADS) {                                                        \
        QF(gate_up_##F)(out, wg, wu, rb, xq, n, r0, r1, act, nx, nxb);                        \
        return;                                                                               \
    }                                                                                         \
    cyllm_qact_view a = cyllm_qact_split(xq, n, CYLLM_QA_Q8_0);                               \
    qx_pf pg = {wg + r1 * rb, 0, 0, cyllm_qpf_bytes};                                         \
    qx_pf pu = {wu + r1 * rb, nx, nxb, cyllm_qpf_bytes};                                      \
    qz_xquad xp[QZ_QUADS];                                                                    \
    zn_prep(KIND, xp, &a, n / 32);                                                            \
    float g[16], u[16];                                                                       \
    for (int64_t r = r0; r < r1; r += 16) {                                                   \
        int64_t e = r + 16 < r1 ? r + 16 : r1;                                                \
        zn_range(KIND, g, wg, rb, xp, n, r, e, 0, &pg);                                       \
        zn_range(KIND, u, wu, rb, xp, n, r, e, 0, &pu);                                       \
        for (int64_t i = r; i < e; i++) out[i] = cyllm_qact_apply(act, g[i - r]) * u[i - r]; \
    }                                                                                         \
}                                                                                             \
static void QF(gemm_##F##z)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                            int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) { \
    const int64_t nb = n / 32, nq = (nb + 3) / 4;                                             \
    if (nq > QZ_QUADS) {                                                                      \
        QF(gemm_##F)(out, ldo, w, rb, xq, xs, T, n, r0, r1, add);                             \
        return;                                                                               \
    }                                                                                         \
    qz_xquad xp[4 * QZ_QUADS];                                                                \
    if (nq <= QZN_WIDE_QUADS)                                                                 \
        zn_gemm(QZN_R, QZN_CW, KIND, xp, out, ldo, w, rb, xq, xs, T, n, r0, r1, add);         \
    else                                                                                      \
        zn_gemm(QZN_RN, QZN_C, KIND, xp, out, ldo, w, rb, xq, xs, T, n, r0, r1, add);         \
}

QZN_FORMAT(q4_0, 0)
QZN_FORMAT(q4_1, 1)
QZN_FORMAT(q5_0, 2)
QZN_FORMAT(q5_1, 3)
#endif

#if QX_VNNI == 2
/* ---- AVX512-VNNI q4_k and q5_k on their r16 layouts (rows interleaved by 16, quant.h) ----
 * One 512-bit load holds 4 consecutive nibble bytes of each of 16 rows, so one vpdpbusd
 * against 4 broadcast x bytes advances 16 rows at once: the nibble unpacking, the scale
 * unpacking and the float work are shared by 16 rows instead of repeated per row (Zen 4,
 * 1 thread, 2048x2048 from L3: 98 -> 48 us against the row kernel above). Each lane is
 * one row: per superblock, the sub-block sums (exact int32) times the 6-bit scales, the
 * min term as int16 pairs (vpdpwssd), then two FMAs into the row's float accumulator, so
 * a (row, token) chain is the same for any number of tokens (decode = prefill bits) and
 * any split of rows (the callers split rows in whole groups, cyllm_qf_is_r16; a range that
 * cuts a group is still computed right, each call storing only its own lanes). q5_k (five)
 * adds each code's fifth bit from its qh chunk: bit 2c (low nibbles) or 2c + 1 (high) of the
 * byte, moved to bit 4 by a 16-bit shift (bit 4 of a byte then comes from the same byte). */
#ifndef R16_TB
#define R16_TB 16           /* prefill: tokens whose activations are split together */
#endif

/* v shifted left by k bits (right by -k) in 16-bit lanes; k is a constant after unrolling */
ALWAYS __m512i shl16(__m512i v, const int k) {
    return k > 0 ? _mm512_slli_epi16(v, k) : k < 0 ? _mm512_srli_epi16(v, -k) : v;
}

/* superblock p's 6-bit scales and mins of 16 rows (byte i of sc[k] / mn[k]: row i's) */
ALWAYS void k45r16_scales(const uint8_t *p, __m128i sc[8], __m128i mn[8]) {
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m30 = _mm_set1_epi8(0x30);
    __m128i s[12];
    _Pragma("GCC unroll 12")
    for (int k = 0; k < 12; k++) s[k] = _mm_loadu_si128((const __m128i *)(p + 64 + 16 * k));
    _Pragma("GCC unroll 4")
    for (int j = 0; j < 4; j++) {           /* the 6-bit packing of k_scales, 16 rows per vector */
        sc[j] = _mm_and_si128(s[j], m63);
        mn[j] = _mm_and_si128(s[j + 4], m63);
        sc[j + 4] = _mm_or_si128(_mm_and_si128(s[j + 8], m15), _mm_and_si128(_mm_srli_epi16(s[j], 2), m30));
        mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 8], 4), m15),
                                 _mm_and_si128(_mm_srli_epi16(s[j + 4], 2), m30));
    }
}

/* mp[i] = (m_2i, m_2i+1) of each row as an int16 pair */
ALWAYS void k45r16_min_pairs(const __m128i mn[8], __m512i mp[4]) {
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++)
        mp[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(mn[2 * i], mn[2 * i + 1]),
                                                      _mm_unpacklo_epi8(mn[2 * i], mn[2 * i + 1])));
}

/* the codes of chunk (c, l) of superblock p: vl = elements 64c + 4l .. +3 (sub-block 2c), vh =
 * elements 64c + 32 + 4l .. (2c + 1), 16 rows each */
ALWAYS void k45r16_codes(const int five, const uint8_t *p, const int c, const int l, __m512i *vl, __m512i *vh) {
    const __m512i m4 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(0x10);
    const __m512i v = _mm512_loadu_si512((const void *)(p + (five ? cyllm_r16_q5_qs(8 * c + l) : 256 + 64 * (8 * c + l))));
    if (five) {                             /* (nibble & 15) | (the bit at 4 & 0x10) */
        const __m512i hb = _mm512_loadu_si512((const void *)(p + cyllm_r16_q5_qh(l)));
        *vl = _mm512_ternarylogic_epi32(v, _mm512_and_si512(shl16(hb, 4 - 2 * c), m16), m4, 0xEC);
        *vh = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(shl16(hb, 3 - 2 * c), m16), m4, 0xEC);
    } else {
        *vl = _mm512_and_si512(v, m4);
        *vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

ALWAYS void r16_group(const int five, const int C, float *o, int64_t ldo, const uint8_t *g, int64_t nb,
                      const cyllm_qact_view *a, int add, __mmask16 keep) {
    const int64_t sb = five ? CYLLM_R16_SB5 : CYLLM_R16_SB;
    __m512 acc[4];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * sb;
        __m128i sc[8], mn[8];
        k45r16_scales(p, sc, mn);
        __m512i isum[4];
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) isum[t] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {       /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            __m512i lo[4], hi[4];
            _Pragma("GCC unroll 4")
            for (int t = 0; t < C; t++) lo[t] = hi[t] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int l = 0; l < 8; l++) {
                __m512i vl, vh;
                k45r16_codes(five, p, c, l, &vl, &vh);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < C; t++) {
                    const uint8_t *x = (const uint8_t *)a[t].q + b * QK_K + 64 * c + 4 * l;
                    lo[t] = _mm512_dpbusd_epi32(lo[t], vl, _mm512_set1_epi32((int)cyllm_rd32(x)));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], vh, _mm512_set1_epi32((int)cyllm_rd32(x + 32)));
                }
            }
            const __m512i slo = _mm512_cvtepu8_epi32(sc[2 * c]), shi = _mm512_cvtepu8_epi32(sc[2 * c + 1]);
            /* |sub-block sum| <= 32 * 31 * 127, times a scale <= 63, 8 of them: exact */
            _Pragma("GCC unroll 4")
            for (int t = 0; t < C; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(lo[t], slo),
                                                                     _mm512_mullo_epi32(hi[t], shi)));
        }
        __m512i mp[4];
        k45r16_min_pairs(mn, mp);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) {
            int32_t pr[4];
            x_sum_pairs(&a[t], b, pr);
            __m512i im = _mm512_setzero_si512();
            _Pragma("GCC unroll 4")
            for (int i = 0; i < 4; i++) im = _mm512_dpwssd_epi32(im, mp[i], _mm512_set1_epi32(pr[i]));
            const __m512 dx = _mm512_set1_ps(a[t].d[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dm, dx), acc[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        __m512 r = acc[t];
        if (add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o + t * ldo), r);
        _mm512_mask_storeu_ps(o + t * ldo, keep, r);
    }
}

/* the lanes of group g inside rows [r0, r1) */
ALWAYS __mmask16 r16_keep(int64_t g, int64_t r0, int64_t r1) {
    const int64_t lo = 16 * g < r0 ? r0 - 16 * g : 0, hi = 16 * g + 16 > r1 ? r1 - 16 * g : 16;
    return (__mmask16)((0xFFFFu >> (16 - hi)) & ~((1u << lo) - 1u));
}


/* q4_0, q8_0, q4_1, q5_0 and q5_1 on their r16 layouts: per 32-element block, 4 (the nibble
 * formats) or 8 (q8_0) loads of 16 rows x 4 bytes. q4_0: two vpdpbusd per load (low nibbles
 * against x[4c..], high against x[16 + 4c..]), the -8 offset from x's block sum; q5_0 and q5_1
 * the same with each code's fifth bit from the block's qh chunk (16 rows' 4 qh bytes): the qh
 * byte of elements 4c..4c+3 (and 16 + 4c..) copied to each byte of the row's lane (vpshufb, two
 * a block for each half), its bit of that element tested into a mask that adds 16 to the
 * code; q8_0: the signed bytes made unsigned (w + 128, one xor) for one vpdpbusd, 128 x's block
 * sum taken off. Then one FMA per block (two with a min) into the row's float accumulator: the
 * same chain for any number of tokens and any split of rows. */
ALWAYS void r16_b32_group(const int kind, const int C, float *o, int64_t ldo, const uint8_t *g, int64_t nb,
                          const cyllm_qact_view *a, int add, __mmask16 keep) {
    /* kind: 0 q4_0, 1 q8_0, 2 q4_1, 3 q5_0, 4 q5_1 (q4_0's nibbles with a min: d q + m, the m
     * plane after d's; with a fifth bit: a qh chunk before the nibbles) */
    const int q8 = kind == 1, mins = kind == 2 || kind == 4, five = kind >= 3;
    const int hdr = mins ? 64 : 32;                 /* the f16 planes before the chunks */
    const int qs0 = hdr + (five ? 64 : 0);          /* the nibbles' first chunk */
    const __m512i m4 = _mm512_set1_epi8(15), sign = _mm512_set1_epi8((char)0x80), b16 = _mm512_set1_epi8(16);
    /* vpshufb's control: each byte of a row's lane <- byte j (0..3) of that lane; element k
     * of a 4-byte chunk (byte k of the lane) has its fifth bit at bit k of its qh byte
     * (chunks 0, 2) or 4 + k (1, 3) */
    const __m512i lane0 = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const __m512i bits[2] = {_mm512_set1_epi32(0x08040201), _mm512_set1_epi32((int)0x80402010u)};
    const int64_t sb = CYLLM_R16 * (q8 ? QB_Q8_0 : kind == 2 ? QB_Q4_1 : kind == 3 ? QB_Q5_0 : kind == 4 ? QB_Q5_1 : QB_Q4_0);
    const int off = q8 ? 128 : kind == 0 ? 8 : kind == 3 ? 16 : 0;
    __m512 acc[4];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * sb;
        __m512i isum[4];
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) isum[t] = _mm512_setzero_si512();
        if (q8) {
            _Pragma("GCC unroll 8")
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + hdr + 64 * c)), sign);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < C; t++)
                    isum[t] = _mm512_dpbusd_epi32(isum[t], v,
                                                  _mm512_set1_epi32((int)cyllm_rd32((const uint8_t *)a[t].q + 32 * b + 4 * c)));
            }
        } else {
            __m512i qh[4];                          /* qh byte j of each row, in each byte of its lane */
            if (five) {
                const __m512i h = _mm512_loadu_si512((const void *)(p + hdr));
                _Pragma("GCC unroll 4")
                for (int j = 0; j < 4; j++) qh[j] = _mm512_shuffle_epi8(h, _mm512_add_epi8(lane0, _mm512_set1_epi8((char)j)));
            }
            _Pragma("GCC unroll 4")
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(p + qs0 + 64 * c));
                __m512i vl = _mm512_and_si512(v, m4);
                __m512i vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (five) {                         /* elements 4c + k: qh byte c / 2; 16 + 4c + k: byte 2 + c / 2 */
                    vl = _mm512_mask_add_epi8(vl, _mm512_test_epi8_mask(qh[c >> 1], bits[c & 1]), vl, b16);
                    vh = _mm512_mask_add_epi8(vh, _mm512_test_epi8_mask(qh[2 + (c >> 1)], bits[c & 1]), vh, b16);
                }
                _Pragma("GCC unroll 4")
                for (int t = 0; t < C; t++) {
                    const uint8_t *x = (const uint8_t *)a[t].q + 32 * b + 4 * c;
                    isum[t] = _mm512_dpbusd_epi32(isum[t], vl, _mm512_set1_epi32((int)cyllm_rd32(x)));
                    isum[t] = _mm512_dpbusd_epi32(isum[t], vh, _mm512_set1_epi32((int)cyllm_rd32(x + 16)));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 m = mins ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))) : d;
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) {
            /* q4_0, q5_0: sum (q - 8 | 16) x; q8_0: sum (w + 128) x - 128 sum x; q4_1, q5_1:
             * sum q x (the min below); exact in int32 */
            const __m512i s = _mm512_sub_epi32(isum[t], _mm512_set1_epi32(off * a[t].sum[b]));
            const __m512 dx = _mm512_set1_ps(a[t].d[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dx), acc[t]);
            if (mins)                       /* + m * (d_x sum x) */
                acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[t].d[b] * (float)a[t].sum[b]), acc[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        __m512 r = acc[t];
        if (add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o + t * ldo), r);
        _mm512_mask_storeu_ps(o + t * ldo, keep, r);
    }
}

/* q6_k on its r16 layout. Per superblock and half h (128 elements), step l (0..7) loads its
 * three chunks of 16 rows x 4 bytes -- ql bytes 64h + 4l (A) and 64h + 32 + 4l (B), qh bytes
 * 32h + 4l (H) -- and makes four vectors of codes (0..63): elements 128h + 32j + 4l .. +3 of
 * 16 rows, j = 0..3 (A's low nibbles with H's bits 0-1, B's low with bits 2-3, A's high with
 * 4-5, B's high with 6-7). One vpdpbusd per vector and token sums 4 codes times 4 x bytes;
 * four steps fill sub-blocks 8h + 2j + l / 4 (16 elements, exact), which take the row's int8
 * scale (vpmulld). The -32 of every code comes from x's 16-element sums against the scales as
 * int16 pairs (vpdpwssd). Then one FMA per superblock into the row's float accumulator: the
 * same chain for any number of tokens and any split of rows. */
/* the four code vectors of step st (three chunks: A, B, H): c[j] = elements 128h + 32j + 4l
 * .. +3 of 16 rows. A code is bits 0-3 from a nibble and bits 4-5 from two bits of H moved
 * there, with zeros above: H's pairs 0 and 2 (mask 0x33) or 1 and 3 (0xCC), so a 16-bit shift
 * brings nothing else into bits 4-7 (what it moves into the next byte lands in that byte's
 * nibble, which the select drops). */
ALWAYS void q6r16_codes(__m512i c[4], const uint8_t *st) {
    const __m512i m15 = _mm512_set1_epi8(15), m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xCC);
    const __m512i A = _mm512_loadu_si512((const void *)st);
    const __m512i B = _mm512_loadu_si512((const void *)(st + 64));
    const __m512i H = _mm512_loadu_si512((const void *)(st + 128));
    const __m512i H02 = _mm512_and_si512(H, m33), H13 = _mm512_and_si512(H, mcc);
    /* m15 ? nibble : high bits (0xE4) */
    c[0] = _mm512_ternarylogic_epi32(A, _mm512_slli_epi16(H02, 4), m15, 0xE4);
    c[1] = _mm512_ternarylogic_epi32(B, _mm512_slli_epi16(H13, 2), m15, 0xE4);
    c[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A, 4), H02, m15, 0xE4);
    c[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(H13, 2), m15, 0xE4);
}

/* the scales of superblock p's 16 rows: sp[i] = (sc_2i, sc_2i+1) of each row as an int16 pair */
ALWAYS void q6r16_scale_pairs(__m512i sp[8], const uint8_t *p) {
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) {
        const __m128i s0 = _mm_loadu_si128((const __m128i *)(p + CYLLM_R16_Q6_SC + 32 * i));
        const __m128i s1 = _mm_loadu_si128((const __m128i *)(p + CYLLM_R16_Q6_SC + 32 * i + 16));
        sp[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(s0, s1), _mm_unpacklo_epi8(s0, s1)));
    }
}

ALWAYS void r16_q6k_group(const int C, float *o, int64_t ldo, const uint8_t *g, int64_t nb,
                          const cyllm_qact_view *a, int add, __mmask16 keep) {
    __m512 acc[4];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * CYLLM_R16_SB6;
        __m512i isum[4];
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) isum[t] = _mm512_setzero_si512();
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            _Pragma("GCC unroll 2")
            for (int hh = 0; hh < 2; hh++) {        /* steps l = 4hh .. 4hh + 3 */
                __m512i D[4][4];                    /* token t, vector j: a sub-block's sums */
                _Pragma("GCC unroll 4")
                for (int t = 0; t < C; t++) {
                    _Pragma("GCC unroll 4")
                    for (int j = 0; j < 4; j++) D[t][j] = _mm512_setzero_si512();
                }
                _Pragma("GCC unroll 4")
                for (int l = 4 * hh; l < 4 * hh + 4; l++) {
                    __m512i c[4];
                    q6r16_codes(c, p + 192 * (8 * h + l));
                    _Pragma("GCC unroll 4")
                    for (int t = 0; t < C; t++) {
                        const uint8_t *x = (const uint8_t *)a[t].q + b * QK_K + 128 * h + 4 * l;
                        _Pragma("GCC unroll 4")
                        for (int j = 0; j < 4; j++)
                            D[t][j] = _mm512_dpbusd_epi32(D[t][j], c[j], _mm512_set1_epi32((int)cyllm_rd32(x + 32 * j)));
                    }
                }
                /* |sub-block sum| <= 16 * 63 * 127, times |scale| <= 128, 16 of them: exact */
                _Pragma("GCC unroll 4")
                for (int j = 0; j < 4; j++) {
                    const int k = 8 * h + 2 * j + hh;
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + CYLLM_R16_Q6_SC + 16 * k)));
                    _Pragma("GCC unroll 4")
                    for (int t = 0; t < C; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(D[t][j], sc));
                }
            }
        }
        __m512i sp[8];
        q6r16_scale_pairs(sp, p);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + CYLLM_R16_Q6_D)));
        _Pragma("GCC unroll 4")
        for (int t = 0; t < C; t++) {
            const int16_t *bs = a[t].bsum + 16 * b;
            __m512i off = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int i = 0; i < 8; i++)
                off = _mm512_dpwssd_epi32(off, sp[i], _mm512_set1_epi32((int)cyllm_rd32((const uint8_t *)(bs + 2 * i))));
            const __m512i tot = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(off, 5));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(d, _mm512_set1_ps(a[t].d[b])), acc[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < C; t++) {
        __m512 r = acc[t];
        if (add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o + t * ldo), r);
        _mm512_mask_storeu_ps(o + t * ldo, keep, r);
    }
}

/* the three entry points of an r16 layout from its group kernel GROUP(C, o, ldo, g, nb, a, add,
 * keep): decode one group after another, gate+up group by group, and the GEMM in tiles of 4
 * tokens (the activations of R16_TB tokens split at a time) */
#define R16_ENTRIES(F, GROUP, ACT, BLK)                                                         \
static void QF(matvec_##F)(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                           int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb) {    \
    (void)nx; (void)nxb;                                                                      \
    const cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                   \
    for (int64_t g = r0 / 16; 16 * g < r1; g++)                                               \
        GROUP(1, out + 16 * g, 0, w + 16 * g * rb, n / BLK, &a, add, r16_keep(g, r0, r1));    \
}                                                                                             \
static void QF(gate_up_##F)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb,    \
                            const void *xq, int64_t n, int64_t r0, int64_t r1, int act,      \
                            const void *nx, int64_t nxb) {                                    \
    (void)nx; (void)nxb;                                                                      \
    const cyllm_qact_view a = cyllm_qact_split(xq, n, ACT);                                   \
    float gv[16], uv[16];                                                                     \
    for (int64_t g = r0 / 16; 16 * g < r1; g++) {                                             \
        GROUP(1, gv, 0, wg + 16 * g * rb, n / BLK, &a, 0, 0xFFFF);                            \
        GROUP(1, uv, 0, wu + 16 * g * rb, n / BLK, &a, 0, 0xFFFF);                            \
        const int64_t e = 16 * g + 16 < r1 ? 16 * g + 16 : r1;                                \
        for (int64_t r = 16 * g > r0 ? 16 * g : r0; r < e; r++)                               \
            out[r] = cyllm_qact_apply(act, gv[r - 16 * g]) * uv[r - 16 * g];                  \
    }                                                                                         \
}                                                                                             \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) { \
    cyllm_qact_view a[R16_TB];                                                                \
    for (int64_t t0 = 0; t0 < T; t0 += R16_TB) {                                              \
        const int64_t tn = T - t0 < R16_TB ? T - t0 : R16_TB;                                 \
        for (int64_t t = 0; t < tn; t++)                                                      \
            a[t] = cyllm_qact_split((const char *)xq + (t0 + t) * xs, n, ACT);                \
        for (int64_t g = r0 / 16; 16 * g < r1; g++) {                                         \
            const __mmask16 keep = r16_keep(g, r0, r1);                                       \
            const uint8_t *wg = w + 16 * g * rb;                                              \
            float *o = out + t0 * ldo + 16 * g;                                               \
            int64_t t = 0;                                                                    \
            for (; t + 4 <= tn; t += 4) GROUP(4, o + t * ldo, ldo, wg, n / BLK, a + t, add, keep); \
            for (; t < tn; t++) GROUP(1, o + t * ldo, ldo, wg, n / BLK, a + t, add, keep);    \
        }                                                                                     \
    }                                                                                         \
}
#define R16_Q4K_GROUP(C, ...) r16_group(0, C, __VA_ARGS__)
#define R16_Q5K_GROUP(C, ...) r16_group(1, C, __VA_ARGS__)
#define R16_Q40_GROUP(C, ...) r16_b32_group(0, C, __VA_ARGS__)
#define R16_Q80_GROUP(C, ...) r16_b32_group(1, C, __VA_ARGS__)
#define R16_Q41_GROUP(C, ...) r16_b32_group(2, C, __VA_ARGS__)
#define R16_Q50_GROUP(C, ...) r16_b32_group(3, C, __VA_ARGS__)
#define R16_Q51_GROUP(C, ...) r16_b32_group(4, C, __VA_ARGS__)
#define R16_Q6K_GROUP(C, ...) r16_q6k_group(C, __VA_ARGS__)
R16_ENTRIES(q4kr16, R16_Q4K_GROUP, CYLLM_QA_Q8_K, QK_K)
R16_ENTRIES(q40r16, R16_Q40_GROUP, CYLLM_QA_Q8_0, 32)
R16_ENTRIES(q80r16, R16_Q80_GROUP, CYLLM_QA_Q8_0, 32)
R16_ENTRIES(q41r16, R16_Q41_GROUP, CYLLM_QA_Q8_0, 32)
R16_ENTRIES(q6kr16, R16_Q6K_GROUP, CYLLM_QA_Q8_K, QK_K)
R16_ENTRIES(q5kr16, R16_Q5K_GROUP, CYLLM_QA_Q8_K, QK_K)
R16_ENTRIES(q50r16, R16_Q50_GROUP, CYLLM_QA_Q8_0, 32)
R16_ENTRIES(q51r16, R16_Q51_GROUP, CYLLM_QA_Q8_0, 32)

/* ---- AVX512-VNNI q6_k prefill: 16 tokens in a zmm's lanes, from the r16 layout ----------
 * r16_q6k_group's integers and chain with tokens in the lanes instead of rows: x is
 * transposed as for q5_k's tile (ktx, with x's 16-element sums), each group of 16 rows is
 * unpacked once to its code vectors (the group kernel's, stored as they come: row i's 4 codes
 * at 4i of each 64 bytes), and one vpdpbusd takes a row's 4 codes (broadcast) against a line
 * of 16 tokens. Per (row, token) and superblock the exact total is the group kernel's, and
 * it meets the same d dx in the same FMA chain, so a token gets decode's bits. */
typedef struct {
    uint8_t *q;             /* (nb, 64, 64): step s's vector j at (4s + j) * 64, row i at 4i */
    int32_t *sc;            /* (nb, 16, 16): scale k of row i at 16 k + i */
    int32_t *sp;            /* (nb, 8, 16): (sc_2p, sc_2p+1) of row i as int16 pairs */
    float *d;               /* (nb, 16) */
} k6t_w;

#ifndef K6T_REST_MIN
#define K6T_REST_MIN 12     /* a last block of fewer tokens takes the group kernel (Zen 4, 1 thread,
                               per token: tile 34-38 us whether 16 or fewer lanes are used,
                               group kernel 38-40 us; 2048x2048) */
#endif

static size_t k6t_w_bytes(int64_t n) { return (size_t)(n / QK_K) * (4096 + 1024 + 512 + 64); }

static k6t_w k6t_w_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / QK_K;
    k6t_w w = {p, (int32_t *)(p + nb * 4096), (int32_t *)(p + nb * 5120), (float *)(p + nb * 5632)};
    return w;
}

/* the 16 rows of r16 group g (at w) -> the panel */
static void k6t_wprep(const k6t_w *pw, const uint8_t *g, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * CYLLM_R16_SB6;
        for (int st = 0; st < 16; st++) {
            __m512i c[4];
            q6r16_codes(c, p + 192 * st);
            for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(pw->q + (b * 64 + 4 * st + j) * 64), c[j]);
        }
        for (int k = 0; k < 16; k++)
            _mm512_storeu_si512((void *)(pw->sc + (b * 16 + k) * 16),
                                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + CYLLM_R16_Q6_SC + 16 * k))));
        __m512i sp[8];
        q6r16_scale_pairs(sp, p);
        for (int i = 0; i < 8; i++) _mm512_storeu_si512((void *)(pw->sp + (b * 8 + i) * 16), sp[i]);
        _mm512_storeu_ps(pw->d + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + CYLLM_R16_Q6_D))));
    }
}

/* The tiles' shared steps, rows i < 8 against 16 token lanes. D[i] += row i's 4 codes (at wv + 4i)
 * times the line of x at xl */
ALWAYS void kt_quad(__m512i D[8], const uint8_t *xl, const uint8_t *wv) {
    const __m512i xv = _mm512_loadu_si512((const void *)xl);
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) D[i] = _mm512_dpbusd_epi32(D[i], _mm512_set1_epi32((int)cyllm_rd32(wv + 4 * i)), xv);
}

/* L[i] += D[i] times row i's scale sc[i] (exact: see the group kernels' bounds) */
ALWAYS void kt_scale(__m512i L[8], const __m512i D[8], const int32_t *sc) {
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) L[i] = _mm512_add_epi32(L[i], _mm512_mullo_epi32(D[i], _mm512_set1_epi32(sc[i])));
}

/* sum over np pairs p of x's sum pairs (bs + 16p, 16 tokens) times the row's pair (wp[16p]) */
ALWAYS __m512i kt_pairs(const int np, const int32_t *bs, const int32_t *wp) {
    __m512i m = _mm512_setzero_si512();
    _Pragma("GCC unroll 8")
    for (int p = 0; p < np; p++)
        m = _mm512_dpwssd_epi32(m, _mm512_loadu_si512((const void *)(bs + 16 * p)), _mm512_set1_epi32(wp[16 * p]));
    return m;
}

/* rows [ilo, ihi) of acc, tokens j < nt, into o[j * ldo + i] (add: +=) */
ALWAYS void kt_store(float *o, int64_t ldo, const __m512 acc[8], int ilo, int ihi, int nt, int add) {
    for (int i = ilo; i < ihi; i++) {
        float r[16];
        _mm512_storeu_ps(r, acc[i]);
        for (int j = 0; j < nt; j++) o[j * ldo + i] = add ? o[j * ldo + i] + r[j] : r[j];
    }
}

/* rows r0 + 0..7 of the panel (r0 = 0 or 8) x 16 tokens; o[j * ldo + i] gets (row i in
 * [ilo, ihi), token j < nt) */
static void k6t_tile(float *o, int64_t ldo, const k6t_w *w, int r0, const ktx *x, int64_t nb, int ilo,
                     int ihi, int nt, int add) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        __m512i L[8];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) L[i] = _mm512_setzero_si512();
        for (int k = 0; k < 16; k++) {          /* sub-block k = 8h + 2j + hh: steps 8h + 4hh .. +3 */
            const int h = k >> 3, j = (k >> 1) & 3, hh = k & 1;
            __m512i D[8];
            _Pragma("GCC unroll 8")
            for (int i = 0; i < 8; i++) D[i] = _mm512_setzero_si512();
            _Pragma("GCC unroll 4")
            for (int q = 0; q < 4; q++) {
                const int l = 4 * hh + q;
                kt_quad(D, x->q + 16 * (s * QK_K + 128 * h + 32 * j + 4 * l),
                        w->q + (s * 64 + 4 * (8 * h + l) + j) * 64 + 4 * r0);
            }
            kt_scale(L, D, w->sc + (s * 16 + k) * 16 + r0);
        }
        const __m512 dx = _mm512_loadu_ps(x->dx + 16 * s);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) {
            const __m512i off = kt_pairs(8, x->bs + 8 * s * 16, w->sp + s * 8 * 16 + r0 + i);
            const __m512i tot = _mm512_sub_epi32(L[i], _mm512_slli_epi32(off, 5));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(_mm512_set1_ps(w->d[s * 16 + r0 + i]), dx),
                                     acc[i]);
        }
    }
    kt_store(o, ldo, acc, ilo, ihi, nt, add);
}

/* q5_k the same way (r16_group's integers and chain, 16 tokens in the lanes; the same tile on
 * q4_k's layout measured slower than q4_k's group kernel): the
 * panel holds each chunk's code vectors (sub-block 2c + hi, quad l at (8 (2c + hi) + l) * 64),
 * the scales and the min pairs per row lane; per (row, token) and superblock, L meets d dx and
 * M dm dx in the group kernel's two FMAs. */
typedef struct {
    uint8_t *q;             /* (nb, 64, 64): row i's 4 codes at 4i */
    int32_t *sc;            /* (nb, 8, 16): scale k of row i at 16 k + i */
    int32_t *mp;            /* (nb, 4, 16): (m_2p, m_2p+1) of row i as int16 pairs */
    float *d, *dm;          /* (nb, 16) */
} k45t_w;

static size_t k45t_w_bytes(int64_t n) { return (size_t)(n / QK_K) * (4096 + 512 + 256 + 128); }

static k45t_w k45t_w_at(uint8_t *p, int64_t n) {
    const int64_t nb = n / QK_K;
    k45t_w w = {p, (int32_t *)(p + nb * 4096), (int32_t *)(p + nb * 4608), (float *)(p + nb * 4864),
                (float *)(p + nb * 4928)};
    return w;
}

/* the 16 rows of q5_k_r16 group g (at w) -> the panel */
static void k45t_wprep(const k45t_w *pw, const uint8_t *g, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * CYLLM_R16_SB5;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++) {
                __m512i vl, vh;
                k45r16_codes(1, p, c, l, &vl, &vh);
                _mm512_storeu_si512((void *)(pw->q + (b * 64 + 16 * c + l) * 64), vl);
                _mm512_storeu_si512((void *)(pw->q + (b * 64 + 16 * c + 8 + l) * 64), vh);
            }
        __m128i sc[8], mn[8];
        __m512i mp[4];
        k45r16_scales(p, sc, mn);
        k45r16_min_pairs(mn, mp);
        for (int k = 0; k < 8; k++) _mm512_storeu_si512((void *)(pw->sc + (b * 8 + k) * 16), _mm512_cvtepu8_epi32(sc[k]));
        for (int i = 0; i < 4; i++) _mm512_storeu_si512((void *)(pw->mp + (b * 4 + i) * 16), mp[i]);
        _mm512_storeu_ps(pw->d + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
        _mm512_storeu_ps(pw->dm + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))));
    }
}

static void k45t_tile(float *o, int64_t ldo, const k45t_w *w, int r0, const ktx *x, int64_t nb, int ilo,
                      int ihi, int nt, int add) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        __m512i L[8];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) L[i] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {           /* sub-block k: chunks (k / 2, l), half k % 2 */
            __m512i D[8];
            _Pragma("GCC unroll 8")
            for (int i = 0; i < 8; i++) D[i] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int l = 0; l < 8; l++)
                kt_quad(D, x->q + 16 * (s * QK_K + 32 * k + 4 * l), w->q + (s * 64 + 8 * k + l) * 64 + 4 * r0);
            kt_scale(L, D, w->sc + (s * 8 + k) * 16 + r0);
        }
        const __m512 dx = _mm512_loadu_ps(x->dx + 16 * s);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) {
            const __m512i M = kt_pairs(4, x->bs + 4 * s * 16, w->mp + s * 4 * 16 + r0 + i);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(L[i]), _mm512_mul_ps(_mm512_set1_ps(w->d[s * 16 + r0 + i]), dx),
                                     acc[i]);
            acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(_mm512_set1_ps(w->dm[s * 16 + r0 + i]), dx),
                                      acc[i]);
        }
    }
    kt_store(o, ldo, acc, ilo, ihi, nt, add);
}

/* prefill on the r16 layouts of q5_k (kind 1) and q6_k (kind 2; q4_k's group kernel beat this
 * tile on Zen 4, 2048x2048 T = 128 1 thread 3.36 ms against 3.84-3.87, so q4_k keeps it): up to K5T_TOKENS tokens
 * transposed at a time, one group of 16 rows unpacked at a time and run, 8 rows by 16 tokens,
 * against every block of tokens; a short last block goes to the group kernel (the same bits).
 * The buffers (x: ~17 bytes per token and element, the panel: ~20-22 per element) are malloc'd
 * per call and thread; if that fails, the group kernel takes every token. */
ALWAYS void kt_gemm(const int kind, float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,
                    int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {
    const int np = kind == 2 ? 8 : 4;           /* pairs of x's sums: 16-element (q6_k), 32 */
    const int64_t rest = T % 16 < K6T_REST_MIN ? T % 16 : 0;
    const int64_t Tt = T - rest;                /* tokens the tile takes */
    const int64_t nb = n / QK_K, tc = Tt < K5T_TOKENS ? Tt : K5T_TOKENS, nblk = (tc + 15) / 16;
    const size_t xb = ktx_bytes(n, np), wb = kind == 2 ? k6t_w_bytes(n) : k45t_w_bytes(n);
    uint8_t *buf = Tt == 0 ? NULL : (uint8_t *)_mm_malloc((size_t)nblk * xb + wb, 64);
    if (rest || !buf) {
        const int64_t t = buf ? Tt : 0;
        (kind == 2 ? QF(gemm_q6kr16) : QF(gemm_q5kr16))(
            out + t * ldo, ldo, w, rb, (const char *)xq + t * xs, xs, T - t, n, r0, r1, add);
        if (!buf) return;
    }
    const k6t_w w6 = k6t_w_at(buf + nblk * xb, n);
    const k45t_w w45 = k45t_w_at(buf + nblk * xb, n);
    for (int64_t t0 = 0; t0 < Tt; t0 += tc) {
        const int64_t tn = Tt - t0 < tc ? Tt - t0 : tc;
        for (int64_t k = 0; k * 16 < tn; k++) {
            ktx x = ktx_at(buf + k * xb, n, np);
            ktx_prep(&x, xq, xs, t0 + 16 * k, tn - 16 * k < 16 ? (int)(tn - 16 * k) : 16, n, np);
        }
        for (int64_t g = r0 / 16; 16 * g < r1; g++) {
            if (kind == 2) k6t_wprep(&w6, w + 16 * g * rb, nb);
            else k45t_wprep(&w45, w + 16 * g * rb, nb);
            for (int half = 0; half < 2; half++) {
                const int64_t base = 16 * g + 8 * half;
                const int ilo = base < r0 ? (int)(r0 - base) : 0;
                const int ihi = base + 8 > r1 ? (int)(r1 - base) : 8;
                if (ilo >= ihi) continue;
                for (int64_t k = 0; k * 16 < tn; k++) {
                    const ktx x = ktx_at(buf + k * xb, n, np);
                    const int nt = tn - 16 * k < 16 ? (int)(tn - 16 * k) : 16;
                    float *o = out + (t0 + 16 * k) * ldo + base;
                    if (kind == 2) k6t_tile(o, ldo, &w6, 8 * half, &x, nb, ilo, ihi, nt, add);
                    else k45t_tile(o, ldo, &w45, 8 * half, &x, nb, ilo, ihi, nt, add);
                }
            }
        }
    }
    _mm_free(buf);
}

#define KT_GEMM(F, KIND)                                                                         \
static void QF(gemm_##F)(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq,  \
                         int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add) {    \
    kt_gemm(KIND, out, ldo, w, rb, xq, xs, T, n, r0, r1, add);                                   \
}
KT_GEMM(q5kt, 1)
KT_GEMM(q6kt, 2)

#define QX_ENTRY_R16(F) {QF(matvec_##F##r16), QF(gate_up_##F##r16), QF(gemm_##F##r16), cyllm_##F##_r16_deq16, \
                         cyllm_##F##_r16_deq32}
/* q5_k's and q6_k's r16 layouts: prefill on the tokens-in-lanes tiles */
#define QX_ENTRY_KT(F) {QF(matvec_##F##r16), QF(gate_up_##F##r16), QF(gemm_##F##t), cyllm_##F##_r16_deq16, \
                        cyllm_##F##_r16_deq32}
#else
#define QX_ENTRY_R16(F) R16_ENTRY_GENERIC(F)
#define QX_ENTRY_KT(F) R16_ENTRY_GENERIC(F)
#endif

#define QX_ENTRY(F) {QF(matvec_##F), QF(gate_up_##F), QF(gemm_##F), QF(deq16_##F), QF(deq32_##F)}
#if QX_VNNI == 2
#define QX_ENTRY_Q8_0 {QF(matvec_z8), QF(gate_up_z8), QF(gemm_z8), QF(deq16_q8_0), QF(deq32_q8_0)}
#define QX_ENTRY_NIB(F) {QF(matvec_##F##z), QF(gate_up_##F##z), QF(gemm_##F##z), QF(deq16_##F), QF(deq32_##F)}
#define QX_ENTRY_Q5(F) QX_ENTRY_NIB(F)
#define QX_ENTRY_Q4_K {QF(matvec_k4z), QF(gate_up_k4z), QF(gemm_k4z), QF(deq16_q4_k), QF(deq32_q4_k)}
#define QX_ENTRY_Q5_K {QF(matvec_k5), QF(gate_up_k5), QF(gemm_k5t), QF(deq16_q5_k), QF(deq32_q5_k)}
#define QX_ENTRY_Q6_K {QF(matvec_k6z), QF(gate_up_k6z), QF(gemm_k6z), QF(deq16_q6_k), QF(deq32_q6_k)}
#else
#define QX_ENTRY_Q8_0 {QF(matvec_k8t), QF(gate_up_k8t), QF(gemm_k8t), QF(deq16_q8_0), QF(deq32_q8_0)}
#define QX_ENTRY_Q4_K {QF(matvec_k4), QF(gate_up_k4), QF(gemm_k4y), QF(deq16_q4_k), QF(deq32_q4_k)}
#define QX_ENTRY_Q5_K {QF(matvec_k5), QF(gate_up_k5), QF(gemm_k5y), QF(deq16_q5_k), QF(deq32_q5_k)}
#define QX_ENTRY_NIB(F) QX_ENTRY(F)
#define QX_ENTRY_Q5(F) {QF(matvec_##F##y), QF(gate_up_##F##y), QF(gemm_##F##y), QF(deq16_##F), QF(deq32_##F)}
#define QX_ENTRY_Q6_K {QF(matvec_k6), QF(gate_up_k6), QF(gemm_k6y), QF(deq16_q6_k), QF(deq32_q6_k)}
#endif

const cyllm_qkernels QX_TABLE = {
    QX_NAME,
    QF(quantize_act_x86_),
    {QX_ENTRY_Q8_0, QX_ENTRY_NIB(q4_0), QX_ENTRY_NIB(q4_1), QX_ENTRY_Q5(q5_0), QX_ENTRY_Q5(q5_1),
     QX_ENTRY_Q4_K, QX_ENTRY_Q5_K, QX_ENTRY_Q6_K,
     QX_ENTRY_R16(q4k), QX_ENTRY_R16(q40), QX_ENTRY_R16(q80), QX_ENTRY_R16(q41),
     QX_ENTRY_KT(q6k), QX_ENTRY_KT(q5k), QX_ENTRY_R16(q50), QX_ENTRY_R16(q51)},
};
