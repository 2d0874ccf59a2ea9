/* cyllm CPU kernels: the per-variant function table.
 *
 * Every variant (generic = portable C, avx2 = AVX2+FMA+F16C intrinsics, avx512 = the avx2
 * table with the AVX-512F prefill GEMM and attention of kernels_avx512.c) fills one
 * table; the Cython layer picks a table once and calls through it from inside its
 * OpenMP loops. The kernels here are single-threaded pieces of work (a range of
 * rows, one attention head): the threading lives in the Cython layer (cpu_ops.pxi,
 * threading.pxi; program.c for the captured decode step).
 *
 * Conventions: float16 travels as uint16_t bit patterns; every pointer may be
 * unaligned beyond its element size (mmap'd safetensors data is only 8-byte
 * aligned), so SIMD code uses unaligned loads only. Nothing here allocates.
 */
#ifndef CYLLM_KERNELS_H
#define CYLLM_KERNELS_H

#include <math.h>
#include <stdint.h>
#include "act.h"

/* Gemma 2's soft cap of an attention score: cap * tanh(s / cap) keeps |s| under cap and
 * leaves small scores almost as they are (applied where cap > 0). */
static inline float cyllm_softcap(float s, float cap) { return cap * tanhf(s / cap); }

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cyllm_kernels {
    const char *name;
    /* rows [r0, r1) of out = W @ x (add == 0) or out += W @ x (add != 0).
     * W (d, n) f16 row-major, x (n,) f32, out (d,) f32. Each row is summed on its
     * own in a fixed order, so a row's result does not depend on how rows are split.
     * nx, nx_bytes: the weights this thread reads next (NULL, 0: none known); the
     * software prefetch runs into them near the end of the rows (a hint only). */
    void (*matvec_rows)(float *out, const uint16_t *w, const float *x,
                        int64_t n, int64_t r0, int64_t r1, int add,
                        const void *nx, int64_t nx_bytes);
    /* rows [r0, r1) of out = act(Wg @ x) * (Wu @ x); Wg, Wu (f, n) f16; act: CYLLM_ACT_*. */
    void (*gate_up_rows)(float *out, const uint16_t *wg, const uint16_t *wu,
                         const float *x, int64_t n, int64_t r0, int64_t r1, int act,
                         const void *nx, int64_t nx_bytes);
    /* n_q consecutive query heads that share one kv head, over t_len cached
     * positions; online softmax in one pass over K and V. out, q (n_q * hd,) f32
     * (must not overlap); k, v (t_len, hd) f16. A head's result does not depend on
     * n_q (any split of a GQA group gives the same bits).
     * ml == NULL: out is the attention output. Otherwise a partial result over these
     * t_len positions: out holds the unnormalised sum of p_t * v_t and ml[2h], ml[2h+1]
     * the running max m and denominator l of head h (merged by cyllm_attention_step).
     * softcap > 0: each scaled score s becomes cyllm_softcap(s, softcap) (Gemma 2). */
    void (*attention_group)(float *out, const float *q, const uint16_t *k,
                            const uint16_t *v, int64_t t_len, int64_t hd, float scale,
                            float softcap, int64_t n_q, float *ml);
    void (*f16_to_f32)(float *out, const uint16_t *in, int64_t n);
    void (*f32_to_f16)(uint16_t *out, const float *in, int64_t n);   /* round to nearest even */
    /* Sum of n floats: the read-bandwidth probe (the result keeps the reads alive). */
    double (*sum_f32)(const float *p, int64_t n);
    /* Batched prefill GEMM, output rows [r0, r1) of every token:
     *   mode 0: out = x @ W.T ; mode 1: out += x @ W.T ;
     *   mode 2 + act: out = act(x @ W.T) * (x @ Wu.T)  (wu used only here; act CYLLM_ACT_*).
     * x (T, n) f32 with rows ldx >= n floats apart, W/Wu (d, n) f16, out (T, d) f32
     * (must not overlap x or W).
     * A row's result does not depend on r0/r1 (any split over threads gives the
     * same bits); splits on multiples of gemm_nr keep the panels full. */
    void (*gemm_rows)(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                      int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                      int mode);
    int gemm_nr;
    /* Prefill attention, GEMM-shaped (NULL in variants without it: the caller falls
     * back to attention_group per row). Up to attention_rows_max query rows of ONE
     * head (q + i * ldq, out + i * ldq); row i attends to positions 0..len0+i-1 of k, v
     * (positions x hd, f16). work: attention_rows_work(len0 + rows - 1) floats. */
    void (*attention_rows)(float *out, const float *q, int64_t ldq, const uint16_t *k,
                           const uint16_t *v, int64_t hd, float scale, float softcap, int64_t rows,
                           int64_t len0, float *work);
    int64_t (*attention_rows_work)(int64_t t_max);
    int attention_rows_max;
    /* Two tokens of matvec_rows (mode 0, 1: add) or gate_up_rows (mode 2 + act) at once, the
     * weights read once: token i's x at x + i * ldx, its rows [r0, r1) at out + i * ldo. Each
     * token gets the bits of the one-token kernel (a prompt of a few tokens, CpuKernels). */
    void (*rows2)(float *out, int64_t ldo, const uint16_t *w, const uint16_t *wu, const float *x,
                  int64_t ldx, int64_t n, int64_t r0, int64_t r1, int mode);
} cyllm_kernels;

extern const cyllm_kernels cyllm_generic_kernels;
#ifdef CYLLM_HAVE_AVX2
extern const cyllm_kernels cyllm_avx2_kernels;
#endif
#ifdef CYLLM_HAVE_AVX512
/* kernels_avx512.c: the avx512 table is the avx2 one with this GEMM (dispatch.c) */
void cyllm_gemm_rows_avx512(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                            int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                            int mode);
void cyllm_attention_rows_avx512(float *out, const float *q, int64_t ldq, const uint16_t *k,
                                 const uint16_t *v, int64_t hd, float scale, float softcap, int64_t rows,
                                 int64_t len0, float *work);
int64_t cyllm_attention_rows_work_avx512(int64_t t_max);
#endif

/* dispatch.c */
enum {
    CYLLM_CPU_AVX = 1, CYLLM_CPU_AVX2 = 2, CYLLM_CPU_FMA = 4, CYLLM_CPU_F16C = 8,
    CYLLM_CPU_AVX512F = 16
};
int cyllm_cpu_features(void);          /* bitmask of CYLLM_CPU_* usable on this CPU + OS */
int cyllm_avx2_compiled(void);         /* 1 when the AVX2 variant was built into this extension */
int cyllm_avx512_compiled(void);       /* 1 when the AVX-512 GEMM was built in */
/* The table named `name` ("generic" | "avx2" | "avx512"), or NULL when unknown or unusable here. */
const cyllm_kernels *cyllm_kernels_by_name(const char *name);

/* Serial helpers shared by every variant (baseline ISA; small vectors). */
float cyllm_silu(float x);
/* the gate activation of a GLU: silu(x) or gelu with the tanh approximation */
float cyllm_act(float x, int act);
/* F16 matvec software prefetch distance in bytes ahead of the weight stream (0 = off);
 * see kernels_avx2.c */
extern int64_t cyllm_pf_bytes;
/* x bytes from which a matvec's row is wide (half of L1d), and the L2 prefetch distance of
 * wide rows (kernels_avx2.c) */
extern int64_t cyllm_pf_wide_x;
extern int64_t cyllm_pf_wide_bytes;
void cyllm_pf_init(void);        /* cyllm_pf_wide_x from this CPU's L1d size (once, at import) */
extern int cyllm_pf_next;       /* program.c: 1 = decode program prefetches across ops */
extern int cyllm_spin;          /* program.c: polls at a barrier before a waiter sleeps */
/* out (n,) = x / sqrt(mean(x^2) + eps) * w: sum of squares in double, one f32 scale.
 * Shared by the rmsnorm op and the decode program so both give the same bits. */
void cyllm_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* rotate-half RoPE in place of `heads` heads of hd floats: the first 2*half floats of
 * each head rotate (partial rotary when 2*half < hd), with c, s (half,) */
void cyllm_rope_rows(float *v, int64_t heads, int64_t hd, int64_t half, const float *c, const float *s);

/* program.c: a captured decode step (see cyllm_program_run). */
enum {
    CYLLM_OP_EMBED = 1, CYLLM_OP_RMSNORM, CYLLM_OP_MATVEC, CYLLM_OP_GATE_UP, CYLLM_OP_ROPE,
    CYLLM_OP_CACHE_STORE, CYLLM_OP_ATTENTION, CYLLM_OP_ADD, CYLLM_OP_SWIGLU,
    /* quantized weights (quant.h): x -> activation blocks once, then integer matvecs */
    CYLLM_OP_QUANTIZE, CYLLM_OP_QMATVEC, CYLLM_OP_QGATE_UP, CYLLM_OP_QEMBED, CYLLM_OP_GLU,
    /* a mixture of experts' MLP (cyllm_moe_layer): router, choice, chosen experts */
    CYLLM_OP_MOE
};
typedef struct cyllm_op {
    int kind;
    int barrier;            /* 1: all threads wait after this op (0 only between independent matvecs) */
    int mode;               /* matvec: 0 set, 1 add; gate_up: the activation CYLLM_ACT_* */
    int dyn;                /* rope/cache_store/attention: 1 = use the step's pos; embed: use token */
    float *out;             /* matvec/gate_up/rmsnorm/embed/attention/add/swiglu output; rope: q */
    float *out2;            /* rope: k */
    const void *a;          /* matvec: W; gate_up: Wg; rmsnorm: x; embed: table; attention: q; add/swiglu: x */
    const void *b;          /* gate_up: Wu; rmsnorm: w; add/swiglu: y; rope: cos table */
    const void *c;          /* matvec/gate_up: x; rope: sin table; cache_store: k src */
    const void *e;          /* cache_store: v src */
    uint16_t *kc, *vc;      /* cache_store/attention caches (n_kv, max_ctx, hd) */
    int64_t d, n;           /* matvec: rows, cols; rmsnorm: rows (>= 1), row length; add/swiglu: length; embed: dim */
    int64_t n_heads, n_kv, hd, max_ctx, half;
    int64_t fixed;          /* pos/token when dyn == 0 */
    int64_t window;         /* attention: positions attended, itself included (0: all) */
    int next_w;             /* matvec/gate_up: index of the next matvec/gate_up op (prefetch), -1: none */
    int slot;               /* matvec-like ops: index of its row claims (cyllm_program_run), else -1 */
    float eps, scale;       /* scale: attention score scale; embed: factor on the row */
    float softcap;          /* attention: the scores' soft cap (0: none) */
    /* quantized ops. QUANTIZE: x (c, n floats) -> xq in activation format act; mode 1: on
     * thread 0 alone (x came from a thread-0 op: no barrier in between), 0: blocks split
     * over the team. QMATVEC/QGATE_UP: weights a (and b) of format qfmt read xq; mode as
     * for MATVEC/GATE_UP. QEMBED: row `token` of table a (format qfmt) dequantized.
     * GLU: out = act(a) * b over n elements (mode = act), split over the team. */
    void *xq;
    int qfmt, act;
    int64_t rb;             /* bytes per weight row (every matvec-like op: the prefetch of the next) */
    struct cyllm_moe_layer *moe;    /* MOE: the layer's experts and work arrays */
} cyllm_op;
/* Decode attention of one query (all heads) over cache positions start..pos, called by
 * every thread `tid` of a team of `nth` (it contains barriers). Up to
 * CYLLM_ATT_BLOCK positions: runs of GQA heads split over threads. Longer: the cache
 * is cut in fixed blocks of CYLLM_ATT_BLOCK positions (flash-decoding), threads take
 * (kv head, block) items, then the partials are merged per head in block order --
 * the blocks do not depend on the thread count, so neither do the bits.
 * scratch: cyllm_attention_scratch(n_heads, hd, pos + 1) floats. */
#define CYLLM_ATT_BLOCK 256
int64_t cyllm_attention_scratch(int64_t n_heads, int64_t hd, int64_t t_len);
void cyllm_attention_step(const cyllm_kernels *kt, float *out, const float *q,
                          const uint16_t *kc, const uint16_t *vc, int64_t n_heads, int64_t n_kv,
                          int64_t hd, int64_t max_ctx, int64_t start, int64_t pos, float scale,
                          float softcap, float *scratch, int tid, int nth);
/* the same from outside a parallel region: opens one with nt threads */
void cyllm_attention_run(const cyllm_kernels *kt, float *out, const float *q,
                         const uint16_t *kc, const uint16_t *vc, int64_t n_heads, int64_t n_kv,
                         int64_t hd, int64_t max_ctx, int64_t start, int64_t pos, float scale,
                         float softcap, float *scratch, int nt);
/* Runs ops[0..n_ops) for one token inside one OpenMP parallel region of nt threads
 * (qk: the quantized kernels of the QUANTIZE/QMATVEC/QGATE_UP/QEMBED ops). claims:
 * n_slots * nt cyllm_claim (the ops' slots; zeroed here), or NULL: each thread computes
 * exactly its own rows of a matvec (no stealing). */
struct cyllm_qkernels;
typedef struct cyllm_claim {
    int64_t next;           /* chunks of this share handed out (an atomic counter) */
    char pad[56];           /* one cache line per counter */
} cyllm_claim;
/* a mixture of experts' chosen experts for one token (program.c, cyllm_moe_experts_run) */
#define CYLLM_MOE_MAX_K 64
typedef struct cyllm_moe {
    int64_t k, n, f;            /* experts chosen, x's (and out's) length, each expert's rows */
    const void *gate[CYLLM_MOE_MAX_K], *up[CYLLM_MOE_MAX_K], *down[CYLLM_MOE_MAX_K];   /* chosen, in order */
    int fmt_gu, fmt_down;       /* quantized kernel id of gate/up (one format) and of down; -1: f16 */
    int64_t rb_gu, rb_down;     /* their row bytes */
    int act;                    /* CYLLM_ACT_* */
    const float *x;             /* (n,) */
    float *out;                 /* (n,) += */
    const float *wts;           /* (k,) the experts' weights */
    float *h;                   /* (k, f) scratch */
    float *y;                   /* (k, n) scratch */
    void *xq;                   /* x's activation blocks (gate/up quantized) */
    void *hq;                   /* k h's activation blocks, hq_stride bytes apart (down quantized) */
    int64_t hq_stride;
} cyllm_moe;
void cyllm_moe_experts_run(const cyllm_kernels *kt, const struct cyllm_qkernels *qk, const cyllm_moe *m, int nt);
/* A token's choice of experts, as backends/moe.py route() makes it: scores[e] = router[e] . x
 * (router (E, n) f32; a fixed order of float32 sums, the same wherever it runs), then
 * p = softmax(scores) in place, ids[0:k] the experts of the highest p, best first, of equals
 * the lower id (a NaN p is chosen last), and wts[j] = p[ids[j]], divided by their sum (in
 * rank order) where norm. Every id is in [0, E). 1 <= k <= E. */
void cyllm_moe_route(const float *router, const float *x, int64_t E, int64_t n, int64_t k, int norm,
                     float *scores, int64_t *ids, float *wts);
/* A mixture of experts' MLP in a decode program (CYLLM_OP_MOE): the router's product split
 * over the team, the choice (cyllm_moe_route's) on thread 0, then the chosen experts
 * (cyllm_moe_experts_run's step) with m.gate/up/down set from the tables. */
typedef struct cyllm_moe_layer {
    int64_t E, k;
    int norm;
    const float *router;                        /* (E, n) f32 */
    const void *const *gate, *const *up, *const *down;    /* (E,) each: every expert's matrices */
    float *scores;                              /* (E,) */
    int64_t *ids;                               /* (k,) */
    float *wts;                                 /* (k,): m.wts points here */
    cyllm_moe m;                                /* all but gate/up/down, which each step sets */
} cyllm_moe_layer;

extern int cyllm_steal;     /* 1: idle threads take chunks of the others' rows; 0: off; 2: tests */
void cyllm_program_run(const cyllm_kernels *kt, const struct cyllm_qkernels *qk, const cyllm_op *ops,
                       int n_ops, int nt, int64_t token, int64_t pos, float *scratch,
                       cyllm_claim *claims, int n_slots);

#ifdef __cplusplus
}
#endif
#endif
