// Decode attention over the FP16 KV cache, split across blocks (flash-decoding).
//
// Cache layout per layer: (n_kv_heads, max_ctx, head_dim) f16, so the keys of
// one KV head over a range of positions form one contiguous block of memory.
// Block (kv head, split) handles positions [split*C, split*C + C) for all the
// query heads of its group, or for hpb of them (then a KV head has several blocks a split,
// each reading the same rows, the later ones from L2), in tiles of GT heads (GQA: the K/V
// tile is read once per tile): scores into shared memory (a batch's rows x heads summed across
// each row's lanes by one butterfly), a local softmax (max m, sum l), and the
// un-normalised output sum_t exp(s_t - m) v_t (at short caches an online softmax per
// warp instead, each head of the tile on warps of its own, combined across them). The
// last block of a column (the same heads, every split) to finish combines the splits of
// each of its heads with the online-softmax rescaling exp(m_s - max m), so attention is
// one launch. CudaBackend._attn_plan picks hpb and the variant by the cache's length.
// Nothing is accumulated with global atomics: every partial is written once
// and merged by one block, so tiny terms are never flushed.
//
// The position comes from the host (eager) or from the device step buffer
// (CUDA graph), so the grid is sized for max_ctx and blocks past pos leave.
//
// The _ve and _ek variants read their first pass of cache rows (_ek: of K rows only) before
// pdl_wait: they rely on a decode step writing no cache row but pos (rope_store, cache_store,
// or qmv_qkv_rope_* of quant_matvec.cu, which folds rope_store into the q/k/v matvec). A step
// that wrote several rows (batched or speculative decode) would have to use the others.
//
// Reference: backends/numpy_ref.py. Tests: tests/test_cuda_ops.py (each kernel against the
// reference), tests/test_backend_ops.py (the op table on every backend), tests/test_cuda_model.py.
// Benchmark: bench/bench_cuda.py (per-op GB/s; results in bench/results/cuda_ops_*.md).
#include "common.cuh"

#define ATT_THREADS 256
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_UNROLL 8

// v[0..NV) summed across the SEG lanes of a row segment (lane bits 0 .. log2(SEG)-1), scattered:
// at the levels of the lowest H = min(log2 NV, log2 SEG) bits each lane keeps half of its values
// and adds its partner's copy of that half, so the lane ends holding NV >> H sums, value k being
// the original index k + sum_i bit_i(lane) * (NV >> (i + 1)); the levels above H add plainly.
// NV * (1 - 2^-H) + (log2 SEG - H) * (NV >> H) shuffles instead of NV * log2 SEG.
__device__ constexpr int log2_pow2(int x) { return x <= 1 ? 0 : 1 + log2_pow2(x >> 1); }

// Gemma 2's soft cap of a scaled score, cap * tanh(s / cap), as cap * (1 - 2 / (e^(2s/cap) + 1)):
// e^ large gives inf and 1 / inf = 0 (so +cap), a NaN stays NaN; the error is ~1e-7 cap, which
// moves a softmax weight by as little. The kernels apply it where cap > 0, in loops of their own:
// inside the score or softmax loops (with tanhf) it took the staged kernels g1 from 64 to 74
// registers and g4 from 80 to 94, and tanhf in the prefill's own pass c2_v4 from 90 to 96
// (nvcc 13.0, sm_90a)
__device__ __forceinline__ float attn_softcap(float s, float cap)
{
    const float e = __expf(2.0f * s * __frcp_rn(cap));
    return cap * fmaf(-2.0f, __frcp_rn(e + 1.0f), 1.0f);
}

// the halving levels H of seg_reduce_scatter<NV, SEG>, and the segment's levels
template <int NV, int SEG>
struct SegLevels {
    static_assert(NV > 0 && (NV & (NV - 1)) == 0 && SEG > 0 && SEG <= 32 && (SEG & (SEG - 1)) == 0,
                  "powers of two, a segment within a warp");
    static constexpr int SEGL = log2_pow2(SEG);
    static constexpr int H = log2_pow2(NV) < SEGL ? log2_pow2(NV) : SEGL;
};

template <int NV, int SEG>
__device__ __forceinline__ void seg_reduce_scatter(float (&v)[NV], int lane)
{
    constexpr int H = SegLevels<NV, SEG>::H, LSEG = SegLevels<NV, SEG>::SEGL;
    int n = NV;
#pragma unroll
    for (int i = 0; i < H; ++i) {
        const int o = 1 << i;
        const bool hi = (lane & o) != 0;
        n >>= 1;
#pragma unroll
        for (int k = 0; k < NV / 2; ++k) {
            if (k < n) {
                const float send = hi ? v[k] : v[k + n];
                const float keep = hi ? v[k + n] : v[k];
                v[k] = keep + __shfl_xor_sync(FULL_MASK, send, o);
            }
        }
    }
#pragma unroll
    for (int i = H; i < LSEG; ++i)
#pragma unroll
        for (int k = 0; k < (NV >> H); ++k) v[k] += __shfl_xor_sync(FULL_MASK, v[k], 1 << i);
}

// Original index of value k after seg_reduce_scatter<NV, SEG> in this lane.
template <int NV, int SEG>
__device__ __forceinline__ int seg_scatter_index(int k, int lane)
{
    constexpr int H = SegLevels<NV, SEG>::H;
    int j = k;
#pragma unroll
    for (int i = 0; i < H; ++i)
        if (lane & (1 << i)) j += NV >> (i + 1);
    return j;
}


// The block that finishes a column's splits last merges them: every block
// writes its partials, fences, and bumps its column's counter once; the block
// that sees count == n_used - 1 knows every partial is visible, combines them
// with the online-softmax weights e^(m_s - M) and resets the counter for the
// next launch (the next layer reuses the same scratch). The partial sums are
// still each written once and merged by one block: no atomics on data.
__device__ __forceinline__ bool attn_last_block(int* counter, int n_used)
{
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = (atomicAdd(counter, 1) == n_used - 1);
    __syncthreads();
    return is_last != 0;
}

// out[h] for heads h0 .. h0+nh-1: sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// Heads go in tiles of ATT_WARPS: warp gi turns head gi's split maxima/sums into
// weights in wsm (ATT_WARPS * n_split floats), then all threads sum the
// o_part rows with independent (unrolled) loads. __ldcg: the partials were
// written by other blocks, so read them from L2, never from a stale L1 line.
__device__ __forceinline__ void attn_merge_heads(
    float* __restrict__ out, const float* o_part, const float* m_part, const float* l_part,
    int h0, int nh, int hd, int n_split, int s0, int n_used, float* wsm,
    unsigned char* __restrict__ qxo = nullptr, int n_out = 0)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t0 = 0; t0 < nh; t0 += ATT_WARPS) {
        const int nt = min(ATT_WARPS, nh - t0);
        if (warp < nt) {
            const int h = h0 + t0 + warp;
            const float* mp = m_part + (size_t)h * n_split;
            const float* lp = l_part + (size_t)h * n_split;
            float M = NEG_INF;
            for (int s = s0 + lane; s < n_used; s += 32) M = fmaxf(M, __ldcg(mp + s));
            M = warp_max(M);
            float L = 0.0f;
            for (int s = s0 + lane; s < n_used; s += 32) {
                const float w = expf(__ldcg(mp + s) - M);
                wsm[warp * n_split + s] = w;
                L = fmaf(__ldcg(lp + s), w, L);
            }
            L = warp_sum(L);
            const float inv = 1.0f / L;
            __syncwarp();
            for (int s = s0 + lane; s < n_used; s += 32) wsm[warp * n_split + s] *= inv;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nt * hd; i += ATT_THREADS) {
            const int gi = i / hd, e = i - gi * hd;
            const int h = h0 + t0 + gi;
            const float* op = o_part + (size_t)h * n_split * hd + e;
            const float* w = wsm + gi * n_split;
            float acc = 0.0f;
#pragma unroll 8
            for (int s = s0; s < n_used; ++s) acc = fmaf(__ldcg(op + (size_t)s * hd), w[s], acc);
            out[(size_t)h * hd + e] = acc;
            // qxo: also prequantized for the matvec that reads out (hd % 32 == 0: each warp
            // of an iteration holds one 32-block, and every lane of it is in range)
            if (qxo != nullptr) qx_produce(qxo, n_out, h * hd + e, acc, 1.0f, threadIdx.x & 31);
        }
        __syncthreads();
    }
}

// The scores of a batch (pv[u * GT + gi]: row u of the batch, head gi; each lane's part of the
// dot) summed over the SEG lanes of a row by one butterfly, and stored to S by the lanes
// holding them (the first NV of a segment where NV < SEG: the others hold copies).
template <int U, int GT, int SEG>
__device__ __forceinline__ void attn_store_scores(float (&pv)[U * GT], float* S, int lane, int e8, int base,
                                                  int rp, int row_in_pass, int chunk, int gt, int n_valid,
                                                  int t_first)
{
    constexpr int NV = U * GT;
    constexpr int NK = NV >= SEG ? NV / SEG : 1;
    seg_reduce_scatter<NV, SEG>(pv, lane);
    if (NV < SEG && e8 >= NV) return;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        const int j = seg_scatter_index<NV, SEG>(k, lane);
        const int u = j / GT, gi = j - u * GT;
        const int t = base + u * rp + row_in_pass;
        if (gi < gt && t < n_valid) S[gi * chunk + t] = t < t_first ? NEG_INF : pv[k];
    }
}

// rows[u] = 16-byte word e8 of row base + u * rp + row_in_pass of C, for the rows before n_valid
// (rows past pos may hold garbage, even NaN: never load them)
template <int U>
__device__ __forceinline__ void attn_load_rows(uint4 (&rows)[U], const uint4* C, int base, int rp,
                                               int row_in_pass, int n_valid, int hd8, int e8)
{
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int t = base + u * rp + row_in_pass;
        rows[u] = t < n_valid ? C[(size_t)t * hd8 + e8] : make_uint4(0, 0, 0, 0);
    }
}

// Fast path: head_dim % 8 == 0 and hd8 = head_dim / 8 a power of two <= 32.
// Thread layout in a pass over rows: e8 = lane % hd8 picks a 16-byte column
// word of the row, rows of a warp are lane / hd8; a pass covers WPH * (32 / hd8)
// consecutive positions with fully coalesced loads, WPH the warps that work on one head
// (all ATT_WARPS on the staged path, ATT_WARPS / GT on the online one).
// Dynamic shared memory: qs[GT*hd] | S[GT*C] | Wp[ATT_WARPS*GT*hd] | ml[2*GT] | wsm[ATT_WARPS*n_split]
template <int GT, bool VE, bool BF, bool EK = false>
__device__ __forceinline__ void attn_split_body(
    float* __restrict__ out, int* __restrict__ counters, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part,
    const float* q, const f16_t* k_cache,        // written by rope_store (or qmv_qkv_rope) just before: no
    const f16_t* v_cache, const int* __restrict__ step, int pos_host,   // __restrict__, no nc loads
    int max_ctx, int n_kv, int group, int hpb, int hd, int chunk, int n_split, float scale, int window,
    float softcap, unsigned char* __restrict__ qxo)
{
    extern __shared__ __align__(16) float smem[];
    // fewer loads in flight for wide head tiles keeps registers (and so resident blocks) in
    // check, and for EK, whose early batches stay in registers across the wait and the softmax
    // (at 8, one head's tiles took 128 registers); the online path (VE) holds one head a warp,
    // whatever the tile
    constexpr int U = ((GT >= 4 && !VE) || EK) ? 4 : ATT_UNROLL;
    // warps a head: the online path gives each head of the tile its own group of warps
    constexpr int WPH = VE ? ATT_WARPS / GT : ATT_WARPS;
    // block x: heads g_lo .. g_hi-1 of KV head kvh's group, hpb of them (the whole group,
    // or fewer so that a short cache's few rows spread over more blocks)
    const int nhs = (group + hpb - 1) / hpb;      // blocks a KV head
    const int kvh = blockIdx.x / nhs;
    const int g_lo = (blockIdx.x - kvh * nhs) * hpb;
    const int g_hi = min(group, g_lo + hpb);
    const int split = blockIdx.y;
    pdl_trigger();                                // wo's matvec may start loading its weights
    int pos = step_value(step, 1, pos_host);      // the step buffer is written before the graph
    if (pos >= max_ctx) pos = max_ctx - 1;
    const int t0 = split * chunk;
    // sliding window: positions start..pos; splits wholly before start take no part
    const int start = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    if (t0 > pos || t0 + chunk <= start || kvh >= n_kv) return;          // uniform over the block
    const int n_valid = min(chunk, pos + 1 - t0);
    const int t_first = max(0, start - t0);       // rows before it are masked out

    const int hd8 = hd >> 3;
    const int rpw = 32 / hd8;                     // rows per warp per pass
    const int rp = WPH * rpw;                     // rows per pass (of a head's warps)
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int e8 = lane % hd8;
    const int row_in_pass = (warp % WPH) * rpw + lane / hd8;

    float* qs = smem;                             // GT * hd
    float* S = qs + GT * hd;                      // GT * chunk
    float* Wp = S + GT * chunk;                   // ATT_WARPS * GT * hd
    float* ml = Wp + ATT_WARPS * GT * hd;         // GT maxima, GT sums

    const uint4* K = reinterpret_cast<const uint4*>(k_cache + ((size_t)kvh * max_ctx + t0) * hd);
    const uint4* V = reinterpret_cast<const uint4*>(v_cache + ((size_t)kvh * max_ctx + t0) * hd);

    // VE: the first pass of K and V rows goes out before pdl_wait. Rows before pos were
    // written by earlier tokens' launches (stream-ordered before this graph), so only row
    // pos, which rope_store writes now, waits; at short contexts the kernel then has one
    // memory round trip after the wait (q and row pos) instead of three (q, K, V), and
    // those loads overlap the qkv matvec and rope_store. The cost: 2U more 16-byte values
    // per thread (tiles of one head: 64 -> 124 registers, the online path below).
    // EK (the staged path of long caches): the first batch of K rows goes out before
    // pdl_wait the same way, V's first batch before the softmax (it does not depend on the
    // scores), so neither phase of the first head tile starts with a round trip of its own.
    // Later batches load row pos plainly: the host launches EK only where rows fill whole
    // 32-byte sectors (head_dim >= 16, the cache 32-byte aligned), so no early load can have
    // put a sector of row pos in L1.
    const int t_new = pos - t0;                   // this split's row written by rope_store
    constexpr bool KE = VE || EK;                 // K rows loaded before pdl_wait
    uint4 kpre[U], vpre[VE ? U : 1];             // kpre: also the staged path's K batches
    if (KE) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = u * rp + row_in_pass;
            const bool old = t < n_valid && t != t_new;
            kpre[u] = old ? K[(size_t)t * hd8 + e8] : make_uint4(0, 0, 0, 0);
            if (VE) vpre[VE ? u : 0] = old ? V[(size_t)t * hd8 + e8] : make_uint4(0, 0, 0, 0);
        }
    }
    pdl_wait();                                   // q and cache row pos come from rope_store (or qmv_qkv_rope)
    if (KE) {
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (u * rp + row_in_pass == t_new && t_new < n_valid) {
                // from L2: with 16-byte rows (head_dim 8) row pos shares a 32-byte sector
                // with the row before it, which the early loads may have put in L1
                kpre[u] = __ldcg(K + (size_t)t_new * hd8 + e8);
                if (VE) vpre[VE ? u : 0] = __ldcg(V + (size_t)t_new * hd8 + e8);
            }
    }
    // splits s0 .. n_used-1 take part; one alone writes the final output, no merge
    const int n_used = min(n_split, pos / chunk + 1);
    const int s0 = start / chunk;
    const bool single = n_used - s0 == 1;

    for (int g0 = g_lo; g0 < g_hi; g0 += GT) {
        const int gt = min(GT, g_hi - g0);
        __syncthreads();                          // smem reuse across head tiles
        for (int i = threadIdx.x; i < GT * hd; i += ATT_THREADS) {
            const int gi = i / hd;
            qs[i] = gi < gt ? q[(size_t)(kvh * group + g0 + gi) * hd + (i - gi * hd)] * scale : 0.0f;
        }
        __syncthreads();
        if (g0 == g_lo) TRACE_MARK(1);               // bench/trace_cuda_decode.py, first head tile: q staged

        if (VE) {
            // Short caches (the variant that loads early): each head of the tile gets WPH of
            // the block's warps, and each warp runs an online softmax over the rows it reads
            // (scores, max, sum and V in registers, no block barrier between them); then the
            // partials of a head's warps are combined once: two barriers a head tile instead
            // of the staged path's four. At a short depth attention is latency, not bytes
            // (~1 us a barrier-separated stage). One head a warp keeps the registers of one
            // head whatever the tile (an earlier form, every warp on all GT heads of its rows,
            // took g4_ve from 78 to 154 registers and SmolLM2-135M decode 2-4% slower).
            // Decode at depth 0 on an H100 against the staged path: Llama-2-7B (GT 1) Q4_K_M
            // 565.0 -> 577.6 tok/s, Q4_0 601.9 -> 613.2, Q8_0 level; SmolLM2-135M Q4_K_M
            // (groups of 3 in tiles of 4) 1508.7 -> 1619.6; Mistral-7B Q4_0 (tiles of 4)
            // 517.5 -> 523.7 (bench/results/cuda_quant_model_h100.md, twenty-second and
            // twenty-third sessions). Long caches keep the staged path, chosen when this path
            // took 196 registers (it would have halved their resident blocks); at 123-124
            // against the staged kernels' 64-122 that has not been timed again.
            float* mlw = S;                           // ATT_WARPS (max, sum) pairs; chunk >= 64
            const int gw = warp / WPH;                // this warp's head in the tile (uniform)
            const float4* qv = reinterpret_cast<const float4*>(qs + gw * hd + e8 * 8);
            float mx = NEG_INF, sm = 0.0f, acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
            // warps of a head slot past the group (gw >= gt) read no rows: their partials
            // (max -inf, sum 0) go to slots that no head's combine reads
            for (int base = 0; gw < gt && base < n_valid; base += rp * U) {
                // the first pass is the rows loaded before pdl_wait; later passes (and a second
                // head tile's first) load into the same registers, so the early rows hold no
                // registers of their own past it: g1_ve 196 -> 122 registers, g2/g4/g8_ve 118-119
                // (nvcc 13.0, sm_90a; 123-124 since hpb), and an SM holds the block (128
                // allocated a thread) beside a q/k/v matvec block (124-128: 64 K between them)
                if (base > 0 || g0 > g_lo) {
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int t = base + u * rp + row_in_pass;
                        // rows past pos may hold garbage (even NaN): never load them. From L2:
                        // row pos is this step's, and L1 may hold its sector from an early load
                        kpre[u] = t < n_valid ? __ldcg(K + (size_t)t * hd8 + e8) : make_uint4(0, 0, 0, 0);
                        vpre[u] = t < n_valid ? __ldcg(V + (size_t)t * hd8 + e8) : make_uint4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (base + u * rp >= n_valid) break;          // uniform
                    const int t = base + u * rp + row_in_pass;
                    float vf[8];
                    h8f(vpre[u], vf);
                    float p = dot8(kpre[u], qv[0], qv[1], 0.0f);
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1)       // every lane of the row gets the score
                        if (off < hd8) p += __shfl_xor_sync(FULL_MASK, p, off);
                    if (softcap > 0.0f) p = attn_softcap(p, softcap);
                    const float sc = (t < n_valid && t >= t_first) ? p : NEG_INF;
                    const float mn = fmaxf(mx, sc);
                    if (mn == NEG_INF) continue;                  // no valid row yet in this lane's rows
                    const float c = expf(mx - mn), e = expf(sc - mn);
                    sm = fmaf(sm, c, e);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[j] = fmaf(acc[j], c, e * vf[j]);
                    mx = mn;
                }
            }
            if (g0 == g_lo) TRACE_MARK(2);               // a warp's rows: scores, softmax and V
            // the rows of one warp share e8 every hd8 lanes: fold their (max, sum, output)
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                if (off < hd8) continue;                          // uniform
                const float mo = __shfl_xor_sync(FULL_MASK, mx, off);
                const float so = __shfl_xor_sync(FULL_MASK, sm, off);
                const float M = fmaxf(mx, mo);
                const float a = mx == NEG_INF ? 0.0f : expf(mx - M);
                const float b = mo == NEG_INF ? 0.0f : expf(mo - M);
                sm = sm * a + so * b;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float ao = __shfl_xor_sync(FULL_MASK, acc[j], off);
                    acc[j] = acc[j] * a + ao * b;
                }
                mx = M;
            }
            if (lane < hd8) {
                float4* dst = reinterpret_cast<float4*>(Wp + warp * hd + e8 * 8);
                dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                if (lane == 0) { mlw[2 * warp] = mx; mlw[2 * warp + 1] = sm; }
            }
            if (g0 == g_lo) TRACE_MARK(3);               // folded in the warp
            __syncthreads();
            if (g0 == g_lo) TRACE_MARK(4);               // every warp's partials in shared memory
            // element e of head slot gi: its WPH warps' partials, each weighed by e^(m_w - M)
            for (int i = threadIdx.x; i < gt * hd; i += ATT_THREADS) {
                const int gi = i / hd, e = i - gi * hd;
                const float* ml_h = mlw + 2 * WPH * gi;
                float M = NEG_INF;
#pragma unroll
                for (int w = 0; w < WPH; ++w) M = fmaxf(M, ml_h[2 * w]);
                float o = 0.0f, L = 0.0f;
#pragma unroll
                for (int w = 0; w < WPH; ++w) {
                    const float f = ml_h[2 * w] == NEG_INF ? 0.0f : expf(ml_h[2 * w] - M);
                    L = fmaf(ml_h[2 * w + 1], f, L);
                    o = fmaf(Wp[(WPH * gi + w) * hd + e], f, o);
                }
                const int h = kvh * group + g0 + gi;
                if (single) {
                    const float v = o / L;
                    out[(size_t)h * hd + e] = v;
                    // qxo: as in attn_merge_heads (an iteration's warps hold whole 32-blocks)
                    if (qxo != nullptr) qx_produce(qxo, n_kv * group * hd, h * hd + e, v, 1.0f, lane);
                } else {
                    o_part[((size_t)h * n_split + split) * hd + e] = o;
                    if (e == 0) {                     // the split's max and sum
                        m_part[(size_t)h * n_split + split] = M;
                        l_part[(size_t)h * n_split + split] = L;
                    }
                }
            }
        } else {
            // ---- scores S[gi][t] = (q_g . k_t) * scale
            // the batch's rows go into the registers the early rows came in (EK: the first
            // batch of the first head tile is those rows), so they hold none of their own
            uint4 (&kv)[U] = kpre;
            for (int base = 0; base < n_valid; base += rp * U) {
                if (!EK || base > 0 || g0 > g_lo) attn_load_rows<U>(kv, K, base, rp, row_in_pass, n_valid, hd8, e8);
                if (BF && (hd8 == 8 || hd8 == 16)) {
                    // Every (row, head) partial of the batch first, then one butterfly sums them
                    // across each row's lanes: U * GT * (1 - 1/hd8) shuffles for the batch (8
                    // for one head's 8 rows at head_dim 128) where a fold a score took
                    // U * GT * log2(hd8). With a GQA tile the folds, not the
                    // bytes, had set the pace of a long cache: Mistral-7B Q4_0 (tiles of 4 heads)
                    // on an H200, depth 4096 433.9 -> 509.5 tok/s, 16384 290.8 -> 359.9;
                    // Llama-2-7B (one head) level (bench/results/cuda_quant_model_h100.md,
                    // twenty-fifth session)
                    float pv[U * GT];
#pragma unroll
                    for (int u = 0; u < U; ++u)
#pragma unroll
                        for (int gi = 0; gi < GT; ++gi) {
                            const float4* qv = reinterpret_cast<const float4*>(qs + gi * hd + e8 * 8);
                            pv[u * GT + gi] = dot8(kv[u], qv[0], qv[1], 0.0f);
                        }
                    // head_dim 64 and 128 only: a third width (256) took g4 from 80 to 95
                    // registers (nvcc 13.0, sm_90a), two resident blocks an SM instead of three
                    if (hd8 == 16)
                        attn_store_scores<U, GT, 16>(pv, S, lane, e8, base, rp, row_in_pass, chunk, gt, n_valid, t_first);
                    else
                        attn_store_scores<U, GT, 8>(pv, S, lane, e8, base, rp, row_in_pass, chunk, gt, n_valid, t_first);
                    continue;
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    // uniform: a pass past the last row, or a head slot past the group, costs
                    // nothing (short caches: n_valid = pos + 1 leaves most of the U passes empty)
                    if (base + u * rp >= n_valid) break;
                    const int t = base + u * rp + row_in_pass;
#pragma unroll
                    for (int gi = 0; gi < GT; ++gi) {
                        if (GT > 1 && gi >= gt) break;
                        const float4* qv = reinterpret_cast<const float4*>(qs + gi * hd + e8 * 8);
                        float p = dot8(kv[u], qv[0], qv[1], 0.0f);
#pragma unroll
                        for (int off = 16; off > 0; off >>= 1)      // unrolled: hd8 is not a constant
                            if (off < hd8) p += __shfl_xor_sync(FULL_MASK, p, off);
                        if (e8 == 0 && t < n_valid) S[gi * chunk + t] = t < t_first ? NEG_INF : p;
                    }
                }
            }
            uint4 vv[U];                              // EK: V's first batch, in flight over the softmax
            if (EK) attn_load_rows<U>(vv, V, 0, rp, row_in_pass, n_valid, hd8, e8);
            __syncthreads();
            if (g0 == g_lo) TRACE_MARK(2);               // scores

            // ---- local softmax per head: one warp per head of the tile
            for (int gi = warp; gi < gt; gi += ATT_WARPS) {
                if (softcap > 0.0f) {
                    // the scores' soft cap here, where each lane rereads only its own (either
                    // score path stores S); the masked rows stay -inf
#pragma unroll 1
                    for (int t = lane; t < n_valid; t += 32) {
                        const float s = S[gi * chunk + t];
                        if (s > NEG_INF) S[gi * chunk + t] = attn_softcap(s, softcap);
                    }
                }
                float m = NEG_INF;
                for (int t = lane; t < n_valid; t += 32) m = fmaxf(m, S[gi * chunk + t]);
                m = warp_max(m);
                float l = 0.0f;
                for (int t = lane; t < n_valid; t += 32) {
                    const float e = expf(S[gi * chunk + t] - m);
                    S[gi * chunk + t] = e;
                    l += e;
                }
                l = warp_sum(l);
                if (lane == 0) { ml[gi] = m; ml[GT + gi] = l; }
            }
            __syncthreads();
            if (g0 == g_lo) TRACE_MARK(3);               // softmax

            // ---- un-normalised output: acc[gi][j] = sum_t p[gi][t] * v_t[e8*8 + j]
            float acc[GT][8];
#pragma unroll
            for (int gi = 0; gi < GT; ++gi)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[gi][j] = 0.0f;
            for (int base = 0; base < n_valid; base += rp * U) {
                if (!EK || base > 0) attn_load_rows<U>(vv, V, base, rp, row_in_pass, n_valid, hd8, e8);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (base + u * rp >= n_valid) break;          // uniform
                    const int t = base + u * rp + row_in_pass;
                    if (t < n_valid) {
                        float vf[8];
                        h8f(vv[u], vf);
#pragma unroll
                        for (int gi = 0; gi < GT; ++gi) {
                            if (GT > 1 && gi >= gt) break;
                            const float pw = S[gi * chunk + t];
#pragma unroll
                            for (int j = 0; j < 8; ++j) acc[gi][j] = fmaf(pw, vf[j], acc[gi][j]);
                        }
                    }
                }
            }
            // rows of one warp share e8 every hd8 lanes: fold them, then across warps in smem
#pragma unroll
            for (int gi = 0; gi < GT; ++gi) {
                if (GT > 1 && gi >= gt) break;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int off = 1; off < 32; off <<= 1)
                        if (off >= hd8) acc[gi][j] += __shfl_xor_sync(FULL_MASK, acc[gi][j], off);
            }
            if (lane < hd8) {
#pragma unroll
                for (int gi = 0; gi < GT; ++gi) {
                    float4* dst = reinterpret_cast<float4*>(Wp + (warp * GT + gi) * hd + e8 * 8);
                    dst[0] = make_float4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]);
                    dst[1] = make_float4(acc[gi][4], acc[gi][5], acc[gi][6], acc[gi][7]);
                }
            }
            __syncthreads();
            if (g0 == g_lo) TRACE_MARK(4);               // V rows summed per warp
            for (int i = threadIdx.x; i < gt * hd; i += ATT_THREADS) {
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) s += Wp[w * GT * hd + i];
                const int gi = i / hd;
                const int h = kvh * group + g0 + gi;
                if (single) {
                    const float v = s / ml[GT + gi];
                    out[(size_t)h * hd + (i - gi * hd)] = v;
                    // qxo: as in attn_merge_heads (an iteration's warps hold whole 32-blocks)
                    if (qxo != nullptr) qx_produce(qxo, n_kv * group * hd, h * hd + (i - gi * hd), v, 1.0f, lane);
                } else {
                    o_part[((size_t)h * n_split + split) * hd + (i - gi * hd)] = s;
                }
            }
            if (!single && threadIdx.x < gt) {
                const int h = kvh * group + g0 + threadIdx.x;
                m_part[(size_t)h * n_split + split] = ml[threadIdx.x];
                l_part[(size_t)h * n_split + split] = ml[GT + threadIdx.x];
            }
        }
    }
    if (single || !attn_last_block(counters + blockIdx.x, n_used - s0)) return;
    attn_merge_heads(out, o_part, m_part, l_part, kvh * group + g_lo, g_hi - g_lo, hd, n_split, s0,
                     n_used, ml + 2 * GT, qxo, n_kv * group * hd);
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

// Resident blocks an SM asked of ptxas (0: no bound). Unbound, ptxas gave the _ek kernels
// 105-151 registers where the staged ones get 64 (g1), 80 (g2, g4) and 122 (g8), which would
// halve a long cache's resident blocks; bound, g1_ek and g2_ek keep 64 and 80 (8 bytes of
// spill, as g1 has 12) and g8_ek takes 126; g4_ek, bound to 2, takes 96 (2 resident blocks
// against g4's 3: bound to 3 it spilled 260 bytes). nvcc 13.0, sm_90a.
#define ATT_MIN_BLOCKS(GT, EK) ((EK) ? ((GT) == 1 ? 4 : (GT) == 2 ? 3 : 2) : 0)
#define CYLLM_ATTN_SPLIT1(NAME, GT, VE, BF, EK)                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS(GT, EK)) NAME(    \
        float* out, int* counters, float* o_part, float* m_part, float* l_part,              \
        const float* q, const f16_t* k_cache,                                                \
        const f16_t* v_cache, const int* step, int pos_host, int max_ctx, int n_kv,          \
        int group, int hpb, int hd, int chunk, int n_split, float scale, int window,         \
        float softcap, unsigned char* qxo) {                                                 \
        TRACE_BEGIN(); attn_split_body<GT, VE, BF, EK>(out, counters, o_part, m_part, l_part, q, k_cache, v_cache,  \
                                step, pos_host, max_ctx, n_kv, group, hpb, hd, chunk,        \
                                n_split, scale, window, softcap, qxo);                       \
        TRACE_END(0x1000);                                                                   \
    }
// NAME_ve: the first pass of K and V rows loaded before pdl_wait (short contexts: one round
// trip after the wait instead of three; more registers; CudaBackend._attn_plan picks it).
// NAME_fold: the staged path with a fold a score instead of the batch's butterfly (measurements:
// CudaBackend.attn_butterfly). NAME_ek: the staged path with its first K rows loaded before
// pdl_wait and its first V rows before the softmax (CudaBackend.attn_staged_early).
#define CYLLM_ATTN_SPLIT(NAME, GT) CYLLM_ATTN_SPLIT1(NAME, GT, false, true, false)              \
    CYLLM_ATTN_SPLIT1(NAME##_ve, GT, true, false, false)                                     \
    CYLLM_ATTN_SPLIT1(NAME##_fold, GT, false, false, false)                                  \
    CYLLM_ATTN_SPLIT1(NAME##_ek, GT, false, true, true)

CYLLM_ATTN_SPLIT(attn_split_g1, 1)
CYLLM_ATTN_SPLIT(attn_split_g2, 2)
CYLLM_ATTN_SPLIT(attn_split_g4, 4)
CYLLM_ATTN_SPLIT(attn_split_g8, 8)

// Generic path (any even head_dim, any alignment): block (query head, split).
// Dynamic shared memory: qs[hd] | S[chunk] | red[ATT_WARPS] | wsm[ATT_WARPS*n_split]
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_split_generic(
    float* out, int* counters, float* o_part, float* m_part, float* l_part, const float* q, const f16_t* k_cache,
    const f16_t* v_cache, const int* step, int pos_host, int max_ctx, int n_kv,
    int group, int hd, int chunk, int n_split, float scale, int window, float softcap)
{
    extern __shared__ __align__(16) float smem_generic[];
    const int h = blockIdx.x;
    const int split = blockIdx.y;
    int pos = step_value(step, 1, pos_host);
    if (pos >= max_ctx) pos = max_ctx - 1;
    const int t0 = split * chunk;
    const int kvh = h / group;
    const int start = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    if (t0 > pos || t0 + chunk <= start || kvh >= n_kv) return;
    const int n_valid = min(chunk, pos + 1 - t0);
    const int t_first = max(0, start - t0);       // rows before the window are masked out
    float* qs = smem_generic;
    float* S = qs + hd;
    float* red = S + chunk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < hd; i += ATT_THREADS) qs[i] = q[(size_t)h * hd + i] * scale;
    __syncthreads();
    const f16_t* K = k_cache + ((size_t)kvh * max_ctx + t0) * hd;
    const f16_t* V = v_cache + ((size_t)kvh * max_ctx + t0) * hd;
    float m = NEG_INF;
    for (int t = threadIdx.x; t < n_valid; t += ATT_THREADS) {
        float s = 0.0f;
        for (int e = 0; e < hd; ++e) s = fmaf(qs[e], h2f(K[(size_t)t * hd + e]), s);
        if (softcap > 0.0f) s = attn_softcap(s, softcap);
        if (t < t_first) s = NEG_INF;
        S[t] = s;
        m = fmaxf(m, s);
    }
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < ATT_WARPS; ++w) m = fmaxf(m, red[w]);
    __syncthreads();                              // everyone has read red before reuse
    float l = 0.0f;
    for (int t = threadIdx.x; t < n_valid; t += ATT_THREADS) {
        const float e = expf(S[t] - m);
        S[t] = e;
        l += e;
    }
    l = warp_sum(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    if (threadIdx.x == 0) {
        float tot = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) tot += red[w];
        m_part[(size_t)h * n_split + split] = m;
        l_part[(size_t)h * n_split + split] = tot;
    }
    for (int e = threadIdx.x; e < hd; e += ATT_THREADS) {
        float acc = 0.0f;
        for (int t = 0; t < n_valid; ++t) acc = fmaf(S[t], h2f(V[(size_t)t * hd + e]), acc);
        o_part[((size_t)h * n_split + split) * hd + e] = acc;
    }
    const int n_used = min(n_split, pos / chunk + 1);
    const int s0 = start / chunk;
    if (!attn_last_block(counters + h, n_used - s0)) return;
    attn_merge_heads(out, o_part, m_part, l_part, h, 1, hd, n_split, s0, n_used, red + ATT_WARPS);
    if (threadIdx.x == 0) counters[h] = 0;
}

// ---- Batched causal attention (prefill), FlashAttention style.
// Block (query head h, tile of BQ consecutive queries) with AB_THREADS threads.
// Query row r of the tile is position pos0 + q0 + r and attends cache positions
// 0 .. pos0 + q0 + r. The block walks the cache in tiles of BK positions:
//   K tile (f16 -> f32) into shared memory, scores S = Q K^T (BQ x BK), causal
//   mask, then per row the online softmax (running max m and sum l; the output
//   accumulated so far is rescaled by e^(m_old - m_new)), then O += P V with the
//   V tile loaded into the same shared buffer. O stays in registers: warp w owns
//   rows w, w + 4, ... and lane owns columns lane, lane + 32, ... , so the
//   softmax statistics of a row live in the one warp that scales its output.
// VEC (head_dim % 4 == 0): rows padded to hd + 4 floats and read as float4 (a
// quarter warp then touches 8 distinct 16-byte bank groups); the probabilities
// are read four at a time too, so shared-memory loads stay well under the FMAs.
// Otherwise rows are padded to hd + 1 floats (odd stride) and read one by one.
// Cache rows past the last position of the tile are never read (they may hold
// anything); the KV head is h / group (GQA re-reads a tile from L2, not DRAM).
#define AB_THREADS 128
#define AB_WARPS (AB_THREADS / 32)

// K or V tile rows kt .. kt+BK-1 (f16) -> KVs (f32, row stride hdp); rows past kmax are zero
template <bool VEC>
__device__ __forceinline__ void attn_batch_load_tile(float* KVs, const f16_t* __restrict__ src, int kt,
                                                     int kmax, int bk, int hd, int hdp)
{
    if (VEC) {
        const int h4 = hd >> 2;
        for (int i = threadIdx.x; i < bk * h4; i += AB_THREADS) {
            const int j = i / h4, e = (i - j * h4) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (kt + j <= kmax) {
                const uint2 raw = *reinterpret_cast<const uint2*>(src + (size_t)(kt + j) * hd + e);
                const float2 a = h2x2f(raw.x), b = h2x2f(raw.y);
                v = make_float4(a.x, a.y, b.x, b.y);
            }
            *reinterpret_cast<float4*>(KVs + j * hdp + e) = v;
        }
    } else {
        for (int i = threadIdx.x; i < bk * hd; i += AB_THREADS) {
            const int j = i / hd, e = i - j * hd;
            // zero (not garbage) past kmax: p = 0 there, and 0 * NaN would still be NaN
            KVs[j * hdp + e] = kt + j <= kmax ? h2f(src[(size_t)(kt + j) * hd + e]) : 0.0f;
        }
    }
}

template <int NC, int BQ, int BK, bool VEC>
__device__ __forceinline__ void attn_batch_body(
    float* __restrict__ out, const float* __restrict__ q, const f16_t* __restrict__ k_cache,
    const f16_t* __restrict__ v_cache, int T, int pos0, int max_ctx, int group, int hd,
    int q_stride, int out_stride, float scale, int window, float softcap)
{
    constexpr int RPW = BQ / AB_WARPS;        // output rows per warp
    constexpr int SR = BQ / 16;               // score rows per thread
    constexpr int SC = BK / 8;                // score columns per thread
    constexpr int PS = VEC ? BK + 4 : BK + 1; // row stride of Ps
    extern __shared__ __align__(16) float smem_ab[];
    const int hdp = VEC ? hd + 4 : hd + 1;
    float* Qs = smem_ab;                      // BQ * hdp, pre-scaled queries
    float* KVs = Qs + BQ * hdp;               // BK * hdp, the K tile, then the V tile
    float* Ps = KVs + BK * hdp;               // BQ * PS, scores then probabilities

    const int h = blockIdx.x;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;   // heaviest (latest) tiles first
    const int kvh = h / group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nq = min(BQ, T - q0);
    if (nq <= 0) return;
    const int kmax = pos0 + q0 + nq - 1;      // last cache position any row of the tile reads

    for (int i = tid; i < BQ * hd; i += AB_THREADS) {
        const int r = i / hd, e = i - r * hd;
        Qs[r * hdp + e] = r < nq ? q[(size_t)(q0 + r) * q_stride + (size_t)h * hd + e] * scale : 0.0f;
    }
    const f16_t* K = k_cache + (size_t)kvh * max_ctx * hd;
    const f16_t* V = v_cache + (size_t)kvh * max_ctx * hd;

    float o[RPW][NC], m[RPW], l[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < NC; ++c) o[i][c] = 0.0f;
    }
    const int tx = tid & 7, ty = tid >> 3;    // score layout: rows ty + 16 r, columns tx + 8 c

    // sliding window: no row of the tile reads below its first row's window
    const int kfirst = window > 0 ? max(0, pos0 + q0 + 1 - window) : 0;
    for (int kt = kfirst / BK * BK; kt <= kmax; kt += BK) {
        __syncthreads();                      // the previous tile's P V is done with KVs and Ps
        attn_batch_load_tile<VEC>(KVs, K, kt, kmax, BK, hd, hdp);
        __syncthreads();
        float s[SR][SC];
#pragma unroll
        for (int r = 0; r < SR; ++r)
#pragma unroll
            for (int c = 0; c < SC; ++c) s[r][c] = 0.0f;
        if (VEC) {
#pragma unroll 2
            for (int e = 0; e < hd; e += 4) {
                float4 qv[SR], kv[SC];
#pragma unroll
                for (int r = 0; r < SR; ++r) qv[r] = *reinterpret_cast<const float4*>(Qs + (ty + 16 * r) * hdp + e);
#pragma unroll
                for (int c = 0; c < SC; ++c) kv[c] = *reinterpret_cast<const float4*>(KVs + (tx + 8 * c) * hdp + e);
#pragma unroll
                for (int r = 0; r < SR; ++r)
#pragma unroll
                    for (int c = 0; c < SC; ++c) {
                        float a = s[r][c];
                        a = fmaf(qv[r].x, kv[c].x, a);
                        a = fmaf(qv[r].y, kv[c].y, a);
                        a = fmaf(qv[r].z, kv[c].z, a);
                        s[r][c] = fmaf(qv[r].w, kv[c].w, a);
                    }
            }
        } else {
#pragma unroll 4
            for (int e = 0; e < hd; ++e) {
                float qv[SR], kv[SC];
#pragma unroll
                for (int r = 0; r < SR; ++r) qv[r] = Qs[(ty + 16 * r) * hdp + e];
#pragma unroll
                for (int c = 0; c < SC; ++c) kv[c] = KVs[(tx + 8 * c) * hdp + e];
#pragma unroll
                for (int r = 0; r < SR; ++r)
#pragma unroll
                    for (int c = 0; c < SC; ++c) s[r][c] = fmaf(qv[r], kv[c], s[r][c]);
            }
        }
#pragma unroll
        for (int r = 0; r < SR; ++r)
#pragma unroll
            for (int c = 0; c < SC; ++c) {
                const int row = ty + 16 * r, col = tx + 8 * c;
                const bool ok = row < nq && kt + col <= pos0 + q0 + row
                                && (window <= 0 || kt + col > pos0 + q0 + row - window);
                Ps[row * PS + col] = ok ? s[r][c] : NEG_INF;
            }
        __syncthreads();                      // every score written, K tile no longer read
        if (softcap > 0.0f) {
            // a pass of its own: in the loops above or below it took registers from every
            // variant (c2_v4 90 -> 112, nvcc 13.0, sm_90a); masked scores stay -inf
#pragma unroll 1
            for (int i = tid; i < BQ * BK; i += AB_THREADS) {
                const int row = i / BK, col = i - row * BK;
                const float v = Ps[row * PS + col];
                if (v > NEG_INF) Ps[row * PS + col] = attn_softcap(v, softcap);
            }
            __syncthreads();
        }
        attn_batch_load_tile<VEC>(KVs, V, kt, kmax, BK, hd, hdp);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int row = warp + AB_WARPS * i;
            const float sv = lane < BK ? Ps[row * PS + lane] : NEG_INF;
            const float mn = fmaxf(m[i], warp_max(sv));
            // a row with nothing unmasked yet (mn = -inf) keeps p = 0 and its zero state
            const float p = sv == NEG_INF ? 0.0f : expf(sv - mn);
            const float alpha = m[i] == NEG_INF ? 0.0f : expf(m[i] - mn);
            l[i] = fmaf(l[i], alpha, warp_sum(p));
            m[i] = mn;
            if (lane < BK) Ps[row * PS + lane] = p;
#pragma unroll
            for (int c = 0; c < NC; ++c) o[i][c] *= alpha;
        }
        __syncthreads();                      // V tile and probabilities in place
#pragma unroll 2
        for (int j = 0; j < BK; j += 4) {
            float4 pv[RPW];
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                const float* pr = Ps + (warp + AB_WARPS * i) * PS + j;
                pv[i] = VEC ? *reinterpret_cast<const float4*>(pr) : make_float4(pr[0], pr[1], pr[2], pr[3]);
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                float vv[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c)
                    vv[c] = (lane + 32 * c < hd) ? KVs[(j + jj) * hdp + lane + 32 * c] : 0.0f;
#pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    const float p = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
#pragma unroll
                    for (int c = 0; c < NC; ++c) o[i][c] = fmaf(p, vv[c], o[i][c]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = warp + AB_WARPS * i;
        if (row < nq) {
            const float inv = 1.0f / l[i];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int col = lane + 32 * c;
                if (col < hd) out[(size_t)(q0 + row) * out_stride + (size_t)h * hd + col] = o[i][c] * inv;
            }
        }
    }
}

// pos0 < 0: step[1] (a captured prefill chunk, replayed at the position its step buffer holds)
#define CYLLM_ATTN_BATCH(NAME, NC, BQ, BK)                                                      \
    extern "C" __global__ void __launch_bounds__(AB_THREADS) NAME(                             \
        float* out, const float* q, const f16_t* k_cache, const f16_t* v_cache, int T,         \
        int pos0, int max_ctx, int group, int hd, int q_stride, int out_stride, float scale,   \
        int window, float softcap, const int* __restrict__ step) {                             \
        attn_batch_body<NC, BQ, BK, false>(out, q, k_cache, v_cache, T, step_value(step, 1, pos0), \
                                           max_ctx, group, hd, q_stride, out_stride, scale, window, softcap); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(AB_THREADS) NAME##_v4(                        \
        float* out, const float* q, const f16_t* k_cache, const f16_t* v_cache, int T,         \
        int pos0, int max_ctx, int group, int hd, int q_stride, int out_stride, float scale,   \
        int window, float softcap, const int* __restrict__ step) {                             \
        attn_batch_body<NC, BQ, BK, true>(out, q, k_cache, v_cache, T, step_value(step, 1, pos0), \
                                          max_ctx, group, hd, q_stride, out_stride, scale, window, softcap); \
    }

// NC = head_dim / 32 rounded up (columns per lane); tiles sized to stay under 48 KB of
// shared memory; _v4: the float4 variant for head_dim % 4 == 0
CYLLM_ATTN_BATCH(attn_batch_c1, 1, 32, 32)
CYLLM_ATTN_BATCH(attn_batch_c2, 2, 32, 32)
CYLLM_ATTN_BATCH(attn_batch_c4, 4, 32, 32)
CYLLM_ATTN_BATCH(attn_batch_c8, 8, 16, 16)
