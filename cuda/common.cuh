// Shared helpers for cyllm's CUDA kernels (inlined into one NVRTC source by
// backends/cuda/source.py, so no header lookup is needed at compile time).
//
// FP16 is kept as raw 16-bit words and converted with PTX `cvt`: NVRTC does not
// always find cuda_fp16.h, and this header needs nothing from the toolkit.
#pragma once

typedef unsigned short f16_t;   // IEEE binary16 bits
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
// threads of a block of the row norms (rmsnorm_f32, rmsnorm_rows_f32 of elementwise.cu); the
// kernels that fold a norm in (moe.cu's router, the q/k head norms) add in their order
#define RMS_THREADS 512

__device__ __forceinline__ float h2f(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_t f2h(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two packed halves (low half first in memory) -> two floats.
__device__ __forceinline__ float2 h2x2f(u32 v) {
    float lo, hi;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(v));
    return make_float2(lo, hi);
}

// The eight halves of a 16-byte word (a KV-cache row's slice) as floats.
__device__ __forceinline__ void h8f(uint4 v, float (&f)[8]) {
    float2 p;
    p = h2x2f(v.x); f[0] = p.x; f[1] = p.y;
    p = h2x2f(v.y); f[2] = p.x; f[3] = p.y;
    p = h2x2f(v.z); f[4] = p.x; f[5] = p.y;
    p = h2x2f(v.w); f[6] = p.x; f[7] = p.y;
}

// Activation loads: x, the residual stream, anything a previous kernel of the step wrote.
// Never __ldg / ld.global.nc for these: the non-coherent path is only for data that is
// read-only for the kernel's whole lifetime, and under programmatic dependent launch a
// kernel starts while its predecessor is still writing them; the compiler may also move
// an nc load (or any load through a const __restrict__ pointer) above pdl_wait. A plain
// ld.global in volatile asm stays after pdl_wait (asm volatile statements keep their
// order) and reads what griddepcontrol.wait made visible. Captured whole-model decode on
// q4_0/q4_1/q5_0/q5_1 weights read stale activations through __ldg (H100).
__device__ __forceinline__ float4 ld_act4(const float4* p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float ld_act(const float* p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int ld_act_int(const int* p) {
    int v;
    asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Streamed weight loads: read once per token, so keep them out of L1 and leave
// L1 to the activation vector that every warp re-reads.
__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
#ifdef CYLLM_PLAIN_LOADS
    return *p;
#else
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// Programmatic dependent launch (sm_90+). Under decode_step the backend launches
// the decode kernels with the programmatic-stream-serialization attribute, so a
// kernel's blocks may start while the previous kernel still runs: each such kernel
// lets its successor launch as soon as it starts (pdl_trigger), does only work
// that depends on nothing the previous kernels write (weight loads; attention's
// cache rows before pos, which no kernel of a step writes: a step writes row pos
// only) and then waits (pdl_wait) for the previous grid to complete and flush
// before it touches activations, the cache row pos or any output. Every kernel launched with the
// attribute calls pdl_wait before its first dependent access, so completion still
// chains kernel to kernel. Launched without the attribute both are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#ifdef CYLLM_TRACE
__device__ unsigned long long* cyllm_trace_buf;
__device__ unsigned int cyllm_trace_cnt;
__device__ __forceinline__ unsigned long long trace_now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
// per block, in shared memory: start, pdl_wait return, then TRACE_MARKS stage marks (0: none)
#define TRACE_MARKS 4
__device__ __forceinline__ unsigned long long* trace_slots() { __shared__ unsigned long long s[2 + TRACE_MARKS]; return s; }
__device__ __forceinline__ void trace_begin() {
    if (threadIdx.x == 0) {
        trace_slots()[0] = trace_now();
        for (int i = 1; i < 2 + TRACE_MARKS; ++i) trace_slots()[i] = 0;
    }
}
// a record: tag<<40 | sm<<32 | blockIdx.y<<16 | blockIdx.x, start, wait return, end, marks 1..4 (ns)
__device__ __forceinline__ void trace_end(unsigned tag) {
    if (threadIdx.x == 0 && cyllm_trace_buf != nullptr) {
        unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        const unsigned i = atomicAdd(&cyllm_trace_cnt, 1u);
        if (i < (1u << 18)) {
            unsigned long long* e = cyllm_trace_buf + (4ull + TRACE_MARKS) * i;
            e[0] = ((unsigned long long)tag << 40) | ((unsigned long long)smid << 32) | (blockIdx.y << 16) | blockIdx.x;
            e[1] = trace_slots()[0]; e[2] = trace_slots()[1]; e[3] = trace_now();
            for (int m = 0; m < TRACE_MARKS; ++m) e[4 + m] = trace_slots()[2 + m];
        }
    }
}
#define TRACE_BEGIN() trace_begin()
#define TRACE_END(tag) trace_end(tag)
// stage m (1..TRACE_MARKS) of the block done: place it after a __syncthreads
#define TRACE_MARK(m) do { if (threadIdx.x == 0) trace_slots()[1 + (m)] = trace_now(); } while (0)
#else
#define TRACE_BEGIN()
#define TRACE_END(tag)
#define TRACE_MARK(m) do { } while (0)
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef CYLLM_TRACE
    if (threadIdx.x == 0) trace_slots()[1] = trace_now();
#endif
}

// A launch over a token's chosen experts (qmv_experts_* of quant_matvec.cu, *_experts_f16 of
// matvec.cu): blockIdx.y is the rank j of an expert the token chose. Waits for the ids (the
// previous kernel, moe_route_f32, wrote them), then returns where expert ids[j]'s matrix starts
// in its role's stack (e * stride, in the caller's units), or -1 for an id out of range
// (never: moe_route_f32 writes them in range). None of the weights can load before the wait.
__device__ __forceinline__ long long expert_offset(const int* ids, int n_experts, long long stride) {
    pdl_trigger();
    pdl_wait();
    const int e = ld_act_int(ids + blockIdx.y);
    return (e < 0 || e >= n_experts) ? -1 : (long long)e * stride;
}

// pdl_wait for a kernel that issued loads before it: ptxas may schedule such loads below
// griddepcontrol.wait when both sit in one basic block, and did so for every q4_0 matvec and
// q8_0's gate+up (SASS of cuda/quant_matvec.cu, CUDA 13, sm_90a: no weight load before the
// wait), so their weights streamed only once the previous kernel had finished. A branch on a
// value the compiler cannot know (an argument never negative) ends the block: the loads above
// it are issued before the wait (Llama-2-7B Q4_0 decode on an H100 +3%).
__device__ __forceinline__ void pdl_wait_after_loads(int never_negative) {
    if (never_negative < 0) __trap();
    pdl_wait();
}

// dot of 8 halves (one 16-byte word) with 8 floats (two float4)
__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b, float acc) {
    float2 p;
    p = h2x2f(w.x); acc = fmaf(p.x, a.x, acc); acc = fmaf(p.y, a.y, acc);
    p = h2x2f(w.y); acc = fmaf(p.x, a.z, acc); acc = fmaf(p.y, a.w, acc);
    p = h2x2f(w.z); acc = fmaf(p.x, b.x, acc); acc = fmaf(p.y, b.y, acc);
    p = h2x2f(w.w); acc = fmaf(p.x, b.z, acc); acc = fmaf(p.y, b.w, acc);
    return acc;
}

// One rotate-half pair turned by the angle (c, s), its roundings spelled out (a product, then a
// fused multiply-add) so that every rope kernel rounds alike whatever ptxas would contract:
// the decode kernels that fold rope in (quant_matvec.cu qkv_rope_body, elementwise.cu
// qknorm_rope_store_*) give rope_store_f32's results to the bit. Inputs are read before any
// output is written, so y1/y2 may alias x1/x2.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float s, float& y1, float& y2) {
    const float a = fmaf(x1, c, -__fmul_rn(x2, s));
    const float b = fmaf(x2, c, __fmul_rn(x1, s));
    y1 = a;
    y2 = b;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

// A vector handed to the next quantized matvec already quantized (backends/cuda/prequant.py):
// a warp holding 32 consecutive outputs v (element `row` in this lane, row % 32 == lane)
// writes their 32-block's int8 codes, entry {d, d * sum(q), sum(q[0:16]), sum(q[16:32])}
// and sum of squares into qxo (n codes | n/32 entries | n/32 sums) as quant_matvec.cu's
// qstage would have made them from v * nw (nw: the reader's rmsnorm weight at this element,
// 1 without one). Every lane of the warp takes part.
__device__ __forceinline__ void qx_produce(unsigned char* __restrict__ qxo, int n, int row, float v, float nwr,
                                           int lane)
{
    const float xv = v * nwr;
    const float a = warp_max(fabsf(xv));
    const float dq = a / 127.0f;
    const float id = a > 0.0f ? 127.0f / a : 0.0f;
    const int q = __float2int_rn(xv * id);
    int sm = q;
#pragma unroll
    for (int off = 1; off < 16; off <<= 1) sm += __shfl_xor_sync(FULL_MASK, sm, off);   // per half warp
    const int so = __shfl_xor_sync(FULL_MASK, sm, 16);
    const float sq = warp_sum(v * v);
    reinterpret_cast<signed char*>(qxo)[row] = (signed char)q;
    if (lane == 0) {
        reinterpret_cast<float4*>(qxo + n)[row >> 5] = make_float4(dq, dq * (float)(sm + so),
                                                                    __int_as_float(sm), __int_as_float(so));
        reinterpret_cast<float*>(qxo + n + n / 2)[row >> 5] = sq;
    }
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
// GELU, tanh approximation (Gemma's gelu_pytorch_tanh)
__device__ __forceinline__ float gelu_tanh_f(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// Per-step values (token, position) either come from the host as kernel
// arguments (eager ops) or from a small device buffer `step` = {token, pos}
// (decode_step's CUDA graph, whose arguments are frozen at capture).
// A host value < 0 means "read the device buffer".
__device__ __forceinline__ int step_value(const int* step, int idx, int host) {
    return host >= 0 ? host : step[idx];
}
