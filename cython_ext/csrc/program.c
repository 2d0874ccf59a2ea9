/* A captured decode step: every op of one token's forward pass, run inside ONE
 * OpenMP parallel region (compiled at the baseline ISA; the kernels themselves
 * come through the variant's table).
 *
 * Why: op by op, every matvec opens its own parallel region, and each opening
 * costs ~1 us with a hot team (~14 us after the threads fell asleep), plus a
 * Python call and argument checks per op (~250 ops per token for a 30-layer
 * model). Here the team is woken once per token; ops are separated by barriers
 * only where a dependency needs one (see cyllm_op.barrier), small vector ops run
 * on thread 0 alone, matvecs split their rows and attention its heads exactly as
 * the op-by-op code does, so the logits are bitwise the same.
 *
 * Every pointer and size in the program was validated when it was captured
 * (program.pxi, DecodeProgram); the step's pos and token are range-checked by
 * the caller before this runs.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <stdatomic.h>
#include "kernels.h"
#include "quant.h"
#include "omp_shim.h"
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---- the team's barrier: spin briefly, then sleep ------------------------------------
 * A decode step waits at ~10 barriers per layer. With the cores to itself a barrier is
 * over in well under a microsecond, so the waiters spin. When another process keeps a
 * core busy, the thread being waited for may be descheduled for a whole time slice:
 * spinning then burns the very core it needs (libgomp spins ~300k iterations first,
 * and 2-thread decode collapsed 10-40x). So after cyllm_spin polls the waiter sleeps
 * on a futex (elsewhere: yields) and the last arrival wakes it. Sense: `gen` counts
 * completed barriers; seq_cst on `sleepers`/`gen` orders the sleep/wake handshake. */
int cyllm_spin = 2000;

typedef struct {
    atomic_int arrived;
    atomic_int gen;
    atomic_int sleepers;
} cyllm_sync;

static void sync_wait(cyllm_sync *s, int nth) {
    int g = atomic_load_explicit(&s->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&s->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&s->arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&s->gen, 1);
        if (atomic_load(&s->sleepers) > 0) {
#if defined(__linux__)
            syscall(SYS_futex, (int *)&s->gen, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#endif
        }
        return;
    }
    for (int i = 0; i < cyllm_spin; i++) {
        if (atomic_load_explicit(&s->gen, memory_order_acquire) != g) return;
        CPU_RELAX();
    }
    atomic_fetch_add(&s->sleepers, 1);
    while (atomic_load(&s->gen) == g) {
#if defined(__linux__)
        syscall(SYS_futex, (int *)&s->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&s->sleepers, 1);
}

static inline void sync_init(cyllm_sync *s) {
    atomic_init(&s->arrived, 0);
    atomic_init(&s->gen, 0);
    atomic_init(&s->sleepers, 0);
}

/* a barrier of the team running a step: the program's own (sync), or OpenMP's */
static inline void team_barrier(cyllm_sync *sync, int nth) {
    if (sync) {
        sync_wait(sync, nth);
        return;
    }
#ifdef _OPENMP
    #pragma omp barrier
#endif
}

int64_t cyllm_attention_scratch(int64_t n_heads, int64_t hd, int64_t t_len) {
    int64_t nblk = (t_len + CYLLM_ATT_BLOCK - 1) / CYLLM_ATT_BLOCK;
    return nblk <= 1 ? 0 : nblk * n_heads * (hd + 2);
}

static void attention_step(const cyllm_kernels *kt, float *out, const float *q,
                           const uint16_t *kc, const uint16_t *vc, int64_t n_heads, int64_t n_kv,
                           int64_t hd, int64_t max_ctx, int64_t start, int64_t pos, float scale,
                           float softcap, float *scratch, int tid, int nth, cyllm_sync *sync) {
    /* a sliding window only moves the first position: the cache rows start..pos */
    int64_t group = n_heads / n_kv, t_len = pos + 1 - start;
    kc += start * hd;
    vc += start * hd;
    int64_t nblk = (t_len + CYLLM_ATT_BLOCK - 1) / CYLLM_ATT_BLOCK;
    if (nblk <= 1) {
        /* runs of a GQA group's heads, the fewest splits that give every thread the
         * same number of items (as the op used to split them) */
        int64_t splits = 1;
        while (splits < group && (n_kv * splits) % nth != 0) splits++;
        int64_t chunk = (group + splits - 1) / splits;
        splits = (group + chunk - 1) / chunk;
        int64_t items = n_kv * splits;
        for (int64_t it = tid; it < items; it += nth) {
            int64_t kvh = it / splits;
            int64_t h0 = kvh * group + (it % splits) * chunk;
            int64_t nq = (kvh + 1) * group - h0;
            if (nq > chunk) nq = chunk;
            kt->attention_group(out + h0 * hd, q + h0 * hd, kc + kvh * max_ctx * hd,
                                vc + kvh * max_ctx * hd, t_len, hd, scale, softcap, nq, NULL);
        }
        return;
    }
    /* scratch: partial sums [nblk][n_heads][hd], then (m, l) [nblk][n_heads][2] */
    float *po = scratch, *pml = scratch + nblk * n_heads * hd;
    int64_t items = n_kv * nblk;
    for (int64_t it = tid; it < items; it += nth) {
        int64_t blk = it / n_kv, kvh = it % n_kv, t0 = blk * CYLLM_ATT_BLOCK;
        int64_t len = t_len - t0 < CYLLM_ATT_BLOCK ? t_len - t0 : CYLLM_ATT_BLOCK;
        int64_t h0 = kvh * group;
        kt->attention_group(po + (blk * n_heads + h0) * hd, q + h0 * hd,
                            kc + (kvh * max_ctx + t0) * hd, vc + (kvh * max_ctx + t0) * hd,
                            len, hd, scale, softcap, group, pml + (blk * n_heads + h0) * 2);
    }
    team_barrier(sync, nth);
    for (int64_t h = tid; h < n_heads; h += nth) {
        float m = -INFINITY;
        for (int64_t b = 0; b < nblk; b++) {
            float mb = pml[(b * n_heads + h) * 2];
            if (mb > m) m = mb;
        }
        float *oh = out + h * hd, l = 0.0f;
        for (int64_t d = 0; d < hd; d++) oh[d] = 0.0f;
        for (int64_t b = 0; b < nblk; b++) {
            float w = expf(pml[(b * n_heads + h) * 2] - m);
            l += pml[(b * n_heads + h) * 2 + 1] * w;
            const float *ob = po + (b * n_heads + h) * hd;
            for (int64_t d = 0; d < hd; d++) oh[d] += ob[d] * w;
        }
        float inv = 1.0f / l;
        for (int64_t d = 0; d < hd; d++) oh[d] *= inv;
    }
}

void cyllm_attention_step(const cyllm_kernels *kt, float *out, const float *q,
                          const uint16_t *kc, const uint16_t *vc, int64_t n_heads, int64_t n_kv,
                          int64_t hd, int64_t max_ctx, int64_t start, int64_t pos, float scale,
                          float softcap, float *scratch, int tid, int nth) {
    attention_step(kt, out, q, kc, vc, n_heads, n_kv, hd, max_ctx, start, pos, scale, softcap, scratch,
                   tid, nth, NULL);
}

void cyllm_attention_run(const cyllm_kernels *kt, float *out, const float *q,
                         const uint16_t *kc, const uint16_t *vc, int64_t n_heads, int64_t n_kv,
                         int64_t hd, int64_t max_ctx, int64_t start, int64_t pos, float scale,
                         float softcap, float *scratch, int nt) {
    if (nt <= 1) {
        cyllm_attention_step(kt, out, q, kc, vc, n_heads, n_kv, hd, max_ctx, start, pos, scale,
                             softcap, scratch, 0, 1);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt)
    cyllm_attention_step(kt, out, q, kc, vc, n_heads, n_kv, hd, max_ctx, start, pos, scale, softcap,
                         scratch, omp_get_thread_num(), omp_get_num_threads());
#else
    cyllm_attention_step(kt, out, q, kc, vc, n_heads, n_kv, hd, max_ctx, start, pos, scale, softcap,
                         scratch, 0, 1);
#endif
}

/* rows [r0, r1) of a matvec-like op for thread tid: contiguous runs of whole groups of
 * `unit` rows (4; 16 for the r16 layouts), as CpuKernels and QuantKernels split them */
int cyllm_pf_next = 1;     /* 0: no prefetch across ops (for A/B measurements) */

static inline void row_split(int64_t d, int64_t unit, int tid, int nth, int64_t *r0, int64_t *r1) {
    int64_t groups = (d + unit - 1) / unit;
    *r0 = (groups * tid / nth) * unit;
    *r1 = (groups * (tid + 1) / nth) * unit;
    if (*r1 > d) *r1 = d;
}

static inline int64_t op_unit(const cyllm_op *o) {
    return (o->kind == CYLLM_OP_QMATVEC || o->kind == CYLLM_OP_QGATE_UP) && cyllm_qf_is_r16(o->qfmt)
           ? CYLLM_R16 : 4;
}

/* rows [r0, r1) of matvec-like op o; nx, nx_bytes: what the thread reads after them */
static void run_rows(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_op *o,
                     int64_t r0, int64_t r1, const void *nx, int64_t nx_bytes) {
    switch (o->kind) {
    case CYLLM_OP_MATVEC:
        kt->matvec_rows(o->out, (const uint16_t *)o->a, (const float *)o->c, o->n, r0, r1,
                        o->mode, nx, nx_bytes);
        break;
    case CYLLM_OP_GATE_UP:
        kt->gate_up_rows(o->out, (const uint16_t *)o->a, (const uint16_t *)o->b,
                         (const float *)o->c, o->n, r0, r1, o->mode, nx, nx_bytes);
        break;
    case CYLLM_OP_QMATVEC:
        qk->fmt[o->qfmt].matvec_rows(o->out, (const uint8_t *)o->a, o->rb, o->xq, o->n, r0, r1,
                                     o->mode, nx, nx_bytes);
        break;
    default:
        qk->fmt[o->qfmt].gate_up_rows(o->out, (const uint8_t *)o->a, (const uint8_t *)o->b, o->rb,
                                      o->xq, o->n, r0, r1, o->mode, nx, nx_bytes);
    }
}

/* ---- rows handed out in chunks ------------------------------------------------------
 * Each thread owns the rows row_split gives it, as without stealing, and takes them in
 * chunks of ~CLAIM_BYTES front to back from its share's counter; a thread done with its
 * own share then takes the remaining chunks of the others'. On a shared host a thread
 * loses its core for part of a step now and then (the hypervisor's steal time, another
 * process), and with fixed shares every barrier waited for its rows; now the other
 * threads finish them. Every row is computed by the same kernel whoever takes it, and
 * chunks start on multiples of the op's row unit, so no bit depends on who did what. */
int cyllm_steal = 1;
#define CLAIM_BYTES 65536

static void run_claimed(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_op *o,
                        int tid, int nth, cyllm_claim *claims, const void *nx, int64_t nx_bytes) {
    const int64_t unit = op_unit(o);
    int64_t cr = o->rb > 0 ? (CLAIM_BYTES / o->rb) / unit * unit : unit;
    if (cr < unit) cr = unit;
    for (int k = 0; k < nth; k++) {
        /* own share first; cyllm_steal == 2 (tests) starts with the next thread's */
        const int s = (tid + k + (cyllm_steal == 2)) % nth;
        int64_t s0, s1;
        row_split(o->d, unit, s, nth, &s0, &s1);
        if (s0 >= s1) continue;
        _Atomic int64_t *next = (_Atomic int64_t *)&claims[(int64_t)o->slot * nth + s].next;
        for (;;) {
            const int64_t c0 = s0 + atomic_fetch_add_explicit(next, 1, memory_order_relaxed) * cr;
            if (c0 >= s1) break;
            const int64_t c1 = c0 + cr < s1 ? c0 + cr : s1;
            /* prefetch: the rest of its own share, then its rows of the next op */
            if (s == tid && c1 < s1)
                run_rows(kt, qk, o, c0, c1, (const char *)o->a + c1 * o->rb, (s1 - c1) * o->rb);
            else
                run_rows(kt, qk, o, c0, c1, nx, nx_bytes);
        }
    }
}

static void moe_layer_step(const cyllm_kernels *kt, const cyllm_qkernels *qk, cyllm_moe_layer *L,
                           int tid, int nth, cyllm_sync *sync);

static void run_op(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_op *ops, int i,
                   int tid, int nth, int64_t token, int64_t pos, float *scratch, cyllm_sync *sync,
                   cyllm_claim *claims) {
    const cyllm_op *o = &ops[i];
    int64_t p = o->dyn ? pos : o->fixed;
    switch (o->kind) {
    case CYLLM_OP_MATVEC:
    case CYLLM_OP_GATE_UP:
    case CYLLM_OP_QMATVEC:
    case CYLLM_OP_QGATE_UP: {
        /* the weights this thread reads next: its rows of the next matvec-like op */
        const void *nx = NULL;
        int64_t nx_bytes = 0;
        if (o->next_w >= 0 && cyllm_pf_next) {
            const cyllm_op *nw = &ops[o->next_w];
            int64_t q0, q1;
            row_split(nw->d, op_unit(nw), tid, nth, &q0, &q1);
            if (q0 < q1) {
                nx = (const char *)nw->a + q0 * nw->rb;
                nx_bytes = (q1 - q0) * nw->rb;
            }
        }
        if (claims && o->slot >= 0 && cyllm_steal) {
            run_claimed(kt, qk, o, tid, nth, claims, nx, nx_bytes);
            return;
        }
        int64_t r0, r1;
        row_split(o->d, op_unit(o), tid, nth, &r0, &r1);
        if (r0 < r1) run_rows(kt, qk, o, r0, r1, nx, nx_bytes);
        return;
    }
    case CYLLM_OP_QUANTIZE:
        if (o->mode == 0) {         /* blocks split over the team (each block's bytes are its own) */
            int64_t nb = o->n / cyllm_qact_block(o->act);
            int64_t b0 = nb * tid / nth, b1 = nb * (tid + 1) / nth;
            if (b0 < b1) qk->quantize_act(o->xq, (const float *)o->c, o->n, o->act, b0, b1);
            return;
        }
        break;
    case CYLLM_OP_GLU: {
        int64_t r0, r1;
        row_split(o->n, 4, tid, nth, &r0, &r1);
        cyllm_qglu(o->out, (const float *)o->a, (const float *)o->b, r0, r1, o->mode);
        return;
    }
    case CYLLM_OP_ATTENTION: {
        int64_t start = o->window > 0 && p + 1 > o->window ? p + 1 - o->window : 0;
        attention_step(kt, o->out, (const float *)o->a, o->kc, o->vc, o->n_heads, o->n_kv,
                       o->hd, o->max_ctx, start, p, o->scale, o->softcap, scratch, tid, nth, sync);
        return;
    }
    case CYLLM_OP_MOE:
        moe_layer_step(kt, qk, o->moe, tid, nth, sync);
        return;
    default:
        break;
    }
    if (tid != 0) return;               /* the small vector ops: thread 0 alone */
    switch (o->kind) {
    case CYLLM_OP_QUANTIZE:
        qk->quantize_act(o->xq, (const float *)o->c, o->n, o->act, 0, o->n / cyllm_qact_block(o->act));
        break;
    case CYLLM_OP_QEMBED:
        qk->fmt[o->qfmt].dequant_row_f32(o->out, (const uint8_t *)o->a, o->rb, o->dyn ? token : o->fixed,
                                         o->n);
        if (o->scale != 1.0f)
            for (int64_t i = 0; i < o->n; i++) o->out[i] *= o->scale;
        break;
    case CYLLM_OP_EMBED:
        kt->f16_to_f32(o->out, (const uint16_t *)o->a + (o->dyn ? token : o->fixed) * o->n, o->n);
        if (o->scale != 1.0f)
            for (int64_t i = 0; i < o->n; i++) o->out[i] *= o->scale;
        break;
    case CYLLM_OP_RMSNORM:
        /* d rows of n (d > 1: per-head q/k norms) */
        for (int64_t r = 0; r < o->d; r++)
            cyllm_rmsnorm(o->out + r * o->n, (const float *)o->a + r * o->n, (const float *)o->b,
                          o->n, o->eps);
        break;
    case CYLLM_OP_ROPE: {
        const float *c = (const float *)o->b + p * o->half, *s = (const float *)o->c + p * o->half;
        cyllm_rope_rows(o->out, o->n_heads, o->hd, o->half, c, s);
        cyllm_rope_rows(o->out2, o->n_kv, o->hd, o->half, c, s);
        break;
    }
    case CYLLM_OP_CACHE_STORE: {
        const float *k = (const float *)o->c, *v = (const float *)o->e;
        for (int64_t h = 0; h < o->n_kv; h++) {
            kt->f32_to_f16(o->kc + (h * o->max_ctx + p) * o->hd, k + h * o->hd, o->hd);
            kt->f32_to_f16(o->vc + (h * o->max_ctx + p) * o->hd, v + h * o->hd, o->hd);
        }
        break;
    }
    case CYLLM_OP_ADD: {
        const float *x = (const float *)o->a, *y = (const float *)o->b;
        for (int64_t i = 0; i < o->n; i++) o->out[i] = x[i] + y[i];
        break;
    }
    case CYLLM_OP_SWIGLU: {
        const float *g = (const float *)o->a, *u = (const float *)o->b;
        for (int64_t i = 0; i < o->n; i++) o->out[i] = cyllm_silu(g[i]) * u[i];
        break;
    }
    default:
        break;
    }
}

void cyllm_program_run(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_op *ops,
                       int n_ops, int nt, int64_t token, int64_t pos, float *scratch,
                       cyllm_claim *claims, int n_slots) {
    if (nt <= 1) {
        for (int i = 0; i < n_ops; i++) run_op(kt, qk, ops, i, 0, 1, token, pos, scratch, NULL, NULL);
        return;
    }
#ifdef _OPENMP
    cyllm_sync sync;
    sync_init(&sync);
    if (claims) memset(claims, 0, (size_t)n_slots * (size_t)nt * sizeof(cyllm_claim));
    #pragma omp parallel num_threads(nt)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        /* a smaller team than asked for would index past the claims of nt threads: no
           stealing then (the shares are still every row) */
        cyllm_claim *cl = nth <= nt ? claims : NULL;
        for (int i = 0; i < n_ops; i++) {
            run_op(kt, qk, ops, i, tid, nth, token, pos, scratch, &sync, cl);
            if (ops[i].barrier) sync_wait(&sync, nth);
        }
    }
#else
    for (int i = 0; i < n_ops; i++) run_op(kt, qk, ops, i, 0, 1, token, pos, scratch, NULL, NULL);
#endif
}

/* ---- a mixture of experts' chosen experts, for one token --------------------------------
 * out (n,) += w_j * down_j(act(gate_j x) * (up_j x)) for j = 0..k-1, in one parallel region:
 * x quantized once for the gate/up rows (a quantized format), every expert's gate/up rows
 * split over the team, each h_j quantized for its down rows, then each thread's rows of out
 * take the k down products, each scaled by its weight, added in order j = 0, 1, .... Each row
 * is the same kernel call as the op-by-op gate_up and matvec make, and the scaling and adds
 * are two float32 roundings (y * w, then out + that), as numpy's are in the prefill path
 * (backends/moe.py): decode and prefill give a row the same bits. */
static void moe_experts_step(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_moe *m,
                             int tid, int nth, cyllm_sync *sync) {
    const int64_t k = m->k, n = m->n, f = m->f;
    const int qgu = m->fmt_gu >= 0, qdn = m->fmt_down >= 0;
    if (qgu) {
        int act = cyllm_qformat(m->fmt_gu)->act;
        int64_t nb = n / cyllm_qact_block(act);
        qk->quantize_act(m->xq, m->x, n, act, nb * tid / nth, nb * (tid + 1) / nth);
        team_barrier(sync, nth);
    }
    const int64_t unit_gu = qgu && cyllm_qf_is_r16(m->fmt_gu) ? CYLLM_R16 : 4;
    const int64_t unit_dn = qdn && cyllm_qf_is_r16(m->fmt_down) ? CYLLM_R16 : 4;
    const int64_t rb_gu = qgu ? m->rb_gu : 2 * n, rb_dn = qdn ? m->rb_down : 2 * f;
    int64_t r0, r1, d0, d1;
    row_split(f, unit_gu, tid, nth, &r0, &r1);
    row_split(n, unit_dn, tid, nth, &d0, &d1);
    for (int64_t j = 0; j < k && r0 < r1; j++) {
        /* the weights this thread reads next, for the kernels' software prefetch: its rows of
           the next expert's gate, or of the first expert's down */
        const char *nx = j + 1 < k ? (const char *)m->gate[j + 1] + r0 * rb_gu : (const char *)m->down[0] + d0 * rb_dn;
        int64_t nx_bytes = j + 1 < k ? (r1 - r0) * rb_gu : (d1 - d0) * rb_dn;
        if (qgu)
            qk->fmt[m->fmt_gu].gate_up_rows(m->h + j * f, (const uint8_t *)m->gate[j], (const uint8_t *)m->up[j],
                                            m->rb_gu, m->xq, n, r0, r1, m->act, nx, nx_bytes);
        else
            kt->gate_up_rows(m->h + j * f, (const uint16_t *)m->gate[j], (const uint16_t *)m->up[j], m->x, n,
                             r0, r1, m->act, nx, nx_bytes);
    }
    team_barrier(sync, nth);
    if (qdn) {
        int act = cyllm_qformat(m->fmt_down)->act;
        int64_t nb = f / cyllm_qact_block(act), items = k * nb;
        for (int64_t it = items * tid / nth; it < items * (tid + 1) / nth; ) {
            /* runs of blocks inside one expert's h */
            int64_t j = it / nb, b0 = it % nb, b1 = nb;
            if (j * nb + b1 > items * (tid + 1) / nth) b1 = items * (tid + 1) / nth - j * nb;
            qk->quantize_act((char *)m->hq + j * m->hq_stride, m->h + j * f, f, act, b0, b1);
            it = j * nb + b1;
        }
        team_barrier(sync, nth);
    }
    r0 = d0;
    r1 = d1;
    if (r0 >= r1) return;
    for (int64_t j = 0; j < k; j++) {
        float *y = m->y + j * n;
        const char *nx = j + 1 < k ? (const char *)m->down[j + 1] + r0 * rb_dn : NULL;
        int64_t nx_bytes = j + 1 < k ? (r1 - r0) * rb_dn : 0;
        if (qdn)
            qk->fmt[m->fmt_down].matvec_rows(y, (const uint8_t *)m->down[j], m->rb_down,
                                             (const char *)m->hq + j * m->hq_stride, f, r0, r1, 0, nx, nx_bytes);
        else
            kt->matvec_rows(y, (const uint16_t *)m->down[j], m->h + j * f, f, r0, r1, 0, nx, nx_bytes);
        const float w = m->wts[j];
        for (int64_t r = r0; r < r1; r++) y[r] = y[r] * w;
    }
    for (int64_t j = 0; j < k; j++) {
        const float *y = m->y + j * n;
        for (int64_t r = r0; r < r1; r++) m->out[r] = m->out[r] + y[r];
    }
}

void cyllm_moe_experts_run(const cyllm_kernels *kt, const cyllm_qkernels *qk, const cyllm_moe *m, int nt) {
    if (nt <= 1) {
        moe_experts_step(kt, qk, m, 0, 1, NULL);
        return;
    }
#ifdef _OPENMP
    cyllm_sync sync;
    sync_init(&sync);
    #pragma omp parallel num_threads(nt)
    moe_experts_step(kt, qk, m, omp_get_thread_num(), omp_get_num_threads(), &sync);
#else
    moe_experts_step(kt, qk, m, 0, 1, NULL);
#endif
}

/* ---- a mixture of experts' router and choice ------------------------------------------
 * The router's rows are summed in 16 lanes (i mod 16) combined pairwise at the end: a fixed
 * order, so a row's score has the same bits whichever thread computes it, in decode (the
 * program, the op) and prefill alike (CpuKernels.moe_route): both paths choose the same
 * experts for the same x. This file is compiled at the baseline ISA: no fused multiply-add. */
#define ROUTER_LANES 16

static void router_rows(float *scores, const float *router, const float *x, int64_t n, int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; e++) {
        const float *r = router + e * n;
        float acc[ROUTER_LANES] = {0.0f};
        int64_t i = 0;
        for (; i + ROUTER_LANES <= n; i += ROUTER_LANES)
            for (int l = 0; l < ROUTER_LANES; l++) acc[l] += r[i + l] * x[i + l];
        for (int l = 0; i < n; i++, l++) acc[l] += r[i] * x[i];
        for (int w = ROUTER_LANES / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; l++) acc[l] += acc[l + w];
        scores[e] = acc[0];
    }
}

/* scores (E,) logits -> probabilities (in place), ids and wts of the k best (see cyllm_moe_route) */
static void route_pick(float *scores, int64_t E, int64_t k, int norm, int64_t *ids, float *wts) {
    float mx = scores[0];
    for (int64_t e = 1; e < E; e++)
        if (scores[e] > mx) mx = scores[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        scores[e] = expf(scores[e] - mx);
        sum += scores[e];
    }
    for (int64_t e = 0; e < E; e++) scores[e] = scores[e] / sum;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)      /* a chosen expert holds -1, below every p */
            if (scores[e] >= 0.0f && (best < 0 || scores[e] > scores[best])) best = e;
        if (best < 0)                        /* only NaNs left: the lowest id not chosen */
            for (int64_t e = 0; e < E && best < 0; e++)
                if (scores[e] != -1.0f) best = e;
        if (best < 0) best = 0;              /* never: k <= E leaves one unchosen */
        ids[j] = best;
        wts[j] = scores[best];
        scores[best] = -1.0f;
    }
    if (norm) {
        float t = 0.0f;
        for (int64_t j = 0; j < k; j++) t += wts[j];
        for (int64_t j = 0; j < k; j++) wts[j] = wts[j] / t;
    }
}

void cyllm_moe_route(const float *router, const float *x, int64_t E, int64_t n, int64_t k, int norm,
                     float *scores, int64_t *ids, float *wts) {
    router_rows(scores, router, x, n, 0, E);
    route_pick(scores, E, k, norm, ids, wts);
}

static void moe_layer_step(const cyllm_kernels *kt, const cyllm_qkernels *qk, cyllm_moe_layer *L,
                           int tid, int nth, cyllm_sync *sync) {
    router_rows(L->scores, L->router, L->m.x, L->m.n, L->E * tid / nth, L->E * (tid + 1) / nth);
    team_barrier(sync, nth);
    if (tid == 0) {
        route_pick(L->scores, L->E, L->k, L->norm, L->ids, L->wts);
        for (int64_t j = 0; j < L->k; j++) {
            L->m.gate[j] = L->gate[L->ids[j]];
            L->m.up[j] = L->up[L->ids[j]];
            L->m.down[j] = L->down[L->ids[j]];
        }
    }
    team_barrier(sync, nth);
    moe_experts_step(kt, qk, &L->m, tid, nth, sync);
}
