/* cyllm CPU kernels: the per-variant function table.
 *
 * Every variant (generic = portable C, avx2 = AVX2+FMA+F16C intrinsics) fills one
 * table; the Cython layer picks a table once and calls through it from inside its
 * OpenMP loops. The kernels here are single-threaded pieces of work (a range of
 * rows, one attention head): the threading lives in kernels.pyx.
 *
 * Conventions: float16 travels as uint16_t bit patterns; every pointer may be
 * unaligned beyond its element size (mmap'd safetensors data is only 8-byte
 * aligned), so SIMD code uses unaligned loads only. Nothing here allocates.
 */
#ifndef CYLLM_KERNELS_H
#define CYLLM_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cyllm_kernels {
    const char *name;
    /* rows [r0, r1) of out = W @ x (add == 0) or out += W @ x (add != 0).
     * W (d, n) f16 row-major, x (n,) f32, out (d,) f32. Rows are grouped in fours
     * from row 0, so a row's result does not depend on how rows are split. */
    void (*matvec_rows)(float *out, const uint16_t *w, const float *x,
                        int64_t n, int64_t r0, int64_t r1, int add);
    /* rows [r0, r1) of out = silu(Wg @ x) * (Wu @ x); Wg, Wu (f, n) f16. */
    void (*gate_up_rows)(float *out, const uint16_t *wg, const uint16_t *wu,
                         const float *x, int64_t n, int64_t r0, int64_t r1);
    /* n_q consecutive query heads that share one kv head, over t_len cached
     * positions; online softmax in one pass over K and V. out, q (n_q * hd,) f32
     * (must not overlap); k, v (t_len, hd) f16. A head's result does not depend on
     * n_q (any split of a GQA group gives the same bits). */
    void (*attention_group)(float *out, const float *q, const uint16_t *k,
                            const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                            int64_t n_q);
    void (*f16_to_f32)(float *out, const uint16_t *in, int64_t n);
    void (*f32_to_f16)(uint16_t *out, const float *in, int64_t n);   /* round to nearest even */
    /* Sum of n floats: the read-bandwidth probe (the result keeps the reads alive). */
    double (*sum_f32)(const float *p, int64_t n);
} cyllm_kernels;

extern const cyllm_kernels cyllm_generic_kernels;
#ifdef CYLLM_HAVE_AVX2
extern const cyllm_kernels cyllm_avx2_kernels;
#endif

/* dispatch.c */
enum {
    CYLLM_CPU_AVX = 1, CYLLM_CPU_AVX2 = 2, CYLLM_CPU_FMA = 4, CYLLM_CPU_F16C = 8,
    CYLLM_CPU_AVX512F = 16
};
int cyllm_cpu_features(void);          /* bitmask of CYLLM_CPU_* usable on this CPU + OS */
int cyllm_avx2_compiled(void);         /* 1 when the AVX2 variant was built into this extension */
/* The table named `name` ("generic" | "avx2"), or NULL when unknown or unusable here. */
const cyllm_kernels *cyllm_kernels_by_name(const char *name);

/* Serial helpers shared by every variant (baseline ISA; small vectors). */
float cyllm_silu(float x);

#ifdef __cplusplus
}
#endif
#endif
