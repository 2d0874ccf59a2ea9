// A mixture of experts around the chosen experts' products (those are the qmv_experts_* and
// qmma<C>_experts_* kernels of quant_matvec.cu): decode's router and choice of experts and
// the sum of their outputs; prefill's choice of each row, grouping of a chunk by expert, and
// sums of rows. All read and write device arrays only, so a decode step or a prefill chunk
// stays one captured graph (backends/cuda/experts.py).
//
// Reference: backends/moe.py (route, moe, moe_batch). Tests: tests/test_backend_ops.py (moe
// cases on cuda and cuda-graph), tests/test_cuda_ops.py (the routing and the grouping against
// numpy), tests/test_families.py (whole models against transformers).
#include "common.cuh"

#define MOE_THREADS 256            // 8 warps: a router row each
#define MOE_MAX_EXPERTS 1024       // probabilities kept in shared memory (experts.py checks E)

// The token's choice from its logits, as backends/moe.py route() makes it, by the first warp of
// the block (the others return; callers call it last): p = softmax(logits); ids[0:k] the experts
// of the highest p, best first, of equals the lower id; weights[j] = p[ids[j]], divided by their
// sum (in rank order) where norm. p (E floats of shared memory) holds the logits on entry.
// Lane l owns the entries l, l + 32, ...: it keeps the best of its own (a NaN is never one) and
// scans them again only when that one was chosen, so a round is one butterfly of (value, id)
// pairs; a warp where the block took three barriers and a serial pass a round took ~7 us of a
// Qwen3-30B-A3B decode layer on an H200 (bench/trace_cuda_decode.py).
__device__ void moe_choose(float* p, int E, int k, int norm, int* __restrict__ ids, float* __restrict__ weights)
{
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    float m = NEG_INF;
    for (int i = lane; i < E; i += 32) m = fmaxf(m, p[i]);
    m = warp_max(m);
    float s = 0.0f;
    for (int i = lane; i < E; i += 32) {
        p[i] = expf(p[i] - m);
        s += p[i];
    }
    s = warp_sum(s);
    for (int i = lane; i < E; i += 32) p[i] = p[i] / s;
    float bv = -2.0f;                      // below every probability, and the chosen ones' -1
    int bi = E;
    for (int i = lane; i < E; i += 32)
        if (p[i] > bv) { bv = p[i]; bi = i; }           // ascending i: the first of equals stays
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
        float v = bv;
        int vi = bi;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {  // every lane ends with the same winner
            const float ov = __shfl_xor_sync(FULL_MASK, v, o);
            const int oi = __shfl_xor_sync(FULL_MASK, vi, o);
            if (ov > v || (ov == v && oi < vi)) { v = ov; vi = oi; }
        }
        vi = vi < E ? vi : 0;              // never: k <= E leaves an expert unchosen each round
        const float w = p[vi];
        if (lane == 0) { ids[j] = vi; weights[j] = w; }
        wsum += w;                         // in rank order, as the host's sum
        __syncwarp();                      // every lane has read p[vi]
        if ((vi & 31) == lane) {           // its owner marks it and finds its next best
            p[vi] = -1.0f;
            bv = -2.0f;
            bi = E;
            for (int i = lane; i < E; i += 32)
                if (p[i] > bv) { bv = p[i]; bi = i; }
        }
    }
    if (norm && lane == 0) {
        for (int j = 0; j < k; ++j) weights[j] = weights[j] / wsum;
    }
}

// logits[e] = router[e] . x for the block's experts (router (E, n) f32, a warp a row); then the
// last block to finish (a counter, as decode attention merges its splits) turns the logits into
// the token's choice (moe_choose). The counter is back at zero afterwards.
// nw non-null: x is the stream and the router reads rmsnorm(x) * nw (the layer's pre-norm,
// held back by norm_fold.py and taken here instead of a launch of its own); every block finds
// the norm as rmsnorm_f32 does, to the bit, and block 0 writes it to xn for the experts.
// The router is constant: a lane's first MOE_ROW_PRE 16-byte words of its row (rows of
// n % 4 == 0 floats; a router 16-byte aligned, which experts.py checks) load before pdl_wait,
// so a Qwen3-30B-A3B router row (2048 floats) is in registers when x arrives. Its rows
// loaded after the wait, a float a lane at a time, took ~10 us of a decode layer on an H200.
#define MOE_ROW_PRE 16
extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_route_f32(
    int* __restrict__ ids, float* __restrict__ weights, float* logits, int* counter,
    const float* __restrict__ router, const float* x, float* __restrict__ xn, const float* __restrict__ nw,
    float eps, int E, int n, int k, int norm)
{
    static_assert(2 * MOE_THREADS == RMS_THREADS, "a thread here sums two of rmsnorm_f32's");
    TRACE_BEGIN();
    pdl_trigger();          // the experts' blocks may be scheduled (they wait for the ids)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * (MOE_THREADS / 32) + warp;
    const int n4 = n % 4 == 0 ? n / 4 : 0;          // whole 16-byte words a row (else floats)
    const float4* r4 = reinterpret_cast<const float4*>(router + (size_t)min(e, E - 1) * n);
    float4 rv[MOE_ROW_PRE];
#pragma unroll
    for (int c = 0; c < MOE_ROW_PRE; ++c) {
        const int i = lane + 32 * c;
        rv[c] = (e < E && i < n4) ? __ldg(r4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    pdl_wait_after_loads(n);    // x: the stream (or the normed stream), written by the previous kernel
    // xs (n floats of dynamic shared memory): x as the router reads it, each element loaded
    // from global memory once a block. Read there by every warp, a lane's 4 n / 32 scalar
    // loads of x and the norm weight took ~4 us after the norm (a Qwen3-30B-A3B layer, H200).
    extern __shared__ float xs[];
    if (nw != nullptr) {
        // rmsnorm_f32's sum of squares: thread t of its 512 sums x[t], x[t + 512], ...; here
        // thread t sums its threads t and t + 256, whose warps are this one's and 8 after it
        __shared__ float red[RMS_THREADS / 32];
        float sa = 0.0f, sb = 0.0f;
        for (int i = threadIdx.x; i < n; i += RMS_THREADS) {
            const float v = ld_act(x + i);
            xs[i] = v;
            sa = fmaf(v, v, sa);
        }
        for (int i = threadIdx.x + MOE_THREADS; i < n; i += RMS_THREADS) {
            const float v = ld_act(x + i);
            xs[i] = v;
            sb = fmaf(v, v, sb);
        }
        sa = warp_sum(sa);
        sb = warp_sum(sb);
        if (lane == 0) {
            red[warp] = sa;
            red[warp + MOE_THREADS / 32] = sb;
        }
        __syncthreads();
        float tot = 0.0f;
#pragma unroll
        for (int w = 0; w < RMS_THREADS / 32; ++w) tot += red[w];
        const float inv = rsqrtf(tot / (float)n + eps);
        TRACE_MARK(1);      // bench/trace_cuda_decode.py: the norm found
        // the elements this thread loaded (i = t mod MOE_THREADS), normed as rmsnorm_f32 writes them
        for (int i = threadIdx.x; i < n; i += MOE_THREADS) {
            const float v = xs[i] * inv * __ldg(nw + i);
            xs[i] = v;
            if (blockIdx.x == 0) xn[i] = v;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += MOE_THREADS) xs[i] = ld_act(x + i);
    }
    __syncthreads();
    if (e < E) {
        float s = 0.0f;
        if (n4 > 0) {
            const float4* x4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
            for (int c = 0; c < MOE_ROW_PRE; ++c) {
                const int i = lane + 32 * c;
                if (i < n4) {
                    const float4 v = x4[i];
                    s = fmaf(rv[c].x, v.x, s);
                    s = fmaf(rv[c].y, v.y, s);
                    s = fmaf(rv[c].z, v.z, s);
                    s = fmaf(rv[c].w, v.w, s);
                }
            }
            for (int i = lane + 32 * MOE_ROW_PRE; i < n4; i += 32) {
                const float4 r = __ldg(r4 + i), v = x4[i];
                s = fmaf(r.x, v.x, s);
                s = fmaf(r.y, v.y, s);
                s = fmaf(r.z, v.z, s);
                s = fmaf(r.w, v.w, s);
            }
        } else {
            const float* r = router + (size_t)e * n;
            for (int i = lane; i < n; i += 32) s = fmaf(__ldg(r + i), xs[i], s);
        }
        s = warp_sum(s);
        if (lane == 0) logits[e] = s;
    }
    TRACE_MARK(2);          // warp 0's row summed
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    TRACE_MARK(3);          // every row written and fenced
    if (threadIdx.x == 0) is_last = (atomicAdd(counter, 1) == (int)gridDim.x - 1);
    __syncthreads();
    TRACE_MARK(4);          // the counter's answer
    if (!is_last) {
        TRACE_END(0x1004);
        return;
    }

    __shared__ float p[MOE_MAX_EXPERTS];
    if (threadIdx.x == 0) *counter = 0;
    for (int i = threadIdx.x; i < E; i += MOE_THREADS)
        p[i] = __ldcg(logits + i);         // other blocks' rows: from L2, past this SM's L1
    __syncthreads();
    moe_choose(p, E, k, norm, ids, weights);
    TRACE_END(0x1005);      // the last block: its choice (bench/trace_cuda_decode.py)
}

// ---- prefill: a chunk of T tokens, routed and grouped by expert on the device ----------------
// (backends/cuda/experts.py moe_batch; the experts' products are qmma_experts* of
// quant_matvec.cu). Nothing is read back to the host, so a chunk can be captured.

// Row t of logits (T, E; the router's product, a GEMM) -> ids[t*k ...], weights[t*k ...]:
// a block a token, moe_choose as decode's.
extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_route_rows(
    int* __restrict__ ids, float* __restrict__ weights, const float* __restrict__ logits, int E, int k, int norm)
{
    __shared__ float p[MOE_MAX_EXPERTS];
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < E; i += MOE_THREADS) p[i] = logits[(size_t)t * E + i];
    __syncthreads();
    moe_choose(p, E, k, norm, ids + (size_t)t * k, weights + (size_t)t * k);
}

// The chunk's choices grouped by expert, one block of MOE_GROUP_THREADS: entry i = t*k + j
// (token t's rank j) with expert ids[i]. Sorted by expert and, within one, by entry:
//   slots[p] = the entry at sorted position p; pos[i] = entry i's position (its inverse);
//   work[g] = {expert, first position, columns, 0} for each group of at most C of one expert's
//   positions, experts in order; *n_work = the number of groups.
// The experts' kernels take a group a block (its expert's weights once for C columns), so
// the grid is sized for the most groups there can be: ceil(T*k / C) + min(E, T*k).
// Shared memory (dynamic): ids (T*k ints), then count, start and first group (E ints each).
#define MOE_GROUP_THREADS 1024
extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS) moe_group(
    int* __restrict__ slots, int* __restrict__ pos, int4* __restrict__ work, int* __restrict__ n_work,
    const int* __restrict__ ids, int entries, int E, int C)
{
    extern __shared__ int moe_smem[];
    int* sid = moe_smem;                   // [entries]
    int* count = sid + entries;            // [E]
    int* start = count + E;                // [E]
    int* group = start + E;                // [E]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = MOE_GROUP_THREADS / 32;
    for (int i = threadIdx.x; i < E; i += MOE_GROUP_THREADS) count[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < entries; i += MOE_GROUP_THREADS) {
        const int e = min(max(ids[i], 0), E - 1);      // moe_route_rows writes them in range
        sid[i] = e;
        atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {                // E <= MOE_MAX_EXPERTS: a serial scan is a few us
        int p = 0, g = 0;
        for (int e = 0; e < E; ++e) {
            start[e] = p;
            group[e] = g;
            p += count[e];
            g += (count[e] + C - 1) / C;
        }
        *n_work = g;
    }
    __syncthreads();
    // a warp an expert: its entries in order (a ballot a window of 32), and its groups
    for (int e = warp; e < E; e += warps) {
        int p = start[e];
        for (int i0 = 0; i0 < entries; i0 += 32) {
            const int i = i0 + lane;
            const bool mine = i < entries && sid[i] == e;
            const unsigned b = __ballot_sync(0xffffffffu, mine);
            if (mine) {
                const int q = p + __popc(b & ((1u << lane) - 1u));
                slots[q] = i;
                pos[i] = q;
            }
            p += __popc(b);
        }
        const int n = count[e];
        for (int g = lane; g * C < n; g += 32)
            work[group[e] + g] = make_int4(e, start[e] + g * C, min(C, n - g * C), 0);
    }
}

// out (T, n) += for each token t, the sum over its ranks j of weights[t*k+j] * y[pos[t*k+j]]
// (y: the experts' outputs by sorted position, (T*k, n)), in rank order and rounded as decode's
// moe_combine_f32. Grid (ceil(n / 256), T).
extern "C" __global__ void moe_combine_rows(float* out, int ldo, const float* __restrict__ y,
                                            const float* __restrict__ weights, const int* __restrict__ pos,
                                            int k, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= n) return;
    float* o = out + (size_t)t * ldo + i;
    float acc = *o;
    for (int j = 0; j < k; ++j) {
        const int q = pos[(size_t)t * k + j];
        acc = __fadd_rn(acc, __fmul_rn(y[(size_t)q * n + i], weights[(size_t)t * k + j]));
    }
    *o = acc;
}

// out (n,) += sum over the ranks j of weights[j] * y[j] (y (k, n)), in rank order and rounded
// as the host ops round (each product, then each sum: no fused multiply-add)
extern "C" __global__ void moe_combine_f32(float* out, const float* y, const float* weights, int k, int n)
{
    TRACE_BEGIN();
    pdl_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    pdl_wait();
    if (i < n) {
        float acc = ld_act(out + i);
        for (int j = 0; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(ld_act(y + (size_t)j * n + i), ld_act(weights + j)));
        out[i] = acc;
    }
    TRACE_END(0x1006);
}
