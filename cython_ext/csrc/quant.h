/* cyllm quantized CPU kernels: per-variant tables indexed by weight format
 * (ggml's type_traits_cpu idea). Independent of kernels.h except for cyllm_silu.
 *
 * Weights: a matrix of `rows` rows of n elements in a block format is
 * (rows, row_bytes) bytes, row_bytes = (n / block) * block_bytes, blocks exactly as
 * in GGUF files (see src/cyllm/quant/formats.py for the layouts).
 *
 * Activations: x (n,) f32 is quantized ONCE per op into the activation format of the
 * weight format (cyllm_qformat(fmt)->act), then every output row is an integer dot
 * product with it. Layouts (cyllm's own, nb = n / block):
 *   CYLLM_QA_Q8_0 (block 32):  int8 q[n] | float d[nb] | int32 sum[nb]      (sum of each block's q)
 *   CYLLM_QA_Q8_K (block 256): int8 q[n] | float d[nb] | int16 bsum[16 nb]  (sum of each 16 q)
 * Per block: amax = max|x|, d = amax / 127, q = rint(x * (127 / amax)) (0 if amax == 0):
 * every variant writes the same bytes (and so does cyllm.quant.reference.quantize_act).
 * Put the buffer on a 64-byte boundary (the kernels use unaligned loads, but a q block
 * that straddles cache lines costs).
 *
 * Determinism: a row's result is computed by one call in a fixed order that does
 * not depend on r0/r1 or on which other rows share the call, so any split of rows
 * over threads gives the same bits. Different variants may differ in the last bits
 * (float summation order); the integer parts are exact in all of them.
 *
 * Pointers may be unaligned beyond their element size; nothing here allocates; the
 * kernels are single-threaded pieces of work (threads live in quant.pxi / program.c).
 *
 * Reference: src/cyllm/quant/reference.py (NumPy block math, bit-exact with llama.cpp's
 * quantizers). Tests: tests/test_quant_kernels.py (every kernel and variant, awkward shapes,
 * bitwise across thread counts), tests/test_backend_ops.py (the ops), tests/test_quant_llamacpp.py
 * (whole models against llama.cpp). Benchmark: bench/bench_quant.py.
 */
#ifndef CYLLM_QUANT_H
#define CYLLM_QUANT_H

#include <stdint.h>
#include "act.h"

#ifdef __cplusplus
extern "C" {
#endif

/* weight formats: the kernel_id of cyllm.quant.formats (KERNEL_IDS order). The last eight are
 * no file's: q4_k, q4_0, q8_0, q4_1, q6_k, q5_k, q5_0 and q5_1 with rows interleaved by 16 (cyllm_r16_repack;
 * the CPU backend makes them at load where the AVX512-VNNI kernels run).
 * q4_k_r16: per superblock b, a group of 16 rows g stores
 * 2304 bytes at w + 16 g row_bytes + 2304 b: d[16] (f16), dmin[16] (f16), scales[12][16]
 * (byte k of row i's packed scales at 64 + 16 k + i), then qs as 32 chunks of 64 bytes
 * (chunk c: bytes 4c..4c+3 of each row's qs, row i at 4i): the same bytes as the file's,
 * reordered so that one 512-bit load holds 4 nibble-pairs of 16 rows. */
enum {
    CYLLM_QF_Q8_0 = 0, CYLLM_QF_Q4_0, CYLLM_QF_Q4_1, CYLLM_QF_Q5_0, CYLLM_QF_Q5_1,
    CYLLM_QF_Q4_K, CYLLM_QF_Q5_K, CYLLM_QF_Q6_K, CYLLM_QF_Q4_K_R16, CYLLM_QF_Q4_0_R16, CYLLM_QF_Q8_0_R16,
    CYLLM_QF_Q4_1_R16, CYLLM_QF_Q6_K_R16, CYLLM_QF_Q5_K_R16, CYLLM_QF_Q5_0_R16, CYLLM_QF_Q5_1_R16,
    CYLLM_QF_COUNT
};
/* q4_0_r16 / q8_0_r16 / q4_1_r16 / q5_0_r16 / q5_1_r16: the same for the 32-element blocks, per
 * block b of a group: d[16] (f16) (q4_1, q5_1: then m[16]), then the bytes after the file's
 * f16 fields as 4 (q4_0, q4_1), 5 (q5_0, q5_1: qh, then qs's 4) or 8 (q8_0) chunks of 64 bytes
 * (chunk c: bytes 4c..4c+3 of each row's, row i at 4i): 16 blocks' bytes. */
#define CYLLM_R16 16                    /* rows per group of the interleaved layout */
/* whether fmt is an r16 layout (its kernels compute whole groups of 16 rows, so a split of
 * rows over threads falls on multiples of 16: a group cut in two would be computed twice) */
static inline int cyllm_qf_is_r16(int fmt) { return fmt >= CYLLM_QF_Q4_K_R16 && fmt < CYLLM_QF_COUNT; }
#define CYLLM_R16_SB (16 * 144)         /* bytes of one superblock of a q4_k_r16 group */
/* q5_k_r16: q4_k_r16's 256 bytes of d, dmin and scales, then q4_k_r16's 32 chunks of qs with
 * the 8 chunks of qh (chunk l: bytes 4l..4l+3 of each row's qh, row i at 4i) after the first
 * 8 of qs, qh chunk l after qs chunk l: the order in which the kernel first reads them (qh
 * chunk l serves qs chunks l, 8 + l, 16 + l, 24 + l). 2816 bytes per superblock of a group. */
#define CYLLM_R16_SB5 (16 * 176)
/* offsets of q5_k_r16's qs chunk c and qh chunk l inside a superblock */
static inline int cyllm_r16_q5_qs(int c) { return c < 8 ? 256 + 128 * c : 768 + 64 * c; }
static inline int cyllm_r16_q5_qh(int l) { return 320 + 128 * l; }
/* q6_k_r16: per superblock b, a group of 16 rows stores 3360 bytes at w + 16 g row_bytes +
 * 3360 b: 16 steps of 192 bytes, then d[16] (f16) at 3072, then scales[16][16] (row i's
 * scale k at 3104 + 16 k + i). Step s = 8 h + l (h = 0, 1: a half of 128 elements; l = 0..7)
 * holds three chunks of 64 bytes (4 bytes of each row, row i at 4i): ql bytes 64h + 4l ..,
 * ql bytes 64h + 32 + 4l .., qh bytes 32h + 4l .. -- the order in which the kernel reads them,
 * so a superblock streams front to back (laid out as in the file, the chunks of a step were
 * apart and decode from DRAM ran at a third of the speed). */
#define CYLLM_R16_SB6 (16 * 210)
#define CYLLM_R16_Q6_D 3072             /* offsets inside a q6_k_r16 superblock */
#define CYLLM_R16_Q6_SC 3104
/* activation formats */
enum { CYLLM_QA_Q8_0 = 0, CYLLM_QA_Q8_K = 1 };

typedef struct cyllm_qformat_info {
    const char *name;       /* "q4_k" */
    int ggml_type;          /* GGML type id */
    int block;              /* elements per block */
    int block_bytes;        /* bytes per block */
    int act;                /* CYLLM_QA_* */
} cyllm_qformat_info;

/* NULL for an id outside [0, CYLLM_QF_COUNT) */
const cyllm_qformat_info *cyllm_qformat(int fmt);
/* elements per activation block (32 | 256), 0 for a bad act */
int cyllm_qact_block(int act);
/* bytes of one quantized activation of n elements (n a multiple of the block), -1 if bad */
int64_t cyllm_qact_bytes(int act, int64_t n);

typedef struct cyllm_qfmt_kernels {
    /* rows [r0, r1) of out = W @ x (add == 0) or out += W @ x (add != 0).
     * w: the whole matrix (rows, row_bytes); xq: x quantized to this format's act; n: cols.
     * nx, nx_bytes: the weights this thread reads next (NULL, 0: none known); the
     * software prefetch runs into them near the end of the rows (a hint only). */
    void (*matvec_rows)(float *out, const uint8_t *w, int64_t row_bytes, const void *xq,
                        int64_t n, int64_t r0, int64_t r1, int add,
                        const void *nx, int64_t nx_bytes);
    /* rows [r0, r1) of out = act(Wg @ x) * (Wu @ x); Wg, Wu of the same format and shape.
     * Each of the two dot products gives the bits matvec_rows gives for that row. */
    void (*gate_up_rows)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t row_bytes,
                         const void *xq, int64_t n, int64_t r0, int64_t r1, int act,
                         const void *nx, int64_t nx_bytes);
    /* Batched (prefill) integer GEMM, rows [r0, r1) for T tokens:
     * out[t * ldo + r] = (add ? out[t * ldo + r] : 0) + W[r] . x_t, where x_t is the
     * activation at (const char *)xq + t * xq_stride. Each (r, t) gives the bits
     * matvec_rows gives for row r with x_t. */
    void (*gemm_rows)(float *out, int64_t ldo, const uint8_t *w, int64_t row_bytes,
                      const void *xq, int64_t xq_stride, int64_t T, int64_t n,
                      int64_t r0, int64_t r1, int add);
    /* rows [r0, r1) dequantized to f16 (round to nearest even): out (r1 - r0, n),
     * row r at out + (r - r0) * n. The prefill path feeds these panels to gemm_rows
     * of kernels.h. Values beyond the f16 range become +-inf. */
    void (*dequant_rows_f16)(uint16_t *out, const uint8_t *w, int64_t row_bytes, int64_t n,
                             int64_t r0, int64_t r1);
    /* row r of w to f32 (quantized embedding rows): out (n,) */
    void (*dequant_row_f32)(float *out, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t n);
} cyllm_qfmt_kernels;

typedef struct cyllm_qkernels {
    const char *name;       /* "generic" | "avx2" | "avxvnni" | "avx512vnni" */
    /* blocks [b0, b1) of x (n,) -> xq in the layout of act (xq is the whole buffer
     * of cyllm_qact_bytes(act, n) bytes). */
    void (*quantize_act)(void *xq, const float *x, int64_t n, int act, int64_t b0, int64_t b1);
    cyllm_qfmt_kernels fmt[CYLLM_QF_COUNT];
} cyllm_qkernels;

extern const cyllm_qkernels cyllm_qkernels_generic;
#ifdef CYLLM_HAVE_AVX2
extern const cyllm_qkernels cyllm_qkernels_avx2;
#endif
#ifdef CYLLM_HAVE_AVXVNNI
extern const cyllm_qkernels cyllm_qkernels_avxvnni;
#endif
#ifdef CYLLM_HAVE_AVX512VNNI
extern const cyllm_qkernels cyllm_qkernels_avx512vnni;
#endif

/* quant_dispatch.c */
enum {
    CYLLM_QCPU_AVX2 = 1,        /* AVX + AVX2 + FMA + F16C, OS saves ymm */
    CYLLM_QCPU_AVXVNNI = 2,     /* AVX-VNNI (VEX vpdpbusd), with the AVX2 set */
    CYLLM_QCPU_AVX512VNNI = 4   /* AVX512F/BW/VL + AVX512_VNNI, OS saves zmm/opmask, with the AVX2 set */
};
int cyllm_qcpu_features(void);
/* The table called `name`, or NULL when unknown, not built in, or not runnable here. */
const cyllm_qkernels *cyllm_qkernels_by_name(const char *name);
/* The best table runnable here, at most as wide as the main variant (kernels.h names:
 * "generic" -> generic; "avx2" -> avxvnni or avx2; "avx512" -> avx512vnni, avxvnni or avx2). */
const cyllm_qkernels *cyllm_qkernels_for_variant(const char *variant);

/* quant_generic.c: the r16 layout of file format fmt (-1: none); rows [g0, g1) * 16 of a
 * matrix of format fmt (one that has a layout; rows a multiple of 16) -> the same rows of
 * its layout */
int cyllm_r16_layout(int fmt);
void cyllm_r16_repack(int fmt, uint8_t *dst, const uint8_t *src, int64_t row_bytes, int64_t g0, int64_t g1);
/* the file's bytes of block b of row r of an r16 matrix of file format fmt -> out */
void cyllm_r16_gather(int fmt, uint8_t *out, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t b);

/* quant_quantize.c: one row of n float32 (n a multiple of the block, finite values)
 * -> out (row_bytes) in format fmt; the bytes of cyllm.quant.reference.quantize
 * (llama.cpp's reference quantizers). Baseline ISA, no FMA contraction. */
void cyllm_quantize_row(int fmt, uint8_t *out, const float *x, int64_t n);

/* software prefetch distance of the quantized matvecs, bytes ahead of the row
 * stream (0 = off); quant_generic.c, set by quant.pxi's _set_qprefetch */
extern int64_t cyllm_qpf_bytes;

/* shared scalar helpers (baseline ISA): silu is kernels_generic.c's (the same bits as
 * the f16 path), gelu_tanh is quant_generic.c's */
float cyllm_silu(float x);
float cyllm_gelu_tanh(float x);
static inline float cyllm_qact_apply(int act, float g) {
    return act == CYLLM_ACT_GELU_TANH ? cyllm_gelu_tanh(g) : cyllm_silu(g);
}
/* out[i] = act(g[i]) * u[i] for i in [r0, r1): a GLU whose gate and up products came
 * from separate matvecs (gate and up of different formats); the fused kernels apply
 * the same function to the same values */
void cyllm_qglu(float *out, const float *g, const float *u, int64_t r0, int64_t r1, int act);

#ifdef __cplusplus
}
#endif
#endif
