/* Weight-panel packing for the batched GEMMs (included by the AVX2 and AVX-512
 * kernel files, both compiled with at least -mavx2 -mfma -mf16c): a panel of nr
 * weight rows x kc columns, f16 -> f32, stored transposed (wp[j * nr + i]) so the
 * micro-kernel loads nr consecutive outputs' weights for one column at once. */
#ifndef CYLLM_GEMM_PACK_H
#define CYLLM_GEMM_PACK_H
#include <immintrin.h>
#include <stdint.h>

static inline __m256 gp_load8h(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline float gp_h2f(uint16_t h) { return _cvtsh_ss(h); }

/* 8x8 transpose of ymm rows r[0..7] in place */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* wp[j * nr + i] = f32(w[(r0 + i) * n + k0 + j]) for i < nr, j < kc; rows >= rmax are 0.
 * nr is a multiple of 8. */
static void pack_panel_avx2(float *wp, int nr, const uint16_t *w, int64_t n, int64_t r0,
                            int64_t rmax, int64_t k0, int64_t kc) {
    for (int i0 = 0; i0 < nr; i0 += 8) {
        int valid = (int)(rmax - (r0 + i0));
        if (valid >= 8) {
            const uint16_t *src = w + (r0 + i0) * n + k0;
            int64_t j = 0;
            for (; j + 8 <= kc; j += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = gp_load8h(src + i * n + j);
                transpose8(r);
                for (int jj = 0; jj < 8; jj++) _mm256_store_ps(wp + (j + jj) * nr + i0, r[jj]);
            }
            for (; j < kc; j++)
                for (int i = 0; i < 8; i++) wp[j * nr + i0 + i] = gp_h2f(src[i * n + j]);
        } else {
            for (int64_t j = 0; j < kc; j++)
                for (int i = 0; i < 8; i++)
                    wp[j * nr + i0 + i] = i < valid ? gp_h2f(w[(r0 + i0 + i) * n + k0 + j]) : 0.0f;
        }
    }
}

/* The next panel's source lines, fetched into L2 while this panel's micro-kernels run:
 * packing read its weights straight from DRAM, 32 rows x 512 bytes at a stride of a row,
 * and stalled on them (10% of an F16 prefill's samples on Zen 4). The next panel is the
 * next kc columns of these rows, or the first of the next rows; its lines are spread over
 * the `calls` micro-kernel calls of this panel. */
typedef struct {
    int64_t row, rows, col, bytes;  /* the next panel: rows [row, row + rows), columns from col */
    int64_t n;                      /* columns of w */
    int64_t line, lines, per_call;  /* lines issued so far, in all, per call */
} gp_next;

static inline void gp_next_init(gp_next *g, int nr, int64_t n, int64_t r, int64_t rmax, int64_t r1,
                                int64_t k0, int64_t kc, int64_t kcmax, int64_t calls) {
    g->n = n;
    g->line = g->lines = 0;
    g->bytes = 0;
    if (k0 + kc < n) {
        g->row = r;
        g->rows = rmax - r;
        g->col = k0 + kc;
    } else if (rmax < r1) {
        g->row = rmax;
        g->rows = r1 - rmax < nr ? r1 - rmax : nr;
        g->col = 0;
    } else {
        g->per_call = 0;
        return;
    }
    const int64_t cols = n - g->col < kcmax ? n - g->col : kcmax;
    g->bytes = cols * 2;
    const int64_t per_row = (g->bytes + 63) / 64;
    g->lines = g->rows * per_row;
    g->per_call = calls > 0 ? (g->lines + calls - 1) / calls : g->lines;
}

static inline void gp_prefetch_next(gp_next *g, const uint16_t *w, const uint16_t *wu) {
    const int64_t per_row = (g->bytes + 63) / 64;
    for (int64_t k = 0; k < g->per_call && g->line < g->lines; k++, g->line++) {
        const int64_t i = g->line / per_row, off = (g->line % per_row) * 64;
        const int64_t at = (g->row + i) * g->n + g->col;
        _mm_prefetch((const char *)(w + at) + off, _MM_HINT_T1);
        if (wu) _mm_prefetch((const char *)(wu + at) + off, _MM_HINT_T1);
    }
}

#endif
