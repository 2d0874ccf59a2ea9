// Small per-token kernels: embedding lookup, RMSNorm, RoPE, KV-cache store,
// SwiGLU, add, and the f32 -> f16 cast used by batched prefill. They move a
// few KB each; what matters is that they are single launches that read the
// step values (token, pos) from device memory when a CUDA graph replays them.
//
// Reference: backends/numpy_ref.py. Tests: tests/test_cuda_ops.py (each kernel against the
// reference), tests/test_backend_ops.py (the op table on every backend), tests/test_cuda_model.py.
// Benchmark: bench/bench_cuda.py (per-op GB/s; results in bench/results/cuda_ops_*.md).
#include "common.cuh"

// out (dim,) f32 = table[token] * scale ; table (vocab, dim) f16
extern "C" __global__ void embed_f16(float* __restrict__ out, const f16_t* __restrict__ table,
                                     const int* __restrict__ step, int token_host, int vocab, int dim,
                                     float scale)
{
    pdl_trigger();      // layer 0's qkv matvec may start loading its weights
    const int token = step_value(step, 0, token_host);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= dim) return;
    // an out-of-range id was refused on the host; never index with it here
    out[i] = (token >= 0 && token < vocab) ? h2f(table[(size_t)token * dim + i]) * scale : 0.0f;
}

// out = x * rsqrt(mean(x^2) + eps) * w, one block of RMS_THREADS (common.cuh) threads
extern "C" __global__ void __launch_bounds__(RMS_THREADS) rmsnorm_f32(
    float* out, const float* x, const float* __restrict__ w, int n, float eps)
{
    TRACE_BEGIN();
    __shared__ float red[RMS_THREADS / 32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += RMS_THREADS) s = fmaf(x[i], x[i], s);
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_THREADS / 32; ++k) tot += red[k];
    const float inv = rsqrtf(tot / (float)n + eps);
    // out may alias x: each element is read and written by the same thread
    for (int i = threadIdx.x; i < n; i += RMS_THREADS) out[i] = x[i] * inv * w[i];
    TRACE_END(0x1002);
}

// Rotate-half RoPE in place on q (nq heads) and k (nk heads) of hd floats; cos/sin
// (n_pos, half): the first 2*half floats of each head rotate (partial rotary when < hd).
extern "C" __global__ void rope_f32(float* __restrict__ q, float* __restrict__ k,
                                    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                    const int* __restrict__ step, int pos_host, int n_pos,
                                    int nq, int nk, int half, int hd)
{
    const int pos = step_value(step, 1, pos_host);
    if (pos < 0 || pos >= n_pos) return;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (nq + nk) * half) return;
    const int head = i / half, j = i - head * half;
    float* v = head < nq ? q + (size_t)head * hd : k + (size_t)(head - nq) * hd;
    const float c = cos_t[(size_t)pos * half + j], s = sin_t[(size_t)pos * half + j];
    rope_pair(v[j], v[j + half], c, s, v[j], v[j + half]);
}

// Fused rope + cache_store: rotate q and k in place, then write the rotated k
// and v to the cache row pos (one launch instead of two per layer). Thread i
// owns the pair (j, j + half) of one head.
extern "C" __global__ void rope_store_f32(float* __restrict__ q, float* __restrict__ k,
                                          const float* v,     // no __restrict__: no nc loads (ld_act, common.cuh)
                                          const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                          f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache,
                                          const int* __restrict__ step, int pos_host, int n_pos,
                                          int max_ctx, int nq, int nk, int half)
{
    TRACE_BEGIN();
    pdl_trigger();      // attention's blocks may be scheduled now
    const int pos = step_value(step, 1, pos_host);
    if (pos < 0 || pos >= n_pos || pos >= max_ctx) return;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (nq + nk) * half) return;
    const int head = i / half, j = i - head * half;
    // the rotation table is constant: read it while the qkv matvec still runs
    const float c = cos_t[(size_t)pos * half + j], s = sin_t[(size_t)pos * half + j];
    pdl_wait();         // q, k, v come from the qkv matvec
    const bool is_k = head >= nq;
    float* x = is_k ? k + (size_t)(head - nq) * 2 * half : q + (size_t)head * 2 * half;
    const float x1 = x[j], x2 = x[j + half];
    float y1, y2;
    rope_pair(x1, x2, c, s, y1, y2);
    x[j] = y1;
    x[j + half] = y2;
    if (is_k) {
        const int kh = head - nq;
        const size_t row = ((size_t)kh * max_ctx + pos) * 2 * half;
        const float* vh = v + (size_t)kh * 2 * half;
        k_cache[row + j] = f2h(y1);
        k_cache[row + j + half] = f2h(y2);
        v_cache[row + j] = f2h(vh[j]);
        v_cache[row + j + half] = f2h(vh[j + half]);
    }
    TRACE_END(0x1001);
}

// Per-head q/k norms folded into rope_store (Qwen3, Gemma 3, EXAONE 4 decode: the
// rmsnorm_rows_f32 of q's heads, then of k's, then rope_store_f32, were three launches with
// two plain boundaries between them; backends/cuda/qk_norm_fold.py). A warp a head of
// HD = 64 * HC floats (rotary over the whole head): lane l holds the elements l + 32 c, so
// the pair (j, j + HD/2) of the rotation is in one lane, and the sum of squares is
// rmsnorm_rows_f32's to the bit (its warp c sums the elements 32c .. 32c + 31 with one
// butterfly, then the warps' sums are added in order); the normed value x * inv * w then
// goes through rope_pair as rope_store_f32's does. q and k are written back normed and
// rotated, k and v to the cache row pos.
#define QKN_WARPS 2
template <int HC>
__device__ __forceinline__ void qknorm_rope_store_body(
    float* q, float* k, const float* v, const float* __restrict__ qw, const float* __restrict__ kw,
    float eps, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache, const int* __restrict__ step,
    int pos_host, int n_pos, int max_ctx, int nq, int nk)
{
    constexpr int HALF = 32 * HC, HD = 2 * HALF, NC = 2 * HC;
    pdl_trigger();      // attention's blocks may be scheduled now
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * QKN_WARPS + (threadIdx.x >> 5);
    const int pos = step_value(step, 1, pos_host);
    if (pos < 0 || pos >= n_pos || pos >= max_ctx || head >= nq + nk) return;
    const bool is_k = head >= nq;
    // the rotation table and the norm's weight are constant: read them while the matvec runs
    const float* w = is_k ? kw : qw;
    float c[HC], s[HC], wv[NC];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
        c[i] = cos_t[(size_t)pos * HALF + 32 * i + lane];
        s[i] = sin_t[(size_t)pos * HALF + 32 * i + lane];
    }
#pragma unroll
    for (int i = 0; i < NC; ++i) wv[i] = w[32 * i + lane];
    pdl_wait();         // q, k, v come from the q/k/v matvec
    float* x = is_k ? k + (size_t)(head - nq) * HD : q + (size_t)head * HD;
    float xv[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) xv[i] = x[32 * i + lane];
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < NC; ++i) tot += warp_sum(fmaf(xv[i], xv[i], 0.0f));
    const float inv = rsqrtf(tot / (float)HD + eps);
#pragma unroll
    for (int i = 0; i < NC; ++i) xv[i] = xv[i] * inv * wv[i];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
        float y1, y2;
        rope_pair(xv[i], xv[i + HC], c[i], s[i], y1, y2);
        const int j = 32 * i + lane;
        x[j] = y1;
        x[j + HALF] = y2;
        if (is_k) {
            const size_t row = ((size_t)(head - nq) * max_ctx + pos) * HD;
            const float* vh = v + (size_t)(head - nq) * HD;
            k_cache[row + j] = f2h(y1);
            k_cache[row + j + HALF] = f2h(y2);
            v_cache[row + j] = f2h(vh[j]);
            v_cache[row + j + HALF] = f2h(vh[j + HALF]);
        }
    }
}

#define CYLLM_QKNORM_ROPE_STORE(NAME, HC)                                                         \
    extern "C" __global__ void __launch_bounds__(QKN_WARPS * 32) NAME(                            \
        float* q, float* k, const float* v, const float* __restrict__ qw,                         \
        const float* __restrict__ kw, float eps, const float* __restrict__ cos_t,                 \
        const float* __restrict__ sin_t, f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache, \
        const int* __restrict__ step, int pos_host, int n_pos, int max_ctx, int nq, int nk) {     \
        TRACE_BEGIN();                                                                            \
        qknorm_rope_store_body<HC>(q, k, v, qw, kw, eps, cos_t, sin_t, k_cache, v_cache, step,    \
                                   pos_host, n_pos, max_ctx, nq, nk);                             \
        TRACE_END(0x1007);                                                                        \
    }
// head_dim 64, 128, 256
CYLLM_QKNORM_ROPE_STORE(qknorm_rope_store_64, 1)
CYLLM_QKNORM_ROPE_STORE(qknorm_rope_store_128, 2)
CYLLM_QKNORM_ROPE_STORE(qknorm_rope_store_256, 4)

// k_cache[:, pos, :] = k ; v_cache[:, pos, :] = v  (f32 -> f16, round to nearest)
extern "C" __global__ void cache_store_f16(f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache,
                                           const float* __restrict__ k, const float* __restrict__ v,
                                           const int* __restrict__ step, int pos_host,
                                           int max_ctx, int n_kv, int hd)
{
    const int pos = step_value(step, 1, pos_host);
    if (pos < 0 || pos >= max_ctx) return;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_kv * hd) return;
    const int h = i / hd, e = i - h * hd;
    const size_t dst = ((size_t)h * max_ctx + pos) * hd + e;
    k_cache[dst] = f2h(k[i]);
    v_cache[dst] = f2h(v[i]);
}

extern "C" __global__ void swiglu_f32(float* out, const float* gate, const float* up, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu_f(gate[i]) * up[i];
}

// out = gelu_tanh(gate) * up (Gemma's GLU; prefill's product pass)
extern "C" __global__ void geglu_f32(float* out, const float* gate, const float* up, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh_f(gate[i]) * up[i];
}

// out may alias x or y: element-wise, each thread owns its index
extern "C" __global__ void add_f32(float* out, const float* x, const float* y, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}

extern "C" __global__ void cast_f32_f16(f16_t* __restrict__ out, const float* __restrict__ x, long long n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}

// ---- batched prefill: row t of every (T, n) array belongs to prompt position pos0 + t.
// Row strides are passed in elements so row views of larger buffers work.

// out (T, dim) f32 = table[tokens[t]] ; tokens (T,) int32 on the device (checked on the host)
extern "C" __global__ void embed_batch_f16(float* __restrict__ out, const f16_t* __restrict__ table,
                                           const int* __restrict__ tokens, int T, int vocab, int dim,
                                           int out_stride, float scale)
{
    const int t = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || i >= dim) return;
    const int token = tokens[t];
    out[(size_t)t * out_stride + i] = (token >= 0 && token < vocab) ? h2f(table[(size_t)token * dim + i]) * scale : 0.0f;
}

// rmsnorm of every row: one block per row (blockIdx.x = row)
extern "C" __global__ void __launch_bounds__(RMS_THREADS) rmsnorm_rows_f32(
    float* out, const float* x, const float* __restrict__ w, int n, float eps,
    int out_stride, int x_stride)
{
    TRACE_BEGIN();
    __shared__ float red[RMS_THREADS / 32];
    const float* xr = x + (size_t)blockIdx.x * x_stride;
    float* orow = out + (size_t)blockIdx.x * out_stride;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += RMS_THREADS) s = fmaf(xr[i], xr[i], s);
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_THREADS / 32; ++k) tot += red[k];
    const float inv = rsqrtf(tot / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += RMS_THREADS) orow[i] = xr[i] * inv * w[i];
    TRACE_END(0x1003);
}

// out (T, n) = x (T, n) + b (n,) ; contiguous rows; out may alias x
extern "C" __global__ void add_rows_f32(float* out, const float* x, const float* __restrict__ b,
                                        long long total, int n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = x[i] + b[i % n];
}

// rope on every row: row t of q (nq heads) and k (nk heads) is position pos0 + t
// (pos0 < 0: step[1], the position a captured prefill chunk is replayed at)
extern "C" __global__ void rope_batch_f32(float* __restrict__ q, float* __restrict__ k,
                                          const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                          int pos0, int n_pos, int T, int nq, int nk, int half,
                                          int q_stride, int k_stride, int hd, const int* __restrict__ step)
{
    pos0 = step_value(step, 1, pos0);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = (nq + nk) * half;
    if (i >= (long long)T * per_row) return;
    const int t = (int)(i / per_row);
    const int r = (int)(i - (long long)t * per_row);
    const int pos = pos0 + t;
    if (pos < 0 || pos >= n_pos) return;
    const int head = r / half, j = r - head * half;
    float* v = head < nq ? q + (size_t)t * q_stride + (size_t)head * hd
                         : k + (size_t)t * k_stride + (size_t)(head - nq) * hd;
    const float c = cos_t[(size_t)pos * half + j], s = sin_t[(size_t)pos * half + j];
    rope_pair(v[j], v[j + half], c, s, v[j], v[j + half]);
}

// k_cache[:, pos0 + t, :] = k[t] ; same for v (f32 -> f16); pos0 < 0: step[1], as rope_batch_f32
extern "C" __global__ void cache_store_batch_f16(f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache,
                                                 const float* __restrict__ k, const float* __restrict__ v,
                                                 int pos0, int T, int max_ctx, int n_kv, int hd,
                                                 int k_stride, int v_stride, const int* __restrict__ step)
{
    pos0 = step_value(step, 1, pos0);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = n_kv * hd;
    if (i >= (long long)T * per_row) return;
    const int t = (int)(i / per_row);
    const int r = (int)(i - (long long)t * per_row);
    const int pos = pos0 + t;
    if (pos < 0 || pos >= max_ctx) return;
    const int h = r / hd, e = r - h * hd;
    const size_t dst = ((size_t)h * max_ctx + pos) * hd + e;
    k_cache[dst] = f2h(k[(size_t)t * k_stride + r]);
    v_cache[dst] = f2h(v[(size_t)t * v_stride + r]);
}

// rows of x (T, n) f32 with row stride x_stride -> contiguous (T, n) f16 (the GEMM's input)
extern "C" __global__ void cast_rows_f32_f16(f16_t* __restrict__ out, const float* __restrict__ x,
                                             long long total, int n, int x_stride)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long t = i / n;
    out[i] = f2h(x[t * x_stride + (i - t * n)]);
}
