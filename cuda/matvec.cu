// Matrix-vector products over FP16 weights with FP32 activations/accumulation.
//
// Decode reads every weight once per token, so these kernels are bound by
// memory bandwidth: one warp per row (R rows per warp), lanes striding along
// the row with 16-byte loads (8 halves) so each warp load is 512 contiguous
// bytes, MV_UNROLL loads hoisted before their FMAs to keep enough bytes in
// flight, a warp-shuffle sum, and the block's row results gathered in shared
// memory so that consecutive threads write consecutive outputs.
//
// Variants (one body, selected at compile time):
//   MODE 0  out  = W x
//   MODE 1  out += W x                      (matvec fused with the residual add)
//   MODE 2  out  = silu(Wg x) * (Wu x)      (gate and up matvecs fused with SiLU)
//   MODE 3  out  = gelu_tanh(Wg x) * (Wu x) (the same with Gemma's GELU)
// Each variant also comes with U = 8 loads in flight (_u8) and with the preceding
// rmsnorm folded in (_norm: every warp walks all of x anyway, so it sums x^2 and
// scales x by the norm weight on the fly; the result is multiplied by
// rsqrt(mean(x^2) + eps) after the warp sum, and block 0 writes the normed vector).
// The vector path needs n % 8 == 0 and 16-byte aligned W rows and x; the
// scalar path (any n, any alignment) is there so odd shapes still work.
//
// Reference: backends/numpy_ref.py. Tests: tests/test_cuda_ops.py (each kernel against the
// reference), tests/test_backend_ops.py (the op table on every backend), tests/test_cuda_model.py.
// Benchmark: bench/bench_cuda.py (per-op GB/s; results in bench/results/cuda_ops_*.md).
#include "common.cuh"

#ifndef MV_UNROLL
#define MV_UNROLL 4
#endif
#define MV_MAX_ROWS 128   // warps per block (<= 32) * R (<= 4)

// NORM prologue on 8 activations: accumulate x^2 into ss, then x *= norm weight
__device__ __forceinline__ void norm_prep(float4& a, float4& b, const float4* __restrict__ nw, float& ss) {
    ss = fmaf(a.x, a.x, ss); ss = fmaf(a.y, a.y, ss); ss = fmaf(a.z, a.z, ss); ss = fmaf(a.w, a.w, ss);
    ss = fmaf(b.x, b.x, ss); ss = fmaf(b.y, b.y, ss); ss = fmaf(b.z, b.z, ss); ss = fmaf(b.w, b.w, ss);
    const float4 wa = __ldg(nw), wb = __ldg(nw + 1);
    a.x *= wa.x; a.y *= wa.y; a.z *= wa.z; a.w *= wa.w;
    b.x *= wb.x; b.y *= wb.y; b.z *= wb.z; b.w *= wb.w;
}

template <int R, int MODE, int U, bool NORM>
__device__ __forceinline__ void matvec_vec_body(
    float* __restrict__ out, const uint4* __restrict__ w0, const uint4* __restrict__ w1,
    const float4* x, int d, int n8,
    const float4* __restrict__ nw, float eps, float* __restrict__ xn)
{
    constexpr int NM = (MODE >= 2) ? 2 : 1;
    __shared__ float res[MV_MAX_ROWS];
    pdl_trigger();      // the next kernel may start loading its weights now
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int rows_blk = (blockDim.x >> 5) * R;
    const int row0 = blockIdx.x * rows_blk + warp * R;

    const uint4* wr[NM][R];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // rows past the end re-read the last row (in bounds); their results are dropped
            int row = min(row0 + r, d - 1);
            wr[m][r] = (m == 0 ? w0 : w1) + (size_t)row * n8;
        }

    float acc[NM][R];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    float ss = 0.0f;     // NORM: this lane's share of sum(x^2); every warp walks the whole x

    // The first U loads of every row go out before pdl_wait: under programmatic
    // dependent launch they overlap the previous kernel's tail (weights never
    // depend on it); x, the output and the norm vector are touched only after.
    // Each iteration then issues the next batch's loads after its FMAs, so all
    // U*NM*R loads of a batch stay in flight together (more registers than a
    // load-then-use loop, which the compiler interleaves: see _mv's block cap).
    uint4 wv[U][NM][R];
    int i = lane;
    bool full = i + 32 * (U - 1) < n8;
    if (full) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][m][r] = ld_stream16(wr[m][r] + i + 32 * u);
    }
    pdl_wait();
    while (full) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float4 xa = ld_act4(x + 2 * (i + 32 * u));
            float4 xb = ld_act4(x + 2 * (i + 32 * u) + 1);
            if (NORM) norm_prep(xa, xb, nw + 2 * (i + 32 * u), ss);
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[m][r] = dot8(wv[u][m][r], xa, xb, acc[m][r]);
        }
        i += 32 * U;
        full = i + 32 * (U - 1) < n8;
        if (full) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int r = 0; r < R; ++r) wv[u][m][r] = ld_stream16(wr[m][r] + i + 32 * u);
        }
    }
    for (; i < n8; i += 32) {
        float4 xa = ld_act4(x + 2 * i);
        float4 xb = ld_act4(x + 2 * i + 1);
        if (NORM) norm_prep(xa, xb, nw + 2 * i, ss);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] = dot8(ld_stream16(wr[m][r] + i), xa, xb, acc[m][r]);
    }

    float inv = 1.0f;
    if (NORM) {
        // rmsnorm folded in: W (x * w * inv) = inv * (W (x * w)); inv is the same in every warp
        inv = rsqrtf(warp_sum(ss) / (float)(8 * n8) + eps);
        if (blockIdx.x == 0 && xn != nullptr) {
            // block 0 also writes the normed vector, so the rmsnorm op's output exists as asked
            const float* xf = reinterpret_cast<const float*>(x);
            const float* wf = reinterpret_cast<const float*>(nw);
            for (int j = threadIdx.x; j < 8 * n8; j += blockDim.x) xn[j] = ld_act(xf + j) * inv * wf[j];
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]) * inv;

    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            res[warp * R + r] = (MODE == 2) ? silu_f(acc[0][r]) * acc[NM - 1][r]
                              : (MODE == 3) ? gelu_tanh_f(acc[0][r]) * acc[NM - 1][r] : acc[0][r];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < rows_blk; t += blockDim.x) {
        const int row = blockIdx.x * rows_blk + t;
        if (row < d) {
            if (MODE == 1) out[row] += res[t];
            else out[row] = res[t];
        }
    }
}

// Any n, any alignment: one warp per row, lanes over single halves.
template <int MODE>
__device__ __forceinline__ void matvec_scalar_body(
    float* __restrict__ out, const f16_t* __restrict__ w0, const f16_t* __restrict__ w1,
    const float* __restrict__ x, int d, int n)
{
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= d) return;   // whole warp leaves together
    const f16_t* a = w0 + (size_t)row * n;
    const f16_t* b = w1 + (size_t)row * n;
    float s0 = 0.0f, s1 = 0.0f;
    for (int i = lane; i < n; i += 32) {
        const float xv = x[i];
        s0 = fmaf(h2f(a[i]), xv, s0);
        if (MODE >= 2) s1 = fmaf(h2f(b[i]), xv, s1);
    }
    s0 = warp_sum(s0);
    if (MODE >= 2) s1 = warp_sum(s1);
    if (lane == 0) {
        if (MODE == 0) out[row] = s0;
        else if (MODE == 1) out[row] += s0;
        else if (MODE == 2) out[row] = silu_f(s0) * s1;
        else out[row] = gelu_tanh_f(s0) * s1;
    }
}

// NAME: plain kernel (U = MV_UNROLL loads in flight per lane); NAME_u8: 8 in flight;
// NAME_norm / NAME_u8_norm: the same with the preceding rmsnorm folded in (x is the
// un-normed vector, nw the norm weight; xn, if not null, receives the normed vector).
#define CYLLM_MATVEC_VEC(NAME, R, MODE)                                                          \
    extern "C" __global__ void NAME(float* __restrict__ out, const uint4* __restrict__ w0,       \
                                    const uint4* __restrict__ w1,                                \
                                    const float4* __restrict__ x, int d, int n8) {               \
        matvec_vec_body<R, MODE, MV_UNROLL, false>(out, w0, w1, x, d, n8, nullptr, 0.0f, nullptr); \
    }                                                                                            \
    extern "C" __global__ void NAME##_u8(float* __restrict__ out, const uint4* __restrict__ w0,  \
                                         const uint4* __restrict__ w1,                           \
                                         const float4* __restrict__ x, int d, int n8) {          \
        matvec_vec_body<R, MODE, 8, false>(out, w0, w1, x, d, n8, nullptr, 0.0f, nullptr);       \
    }                                                                                            \
    extern "C" __global__ void NAME##_norm(float* __restrict__ out, const uint4* __restrict__ w0, \
                                           const uint4* __restrict__ w1,                          \
                                           const float4* x, int d, int n8,           \
                                           const float4* __restrict__ nw, float eps, float* xn) { \
        matvec_vec_body<R, MODE, MV_UNROLL, true>(out, w0, w1, x, d, n8, nw, eps, xn);           \
    }                                                                                            \
    extern "C" __global__ void NAME##_u8_norm(float* __restrict__ out, const uint4* __restrict__ w0, \
                                              const uint4* __restrict__ w1,                        \
                                              const float4* x, int d, int n8,         \
                                              const float4* __restrict__ nw, float eps, float* xn) { \
        matvec_vec_body<R, MODE, 8, true>(out, w0, w1, x, d, n8, nw, eps, xn);                   \
    }

CYLLM_MATVEC_VEC(matvec_r1, 1, 0)
CYLLM_MATVEC_VEC(matvec_r2, 2, 0)
CYLLM_MATVEC_VEC(matvec_r4, 4, 0)
CYLLM_MATVEC_VEC(matvec_add_r1, 1, 1)
CYLLM_MATVEC_VEC(matvec_add_r2, 2, 1)
CYLLM_MATVEC_VEC(matvec_add_r4, 4, 1)
CYLLM_MATVEC_VEC(gate_up_silu_r1, 1, 2)
CYLLM_MATVEC_VEC(gate_up_silu_r2, 2, 2)
CYLLM_MATVEC_VEC(gate_up_gelu_r1, 1, 3)
CYLLM_MATVEC_VEC(gate_up_gelu_r2, 2, 3)

// A mixture of experts' chosen experts in one launch (decode), over FP16 weights, as the
// qmv_experts_* kernels of quant_matvec.cu (common.cuh, expert_offset): expert ids[j]'s
// matrices at w0 + e * stride and w1 + e * stride (16-byte units: a role's experts back to
// back, backends/cuda/experts.py), x row j at x + j * ldx floats, out row j at out + j * d.
#define CYLLM_MATVEC_EXPERTS(NAME, MODE)                                                          \
    extern "C" __global__ void NAME(float* __restrict__ out, const uint4* __restrict__ w0,        \
                                    const uint4* __restrict__ w1, long long stride, const int* ids, \
                                    int n_experts, const float* x, int ldx, int d, int n8) {      \
        const long long off = expert_offset(ids, n_experts, stride);                              \
        if (off < 0) return;                                                                      \
        const int j = blockIdx.y;                                                                 \
        matvec_vec_body<1, MODE, MV_UNROLL, false>(out + (size_t)j * d, w0 + off, w1 + off,       \
            reinterpret_cast<const float4*>(x + (size_t)j * ldx), d, n8, nullptr, 0.0f, nullptr); \
    }

CYLLM_MATVEC_EXPERTS(matvec_experts_f16, 0)
CYLLM_MATVEC_EXPERTS(gate_up_silu_experts_f16, 2)
CYLLM_MATVEC_EXPERTS(gate_up_gelu_experts_f16, 3)

#define CYLLM_MATVEC_SCALAR(NAME, MODE)                                                     \
    extern "C" __global__ void NAME(float* __restrict__ out, const f16_t* __restrict__ w0,  \
                                    const f16_t* __restrict__ w1,                           \
                                    const float* __restrict__ x, int d, int n) {            \
        matvec_scalar_body<MODE>(out, w0, w1, x, d, n);                                     \
    }

CYLLM_MATVEC_SCALAR(matvec_scalar, 0)
CYLLM_MATVEC_SCALAR(matvec_add_scalar, 1)
CYLLM_MATVEC_SCALAR(gate_up_silu_scalar, 2)
CYLLM_MATVEC_SCALAR(gate_up_gelu_scalar, 3)
