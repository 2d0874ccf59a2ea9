/* Private helpers shared by the quant_*.c variants (not part of the table's API). */
#ifndef CYLLM_QUANT_IMPL_H
#define CYLLM_QUANT_IMPL_H

#include <stdint.h>
#include <string.h>
#include "quant.h"
#include "fp16.h"

/* block sizes in bytes (formats.py holds the same table) */
#define QB_Q8_0 34
#define QB_Q4_0 18
#define QB_Q4_1 20
#define QB_Q5_0 22
#define QB_Q5_1 24
#define QB_Q4_K 144
#define QB_Q5_K 176
#define QB_Q6_K 210
#define QK_K 256

/* the activation buffer, split into its parts (see quant.h for the layout) */
typedef struct {
    const int8_t *q;        /* (n,) */
    const float *d;         /* (nb,) */
    const int32_t *sum;     /* q8_0: (nb,) */
    const int16_t *bsum;    /* q8_K: (16 nb,) */
} cyllm_qact_view;

static inline cyllm_qact_view cyllm_qact_split(const void *xq, int64_t n, int act) {
    cyllm_qact_view v;
    const char *p = (const char *)xq;
    int64_t nb = act == CYLLM_QA_Q8_K ? n / QK_K : n / 32;
    v.q = (const int8_t *)p;
    v.d = (const float *)(p + n);
    v.sum = (const int32_t *)(p + n + 4 * nb);
    v.bsum = (const int16_t *)(p + n + 4 * nb);
    return v;
}

static inline uint16_t cyllm_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t cyllm_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* q4_K / q5_K: the 12 packed bytes -> 8 six-bit scales (sc) and mins (m), one byte each.
 * Sub-blocks 0-3: low 6 bits of bytes 0-3 / 4-7; 4-7: nibbles of bytes 8-11 plus the top
 * two bits of bytes 0-3 / 4-7. Done on 32-bit words, 4 sub-blocks at a time. */
static inline void cyllm_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t a0 = cyllm_rd32(s), a1 = cyllm_rd32(s + 4), a2 = cyllm_rd32(s + 8);
    uint32_t sc_lo = a0 & 0x3f3f3f3fu, m_lo = a1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
    memcpy(sc, &sc_lo, 4); memcpy(sc + 4, &sc_hi, 4);
    memcpy(m, &m_lo, 4); memcpy(m + 4, &m_hi, 4);
}

/* the generic variant's pieces that other variants reuse */
void cyllm_qdequant_rows_f16_generic(int fmt, uint16_t *out, const uint8_t *w, int64_t row_bytes,
                                     int64_t n, int64_t r0, int64_t r1);
void cyllm_qdequant_row_f32_generic(int fmt, float *out, const uint8_t *row, int64_t n);
/* the r16 layouts' portable entries (quant_generic.c), F = q4k | q40 | q80 | q41 | q6k | q5k | q50 | q51 */
#define R16_DECL(F)                                                                              \
void cyllm_##F##_r16_deq16(uint16_t *out, const uint8_t *w, int64_t rb, int64_t n, int64_t r0, int64_t r1); \
void cyllm_##F##_r16_deq32(float *out, const uint8_t *w, int64_t rb, int64_t r, int64_t n);  \
void cyllm_##F##_r16_matvec_generic(float *out, const uint8_t *w, int64_t rb, const void *xq, int64_t n, \
                                    int64_t r0, int64_t r1, int add, const void *nx, int64_t nxb); \
void cyllm_##F##_r16_gate_up_generic(float *out, const uint8_t *wg, const uint8_t *wu, int64_t rb, \
                                     const void *xq, int64_t n, int64_t r0, int64_t r1, int act, \
                                     const void *nx, int64_t nxb);                            \
void cyllm_##F##_r16_gemm_generic(float *out, int64_t ldo, const uint8_t *w, int64_t rb, const void *xq, \
                                  int64_t xs, int64_t T, int64_t n, int64_t r0, int64_t r1, int add);
R16_DECL(q4k)
R16_DECL(q40)
R16_DECL(q80)
R16_DECL(q41)
R16_DECL(q6k)
R16_DECL(q5k)
R16_DECL(q50)
R16_DECL(q51)
#define R16_ENTRY_GENERIC(F) {cyllm_##F##_r16_matvec_generic, cyllm_##F##_r16_gate_up_generic, \
                              cyllm_##F##_r16_gemm_generic, cyllm_##F##_r16_deq16, cyllm_##F##_r16_deq32}

#endif
