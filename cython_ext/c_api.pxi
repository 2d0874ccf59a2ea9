# The C side of the CPU kernels, as Cython sees it: csrc/kernels.h (the per-variant
# kernel tables, the decode program's op array, the scalar helpers) and csrc/omp_shim.h
# (OpenMP, or stubs in a serial build). Included by kernels.pyx.

cdef extern from "csrc/kernels.h" nogil:
    ctypedef struct cyllm_kernels:
        const char *name
        void (*matvec_rows)(float *out, const uint16_t *w, const float *x,
                            int64_t n, int64_t r0, int64_t r1, int add,
                            const void *nx, int64_t nx_bytes) noexcept nogil
        void (*gate_up_rows)(float *out, const uint16_t *wg, const uint16_t *wu,
                             const float *x, int64_t n, int64_t r0, int64_t r1, int act,
                             const void *nx, int64_t nx_bytes) noexcept nogil
        void (*attention_group)(float *out, const float *q, const uint16_t *k,
                                const uint16_t *v, int64_t t_len, int64_t hd,
                                float scale, float softcap, int64_t n_q, float *ml) noexcept nogil
        void (*f16_to_f32)(float *out, const uint16_t *inp, int64_t n) noexcept nogil
        void (*f32_to_f16)(uint16_t *out, const float *inp, int64_t n) noexcept nogil
        double (*sum_f32)(const float *p, int64_t n) noexcept nogil
        void (*gemm_rows)(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                          int64_t ldx, int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                          int mode) noexcept nogil
        int gemm_nr
        void (*attention_rows)(float *out, const float *q, int64_t ldq, const uint16_t *k,
                               const uint16_t *v, int64_t hd, float scale, float softcap, int64_t rows,
                               int64_t len0, float *work) noexcept nogil
        int64_t (*attention_rows_work)(int64_t t_max) noexcept nogil
        int attention_rows_max
        void (*rows2)(float *out, int64_t ldo, const uint16_t *w, const uint16_t *wu, const float *x,
                      int64_t ldx, int64_t n, int64_t r0, int64_t r1, int mode) noexcept nogil

    ctypedef struct cyllm_op:
        int kind, barrier, mode, dyn
        float *out
        float *out2
        const void *a
        const void *b
        const void *c
        const void *e
        uint16_t *kc
        uint16_t *vc
        int64_t d, n, n_heads, n_kv, hd, max_ctx, half, fixed, window
        int next_w
        int slot
        float eps, scale, softcap
        void *xq
        int qfmt, act
        int64_t rb
        void *moe            # cyllm_moe_layer * (declared below)

    enum:
        CYLLM_OP_EMBED, CYLLM_OP_RMSNORM, CYLLM_OP_MATVEC, CYLLM_OP_GATE_UP, CYLLM_OP_ROPE,
        CYLLM_OP_CACHE_STORE, CYLLM_OP_ATTENTION, CYLLM_OP_ADD, CYLLM_OP_SWIGLU,
        CYLLM_OP_QUANTIZE, CYLLM_OP_QMATVEC, CYLLM_OP_QGATE_UP, CYLLM_OP_QEMBED, CYLLM_OP_GLU,
        CYLLM_OP_MOE

    int CYLLM_CPU_AVX, CYLLM_CPU_AVX2, CYLLM_CPU_FMA, CYLLM_CPU_F16C, CYLLM_CPU_AVX512F
    int cyllm_cpu_features() noexcept
    int cyllm_avx2_compiled() noexcept
    int cyllm_avx512_compiled() noexcept
    int64_t cyllm_pf_bytes
    int64_t cyllm_pf_wide_x
    int64_t cyllm_pf_wide_bytes
    void cyllm_pf_init() noexcept
    int cyllm_pf_next
    int cyllm_spin
    void cyllm_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) noexcept
    void cyllm_rope_rows(float *v, int64_t heads, int64_t hd, int64_t half, const float *c,
                         const float *s) noexcept
    ctypedef struct cyllm_claim:
        int64_t next
    int cyllm_steal
    void cyllm_program_run(const cyllm_kernels *kt, const void *qk, const cyllm_op *ops, int n_ops,
                           int nt, int64_t token, int64_t pos, float *scratch,
                           cyllm_claim *claims, int n_slots) noexcept
    enum:
        CYLLM_MOE_MAX_K
    ctypedef struct cyllm_moe:
        int64_t k, n, f
        const void *gate[64]
        const void *up[64]
        const void *down[64]
        int fmt_gu, fmt_down
        int64_t rb_gu, rb_down
        int act
        const float *x
        float *out
        const float *wts
        float *h
        float *y
        void *xq
        void *hq
        int64_t hq_stride
    void cyllm_moe_experts_run(const cyllm_kernels *kt, const void *qk, const cyllm_moe *m, int nt) noexcept
    void cyllm_moe_route(const float *router, const float *x, int64_t E, int64_t n, int64_t k, int norm,
                         float *scores, int64_t *ids, float *wts) noexcept
    ctypedef struct cyllm_moe_layer:
        int64_t E, k
        int norm
        const float *router
        const void *const *gate
        const void *const *up
        const void *const *down
        float *scores
        int64_t *ids
        float *wts
        cyllm_moe m
    int64_t cyllm_attention_scratch(int64_t n_heads, int64_t hd, int64_t t_len) noexcept
    void cyllm_attention_run(const cyllm_kernels *kt, float *out, const float *q,
                             const uint16_t *kc, const uint16_t *vc, int64_t n_heads,
                             int64_t n_kv, int64_t hd, int64_t max_ctx, int64_t start,
                             int64_t pos, float scale, float softcap, float *scratch, int nt) noexcept
    const cyllm_kernels *cyllm_kernels_by_name(const char *name) noexcept
    float cyllm_silu(float x) noexcept
    int CYLLM_ACT_SILU, CYLLM_ACT_GELU_TANH


cdef extern from "csrc/omp_shim.h" nogil:
    int CYLLM_OPENMP
    int omp_get_max_threads() noexcept
