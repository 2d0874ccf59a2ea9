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
// The vector path needs n % 8 == 0 and 16-byte aligned W rows and x; the
// scalar path (any n, any alignment) is there so odd shapes still work.
#include "common.cuh"

#ifndef MV_UNROLL
#define MV_UNROLL 4
#endif
#define MV_MAX_ROWS 128   // warps per block (<= 32) * R (<= 4)

template <int R, int MODE>
__device__ __forceinline__ void matvec_vec_body(
    float* __restrict__ out, const uint4* __restrict__ w0, const uint4* __restrict__ w1,
    const float4* __restrict__ x, int d, int n8)
{
    constexpr int NM = (MODE == 2) ? 2 : 1;
    __shared__ float res[MV_MAX_ROWS];
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

    int i = lane;
    for (; i + 32 * (MV_UNROLL - 1) < n8; i += 32 * MV_UNROLL) {
        uint4 wv[MV_UNROLL][NM][R];
#pragma unroll
        for (int u = 0; u < MV_UNROLL; ++u)
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][m][r] = ld_stream16(wr[m][r] + i + 32 * u);
#pragma unroll
        for (int u = 0; u < MV_UNROLL; ++u) {
            const float4 xa = __ldg(x + 2 * (i + 32 * u));
            const float4 xb = __ldg(x + 2 * (i + 32 * u) + 1);
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[m][r] = dot8(wv[u][m][r], xa, xb, acc[m][r]);
        }
    }
    for (; i < n8; i += 32) {
        const float4 xa = __ldg(x + 2 * i);
        const float4 xb = __ldg(x + 2 * i + 1);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] = dot8(ld_stream16(wr[m][r] + i), xa, xb, acc[m][r]);
    }

#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);

    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            res[warp * R + r] = (MODE == 2) ? silu_f(acc[0][r]) * acc[NM - 1][r] : acc[0][r];
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
        if (MODE == 2) s1 = fmaf(h2f(b[i]), xv, s1);
    }
    s0 = warp_sum(s0);
    if (MODE == 2) s1 = warp_sum(s1);
    if (lane == 0) {
        if (MODE == 0) out[row] = s0;
        else if (MODE == 1) out[row] += s0;
        else out[row] = silu_f(s0) * s1;
    }
}

#define CYLLM_MATVEC_VEC(NAME, R, MODE)                                                    \
    extern "C" __global__ void NAME(float* __restrict__ out, const uint4* __restrict__ w0, \
                                    const uint4* __restrict__ w1,                          \
                                    const float4* __restrict__ x, int d, int n8) {         \
        matvec_vec_body<R, MODE>(out, w0, w1, x, d, n8);                                   \
    }

CYLLM_MATVEC_VEC(matvec_r1, 1, 0)
CYLLM_MATVEC_VEC(matvec_r2, 2, 0)
CYLLM_MATVEC_VEC(matvec_r4, 4, 0)
CYLLM_MATVEC_VEC(matvec_add_r1, 1, 1)
CYLLM_MATVEC_VEC(matvec_add_r2, 2, 1)
CYLLM_MATVEC_VEC(matvec_add_r4, 4, 1)
CYLLM_MATVEC_VEC(gate_up_silu_r1, 1, 2)
CYLLM_MATVEC_VEC(gate_up_silu_r2, 2, 2)

#define CYLLM_MATVEC_SCALAR(NAME, MODE)                                                     \
    extern "C" __global__ void NAME(float* __restrict__ out, const f16_t* __restrict__ w0,  \
                                    const f16_t* __restrict__ w1,                           \
                                    const float* __restrict__ x, int d, int n) {            \
        matvec_scalar_body<MODE>(out, w0, w1, x, d, n);                                     \
    }

CYLLM_MATVEC_SCALAR(matvec_scalar, 0)
CYLLM_MATVEC_SCALAR(matvec_add_scalar, 1)
CYLLM_MATVEC_SCALAR(gate_up_silu_scalar, 2)
