// Decode matvec over quantized weights (ggml block formats), int8 activations, FP32 accumulation.
//
// Why this shape (bench/results/cuda_quant_*.md has the numbers):
// * Bandwidth per SM on an H200 is ~36 B/clk, so a q4 matrix streams ~64 weights per clock
//   per SM. FP32 activations cost at least an unpack, a convert and an FMA per weight and
//   4 bytes of x per weight through L1; int8 activations (x quantized per 32 elements, the
//   q8_0 activation format of the CPU kernels: d = amax/127, q = rint(x * 127/amax)) need
//   one dp4a per 4 weights and 1 byte of x per weight.
// * Layout ("lane = row"): the weights are repacked once at upload (backends/cuda/quant.py,
//   repack) so that lane l of a warp owns row 32*T + l of row tile T and a warp's 16-byte
//   loads are 512 contiguous bytes. Each row is a sequence of items (one block for the
//   32-element formats, one superblock for the K-quants); an item is UPI 16-byte units
//   (the block's quant bits; K-quants: the whole block but q6_k's d) plus up to two small
//   planes (4/8-byte and 2-byte fields: scales, 5th bits). In tile T of width
//   W = min(32, d - 32T):
//     unit j of item s of row 32T + l  at  main + 32T*nbi*UPI*16 + ((s*UPI + j)*W + l)*16
//     small-plane field of item s     at  plane + 32T*nbi*E + (s*W + l)*E
//   The bytes are the file's, only reordered: GPU memory = the file's weight bytes.
// * Every lane of a warp works on the same items (of its own row), so the activation
//   reads from shared memory are broadcasts: no bank conflicts, one wavefront per load.
//   A block holds S warps on one row tile; warp w takes items [w*nbi/S, (w+1)*nbi/S) and
//   quantizes only its own slice of x into shared memory (no block barrier before the
//   dots); the S partial sums per row meet in shared memory at the end.
// * Programmatic dependent launch: a kernel lets the next one launch as it starts
//   (pdl_trigger first, before anything that could delay it), and its first two batches of
//   items (weights only) are issued before pdl_wait, so they stream while the previous
//   kernel finishes (pdl_wait_after_loads in common.cuh keeps ptxas from moving them below it).
//
// Variants (MODE as in matvec.cu; every kernel takes the same arguments):
//   qmv_<fmt>                 out  = W x
//   qmv_add_<fmt>             out += W x
//   qmv_gate_up_silu_<fmt>    out  = silu(Wg x) * (Wu x)
//   qmv_gate_up_gelu_<fmt>    out  = gelu_tanh(Wg x) * (Wu x)
//   ..._norm                  the same with the preceding rmsnorm folded in: x is the
//                             un-normed vector, nw the norm weight; x*nw is quantized (the
//                             int8 codes do not depend on the common factor rsqrt(mean(x^2)+eps),
//                             which multiplies the sums at the end); the blocks also write
//                             the normed vector to xn (if not null), as the rmsnorm op would.
//   qmv_experts_<fmt>, qmv_experts_gate_up_{silu,gelu}_<fmt>
//                             a mixture of experts' chosen experts, one launch for all of
//                             them: the plain and gate+up products, each expert's matrices
//                             picked on the device by the router's choice (see the kernel)
//   qmv_xf32_<fmt>            out = W x with FP32 activations (q8_0, q4_0 only: the measured
//                             alternative; arguments out, w, x, d, nbi)
//   qdeq_f16_<fmt>            rows [r0, r0+nrows) dequantized to FP16 (prefill: cuBLAS tiles)
//   qrows_f32_<fmt>           rows ids[i] (or `host` when >= 0) dequantized to FP32 times
//                             scale (embedding lookup of a quantized table)
//   qmm_c4_<fmt>, qmm_c8_<fmt> prefill chunks of a few rows: out (+)= W x for 4 or 8 columns a
//                             block, x prequantized by qx_rows (one kernel for every format)
//   qmma16_<fmt>, qmma32_<fmt> the same on int8 tensor cores (sm_80+), 16 or 32 columns a block
// Formats are compiled on demand: -DQMV_<fmt> (or -DQMV_ALL) selects which are built.
//
// Every kernel, whole names (each also has a _norm twin, e.g. qmv_q4_k_norm):
//   fmt  | out = W x  | out += W x     | silu(Wg x)*(Wu x)        | gelu_tanh(Wg x)*(Wu x)   | prefill tiles  | embedding rows
//   -----+------------+----------------+--------------------------+--------------------------+----------------+---------------
//   q8_0 | qmv_q8_0   | qmv_add_q8_0   | qmv_gate_up_silu_q8_0    | qmv_gate_up_gelu_q8_0    | qdeq_f16_q8_0 | qrows_f32_q8_0
//   q4_0 | qmv_q4_0   | qmv_add_q4_0   | qmv_gate_up_silu_q4_0    | qmv_gate_up_gelu_q4_0    | qdeq_f16_q4_0 | qrows_f32_q4_0
//   q4_1 | qmv_q4_1   | qmv_add_q4_1   | qmv_gate_up_silu_q4_1    | qmv_gate_up_gelu_q4_1    | qdeq_f16_q4_1 | qrows_f32_q4_1
//   q5_0 | qmv_q5_0   | qmv_add_q5_0   | qmv_gate_up_silu_q5_0    | qmv_gate_up_gelu_q5_0    | qdeq_f16_q5_0 | qrows_f32_q5_0
//   q5_1 | qmv_q5_1   | qmv_add_q5_1   | qmv_gate_up_silu_q5_1    | qmv_gate_up_gelu_q5_1    | qdeq_f16_q5_1 | qrows_f32_q5_1
//   q4_k | qmv_q4_k   | qmv_add_q4_k   | qmv_gate_up_silu_q4_k    | qmv_gate_up_gelu_q4_k    | qdeq_f16_q4_k | qrows_f32_q4_k
//   q5_k | qmv_q5_k   | qmv_add_q5_k   | qmv_gate_up_silu_q5_k    | qmv_gate_up_gelu_q5_k    | qdeq_f16_q5_k | qrows_f32_q5_k
//   q6_k | qmv_q6_k   | qmv_add_q6_k   | qmv_gate_up_silu_q6_k    | qmv_gate_up_gelu_q6_k    | qdeq_f16_q6_k | qrows_f32_q6_k
//   plus, per format, qmv_qkv_<fmt> (q, k and v of a layer in one launch) and qmv_qkv_rope_<fmt>
//   (the same with rope and the KV-cache store folded into the tail), each with its _norm
//   twin, qmv_xf32_q8_0 and qmv_xf32_q4_0 (the FP32-activation alternative, measured only),
//   and in a pair module (-DQMV_PAIR_QK, -DQMV_PAIR_V) qmv_qkv_pair and qmv_qkv_rope_pair
//   (each with _norm): q and k of one format, v of another, in one launch; qmm_c4_<fmt>,
//   qmm_c8_<fmt>, qmma16_<fmt> and qmma32_<fmt> (short prefill chunks) and, in every module, qx_rows.
//
// Reference: quant/reference.py (dequantize, quantize_act, the integer dot) through
// backends/numpy_ref.py. Tests: tests/test_cuda_quant.py. Benchmark: bench/bench_cuda_quant.py.
#include "common.cuh"

#define QMV_TILE 32                 // rows per tile = lanes per warp

extern __shared__ uint4 qmv_smem[];

// ---- streamed loads of the small planes (read once per token, like the 16-byte units)
__device__ __forceinline__ u32 ld_stream4(const u32* p) {
#ifdef CYLLM_PLAIN_LOADS
    return *p;
#else
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ uint2 ld_stream8(const uint2* p) {
#ifdef CYLLM_PLAIN_LOADS
    return *p;
#else
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ unsigned short ld_stream2(const unsigned short* p) {
#ifdef CYLLM_PLAIN_LOADS
    return *p;
#else
    unsigned short v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
#endif
}

// 4-way byte dot products: weights as unsigned bytes (0..255) or signed, x signed
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ int dp4a_ss(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {   // i a compile-time constant
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// bits 0..3 of v -> bit 4 of bytes 0..3 (the 5th bit of four 5-bit quants)
__device__ __forceinline__ u32 spread4(u32 v) {
    return ((v & 0xFu) * 0x02040810u) & 0x10101010u;
}

__device__ __forceinline__ int byte_u(u32 v, int k) { return (int)((v >> (8 * k)) & 0xFFu); }
__device__ __forceinline__ int byte_s(u32 v, int k) { return (int)(signed char)((v >> (8 * k)) & 0xFFu); }

// ---- formats ------------------------------------------------------------------------
// UPI: 16-byte units per item; EA: bytes of the 4/8-byte plane (0: none); EB: bytes of the
// 2-byte plane (0: none); IE: elements per item; B: items per lane loaded together (a
// batch). Two batches are in flight (one computed while the next loads): about 260-420
// bytes per lane for one matrix (the 32-element 4/5-bit formats: 144-192, so that rows of
// 4096 get 16 warps per block at under 128 registers; backends/cuda/quant.py LAYOUTS has
// the measurements); gate+up halves B (q4_k/q5_k/q6_k: one batch instead). The prequantized
// kernels of the 32-element 4/5-bit formats go deeper (qmv_tile's batch shape).
struct QF_q8_0 { enum { UPI = 2,  EA = 0, EB = 2, IE = 32,  B = 4 }; };   // units: q[0:16], q[16:32]; B: d
struct QF_q4_0 { enum { UPI = 1,  EA = 0, EB = 2, IE = 32,  B = 4 }; };   // unit: qs; B: d
struct QF_q4_1 { enum { UPI = 1,  EA = 4, EB = 0, IE = 32,  B = 4 }; };   // unit: qs; A: d, m
struct QF_q5_0 { enum { UPI = 1,  EA = 4, EB = 2, IE = 32,  B = 4 }; };   // unit: qs; A: qh; B: d
struct QF_q5_1 { enum { UPI = 1,  EA = 8, EB = 0, IE = 32,  B = 4 }; };   // unit: qs; A: (d, m), qh
struct QF_q4_k { enum { UPI = 9,  EA = 0, EB = 0, IE = 256, B = 1 }; };   // units: d dmin scales, qs x8
struct QF_q5_k { enum { UPI = 11, EA = 0, EB = 0, IE = 256, B = 1 }; };   // + qh x2 before qs
struct QF_q6_k { enum { UPI = 13, EA = 0, EB = 2, IE = 256, B = 1 }; };   // ql x8, qh x4, scales; B: d

template <class F>
struct QItem {
    uint4 u[F::UPI];
    u32 a0, a1;          // plane A (EA = 4: a0; EA = 8: a0, a1)
    unsigned short b;    // plane B
};

// Where one lane's row of one matrix lives, for row tile T.
struct QGeo {
    const unsigned char* main;   // tile base of the unit plane
    const unsigned char* pa;     // tile base of plane A
    const unsigned char* pb;     // tile base of plane B
};

template <class F>
__device__ __forceinline__ QGeo qgeo(const unsigned char* w, int d, int nbi, int tile) {
    const size_t t0 = (size_t)QMV_TILE * tile * nbi;        // items before this tile
    const size_t items = (size_t)d * nbi;
    QGeo g;
    g.main = w + t0 * F::UPI * 16;
    g.pa = w + items * F::UPI * 16 + t0 * F::EA;
    g.pb = w + items * (F::UPI * 16 + F::EA) + t0 * F::EB;
    return g;
}

template <class F>
__device__ __forceinline__ void qload(QItem<F>& it, const QGeo& g, int s, int W, int l) {
    const uint4* p = reinterpret_cast<const uint4*>(g.main) + ((size_t)s * F::UPI * W + l);
#pragma unroll
    for (int j = 0; j < F::UPI; ++j) it.u[j] = ld_stream16(p + (size_t)j * W);
    const size_t f = (size_t)s * W + l;
    if (F::EA == 4) it.a0 = ld_stream4(reinterpret_cast<const u32*>(g.pa) + f);
    if (F::EA == 8) {
        const uint2 v = ld_stream8(reinterpret_cast<const uint2*>(g.pa) + f);
        it.a0 = v.x;
        it.a1 = v.y;
    }
    if (F::EB == 2) it.b = ld_stream2(reinterpret_cast<const unsigned short*>(g.pb) + f);
}

// Same addresses, cached loads (the dequantize kernels read an item from several threads).
template <class F>
__device__ __forceinline__ void qload_cached(QItem<F>& it, const QGeo& g, int s, int W, int l) {
    const uint4* p = reinterpret_cast<const uint4*>(g.main) + ((size_t)s * F::UPI * W + l);
#pragma unroll
    for (int j = 0; j < F::UPI; ++j) it.u[j] = __ldg(p + (size_t)j * W);
    const size_t f = (size_t)s * W + l;
    if (F::EA == 4) it.a0 = __ldg(reinterpret_cast<const u32*>(g.pa) + f);
    if (F::EA == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(g.pa) + f);
        it.a0 = v.x;
        it.a1 = v.y;
    }
    if (F::EB == 2) it.b = __ldg(reinterpret_cast<const unsigned short*>(g.pb) + f);
}

// ---- activations in shared memory -----------------------------------------------------
// x (n floats) -> int8 codes, 16 bytes per unit (xq: n/16 uint4), and one entry per
// 32 elements: {d, d * sum(q), sum(q[0:16]) (int bits), sum(q[16:32]) (int bits)}.
// The codes and d are the CPU kernels' q8_0 activation (reference.quantize_act) bit for bit,
// for every format: the K-quant dots take each 32-entry's d as it comes, so they need not
// share one d per 256 elements as the CPU's q8_K does, and a vector prequantized by the
// matvec that wrote it (qx_produce: 32-row tiles) rounds as one staged here.
// A warp stages elements [e0, e1) (multiples of 32); 8 lanes share one 32-block.
// Returns this lane's share of sum(x^2) (for the folded rmsnorm).
#define QS_CHUNKS 4   // float4 chunks per lane staged together: loads hoisted, shuffle chains interleaved

// K float4 chunks per lane (chunks base + lane + 32k, k < K, those below c1) into the
// staging: one pass of qstage. Adds this lane's share of sum(x^2) to ss.
template <bool NORM, int K>
__device__ __forceinline__ void qstage_pass(const float* x, const float* __restrict__ nw, bool vec,
                                            int base, int c1, u32* __restrict__ xw, float4* __restrict__ xs,
                                            int lane, float& ss)
{
    float4 v[K];
    bool act[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = base + lane + 32 * k;
        act[k] = c < c1;
        v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (act[k]) {
            if (vec) v[k] = ld_act4(reinterpret_cast<const float4*>(x) + c);
            else v[k] = make_float4(ld_act(x + 4 * c), ld_act(x + 4 * c + 1), ld_act(x + 4 * c + 2),
                                    ld_act(x + 4 * c + 3));
        }
    }
    if (NORM) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = base + lane + 32 * k;
            float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (act[k]) {
                if (vec) g = __ldg(reinterpret_cast<const float4*>(nw) + c);
                else g = make_float4(nw[4 * c], nw[4 * c + 1], nw[4 * c + 2], nw[4 * c + 3]);
            }
            ss = fmaf(v[k].x, v[k].x, ss); ss = fmaf(v[k].y, v[k].y, ss);
            ss = fmaf(v[k].z, v[k].z, ss); ss = fmaf(v[k].w, v[k].w, ss);
            v[k].x *= g.x; v[k].y *= g.y; v[k].z *= g.z; v[k].w *= g.w;
        }
    }
    float a[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
        a[k] = fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w)));
#pragma unroll
    for (int off = 1; off < 8; off <<= 1)       // the 8 lanes of a 32-block
#pragma unroll
        for (int k = 0; k < K; ++k) a[k] = fmaxf(a[k], __shfl_xor_sync(FULL_MASK, a[k], off));
    int q[K][4], sm[K];
    float dq[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        dq[k] = a[k] / 127.0f;
        const float id = a[k] > 0.0f ? 127.0f / a[k] : 0.0f;
        q[k][0] = __float2int_rn(v[k].x * id); q[k][1] = __float2int_rn(v[k].y * id);
        q[k][2] = __float2int_rn(v[k].z * id); q[k][3] = __float2int_rn(v[k].w * id);
        sm[k] = q[k][0] + q[k][1] + q[k][2] + q[k][3];
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1)       // lanes 0-3 of a group: q[0:16], 4-7: q[16:32]
#pragma unroll
        for (int k = 0; k < K; ++k) sm[k] += __shfl_xor_sync(FULL_MASK, sm[k], off);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int so = __shfl_xor_sync(FULL_MASK, sm[k], 4);
        const int c = base + lane + 32 * k;
        if (act[k]) {
            xw[c] = ((u32)q[k][0] & 0xFFu) | (((u32)q[k][1] & 0xFFu) << 8)
                  | (((u32)q[k][2] & 0xFFu) << 16) | ((u32)q[k][3] << 24);
            if ((c & 7) == 0)
                xs[c >> 3] = make_float4(dq[k], dq[k] * (float)(sm[k] + so),
                                         __int_as_float(sm[k]), __int_as_float(so));
        }
    }
}

// The same staging from a prequantized x (qx_produce in common.cuh, in the kernel that wrote x):
// qx = n codes | n/32 entries (16 B) | n/32 sums of x^2 (4 B), BLK = 32 for every format
// (the K-quant dots take each 32-entry's d as it comes). A copy of the slice, no arithmetic:
// staging from floats costs each block a read of all of x (and of the norm weight) from the
// L2 and the quantizing -- 1.4-4.4 us after the wait in Llama-2-7B's decode (H100).
// cp.async (sm_80+): global -> shared without registers; .cg: from the L2, where the previous
// kernel wrote it. Older GPUs copy through registers (a load, then a store).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((unsigned)__cvta_generic_to_shared(smem_dst)), "l"(src) : "memory");
#else
    *reinterpret_cast<float4*>(smem_dst) = ld_act4(reinterpret_cast<const float4*>(src));
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
#endif
}

__device__ __forceinline__ float qstage_qx(const unsigned char* qx, int n, int e0, int e1,
                                           u32* __restrict__ xw, float4* __restrict__ xs, int lane)
{
    const uint4* codes = reinterpret_cast<const uint4*>(qx);              // 16 codes each
    const uint4* ent = reinterpret_cast<const uint4*>(qx + n);
    const float* sq = reinterpret_cast<const float*>(qx + n + n / 2);
    uint4* dw = reinterpret_cast<uint4*>(xw);
    for (int i = (e0 >> 4) + lane; i < (e1 >> 4); i += 32) cp_async16(dw + i, codes + i);
    for (int i = (e0 >> 5) + lane; i < (e1 >> 5); i += 32) cp_async16(xs + i, ent + i);
    float ss = 0.0f;
    for (int i = (e0 >> 5) + lane; i < (e1 >> 5); i += 32) ss += ld_act(sq + i);
    cp_async_wait_all();
    return ss;          // the caller's __syncwarp makes the lanes' copies visible to the warp
}

template <bool NORM>
__device__ __forceinline__ float qstage(const float* x, const float* __restrict__ nw,
                                        int e0, int e1, u32* __restrict__ xw, float4* __restrict__ xs,
                                        int lane)
{
    float ss = 0.0f;
    const bool vec = ((reinterpret_cast<size_t>(x) | (NORM ? reinterpret_cast<size_t>(nw) : 0)) & 15) == 0;
    const int c1 = e1 >> 2;
    int base = e0 >> 2;
    for (; base + 32 * QS_CHUNKS <= c1; base += 32 * QS_CHUNKS)     // uniform: shuffles see every lane
        qstage_pass<NORM, QS_CHUNKS>(x, nw, vec, base, c1, xw, xs, lane, ss);
    // The rest in one pass no wider than it needs. Short rows leave a warp at most one
    // chunk a lane (SmolLM2's rows of 576: 64-96 elements, 16-24 chunks a warp), 16-warp
    // blocks on rows of 4096 two, and in these one-wave kernels every issued instruction is
    // on the critical path: ncu counted ~1000 a warp there.
    if (base + 32 >= c1) {
        if (base < c1) qstage_pass<NORM, 1>(x, nw, vec, base, c1, xw, xs, lane, ss);
    } else if (base + 64 >= c1) {
        qstage_pass<NORM, 2>(x, nw, vec, base, c1, xw, xs, lane, ss);
    } else {
        qstage_pass<NORM, QS_CHUNKS>(x, nw, vec, base, c1, xw, xs, lane, ss);
    }
    return ss;
}

// ---- per-format dot of one item with its activations ----------------------------------
// xq: the item's codes (IE/16 units), xs: its 32-block entries.
__device__ __forceinline__ float qdot(const QItem<QF_q8_0>& it, const uint4* xq, const float4* xs) {
    const uint4 xa = xq[0], xb = xq[1];
    int i = 0;
    i = dp4a_ss(it.u[0].x, xa.x, i); i = dp4a_ss(it.u[0].y, xa.y, i);
    i = dp4a_ss(it.u[0].z, xa.z, i); i = dp4a_ss(it.u[0].w, xa.w, i);
    i = dp4a_ss(it.u[1].x, xb.x, i); i = dp4a_ss(it.u[1].y, xb.y, i);
    i = dp4a_ss(it.u[1].z, xb.z, i); i = dp4a_ss(it.u[1].w, xb.w, i);
    return h2f(it.b) * (xs[0].x * (float)i);
}

// low nibbles: elements 0..15 (x unit 0); high nibbles, kept in place (16*q, still one byte):
// elements 16..31 (x unit 1), divided by 16 after the sum (exact)
__device__ __forceinline__ int dot_nib32(const uint4 q, const uint4 xa, const uint4 xb) {
    int lo = 0, hi = 0;
    lo = dp4a_us(q.x & 0x0F0F0F0Fu, xa.x, lo); hi = dp4a_us(q.x & 0xF0F0F0F0u, xb.x, hi);
    lo = dp4a_us(q.y & 0x0F0F0F0Fu, xa.y, lo); hi = dp4a_us(q.y & 0xF0F0F0F0u, xb.y, hi);
    lo = dp4a_us(q.z & 0x0F0F0F0Fu, xa.z, lo); hi = dp4a_us(q.z & 0xF0F0F0F0u, xb.z, hi);
    lo = dp4a_us(q.w & 0x0F0F0F0Fu, xa.w, lo); hi = dp4a_us(q.w & 0xF0F0F0F0u, xb.w, hi);
    return lo + (hi >> 4);
}

__device__ __forceinline__ float qdot(const QItem<QF_q4_0>& it, const uint4* xq, const float4* xs) {
    const int i = dot_nib32(it.u[0], xq[0], xq[1]);
    const float4 e = xs[0];
    return h2f(it.b) * fmaf(e.x, (float)i, -8.0f * e.y);      // sum (q-8) x
}

__device__ __forceinline__ float qdot(const QItem<QF_q4_1>& it, const uint4* xq, const float4* xs) {
    const int i = dot_nib32(it.u[0], xq[0], xq[1]);
    const float4 e = xs[0];
    const float2 dm = h2x2f(it.a0);
    return fmaf(dm.x, e.x * (float)i, dm.y * e.y);            // sum (d q + m) x
}

// 5-bit quants: nibbles | 5th bit from qh (bit j for element j)
__device__ __forceinline__ int dot_q5(const uint4 q, u32 qh, const uint4 xa, const uint4 xb) {
    int i = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const u32 w = word(q, t);
        i = dp4a_us((w & 0x0F0F0F0Fu) | spread4(qh >> (4 * t)), word(xa, t), i);
        i = dp4a_us(((w >> 4) & 0x0F0F0F0Fu) | spread4(qh >> (16 + 4 * t)), word(xb, t), i);
    }
    return i;
}

__device__ __forceinline__ float qdot(const QItem<QF_q5_0>& it, const uint4* xq, const float4* xs) {
    const int i = dot_q5(it.u[0], it.a0, xq[0], xq[1]);
    const float4 e = xs[0];
    return h2f(it.b) * fmaf(e.x, (float)i, -16.0f * e.y);     // sum (q-16) x
}

__device__ __forceinline__ float qdot(const QItem<QF_q5_1>& it, const uint4* xq, const float4* xs) {
    const int i = dot_q5(it.u[0], it.a1, xq[0], xq[1]);
    const float4 e = xs[0];
    const float2 dm = h2x2f(it.a0);
    return fmaf(dm.x, e.x * (float)i, dm.y * e.y);
}

// q4_k/q5_k packed 6-bit scales (bytes 4..15 of the block: s0, s1, s2) -> sub-block scales
// and mins as bytes: sc[0..3], sc[4..7], m[0..3], m[4..7]
__device__ __forceinline__ void k_scales(const uint4 meta, u32& scA, u32& scB, u32& mA, u32& mB) {
    const u32 s0 = meta.y, s1 = meta.z, s2 = meta.w;
    scA = s0 & 0x3F3F3F3Fu;
    mA = s1 & 0x3F3F3F3Fu;
    scB = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
    mB = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
}

__device__ __forceinline__ float qdot(const QItem<QF_q4_k>& it, const uint4* xq, const float4* xs) {
    u32 scA, scB, mA, mB;
    k_scales(it.u[0], scA, scB, mA, mB);
    float ad = 0.0f, am = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {          // 64 elements: sub-block 2c (low nibbles), 2c+1 (high)
        const uint4 q0 = it.u[1 + 2 * c], q1 = it.u[2 + 2 * c];
        int lo = 0, hi = 0;
        const uint4 xa = xq[4 * c], xb = xq[4 * c + 1], xc = xq[4 * c + 2], xd = xq[4 * c + 3];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            lo = dp4a_us(word(q0, t) & 0x0F0F0F0Fu, word(xa, t), lo);
            lo = dp4a_us(word(q1, t) & 0x0F0F0F0Fu, word(xb, t), lo);
            hi = dp4a_us(word(q0, t) & 0xF0F0F0F0u, word(xc, t), hi);
            hi = dp4a_us(word(q1, t) & 0xF0F0F0F0u, word(xd, t), hi);
        }
        const u32 sc = c < 2 ? scA : scB, mm = c < 2 ? mA : mB;
        const int k0 = (2 * c) & 3;
        const float4 e0 = xs[2 * c], e1 = xs[2 * c + 1];
        ad = fmaf(e0.x, (float)(byte_u(sc, k0) * lo), ad);
        ad = fmaf(e1.x, (float)(byte_u(sc, k0 + 1) * (hi >> 4)), ad);
        am = fmaf(e0.y, (float)byte_u(mm, k0), am);
        am = fmaf(e1.y, (float)byte_u(mm, k0 + 1), am);
    }
    const float2 dd = h2x2f(it.u[0].x);                    // d, dmin
    return fmaf(dd.x, ad, -dd.y * am);
}

__device__ __forceinline__ float qdot(const QItem<QF_q5_k>& it, const uint4* xq, const float4* xs) {
    u32 scA, scB, mA, mB;
    k_scales(it.u[0], scA, scB, mA, mB);
    float ad = 0.0f, am = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const uint4 q0 = it.u[3 + 2 * c], q1 = it.u[4 + 2 * c];
        int lo = 0, hi = 0;
        const uint4 xa = xq[4 * c], xb = xq[4 * c + 1], xc = xq[4 * c + 2], xd = xq[4 * c + 3];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 h0 = word(it.u[1], t), h1 = word(it.u[2], t);   // 5th bits of elements l, l+16
            const u32 w0 = word(q0, t), w1 = word(q1, t);
            lo = dp4a_us((w0 & 0x0F0F0F0Fu) | (((h0 >> (2 * c)) & 0x01010101u) << 4), word(xa, t), lo);
            lo = dp4a_us((w1 & 0x0F0F0F0Fu) | (((h1 >> (2 * c)) & 0x01010101u) << 4), word(xb, t), lo);
            hi = dp4a_us(((w0 >> 4) & 0x0F0F0F0Fu) | (((h0 >> (2 * c + 1)) & 0x01010101u) << 4), word(xc, t), hi);
            hi = dp4a_us(((w1 >> 4) & 0x0F0F0F0Fu) | (((h1 >> (2 * c + 1)) & 0x01010101u) << 4), word(xd, t), hi);
        }
        const u32 sc = c < 2 ? scA : scB, mm = c < 2 ? mA : mB;
        const int k0 = (2 * c) & 3;
        const float4 e0 = xs[2 * c], e1 = xs[2 * c + 1];
        ad = fmaf(e0.x, (float)(byte_u(sc, k0) * lo), ad);
        ad = fmaf(e1.x, (float)(byte_u(sc, k0 + 1) * hi), ad);
        am = fmaf(e0.y, (float)byte_u(mm, k0), am);
        am = fmaf(e1.y, (float)byte_u(mm, k0 + 1), am);
    }
    const float2 dd = h2x2f(it.u[0].x);
    return fmaf(dd.x, ad, -dd.y * am);
}

// q6_k: element 128h + 32k + l (k = 2*nibble + g): low 4 bits from ql byte 64h + 32g + l
// (nibble), high 2 bits from qh byte 32h + l (bits 2k, 2k+1); scale per 16 elements
// (j = 8h + 2k + l/16, signed); w = d * sc_j * (q - 32).
__device__ __forceinline__ float qdot(const QItem<QF_q6_k>& it, const uint4* xq, const float4* xs) {
    float ad = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const uint4 l0 = it.u[4 * h + 2 * g], l1 = it.u[4 * h + 2 * g + 1];
            const uint4 h0 = it.u[8 + 2 * h], h1 = it.u[9 + 2 * h];
            const int ka = g, kb = g + 2;          // x blocks 4h + ka, 4h + kb
            const uint4 xa0 = xq[2 * (4 * h + ka)], xa1 = xq[2 * (4 * h + ka) + 1];
            const uint4 xb0 = xq[2 * (4 * h + kb)], xb1 = xq[2 * (4 * h + kb) + 1];
            int a0 = 0, a1 = 0, b0 = 0, b1 = 0;    // (k, 16-element half)
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const u32 wl0 = word(l0, t), wl1 = word(l1, t), wh0 = word(h0, t), wh1 = word(h1, t);
                a0 = dp4a_us((wl0 & 0x0F0F0F0Fu) | (((wh0 >> (2 * ka)) & 0x03030303u) << 4), word(xa0, t), a0);
                a1 = dp4a_us((wl1 & 0x0F0F0F0Fu) | (((wh1 >> (2 * ka)) & 0x03030303u) << 4), word(xa1, t), a1);
                b0 = dp4a_us(((wl0 >> 4) & 0x0F0F0F0Fu) | (((wh0 >> (2 * kb)) & 0x03030303u) << 4), word(xb0, t), b0);
                b1 = dp4a_us(((wl1 >> 4) & 0x0F0F0F0Fu) | (((wh1 >> (2 * kb)) & 0x03030303u) << 4), word(xb1, t), b1);
            }
            const float4 ea = xs[4 * h + ka], eb = xs[4 * h + kb];
            const int ja = 8 * h + 2 * ka, jb = 8 * h + 2 * kb;     // scale index of the first half
            const u32 swa = word(it.u[12], ja >> 2), swb = word(it.u[12], jb >> 2);
            const int ia = byte_s(swa, ja & 3) * (a0 - 32 * __float_as_int(ea.z))
                         + byte_s(swa, (ja & 3) + 1) * (a1 - 32 * __float_as_int(ea.w));
            const int ib = byte_s(swb, jb & 3) * (b0 - 32 * __float_as_int(eb.z))
                         + byte_s(swb, (jb & 3) + 1) * (b1 - 32 * __float_as_int(eb.w));
            ad = fmaf(ea.x, (float)ia, ad);
            ad = fmaf(eb.x, (float)ib, ad);
        }
    return h2f(it.b) * ad;
}

// ---- the matvec -------------------------------------------------------------------------
#define QMV_MAX_WARPS 16    // warps per block (backends/cuda/quant.py MAX_WARPS)

// One row tile by S warps (warp: 0..S-1 of them), staging in smem (qmv_smem_bytes(n, S)).
// Returns the tile's row 32*tile + lane in warp 0 (lane < the tile's width); the other
// warps' values are meaningless. Every thread of the block must call it (block barrier).
template <class F, int MODE, bool NORM, bool QX>
__device__ __forceinline__ float qmv_tile(
    const unsigned char* __restrict__ w0, const unsigned char* __restrict__ w1,
    const float* x, int d, int nbi,
    const float* __restrict__ nw, float eps, float* __restrict__ xn, int tile,
    int warp, int S, uint4* __restrict__ smem, const unsigned char* qx)
{
    constexpr int NM = (MODE >= 2) ? 2 : 1;
    // Batch shape: B items a batch (of each matrix), P batches in flight. The prequantized
    // kernels of the 16-byte-item formats (q4_0, q4_1, q5_0, q5_1) hold the fewest bytes a lane
    // and have registers to spare, so they keep more in flight: three batches for one matrix
    // (192 B a lane), and for gate+up a whole batch a matrix where the item's side data is at
    // most 4 bytes (q4_0, q4_1: 256 B; q5's qh would spill). Llama-2-7B Q4_0 decode on an H100,
    // 564.9 -> 608.8 tok/s at depth 0, 377.7 -> 389.2 at 4096 (bench/results/
    // cuda_quant_model_h100.md, twenty-first session). The staged kernels keep two batches:
    // the same shapes spill there. quant.py's _items_in_flight mirrors this.
    constexpr bool WIDE = QX && F::UPI == 1;
    constexpr int B = (NM == 2 && WIDE && F::EA + F::EB <= 4) ? F::B : ((F::B / NM) > 0 ? F::B / NM : 1);
    constexpr int P = (NM == 2 && F::B == 1) ? 1 : (NM == 1 && WIDE) ? 3 : 2;
    const int lane = threadIdx.x & 31;
    const int W = min(QMV_TILE, d - QMV_TILE * tile);
    const bool live = lane < W;
    const int s0 = (int)(((long long)nbi * warp) / S);
    const int s1 = (int)(((long long)nbi * (warp + 1)) / S);
    const int n = nbi * F::IE;

    QGeo g[NM];
    g[0] = qgeo<F>(w0, d, nbi, tile);
    if (NM == 2) g[NM - 1] = qgeo<F>(w1, d, nbi, tile);

    // P batches go out before pdl_wait: weights never depend on the previous kernel.
    // Zeroed first: the dots below run on every slot of a batch that holds an item of the
    // slice (branch-free, so the compiler can schedule the shared-memory loads early) and
    // slots past the slice are discarded. A batch with none is skipped whole: short rows
    // leave most slots empty (SmolLM2: 2-3 items a warp in 8 slots), and a branch per slot
    // instead cost rows of 4096 2-3% (bench/results/cuda_quant_model_h100.md).
    QItem<F> it[P][B][NM];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int u = 0; u < B; ++u)
#pragma unroll
            for (int m = 0; m < NM; ++m) {
#pragma unroll
                for (int j = 0; j < F::UPI; ++j) it[p][u][m].u[j] = make_uint4(0u, 0u, 0u, 0u);
                it[p][u][m].a0 = it[p][u][m].a1 = 0u;
                it[p][u][m].b = 0;
                if (live && s0 + p * B + u < s1) qload<F>(it[p][u][m], g[m], s0 + p * B + u, W, lane);
            }
    pdl_wait_after_loads(nbi);

    // the folded norm's output: this thread's first element is loaded now, with the staging
    // loads, so the tail only multiplies and stores
    const int jn = blockIdx.x * blockDim.x + threadIdx.x;
    float xr = 0.0f, wr = 0.0f;
    if (NORM && xn != nullptr && jn < n) {
        xr = ld_act(x + jn);
        wr = __ldg(nw + jn);
    }

    u32* xw = reinterpret_cast<u32*>(smem);
    float4* xs = reinterpret_cast<float4*>(xw + n / 4);
    float* red = reinterpret_cast<float*>(xs + n / 32);      // NM*S*32 partial sums, then S sums of x^2
    // QX: the kernels named ..._qx, whose x came prequantized (a variant of its own: both
    // stagings in one body cost the K-quants' gate+up 60 registers)
    const float ss = QX ? qstage_qx(qx, n, s0 * F::IE, s1 * F::IE, xw, xs, lane)
                        : qstage<NORM>(x, nw, s0 * F::IE, s1 * F::IE, xw, xs, lane);
    __syncwarp();
    TRACE_MARK(1);                                // bench/trace_cuda_decode.py: warp 0's x staged

    float acc[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] = 0.0f;
    if (B > 1 && s1 - s0 <= B) {
        // the whole slice sits in the first batch (short rows: SmolLM2's 2-3 items a warp of
        // q5_0): a dot per item, none on empty slots. A path of its own, because the same
        // guard in the loop below cost rows of 4096 2-3%; not for batches of one item (the
        // K-quants), where the loop already does just this and the extra path cost the 7B
        // shape's Q4_K_M decode 8% on an H100 (bench/results/cuda_quant_model_h100.md).
#pragma unroll
        for (int u = 0; u < B; ++u) {
            const int s = s0 + u;
            if (s >= s1) break;                                   // uniform
            const uint4* xq = reinterpret_cast<const uint4*>(xw) + s * (F::IE / 16);
            const float4* xe = xs + s * (F::IE / 32);
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                const float v = qdot(it[0][u][m], xq, xe);
                acc[m] += live ? v : 0.0f;
            }
        }
    } else
    for (int sb = s0; sb < s1; sb += P * B) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (sb + p * B >= s1) break;      // no item of this warp in this batch (uniform)
#pragma unroll
            for (int u = 0; u < B; ++u) {
                const int s = sb + p * B + u;
                const bool ok = live && s < s1;
                const int sx = min(s, s1 - 1);                    // in this warp's staged slice
                const uint4* xq = reinterpret_cast<const uint4*>(xw) + sx * (F::IE / 16);
                const float4* xe = xs + sx * (F::IE / 32);
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    const float v = qdot(it[p][u][m], xq, xe);
                    acc[m] += ok ? v : 0.0f;
                }
            }
            // refill this batch's slots with the batch after the next
            const int nb = sb + (p + P) * B;
            if (nb < s1) {
#pragma unroll
                for (int u = 0; u < B; ++u)
                    if (live && nb + u < s1)
#pragma unroll
                        for (int m = 0; m < NM; ++m) qload<F>(it[p][u][m], g[m], nb + u, W, lane);
            }
        }
    }

#pragma unroll
    for (int m = 0; m < NM; ++m) red[(m * S + warp) * 32 + lane] = acc[m];
    if (NORM) {
        const float t = warp_sum(ss);
        if (lane == 0) red[NM * S * 32 + warp] = t;
    }
    TRACE_MARK(2);                                // warp 0's dots done
    __syncthreads();
    TRACE_MARK(3);                                // every warp's
    float inv = 1.0f;
    if (NORM) {
        // rmsnorm folded in: W (x * w * inv) = inv * (W (x * w)); the S slices cover all of x
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < QMV_MAX_WARPS; ++w)
            if (w < S) t += red[NM * S * 32 + w];
        inv = rsqrtf(t / (float)n + eps);
    }
    float res = 0.0f;
    if (warp == 0 && live) {
        float r[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            float t = 0.0f;
#pragma unroll
            for (int w = 0; w < QMV_MAX_WARPS; ++w)
                if (w < S) t += red[(m * S + w) * 32 + lane];
            r[m] = t * inv;
        }
        res = (MODE == 2) ? silu_f(r[0]) * r[NM - 1]
            : (MODE == 3) ? gelu_tanh_f(r[0]) * r[NM - 1] : r[0];
    }
    TRACE_MARK(4);                                // warp 0's row sums
    if (NORM && xn != nullptr) {
        // the normed vector is written too, so the rmsnorm op's output exists as asked; every
        // block knows inv, so the blocks share the writes (one block alone would add a chain
        // of dependent loads to the kernel's tail)
        const int step = gridDim.x * blockDim.x;
        if (jn < n) xn[jn] = xr * inv * wr;
        for (int j = jn + step; j < n; j += step) xn[j] = ld_act(x + j) * inv * nw[j];   // small grids only
    }
    return res;
}

// Bytes of shared memory qmv_tile stages in (the host's _shared_bytes, rounded to 16).
__host__ __device__ constexpr int qmv_smem_bytes(int n, int S, int NM) {
    return (n + 16 * (n / 32) + 4 * (NM * S * QMV_TILE + S) + 15) & ~15;
}

template <class F, int MODE, bool NORM, bool QX>
__device__ __forceinline__ void qmv_body(
    float* __restrict__ out, const unsigned char* __restrict__ w0, const unsigned char* __restrict__ w1,
    const float* x, int d, int nbi,
    const float* __restrict__ nw, float eps, float* __restrict__ xn, int tile,
    const unsigned char* qx, unsigned char* __restrict__ qxo, const float* __restrict__ qnw)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = QMV_TILE * tile + lane;
    pdl_trigger();      // the next kernel may start loading its weights now
    // qxo: this launch also writes its output prequantized for the next matvec (qx_produce;
    // the host passes it only where d is whole tiles); its norm weight is constant, read now
    const float nwr = (qxo != nullptr && qnw != nullptr && warp == 0) ? __ldg(qnw + row) : 1.0f;
    const float res = qmv_tile<F, MODE, NORM, QX>(w0, w1, x, d, nbi, nw, eps, xn, tile, warp, blockDim.x >> 5, qmv_smem,
                                              qx);
    if (warp == 0) {
        float v = res;
        if (lane < min(QMV_TILE, d - QMV_TILE * tile)) {
            if (MODE == 1) v += out[row];
            out[row] = v;
        }
        if (qxo != nullptr) qx_produce(qxo, d, row, v, nwr, lane);      // uniform
    }
}

// q, k and v of one layer with rope and the cache store folded into the tail (decode):
// out = [rope(Wq x) | rope(Wk x) | Wv x] and row pos of k_cache / v_cache = the k and v
// parts (f16), the results of the qkv matvec followed by rope_store. A block computes the
// two row tiles that hold the halves of 32 rope pairs -- rows j and j + hd/2 of one head
// (j = 32p + lane) -- with S warps each (warps [0, S) the first tile, [S, 2S) the second,
// each with its own staging; the blocks of v pair their tiles the same way and do not
// rotate). Needs hd % 64 == 0, dq and dk multiples of hd, every dimension rotated. The
// rotation table is read before pdl_wait (it is constant; pos comes from the step buffer,
// written before the graph runs, or the host's argument in eager calls). FV: v's format
// (qmv_qkv_rope_pair; FV = F otherwise, and the v branch compiles away), nbi_v its items.
template <class A, class B> struct QSame { enum { value = 0 }; };
template <class A> struct QSame<A, A> { enum { value = 1 }; };

template <class F, bool NORM, bool QX, class FV = F>
__device__ __forceinline__ void qkv_rope_body(
    float* __restrict__ out, const unsigned char* __restrict__ wq, const unsigned char* __restrict__ wk,
    const unsigned char* __restrict__ wv, const float* x, int dq, int dk, int nbi, int nbi_v,
    const float* __restrict__ nw, float eps, float* __restrict__ xn,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache,
    const int* __restrict__ step, int pos_host, int n_pos, int max_ctx, int hd, const unsigned char* qx)
{
    pdl_trigger();      // the next kernel may start loading its weights now
    // which pair of tiles: recomputed from blockIdx where needed, so nothing but the matvec's
    // own state lives in registers across it
    const int half = hd >> 1, ppt = half / QMV_TILE;            // tile pairs per head
    const int pq = dq / (2 * QMV_TILE), pk = dk / (2 * QMV_TILE);
    const int seg = blockIdx.x < pq ? 0 : blockIdx.x < pq + pk ? 1 : 2;   // q, k or v
    const int pb = blockIdx.x - (seg == 0 ? 0 : pq + (seg - 1) * pk);
    const int head = pb / ppt, j = QMV_TILE * (pb - head * ppt) + (threadIdx.x & 31);
    const int S = blockDim.x >> 6;                              // warps per tile
    const int grp = (threadIdx.x >> 5) >= S ? 1 : 0;
    const int warp = (threadIdx.x >> 5) - grp * S;
    const int lane = threadIdx.x & 31;
    const int n = nbi * F::IE;
    const int g_units = qmv_smem_bytes(n, S, 1) / 16;
    // after both groups' staging: the second tile's rows, cos, sin, the position (or -1)
    float* tail = reinterpret_cast<float*>(qmv_smem + 2 * g_units);
    if (grp == 0 && warp == 0) {        // read before pdl_wait: the table is constant, pos comes
        const int pos = step_value(step, 1, pos_host);      // from the step buffer, set before the graph
        const bool valid = pos >= 0 && pos < n_pos && pos < max_ctx;   // else no rotation, no store (as rope_store)
        tail[32 + lane] = valid && seg < 2 ? cos_t[(size_t)pos * half + j] : 1.0f;
        tail[64 + lane] = valid && seg < 2 ? sin_t[(size_t)pos * half + j] : 0.0f;
        reinterpret_cast<int*>(tail)[96 + lane] = valid ? pos : -1;
    }
    const unsigned char* w = seg == 0 ? wq : seg == 1 ? wk : wv;
    const int tile = (head * hd + grp * half) / QMV_TILE + (pb - head * ppt);
    const float r = (QSame<F, FV>::value || seg < 2)
        ? qmv_tile<F, 0, NORM, QX>(w, w, x, seg ? dk : dq, nbi, nw, eps, xn, tile, warp, S, qmv_smem + grp * g_units, qx)
        : qmv_tile<FV, 0, NORM, QX>(w, w, x, dk, nbi_v, nw, eps, xn, tile, warp, S, qmv_smem + grp * g_units, qx);
    if (grp == 1 && warp == 0) tail[lane] = r;
    __syncthreads();
    if (threadIdx.x < 32) {             // group 0's warp 0: both halves of its 32 pairs
        const int sg = blockIdx.x < pq ? 0 : blockIdx.x < pq + pk ? 1 : 2;
        const int p2 = blockIdx.x - (sg == 0 ? 0 : pq + (sg - 1) * pk);
        const int h2 = p2 / ppt, j2 = QMV_TILE * (p2 - h2 * ppt) + lane;
        const int pos = reinterpret_cast<const int*>(tail)[96 + lane];
        float y1 = r, y2 = tail[lane];
        if (sg < 2 && pos >= 0) {       // v, and q/k at a position rope_store would refuse, as they are
            rope_pair(y1, y2, tail[32 + lane], tail[64 + lane], y1, y2);
        }
        float* o = out + (sg == 0 ? 0 : dq + (sg - 1) * dk) + (size_t)h2 * hd + j2;
        o[0] = y1;
        o[half] = y2;
        if (sg > 0 && pos >= 0) {
            f16_t* cache = sg == 1 ? k_cache : v_cache;
            const size_t row = ((size_t)h2 * max_ctx + pos) * hd + j2;
            cache[row] = f2h(y1);
            cache[row + half] = f2h(y2);
        }
    }
}

// ---- dequantize: one 32-element group of an item -> 32 values ---------------------------
// q: 8 words of 4 byte-codes (elements 4i..4i+3), signed (q8_0) or unsigned; value of
// element e = a[e/16] * q_e + b[e/16].
template <class F> struct QSigned { enum { value = 0 }; };
template <> struct QSigned<QF_q8_0> { enum { value = 1 }; };

__device__ __forceinline__ void qgroup(const QItem<QF_q8_0>& it, int, u32 q[8], float a[2], float b[2]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) { q[t] = word(it.u[0], t); q[4 + t] = word(it.u[1], t); }
    a[0] = a[1] = h2f(it.b);
    b[0] = b[1] = 0.0f;
}

__device__ __forceinline__ void qgroup(const QItem<QF_q4_0>& it, int, u32 q[8], float a[2], float b[2]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = word(it.u[0], t) & 0x0F0F0F0Fu;
        q[4 + t] = (word(it.u[0], t) >> 4) & 0x0F0F0F0Fu;
    }
    a[0] = a[1] = h2f(it.b);
    b[0] = b[1] = -8.0f * a[0];
}

__device__ __forceinline__ void qgroup(const QItem<QF_q4_1>& it, int, u32 q[8], float a[2], float b[2]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = word(it.u[0], t) & 0x0F0F0F0Fu;
        q[4 + t] = (word(it.u[0], t) >> 4) & 0x0F0F0F0Fu;
    }
    const float2 dm = h2x2f(it.a0);
    a[0] = a[1] = dm.x;
    b[0] = b[1] = dm.y;
}

__device__ __forceinline__ void q5_words(const uint4 qs, u32 qh, u32 q[8]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = (word(qs, t) & 0x0F0F0F0Fu) | spread4(qh >> (4 * t));
        q[4 + t] = ((word(qs, t) >> 4) & 0x0F0F0F0Fu) | spread4(qh >> (16 + 4 * t));
    }
}

__device__ __forceinline__ void qgroup(const QItem<QF_q5_0>& it, int, u32 q[8], float a[2], float b[2]) {
    q5_words(it.u[0], it.a0, q);
    a[0] = a[1] = h2f(it.b);
    b[0] = b[1] = -16.0f * a[0];
}

__device__ __forceinline__ void qgroup(const QItem<QF_q5_1>& it, int, u32 q[8], float a[2], float b[2]) {
    q5_words(it.u[0], it.a1, q);
    const float2 dm = h2x2f(it.a0);
    a[0] = a[1] = dm.x;
    b[0] = b[1] = dm.y;
}

// k: sub-block 0..7 (run-time)
__device__ __forceinline__ void k_scale_min(const uint4 meta, int k, float& a, float& b) {
    u32 scA, scB, mA, mB;
    k_scales(meta, scA, scB, mA, mB);
    const u32 sc = k < 4 ? scA : scB, mm = k < 4 ? mA : mB;
    const float2 dd = h2x2f(meta.x);
    a = dd.x * (float)((sc >> (8 * (k & 3))) & 0xFFu);
    b = -dd.y * (float)((mm >> (8 * (k & 3))) & 0xFFu);
}

__device__ __forceinline__ void qgroup(const QItem<QF_q4_k>& it, int k, u32 q[8], float a[2], float b[2]) {
    const int c = k >> 1, sh = 4 * (k & 1);
    uint4 q0 = it.u[1], q1 = it.u[2];
#pragma unroll
    for (int cc = 1; cc < 4; ++cc)
        if (c == cc) { q0 = it.u[1 + 2 * cc]; q1 = it.u[2 + 2 * cc]; }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = (word(q0, t) >> sh) & 0x0F0F0F0Fu;
        q[4 + t] = (word(q1, t) >> sh) & 0x0F0F0F0Fu;
    }
    k_scale_min(it.u[0], k, a[0], b[0]);
    a[1] = a[0];
    b[1] = b[0];
}

__device__ __forceinline__ void qgroup(const QItem<QF_q5_k>& it, int k, u32 q[8], float a[2], float b[2]) {
    const int c = k >> 1, sh = 4 * (k & 1);
    uint4 q0 = it.u[3], q1 = it.u[4];
#pragma unroll
    for (int cc = 1; cc < 4; ++cc)
        if (c == cc) { q0 = it.u[3 + 2 * cc]; q1 = it.u[4 + 2 * cc]; }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = ((word(q0, t) >> sh) & 0x0F0F0F0Fu) | (((word(it.u[1], t) >> k) & 0x01010101u) << 4);
        q[4 + t] = ((word(q1, t) >> sh) & 0x0F0F0F0Fu) | (((word(it.u[2], t) >> k) & 0x01010101u) << 4);
    }
    k_scale_min(it.u[0], k, a[0], b[0]);
    a[1] = a[0];
    b[1] = b[0];
}

__device__ __forceinline__ void qgroup(const QItem<QF_q6_k>& it, int k, u32 q[8], float a[2], float b[2]) {
    const int h = k >> 2, kk = k & 3, g = kk & 1, sh = 4 * (kk >> 1);
    uint4 l0 = it.u[0], l1 = it.u[1], h0 = it.u[8], h1 = it.u[9];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int gg = 0; gg < 2; ++gg)
            if (h == hh && g == gg) { l0 = it.u[4 * hh + 2 * gg]; l1 = it.u[4 * hh + 2 * gg + 1]; }
    if (h == 1) { h0 = it.u[10]; h1 = it.u[11]; }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        q[t] = ((word(l0, t) >> sh) & 0x0F0F0F0Fu) | (((word(h0, t) >> (2 * kk)) & 0x03030303u) << 4);
        q[4 + t] = ((word(l1, t) >> sh) & 0x0F0F0F0Fu) | (((word(h1, t) >> (2 * kk)) & 0x03030303u) << 4);
    }
    const int j = 8 * h + 2 * kk;
    const uint4 sv = it.u[12];
    u32 sw = sv.x;
    if ((j >> 2) == 1) sw = sv.y;
    if ((j >> 2) == 2) sw = sv.z;
    if ((j >> 2) == 3) sw = sv.w;
    const float d = h2f(it.b);
    a[0] = d * (float)byte_s(sw, j & 3);
    a[1] = d * (float)byte_s(sw, (j & 3) + 1);
    b[0] = -32.0f * a[0];
    b[1] = -32.0f * a[1];
}

template <class F>
__device__ __forceinline__ void qgroup_values(const unsigned char* w, int d, int nbi, int row, int grp, float v[32]) {
    const int tile = row / QMV_TILE, l = row % QMV_TILE;
    const int W = min(QMV_TILE, d - QMV_TILE * tile);
    const int s = grp / (F::IE / 32), k = grp % (F::IE / 32);
    QItem<F> it;
    qload_cached<F>(it, qgeo<F>(w, d, nbi, tile), s, W, l);
    u32 q[8];
    float a[2], b[2];
    qgroup(it, k, q, a, b);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const u32 wq = q[i >> 2];
        const int c = QSigned<F>::value ? byte_s(wq, i & 3) : byte_u(wq, i & 3);
        v[i] = fmaf(a[i >> 4], (float)c, b[i >> 4]);
    }
}

// rows [r0, r0 + nrows) -> out (nrows, n) FP16 (r0 a multiple of QMV_TILE); one thread
// per 32 elements. Lane l of a warp takes row l of a tile, as the matvec does: the tile
// stores each unit of its 32 rows side by side, so a warp's loads are one contiguous run
// (consecutive threads on consecutive groups of one row read 16 bytes every 512 and ran
// at about half the bandwidth); each thread still writes 64 contiguous bytes of its row.
template <class F>
__device__ __forceinline__ void qdeq_f16_body(f16_t* __restrict__ out, const unsigned char* __restrict__ w,
                                              int d, int nbi, int r0, int nrows)
{
    const int groups = nbi * (F::IE / 32);
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long tiles = (nrows + QMV_TILE - 1) / QMV_TILE;
    if (idx >= tiles * groups * QMV_TILE) return;
    const int l = (int)(idx % QMV_TILE);
    const long long rest = idx / QMV_TILE;
    const int grp = (int)(rest % groups);
    const int r = (int)(rest / groups) * QMV_TILE + l;
    if (r >= nrows) return;
    float v[32];
    qgroup_values<F>(w, d, nbi, r0 + r, grp, v);
    uint4* o = reinterpret_cast<uint4*>(out + (size_t)r * groups * 32 + (size_t)grp * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 p;
        p.x = (u32)f2h(v[8 * i + 0]) | ((u32)f2h(v[8 * i + 1]) << 16);
        p.y = (u32)f2h(v[8 * i + 2]) | ((u32)f2h(v[8 * i + 3]) << 16);
        p.z = (u32)f2h(v[8 * i + 4]) | ((u32)f2h(v[8 * i + 5]) << 16);
        p.w = (u32)f2h(v[8 * i + 6]) | ((u32)f2h(v[8 * i + 7]) << 16);
        o[i] = p;
    }
}

// out row i (stride ldo floats) = scale * row (host >= 0 ? host : ids[i]) of W, FP32;
// grid (ceil(groups / blockDim), nrows); ids out of range are clamped (callers check tokens)
template <class F>
__device__ __forceinline__ void qrows_f32_body(float* __restrict__ out, int ldo, const unsigned char* __restrict__ w,
                                               int d, int nbi, const int* __restrict__ ids, int host,
                                               float scale)
{
    const int groups = nbi * (F::IE / 32);
    const int grp = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y;
    if (grp >= groups) return;
    int row = host >= 0 ? host : ids[i];
    row = min(max(row, 0), d - 1);
    float v[32];
    qgroup_values<F>(w, d, nbi, row, grp, v);
    float4* o = reinterpret_cast<float4*>(out + (size_t)i * ldo + (size_t)grp * 32);
    const bool vec = ((reinterpret_cast<size_t>(out) | ((size_t)ldo * 4)) & 15) == 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 p = make_float4(v[4 * j] * scale, v[4 * j + 1] * scale, v[4 * j + 2] * scale, v[4 * j + 3] * scale);
        if (vec) {
            o[j] = p;
        } else {
            float* f = out + (size_t)i * ldo + (size_t)grp * 32 + 4 * j;
            f[0] = p.x; f[1] = p.y; f[2] = p.z; f[3] = p.w;
        }
    }
}

// ---- a few columns at once: short prefill chunks ---------------------------------------------
// A chunk of T tokens multiplied on dequantized FP16 tiles (qdeq_f16 + cuBLAS) costs the whole
// matrix's dequantizing whatever T is: a chat's next turn of 16-64 padded rows on a 7B Q4_0
// took 2.5 times its F16 time. These kernels run the decode matvec's loads and dots over C
// columns instead: a block stages C quantized activation vectors side by side and dots every
// weight item it loads with all C. The blocks of one row tile's column groups are neighbours
// in the grid, so they run together and all but the first find the tile's weights in the L2.
//
// qx_rows: x (T rows of n floats, stride ldx) -> T rows of stride qs bytes in qx's layout
// (n codes | n/32 16-byte entries; no sums of squares): qstage's codes and entries bit for
// bit, so each column rounds as decode's staging of the same vector would. Grid
// (ceil(n / 2048), T), 128 threads: a warp per 512 elements.
extern "C" __global__ void qx_rows(unsigned char* __restrict__ qx, int qs, const float* __restrict__ x, int ldx,
                                   int n)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 512;
    if (e0 >= n) return;                                    // whole warps: qstage shuffles
    unsigned char* row = qx + (size_t)blockIdx.y * qs;
    qstage<false>(x + (size_t)blockIdx.y * ldx, nullptr, e0, min(e0 + 512, n), reinterpret_cast<u32*>(row),
                  reinterpret_cast<float4*>(row + n), lane);
}

// out[c, row] (row stride ldo floats; beta 1: +=) = (W x_c)[row] for the columns c of group
// g = blockIdx.x % groups (columns [C g, C g + C) below T) and row tile blockIdx.x / groups;
// x_c: row c of qx (qx_rows). S warps a block split the tile's items as qmv_tile's do, each
// staging its slice of all C columns (cp.async); shared memory: C columns of n + n/2 bytes,
// then C*S*32 partial sums (the host's _qmm_smem). Column c's sum over the warps runs in
// qmv_tile's order, so with the same S it equals decode's qmv of x_c bit for bit.
template <class F, int C>
__device__ __forceinline__ void qmm_body(float* __restrict__ out, int ldo, int beta,
                                         const unsigned char* __restrict__ w, const unsigned char* __restrict__ qx,
                                         int qs, int T, int d, int nbi)
{
    // the K-quants hold one superblock a lane (144-208 bytes): a second batch in flight beside
    // C columns' dots spilled q5_k and q6_k at 255 registers
    constexpr int B = F::B, P = F::B == 1 ? 1 : 2;
    const int groups = (T + C - 1) / C;
    const int tile = blockIdx.x / groups, c0 = (blockIdx.x % groups) * C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = blockDim.x >> 5;
    const int W = min(QMV_TILE, d - QMV_TILE * tile);
    const bool live = lane < W;
    const int s0 = (int)(((long long)nbi * warp) / S);
    const int s1 = (int)(((long long)nbi * (warp + 1)) / S);
    const int n = nbi * F::IE;
    const int cs = n + n / 2;                               // bytes of one staged column
    const QGeo g = qgeo<F>(w, d, nbi, tile);

    // the first P batches of weights go out first, then the staging's copies
    QItem<F> it[P][B];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int u = 0; u < B; ++u) {
#pragma unroll
            for (int j = 0; j < F::UPI; ++j) it[p][u].u[j] = make_uint4(0u, 0u, 0u, 0u);
            it[p][u].a0 = it[p][u].a1 = 0u;
            it[p][u].b = 0;
            if (live && s0 + p * B + u < s1) qload<F>(it[p][u], g, s0 + p * B + u, W, lane);
        }

    // this warp's slice of every column; past T the last column again (its sums are dropped)
    unsigned char* base = reinterpret_cast<unsigned char*>(qmv_smem);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const unsigned char* src = qx + (size_t)min(c0 + c, T - 1) * qs;
        unsigned char* dst = base + c * cs;
        for (int i = ((s0 * F::IE) >> 4) + lane; i < ((s1 * F::IE) >> 4); i += 32) cp_async16(dst + 16 * i, src + 16 * i);
        for (int i = ((s0 * F::IE) >> 5) + lane; i < ((s1 * F::IE) >> 5); i += 32)
            cp_async16(dst + n + 16 * i, src + n + 16 * i);
    }
    cp_async_wait_all();
    __syncwarp();

    // qmv_tile's walk over the batches, kept twice on purpose: one helper taking the dots as a
    // lambda changed ptxas's schedule of the decode kernels that call qmv_tile twice
    // (qmv_qkv_rope_*: different SASS, q4_0's 8 instructions shorter), which were tuned by
    // measurement; no GPU was left to measure that change
    float acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    for (int sb = s0; sb < s1; sb += P * B) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (sb + p * B >= s1) break;          // no item of this warp in this batch (uniform)
#pragma unroll
            for (int u = 0; u < B; ++u) {
                const int s = sb + p * B + u;
                const bool ok = live && s < s1;
                const int sx = min(s, s1 - 1);                    // in this warp's staged slice
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const unsigned char* col = base + c * cs;
                    const float v = qdot(it[p][u], reinterpret_cast<const uint4*>(col) + sx * (F::IE / 16),
                                         reinterpret_cast<const float4*>(col + n) + sx * (F::IE / 32));
                    acc[c] += ok ? v : 0.0f;
                }
            }
            const int nb = sb + (p + P) * B;      // refill this batch's slots with the batch after the next
            if (nb < s1) {
#pragma unroll
                for (int u = 0; u < B; ++u)
                    if (live && nb + u < s1) qload<F>(it[p][u], g, nb + u, W, lane);
            }
        }
    }

    float* red = reinterpret_cast<float*>(base + C * cs);      // [C][S][32]
#pragma unroll
    for (int c = 0; c < C; ++c) red[(c * S + warp) * 32 + lane] = acc[c];
    __syncthreads();
    for (int c = warp; c < C; c += S) {                          // a warp a column
        if (c0 + c >= T || !live) continue;
        float t = 0.0f;
        for (int v = 0; v < S; ++v) t += red[(c * S + v) * 32 + lane];
        float* o = out + (size_t)(c0 + c) * ldo + QMV_TILE * tile + lane;
        *o = beta ? *o + t : t;
    }
}

// ---- the same on tensor cores (sm_80+): qmma<C>_<fmt> ----------------------------------------
// qmm's dots are dp4a: for C columns every lane runs C times a group's 8 dp4a and its scaling,
// and a 16-row chunk of a 7B took ~3.2 ms a group of 8 columns on an H100 against ~1.3 ms of
// weight bytes. Here the warps of a block share one row tile and multiply its 32 rows
// by C staged columns with int8 MMA, a 32-element group at a time:
// * each lane unpacks its row's group to 32 byte codes (qgroup, the dequantize kernels' code)
//   and stores them to a 48-byte row of the warp's shared buffer (48: the 8 rows an ldmatrix
//   phase reads fall on distinct banks); ldmatrix then hands the warp the A fragments of rows
//   0-15 and 16-31 (m16n8k32: a0 row g, bytes 4t..4t+3; a1 row g+8; a2, a3 bytes 16 on);
// * the columns' codes, staged a chunk of KC elements at a time by each warp (C rows of
//   KC + 16 bytes, the 16 again for the banks), give the B fragments the same way (b0 column g,
//   bytes 4t..4t+3; b1 bytes 16 on);
// * the int32 sums of a group are scaled as qdot scales them: row r's value is a_r q + b_r
//   (qgroup), column c's codes times d_c, so the group adds d_c a_r I + b_r d_c sum(codes_c)
//   (the entry's second field); q6_k, a scale per 16 elements, takes two k16 MMAs instead.
// The next chunk's weights and staging go out before this chunk's MMAs. The S warps of a block
// split the tile's chunks, each staging its own (no block barrier in the loop), and add their
// sums at the end; grid tiles x column groups, the groups of a tile neighbours (as qmm's).
template <class F> struct QHalves { enum { value = 0 }; };      // a scale per 16 elements
template <> struct QHalves<QF_q6_k> { enum { value = 1 }; };

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
}

// c = A (16 x 32 weight codes, unsigned or signed) . B (32 x 8 activation codes)
template <bool SIGNED>
__device__ __forceinline__ void mma_k32(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (SIGNED)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %10, %10, %10};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %10, %10, %10};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// the same over 16 elements (a0 row g, a1 row g+8; b0 column g)
template <bool SIGNED>
__device__ __forceinline__ void mma_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    if (SIGNED)
        asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3]) : "r"(a0), "r"(a1), "r"(b0), "r"(0));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3]) : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}
#endif

// elements a chunk, about 150-210 weight bytes a lane: 8 items of the 4/5-bit 32-element formats,
// 4 of q8_0, one superblock of the K-quants
template <class F> struct QmmaChunk {
    enum { KC = F::IE > 32 ? F::IE : (F::UPI == 2 ? 128 : 256), IPC = KC / F::IE, G = KC / 32 };
};

// Where a block's columns come from and go: the C columns [c0, c0 + C) of a chunk (cols of
// them below T), row c0 + c of qx and of out.
struct QmmaRows {
    const unsigned char* qx; int qs; float* out; int ldo; int c0; int cols;
    __device__ __forceinline__ const unsigned char* src(int c) const { return qx + (size_t)(c0 + c) * qs; }
    __device__ __forceinline__ float* dst(int c) const { return out + (size_t)(c0 + c) * ldo; }
};

// A group of one expert's sorted positions [p0, p0 + cols) (moe_group in moe.cu): column c is
// row slots[p0 + c] / k of qx (the token of that entry; slots null: row p0 + c, the experts'
// own rows), written to row p0 + c of out. row[] (shared) holds the columns' qx rows.
struct QmmaExpertRows {
    const unsigned char* qx; int qs; float* out; int ldo; int p0; int cols; const int* row;
    __device__ __forceinline__ const unsigned char* src(int c) const { return qx + (size_t)row[c] * qs; }
    __device__ __forceinline__ float* dst(int c) const { return out + (size_t)(p0 + c) * ldo; }
};

// Shared memory, a warp: two chunk buffers of C * (KC + 16 + KC/32 * 16) bytes (codes, then the
// entries group-major), then 2 KiB (its rows' codes, 32 of 48 bytes, and their a0 a1 b0 b1);
// the host's _qmma_smem. After the loop the warps' partial sums (8 NB * 32 floats each) go
// where the first warp's buffers were.
template <class F, int NB, class Rows>
__device__ __forceinline__ void qmma_body(const Rows& rows, int beta, const unsigned char* __restrict__ w,
                                          int d, int nbi, int tile)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int C = 8 * NB, KC = QmmaChunk<F>::KC, IPC = QmmaChunk<F>::IPC, G = QmmaChunk<F>::G;
    constexpr int XS = KC + 16;                  // bytes of a staged column's codes
    constexpr int XB = C * (XS + 16 * G);        // one chunk buffer
    constexpr int WB = 2 * XB + QMV_TILE * 64;   // a warp's shared memory
    constexpr bool SG = QSigned<F>::value;
    static_assert(NB % 2 == 0, "B fragments come two column blocks an ldmatrix");
    const int S = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int W = min(QMV_TILE, d - QMV_TILE * tile);
    const bool live = lane < W;
    const int n = nbi * F::IE;
    const int nch = (n + KC - 1) / KC;
    const int ch0 = (int)(((long long)nch * warp) / S), ch1 = (int)(((long long)nch * (warp + 1)) / S);
    unsigned char* sm = reinterpret_cast<unsigned char*>(qmv_smem);
    unsigned char* mine = sm + warp * WB;
    unsigned char* wrow = mine + 2 * XB;
    float4* wab = reinterpret_cast<float4*>(wrow + QMV_TILE * 48);
    const QGeo geo = qgeo<F>(w, d, nbi, tile);
    const int gq = lane >> 2, tq = lane & 3;     // the fragments' row (column) and k quarter

    // chunk ch of every column into this warp's buffer b: codes [C][XS], entries [G][C]; past
    // the block's columns the last one again (its sums are dropped)
    auto stage = [&](int ch, int b) {
        const int e0 = ch * KC, ne = min(KC, n - e0);
        const int pc = ne >> 4, pe = ne >> 5, per = pc + pe;    // 16-byte pieces a column
        unsigned char* xs = mine + b * XB;
        for (int i = lane; i < C * per; i += 32) {
            const int c = i / per, j = i - c * per;
            const unsigned char* src = rows.src(min(c, rows.cols - 1));
            if (j < pc) cp_async16(xs + c * XS + 16 * j, src + e0 + 16 * j);
            else cp_async16(xs + C * XS + ((j - pc) * C + c) * 16, src + n + (size_t)(e0 / 32 + j - pc) * 16);
        }
        cp_async_commit();
    };
    auto load = [&](QItem<F> (&it)[IPC], int ch) {
#pragma unroll
        for (int u = 0; u < IPC; ++u) {
#pragma unroll
            for (int j = 0; j < F::UPI; ++j) it[u].u[j] = make_uint4(0u, 0u, 0u, 0u);
            it[u].a0 = it[u].a1 = 0u;
            it[u].b = 0;
            const int s = ch * IPC + u;
            if (live && s < nbi) qload<F>(it[u], geo, s, W, lane);
        }
    };

    float acc[2][NB][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mb][nb][i] = 0.0f;
    QItem<F> cur[IPC], nxt[IPC];
    if (ch0 < ch1) {
        stage(ch0, 0);
        load(cur, ch0);
    }
    for (int ch = ch0; ch < ch1; ++ch) {
        if (ch + 1 < ch1) {
            stage(ch + 1, (ch + 1 - ch0) & 1);
            load(nxt, ch + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();                             // chunk ch staged by every lane
        const unsigned char* xs = mine + ((ch - ch0) & 1) * XB;
        const float4* xe = reinterpret_cast<const float4*>(xs + C * XS);
        const int ng = min(G, (n - ch * KC) >> 5);
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            if (gi >= ng) break;                  // uniform
            u32 q[8];
            float a[2], b[2];
            qgroup(cur[gi / (F::IE / 32)], gi % (F::IE / 32), q, a, b);
            uint4* dst = reinterpret_cast<uint4*>(wrow + lane * 48);
            dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
            dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
            wab[lane] = make_float4(a[0], a[1], b[0], b[1]);
            __syncwarp();
            u32 A[2][4];
#pragma unroll
            for (int mb = 0; mb < 2; ++mb)
                ldsm_x4(A[mb], wrow + (16 * mb + (lane & 7) + ((lane >> 3) & 1) * 8) * 48 + (lane >> 4) * 16);
            u32 Bf[NB][2];
#pragma unroll
            for (int p = 0; p < NB / 2; ++p) {
                u32 r[4];
                ldsm_x4(r, xs + (16 * p + 8 * (lane >> 4) + (lane & 7)) * XS + 32 * gi + ((lane >> 3) & 1) * 16);
                Bf[2 * p][0] = r[0]; Bf[2 * p][1] = r[1]; Bf[2 * p + 1][0] = r[2]; Bf[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int mb = 0; mb < 2; ++mb) {
                const float4 r0 = wab[16 * mb + gq], r1 = wab[16 * mb + gq + 8];
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    const float4 e0 = xe[gi * C + 8 * nb + 2 * tq], e1 = xe[gi * C + 8 * nb + 2 * tq + 1];
                    if (!QHalves<F>::value) {
                        int I[4];
                        mma_k32<SG>(I, A[mb], Bf[nb][0], Bf[nb][1]);
                        acc[mb][nb][0] += fmaf(r0.x * (float)I[0], e0.x, r0.z * e0.y);
                        acc[mb][nb][1] += fmaf(r0.x * (float)I[1], e1.x, r0.z * e1.y);
                        acc[mb][nb][2] += fmaf(r1.x * (float)I[2], e0.x, r1.z * e0.y);
                        acc[mb][nb][3] += fmaf(r1.x * (float)I[3], e1.x, r1.z * e1.y);
                    } else {
                        int I0[4], I1[4];
                        mma_k16<SG>(I0, A[mb][0], A[mb][1], Bf[nb][0]);
                        mma_k16<SG>(I1, A[mb][2], A[mb][3], Bf[nb][1]);
                        // d_c (a0 I0 + a1 I1 + b0 sum(codes 0-15) + b1 sum(codes 16-31))
                        const float s00 = (float)__float_as_int(e0.z), s01 = (float)__float_as_int(e0.w);
                        const float s10 = (float)__float_as_int(e1.z), s11 = (float)__float_as_int(e1.w);
                        acc[mb][nb][0] += e0.x * fmaf(r0.x, (float)I0[0], fmaf(r0.y, (float)I1[0], fmaf(r0.z, s00, r0.w * s01)));
                        acc[mb][nb][1] += e1.x * fmaf(r0.x, (float)I0[1], fmaf(r0.y, (float)I1[1], fmaf(r0.z, s10, r0.w * s11)));
                        acc[mb][nb][2] += e0.x * fmaf(r1.x, (float)I0[2], fmaf(r1.y, (float)I1[2], fmaf(r1.z, s00, r1.w * s01)));
                        acc[mb][nb][3] += e1.x * fmaf(r1.x, (float)I0[3], fmaf(r1.y, (float)I1[3], fmaf(r1.z, s10, r1.w * s11)));
                    }
                }
            }
            __syncwarp();                         // the row buffer is rewritten by the next group
        }
#pragma unroll
        for (int u = 0; u < IPC; ++u) cur[u] = nxt[u];
    }

    // the S warps' partial sums meet in shared memory: [S][8 NB][32], slot (mb, nb, i)
    __syncthreads();
    float* red = reinterpret_cast<float*>(sm);
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[(warp * 8 * NB + (mb * NB + nb) * 4 + i) * 32 + lane] = acc[mb][nb][i];
    __syncthreads();
    for (int e = threadIdx.x; e < 8 * NB * 32; e += blockDim.x) {
        const int slot = e >> 5, l = e & 31;
        const int mb = slot / (4 * NB), nb = (slot >> 2) % NB, i = slot & 3;
        const int r = 16 * mb + (l >> 2) + 8 * (i >> 1), c = 8 * nb + 2 * (l & 3) + (i & 1);
        if (r >= W || c >= rows.cols) continue;
        float t = 0.0f;
        for (int v = 0; v < S; ++v) t += red[(v * 8 * NB + slot) * 32 + l];
        float* o = rows.dst(c) + QMV_TILE * tile + r;
        *o = beta ? *o + t : t;
    }
#else
    __trap();                                     // the host launches these on sm_80 and newer only
#endif
}

// ---- the alternative measured against: FP32 activations (q8_0, q4_0; out = W x only) --------
// Same layout and launch shape; each warp copies its slice of x into shared memory as
// floats and every weight byte becomes a float through the exponent trick
// (0x4B000000 | b is 2^23 + b), then one FMA: about 3 instructions per weight against
// about 0.8 for the int8 path (bench/bench_cuda_quant.py reports both).
__device__ __forceinline__ float byte_f(u32 w, int k, float bias) {   // byte k of w minus bias
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + k)) - bias;
}

__device__ __forceinline__ float dot_bytes_f32(u32 w, const float4 xv, float bias, float acc) {
    acc = fmaf(byte_f(w, 0, bias), xv.x, acc);
    acc = fmaf(byte_f(w, 1, bias), xv.y, acc);
    acc = fmaf(byte_f(w, 2, bias), xv.z, acc);
    return fmaf(byte_f(w, 3, bias), xv.w, acc);
}

__device__ __forceinline__ float qdot_f32(const QItem<QF_q8_0>& it, const float4* xf) {
    float acc = 0.0f;      // signed bytes: flip the sign bit (b + 128), take 128 off with the bias
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        acc = dot_bytes_f32(word(it.u[0], t) ^ 0x80808080u, xf[t], 8388736.0f, acc);
        acc = dot_bytes_f32(word(it.u[1], t) ^ 0x80808080u, xf[4 + t], 8388736.0f, acc);
    }
    return h2f(it.b) * acc;
}

__device__ __forceinline__ float qdot_f32(const QItem<QF_q4_0>& it, const float4* xf) {
    float acc = 0.0f;      // q - 8
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        acc = dot_bytes_f32(word(it.u[0], t) & 0x0F0F0F0Fu, xf[t], 8388616.0f, acc);
        acc = dot_bytes_f32((word(it.u[0], t) >> 4) & 0x0F0F0F0Fu, xf[4 + t], 8388616.0f, acc);
    }
    return h2f(it.b) * acc;
}

template <class F>
__device__ __forceinline__ void qmv_xf32_body(float* __restrict__ out, const unsigned char* __restrict__ w0,
                                              const float* x, int d, int nbi)
{
    constexpr int U = 2 * F::B;       // the same bytes in flight as the int8 kernel's two batches
    pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, S = blockDim.x >> 5;
    const int tile = blockIdx.x;
    const int W = min(QMV_TILE, d - QMV_TILE * tile);
    const bool live = lane < W;
    const int s0 = (int)(((long long)nbi * warp) / S), s1 = (int)(((long long)nbi * (warp + 1)) / S);
    const int n = nbi * F::IE;
    const QGeo g = qgeo<F>(w0, d, nbi, tile);
    QItem<F> it[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (live && s0 + u < s1) qload<F>(it[u], g, s0 + u, W, lane);
    pdl_wait_after_loads(nbi);
    float4* xf = reinterpret_cast<float4*>(qmv_smem);
    float* red = reinterpret_cast<float*>(xf + n / 4);
    for (int c = s0 * F::IE / 4 + lane; c < s1 * F::IE / 4; c += 32)
        xf[c] = make_float4(ld_act(x + 4 * c), ld_act(x + 4 * c + 1), ld_act(x + 4 * c + 2), ld_act(x + 4 * c + 3));
    __syncwarp();
    float acc = 0.0f;
    for (int sb = s0; sb < s1; sb += U) {
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (live && sb + u < s1) acc += qdot_f32(it[u], xf + (sb + u) * (F::IE / 4));
        if (sb + U < s1) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (live && sb + U + u < s1) qload<F>(it[u], g, sb + U + u, W, lane);
        }
    }
    red[warp * 32 + lane] = acc;
    __syncthreads();
    if (warp == 0 && live) {
        float t = 0.0f;
        for (int w = 0; w < S; ++w) t += red[w * 32 + lane];
        out[QMV_TILE * tile + lane] = t;
    }
}

#define CYLLM_QMV_XF32(NAME, F)                                                                      \
    extern "C" __global__ void __launch_bounds__(QMV_MAX_WARPS * 32) NAME(float* __restrict__ out, const unsigned char* __restrict__ w0,   \
                                    const float* x, int d, int nbi) {                                \
        qmv_xf32_body<F>(out, w0, x, d, nbi);                                                        \
    }

// ---- kernels, named whole -----------------------------------------------------------------
// CYLLM_QMV: at most 512 threads, so the compiler keeps to 128 registers and two 256-thread
// blocks (this kernel's and, under programmatic dependent launch, the next one's) fit on one
// SM. CYLLM_QMV_WIDE: no bound, for the kernels that would spill under it (q5_k, q6_k, and
// gate+up of the K-quants: 150-200 registers).
// trace tags (bench/trace_cuda_decode.py tag_name): format, mode, norm, q/k/v, and 0x2000 for _qx
#define QMV_TAG_QX(QX) ((QX) ? 0x2000 : 0)
#define QMV_TAG_EXPERTS 0x4000
#define CYLLM_QMV_DEF(NAME, F, MODE, NORM, BOUNDS) CYLLM_QMV_DEF1(NAME, F, MODE, NORM, BOUNDS, false) \
    CYLLM_QMV_DEF1(NAME##_qx, F, MODE, NORM, BOUNDS, true)
#define CYLLM_QMV_DEF1(NAME, F, MODE, NORM, BOUNDS, QX)                                            \
    extern "C" __global__ void BOUNDS NAME(float* __restrict__ out, const unsigned char* __restrict__ w0, \
                                    const unsigned char* __restrict__ w1, const float* x,             \
                                    int d, int nbi, const float* __restrict__ nw, float eps,         \
                                    float* __restrict__ xn, const unsigned char* qx,                 \
                                    unsigned char* __restrict__ qxo, const float* __restrict__ qnw) { \
        TRACE_BEGIN(); qmv_body<F, MODE, NORM, QX>(out, w0, w1, x, d, nbi, nw, eps, xn, blockIdx.x, qx, qxo, qnw); \
        TRACE_END(QMV_TAG_QX(QX) | (F::UPI << 8) | (F::EA << 4) | (MODE << 2) | (NORM << 1));                     \
    }
// A mixture of experts' chosen experts in one launch (decode): blockIdx.y is the rank j of an
// expert the token chose, e = ids[j] (moe_route_f32 wrote it on the device) picks expert e's
// matrices at w0 + e * stride and w1 + e * stride (a layer's experts of one role lie back to
// back, each in the layout above: backends/cuda/quant.py upload_expert_stack), x row j is at
// x + j * ldx (gate+up: ldx 0, the token's vector; down: each expert's own h) and out row j
// at out + j * d. Their weights depend on the ids, so none is loaded before pdl_wait.
#define CYLLM_QMV_EXPERTS_DEF(NAME, F, MODE, BOUNDS)                                              \
    extern "C" __global__ void BOUNDS NAME(float* __restrict__ out, const unsigned char* __restrict__ w0, \
                                    const unsigned char* __restrict__ w1, long long stride,         \
                                    const int* ids, int n_experts, const float* x, int ldx,         \
                                    int d, int nbi) {                                                \
        TRACE_BEGIN();                                                                               \
        const long long off = expert_offset(ids, n_experts, stride);                                 \
        if (off < 0) return;                                                                         \
        const int j = blockIdx.y;                                                                    \
        qmv_body<F, MODE, false, false>(out + (size_t)j * d, w0 + off, w1 + off, x + (size_t)j * ldx, \
                                        d, nbi, nullptr, 0.0f, nullptr, blockIdx.x, nullptr, nullptr, nullptr); \
        TRACE_END(QMV_TAG_EXPERTS | (F::UPI << 8) | (F::EA << 4) | (MODE << 2));                     \
    }
#define CYLLM_QMV_EXPERTS(NAME, F, MODE) CYLLM_QMV_EXPERTS_DEF(NAME, F, MODE, __launch_bounds__(QMV_MAX_WARPS * 32))
#define CYLLM_QMV_EXPERTS_WIDE(NAME, F, MODE) CYLLM_QMV_EXPERTS_DEF(NAME, F, MODE, )
// q, k and v of one layer in one launch (three matrices of one format, one x): blocks
// [0, tq) are q's row tiles, then k's, then v's; out is q | k | v side by side (dk = dv)
#define CYLLM_QMV_QKV_DEF(NAME, F, NORM, BOUNDS) CYLLM_QMV_QKV_DEF1(NAME, F, NORM, BOUNDS, false)   \
    CYLLM_QMV_QKV_DEF1(NAME##_qx, F, NORM, BOUNDS, true)
#define CYLLM_QMV_QKV_DEF1(NAME, F, NORM, BOUNDS, QX)                                              \
    extern "C" __global__ void BOUNDS NAME(float* __restrict__ out, const unsigned char* __restrict__ wq, \
                                    const unsigned char* __restrict__ wk,                            \
                                    const unsigned char* __restrict__ wv, const float* x,            \
                                    int dq, int dk, int nbi, const float* __restrict__ nw, float eps, \
                                    float* __restrict__ xn, const unsigned char* qx) {               \
        const int tq = (dq + QMV_TILE - 1) / QMV_TILE, tk = (dk + QMV_TILE - 1) / QMV_TILE;          \
        const int t = blockIdx.x;                                                                    \
        const int seg = t < tq ? 0 : t < tq + tk ? 1 : 2;                                            \
        const unsigned char* w = seg == 0 ? wq : seg == 1 ? wk : wv;                                 \
        TRACE_BEGIN(); qmv_body<F, 0, NORM, QX>(out + (seg == 0 ? 0 : dq + (seg - 1) * dk), w, w, x, seg ? dk : dq, nbi, \
                             nw, eps, xn, t - (seg == 0 ? 0 : tq + (seg - 1) * tk), qx, nullptr, nullptr); \
        TRACE_END(QMV_TAG_QX(QX) | (F::UPI << 8) | (F::EA << 4) | (NORM << 1) | 1);                               \
    }
// q and k of one format, v of another (the Q4_K_M/Q5_K_M recipes give some layers' v more
// bits): still one launch, for grids of one wave, where a launch costs more than its bytes
// (backends/cuda/quant.py stack_rows; not for q5_k or q6_k, whose bodies would spill under
// this bound). Each block runs the body of its own part's format (a branch uniform per block).
#define CYLLM_QMV_QKV_PAIR_DEF(NAME, FQ, FV, NORM) CYLLM_QMV_QKV_PAIR_DEF1(NAME, FQ, FV, NORM, false) \
    CYLLM_QMV_QKV_PAIR_DEF1(NAME##_qx, FQ, FV, NORM, true)
#define CYLLM_QMV_QKV_PAIR_DEF1(NAME, FQ, FV, NORM, QX)                                            \
    extern "C" __global__ void __launch_bounds__(QMV_MAX_WARPS * 32) NAME(                           \
            float* __restrict__ out, const unsigned char* __restrict__ wq,                           \
            const unsigned char* __restrict__ wk, const unsigned char* __restrict__ wv, const float* x, \
            int dq, int dk, int nbi_qk, int nbi_v, const float* __restrict__ nw, float eps,         \
            float* __restrict__ xn, const unsigned char* qx) {                                       \
        const int tq = (dq + QMV_TILE - 1) / QMV_TILE, tk = (dk + QMV_TILE - 1) / QMV_TILE;          \
        const int t = blockIdx.x;                                                                    \
        TRACE_BEGIN();                                                                               \
        if (t < tq + tk) {                                                                           \
            const bool isq = t < tq;                                                                 \
            qmv_body<FQ, 0, NORM, QX>(out + (isq ? 0 : dq), isq ? wq : wk, isq ? wq : wk, x, isq ? dq : dk, \
                                  nbi_qk, nw, eps, xn, isq ? t : t - tq, qx, nullptr, nullptr);      \
            TRACE_END(QMV_TAG_QX(QX) | (FQ::UPI << 8) | (FQ::EA << 4) | (NORM << 1) | 1);                             \
        } else {                                                                                     \
            qmv_body<FV, 0, NORM, QX>(out + dq + dk, wv, wv, x, dk, nbi_v, nw, eps, xn, t - tq - tk, qx, nullptr, nullptr); \
            TRACE_END(QMV_TAG_QX(QX) | (FV::UPI << 8) | (FV::EA << 4) | (NORM << 1) | 1);                             \
        }                                                                                            \
    }
// the same three with rope and the cache store of row pos folded in (qkv_rope_body)
#define CYLLM_QMV_QKV_ROPE_DEF(NAME, F, NORM, BOUNDS) CYLLM_QMV_QKV_ROPE_DEF1(NAME, F, NORM, BOUNDS, false) \
    CYLLM_QMV_QKV_ROPE_DEF1(NAME##_qx, F, NORM, BOUNDS, true)
#define CYLLM_QMV_QKV_ROPE_DEF1(NAME, F, NORM, BOUNDS, QX)                                         \
    extern "C" __global__ void BOUNDS NAME(float* __restrict__ out, const unsigned char* __restrict__ wq, \
                                    const unsigned char* __restrict__ wk,                            \
                                    const unsigned char* __restrict__ wv, const float* x,            \
                                    int dq, int dk, int nbi, const float* __restrict__ nw, float eps, \
                                    float* __restrict__ xn, const float* __restrict__ cos_t,         \
                                    const float* __restrict__ sin_t, f16_t* __restrict__ k_cache,    \
                                    f16_t* __restrict__ v_cache, const int* __restrict__ step,       \
                                    int pos_host, int n_pos, int max_ctx, int hd,                    \
                                    const unsigned char* qx) {                                       \
        TRACE_BEGIN();                                                                               \
        qkv_rope_body<F, NORM, QX>(out, wq, wk, wv, x, dq, dk, nbi, nbi, nw, eps, xn, cos_t, sin_t,      \
                               k_cache, v_cache, step, pos_host, n_pos, max_ctx, hd, qx);            \
        TRACE_END(QMV_TAG_QX(QX) | (F::UPI << 8) | (F::EA << 4) | (NORM << 1) | 1);                               \
    }
// the pair's (q and k of one format, v of another) with rope and the cache store folded in
#define CYLLM_QMV_QKV_ROPE_PAIR_DEF(NAME, FQ, FV, NORM) CYLLM_QMV_QKV_ROPE_PAIR_DEF1(NAME, FQ, FV, NORM, false) \
    CYLLM_QMV_QKV_ROPE_PAIR_DEF1(NAME##_qx, FQ, FV, NORM, true)
#define CYLLM_QMV_QKV_ROPE_PAIR_DEF1(NAME, FQ, FV, NORM, QX)                                       \
    extern "C" __global__ void __launch_bounds__(QMV_MAX_WARPS * 32) NAME(                           \
            float* __restrict__ out, const unsigned char* __restrict__ wq,                           \
            const unsigned char* __restrict__ wk, const unsigned char* __restrict__ wv, const float* x, \
            int dq, int dk, int nbi_qk, int nbi_v, const float* __restrict__ nw, float eps,         \
            float* __restrict__ xn, const float* __restrict__ cos_t, const float* __restrict__ sin_t, \
            f16_t* __restrict__ k_cache, f16_t* __restrict__ v_cache, const int* __restrict__ step,   \
            int pos_host, int n_pos, int max_ctx, int hd, const unsigned char* qx) {                 \
        TRACE_BEGIN();                                                                               \
        qkv_rope_body<FQ, NORM, QX, FV>(out, wq, wk, wv, x, dq, dk, nbi_qk, nbi_v, nw, eps, xn, cos_t,   \
                                    sin_t, k_cache, v_cache, step, pos_host, n_pos, max_ctx, hd, qx); \
        if ((int)blockIdx.x < (dq + dk) / (2 * QMV_TILE))      /* q's and k's tile pairs */          \
            TRACE_END(QMV_TAG_QX(QX) | (FQ::UPI << 8) | (FQ::EA << 4) | (NORM << 1) | 1);                             \
        else                                                                                         \
            TRACE_END(QMV_TAG_QX(QX) | (FV::UPI << 8) | (FV::EA << 4) | (NORM << 1) | 1);                             \
    }
#define CYLLM_QMV(NAME, F, MODE, NORM) CYLLM_QMV_DEF(NAME, F, MODE, NORM, __launch_bounds__(QMV_MAX_WARPS * 32))
#define CYLLM_QMV_WIDE(NAME, F, MODE, NORM) CYLLM_QMV_DEF(NAME, F, MODE, NORM, )
#define CYLLM_QMV_QKV(NAME, F, NORM) CYLLM_QMV_QKV_DEF(NAME, F, NORM, __launch_bounds__(QMV_MAX_WARPS * 32))
#define CYLLM_QMV_QKV_WIDE(NAME, F, NORM) CYLLM_QMV_QKV_DEF(NAME, F, NORM, )
#define CYLLM_QMV_QKV_ROPE(NAME, F, NORM) CYLLM_QMV_QKV_ROPE_DEF(NAME, F, NORM, __launch_bounds__(QMV_MAX_WARPS * 32))
#define CYLLM_QMV_QKV_ROPE_WIDE(NAME, F, NORM) CYLLM_QMV_QKV_ROPE_DEF(NAME, F, NORM, )
#define CYLLM_QDEQ(NAME, F)                                                                          \
    extern "C" __global__ void NAME(f16_t* __restrict__ out, const unsigned char* __restrict__ w,     \
                                    int d, int nbi, int r0, int nrows) {                             \
        qdeq_f16_body<F>(out, w, d, nbi, r0, nrows);                                                 \
    }
#define CYLLM_QROWS(NAME, F)                                                                         \
    extern "C" __global__ void NAME(float* __restrict__ out, int ldo, const unsigned char* __restrict__ w, \
                                    int d, int nbi, const int* __restrict__ ids, int host, float scale) { \
        qrows_f32_body<F>(out, ldo, w, d, nbi, ids, host, scale);                                    \
    }

#define CYLLM_QMM(NAME, F, C)                                                                        \
    extern "C" __global__ void NAME(float* __restrict__ out, int ldo, int beta,                      \
                                    const unsigned char* __restrict__ w,                             \
                                    const unsigned char* __restrict__ qx, int qs, int T, int d, int nbi) { \
        qmm_body<F, C>(out, ldo, beta, w, qx, qs, T, d, nbi);                                        \
    }

#define CYLLM_QMMA(NAME, F, NB)                                                                      \
    extern "C" __global__ void NAME(float* __restrict__ out, int ldo, int beta,                      \
                                    const unsigned char* __restrict__ w,                             \
                                    const unsigned char* __restrict__ qx, int qs, int T, int d, int nbi) { \
        const int groups = (T + 8 * NB - 1) / (8 * NB), c0 = (blockIdx.x % groups) * 8 * NB;        \
        const QmmaRows rows{qx, qs, out, ldo, c0, min(8 * NB, T - c0)};                              \
        qmma_body<F, NB>(rows, beta, w, d, nbi, blockIdx.x / groups);                                \
    }
// A mixture of experts' chunk (prefill), its rows grouped by expert on the device (moe_group in
// moe.cu): block (g, tile, z) multiplies row tile `tile` of expert work[g].x's matrix of role z
// (0: w0, 1: w1, the gate and up of one launch; expert e's at e * stride bytes) by that group's
// columns (QmmaExpertRows) into out0 or out1, rows by sorted position. Groups past *n_work exit.
#define CYLLM_QMMA_EXPERTS(NAME, F, NB)                                                              \
    extern "C" __global__ void NAME(float* __restrict__ out0, float* __restrict__ out1, int ldo,     \
                                    const unsigned char* __restrict__ w0,                            \
                                    const unsigned char* __restrict__ w1, long long stride,          \
                                    const int4* __restrict__ work, const int* __restrict__ n_work,   \
                                    const int* __restrict__ slots, int k,                            \
                                    const unsigned char* __restrict__ qx, int qs, int d, int nbi) {  \
        __shared__ int row[8 * NB];                                                                  \
        if ((int)blockIdx.x >= *n_work) return;                                                      \
        const int4 job = work[blockIdx.x];                                                           \
        if (threadIdx.x < job.z) row[threadIdx.x] = slots ? slots[job.y + threadIdx.x] / k : job.y + threadIdx.x; \
        __syncthreads();                                                                             \
        const QmmaExpertRows rows{qx, qs, blockIdx.z ? out1 : out0, ldo, job.y, job.z, row};         \
        qmma_body<F, NB>(rows, 0, (blockIdx.z ? w1 : w0) + (size_t)job.x * stride, d, nbi, blockIdx.y); \
    }

// a pair module (backends/cuda/quant.py compiles one per format pair it meets):
// -DQMV_PAIR_QK=QF_<fmt> -DQMV_PAIR_V=QF_<fmt>
#if defined(QMV_PAIR_QK) && defined(QMV_PAIR_V)
CYLLM_QMV_QKV_PAIR_DEF(qmv_qkv_pair,                QMV_PAIR_QK, QMV_PAIR_V, false)
CYLLM_QMV_QKV_PAIR_DEF(qmv_qkv_pair_norm,           QMV_PAIR_QK, QMV_PAIR_V, true)
CYLLM_QMV_QKV_ROPE_PAIR_DEF(qmv_qkv_rope_pair,      QMV_PAIR_QK, QMV_PAIR_V, false)
CYLLM_QMV_QKV_ROPE_PAIR_DEF(qmv_qkv_rope_pair_norm, QMV_PAIR_QK, QMV_PAIR_V, true)
#endif
#if defined(QMV_ALL) || defined(QMV_q8_0)
CYLLM_QMV(qmv_q8_0,                    QF_q8_0, 0, false)
CYLLM_QMV(qmv_q8_0_norm,               QF_q8_0, 0, true)
CYLLM_QMV(qmv_add_q8_0,                QF_q8_0, 1, false)
CYLLM_QMV(qmv_add_q8_0_norm,           QF_q8_0, 1, true)
CYLLM_QMV(qmv_gate_up_silu_q8_0,       QF_q8_0, 2, false)
CYLLM_QMV(qmv_gate_up_silu_q8_0_norm,  QF_q8_0, 2, true)
CYLLM_QMV(qmv_gate_up_gelu_q8_0,       QF_q8_0, 3, false)
CYLLM_QMV(qmv_gate_up_gelu_q8_0_norm,  QF_q8_0, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q8_0,            QF_q8_0, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q8_0,   QF_q8_0, false)
CYLLM_QMV_QKV(qmv_qkv_q8_0_norm,       QF_q8_0, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q8_0_norm, QF_q8_0, true)
CYLLM_QMV_EXPERTS(qmv_experts_q8_0, QF_q8_0, 0)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_silu_q8_0, QF_q8_0, 2)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_gelu_q8_0, QF_q8_0, 3)
CYLLM_QDEQ(qdeq_f16_q8_0,              QF_q8_0)
CYLLM_QROWS(qrows_f32_q8_0,            QF_q8_0)
CYLLM_QMM(qmm_c4_q8_0,               QF_q8_0, 4)
CYLLM_QMM(qmm_c8_q8_0,               QF_q8_0, 8)
CYLLM_QMMA(qmma16_q8_0,                QF_q8_0, 2)
CYLLM_QMMA(qmma32_q8_0,                QF_q8_0, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q8_0,        QF_q8_0, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q8_0,        QF_q8_0, 4)
CYLLM_QMV_XF32(qmv_xf32_q8_0,          QF_q8_0)
#endif
#if defined(QMV_ALL) || defined(QMV_q4_0)
CYLLM_QMV(qmv_q4_0,                    QF_q4_0, 0, false)
CYLLM_QMV(qmv_q4_0_norm,               QF_q4_0, 0, true)
CYLLM_QMV(qmv_add_q4_0,                QF_q4_0, 1, false)
CYLLM_QMV(qmv_add_q4_0_norm,           QF_q4_0, 1, true)
CYLLM_QMV(qmv_gate_up_silu_q4_0,       QF_q4_0, 2, false)
CYLLM_QMV(qmv_gate_up_silu_q4_0_norm,  QF_q4_0, 2, true)
CYLLM_QMV(qmv_gate_up_gelu_q4_0,       QF_q4_0, 3, false)
CYLLM_QMV(qmv_gate_up_gelu_q4_0_norm,  QF_q4_0, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q4_0,            QF_q4_0, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_0,   QF_q4_0, false)
CYLLM_QMV_QKV(qmv_qkv_q4_0_norm,       QF_q4_0, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_0_norm, QF_q4_0, true)
CYLLM_QMV_EXPERTS(qmv_experts_q4_0, QF_q4_0, 0)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_silu_q4_0, QF_q4_0, 2)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_gelu_q4_0, QF_q4_0, 3)
CYLLM_QDEQ(qdeq_f16_q4_0,              QF_q4_0)
CYLLM_QROWS(qrows_f32_q4_0,            QF_q4_0)
CYLLM_QMM(qmm_c4_q4_0,               QF_q4_0, 4)
CYLLM_QMM(qmm_c8_q4_0,               QF_q4_0, 8)
CYLLM_QMMA(qmma16_q4_0,                QF_q4_0, 2)
CYLLM_QMMA(qmma32_q4_0,                QF_q4_0, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q4_0,        QF_q4_0, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q4_0,        QF_q4_0, 4)
CYLLM_QMV_XF32(qmv_xf32_q4_0,          QF_q4_0)
#endif
#if defined(QMV_ALL) || defined(QMV_q4_1)
CYLLM_QMV(qmv_q4_1,                    QF_q4_1, 0, false)
CYLLM_QMV(qmv_q4_1_norm,               QF_q4_1, 0, true)
CYLLM_QMV(qmv_add_q4_1,                QF_q4_1, 1, false)
CYLLM_QMV(qmv_add_q4_1_norm,           QF_q4_1, 1, true)
CYLLM_QMV(qmv_gate_up_silu_q4_1,       QF_q4_1, 2, false)
CYLLM_QMV(qmv_gate_up_silu_q4_1_norm,  QF_q4_1, 2, true)
CYLLM_QMV(qmv_gate_up_gelu_q4_1,       QF_q4_1, 3, false)
CYLLM_QMV(qmv_gate_up_gelu_q4_1_norm,  QF_q4_1, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q4_1,            QF_q4_1, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_1,   QF_q4_1, false)
CYLLM_QMV_QKV(qmv_qkv_q4_1_norm,       QF_q4_1, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_1_norm, QF_q4_1, true)
CYLLM_QMV_EXPERTS(qmv_experts_q4_1, QF_q4_1, 0)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_silu_q4_1, QF_q4_1, 2)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_gelu_q4_1, QF_q4_1, 3)
CYLLM_QDEQ(qdeq_f16_q4_1,              QF_q4_1)
CYLLM_QROWS(qrows_f32_q4_1,            QF_q4_1)
CYLLM_QMM(qmm_c4_q4_1,               QF_q4_1, 4)
CYLLM_QMM(qmm_c8_q4_1,               QF_q4_1, 8)
CYLLM_QMMA(qmma16_q4_1,                QF_q4_1, 2)
CYLLM_QMMA(qmma32_q4_1,                QF_q4_1, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q4_1,        QF_q4_1, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q4_1,        QF_q4_1, 4)
#endif
#if defined(QMV_ALL) || defined(QMV_q5_0)
CYLLM_QMV(qmv_q5_0,                    QF_q5_0, 0, false)
CYLLM_QMV(qmv_q5_0_norm,               QF_q5_0, 0, true)
CYLLM_QMV(qmv_add_q5_0,                QF_q5_0, 1, false)
CYLLM_QMV(qmv_add_q5_0_norm,           QF_q5_0, 1, true)
CYLLM_QMV(qmv_gate_up_silu_q5_0,       QF_q5_0, 2, false)
CYLLM_QMV(qmv_gate_up_silu_q5_0_norm,  QF_q5_0, 2, true)
CYLLM_QMV(qmv_gate_up_gelu_q5_0,       QF_q5_0, 3, false)
CYLLM_QMV(qmv_gate_up_gelu_q5_0_norm,  QF_q5_0, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q5_0,            QF_q5_0, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q5_0,   QF_q5_0, false)
CYLLM_QMV_QKV(qmv_qkv_q5_0_norm,       QF_q5_0, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q5_0_norm, QF_q5_0, true)
CYLLM_QMV_EXPERTS(qmv_experts_q5_0, QF_q5_0, 0)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_silu_q5_0, QF_q5_0, 2)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_gelu_q5_0, QF_q5_0, 3)
CYLLM_QDEQ(qdeq_f16_q5_0,              QF_q5_0)
CYLLM_QROWS(qrows_f32_q5_0,            QF_q5_0)
CYLLM_QMM(qmm_c4_q5_0,               QF_q5_0, 4)
CYLLM_QMM(qmm_c8_q5_0,               QF_q5_0, 8)
CYLLM_QMMA(qmma16_q5_0,                QF_q5_0, 2)
CYLLM_QMMA(qmma32_q5_0,                QF_q5_0, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q5_0,        QF_q5_0, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q5_0,        QF_q5_0, 4)
#endif
#if defined(QMV_ALL) || defined(QMV_q5_1)
CYLLM_QMV(qmv_q5_1,                    QF_q5_1, 0, false)
CYLLM_QMV(qmv_q5_1_norm,               QF_q5_1, 0, true)
CYLLM_QMV(qmv_add_q5_1,                QF_q5_1, 1, false)
CYLLM_QMV(qmv_add_q5_1_norm,           QF_q5_1, 1, true)
CYLLM_QMV(qmv_gate_up_silu_q5_1,       QF_q5_1, 2, false)
CYLLM_QMV(qmv_gate_up_silu_q5_1_norm,  QF_q5_1, 2, true)
CYLLM_QMV(qmv_gate_up_gelu_q5_1,       QF_q5_1, 3, false)
CYLLM_QMV(qmv_gate_up_gelu_q5_1_norm,  QF_q5_1, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q5_1,            QF_q5_1, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q5_1,   QF_q5_1, false)
CYLLM_QMV_QKV(qmv_qkv_q5_1_norm,       QF_q5_1, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q5_1_norm, QF_q5_1, true)
CYLLM_QMV_EXPERTS(qmv_experts_q5_1, QF_q5_1, 0)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_silu_q5_1, QF_q5_1, 2)
CYLLM_QMV_EXPERTS(qmv_experts_gate_up_gelu_q5_1, QF_q5_1, 3)
CYLLM_QDEQ(qdeq_f16_q5_1,              QF_q5_1)
CYLLM_QROWS(qrows_f32_q5_1,            QF_q5_1)
CYLLM_QMM(qmm_c4_q5_1,               QF_q5_1, 4)
CYLLM_QMM(qmm_c8_q5_1,               QF_q5_1, 8)
CYLLM_QMMA(qmma16_q5_1,                QF_q5_1, 2)
CYLLM_QMMA(qmma32_q5_1,                QF_q5_1, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q5_1,        QF_q5_1, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q5_1,        QF_q5_1, 4)
#endif
#if defined(QMV_ALL) || defined(QMV_q4_k)
CYLLM_QMV(qmv_q4_k,                    QF_q4_k, 0, false)
CYLLM_QMV(qmv_q4_k_norm,               QF_q4_k, 0, true)
CYLLM_QMV(qmv_add_q4_k,                QF_q4_k, 1, false)
CYLLM_QMV(qmv_add_q4_k_norm,           QF_q4_k, 1, true)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q4_k,  QF_q4_k, 2, false)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q4_k_norm, QF_q4_k, 2, true)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q4_k,  QF_q4_k, 3, false)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q4_k_norm, QF_q4_k, 3, true)
CYLLM_QMV_QKV(qmv_qkv_q4_k,            QF_q4_k, false)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_k,   QF_q4_k, false)
CYLLM_QMV_QKV(qmv_qkv_q4_k_norm,       QF_q4_k, true)
CYLLM_QMV_QKV_ROPE(qmv_qkv_rope_q4_k_norm, QF_q4_k, true)
CYLLM_QMV_EXPERTS(qmv_experts_q4_k, QF_q4_k, 0)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_silu_q4_k, QF_q4_k, 2)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_gelu_q4_k, QF_q4_k, 3)
CYLLM_QDEQ(qdeq_f16_q4_k,              QF_q4_k)
CYLLM_QROWS(qrows_f32_q4_k,            QF_q4_k)
CYLLM_QMM(qmm_c4_q4_k,               QF_q4_k, 4)
CYLLM_QMM(qmm_c8_q4_k,               QF_q4_k, 8)
CYLLM_QMMA(qmma16_q4_k,                QF_q4_k, 2)
CYLLM_QMMA(qmma32_q4_k,                QF_q4_k, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q4_k,        QF_q4_k, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q4_k,        QF_q4_k, 4)
#endif
#if defined(QMV_ALL) || defined(QMV_q5_k)
CYLLM_QMV_WIDE(qmv_q5_k,               QF_q5_k, 0, false)
CYLLM_QMV_WIDE(qmv_q5_k_norm,          QF_q5_k, 0, true)
CYLLM_QMV_WIDE(qmv_add_q5_k,           QF_q5_k, 1, false)
CYLLM_QMV_WIDE(qmv_add_q5_k_norm,      QF_q5_k, 1, true)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q5_k,  QF_q5_k, 2, false)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q5_k_norm, QF_q5_k, 2, true)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q5_k,  QF_q5_k, 3, false)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q5_k_norm, QF_q5_k, 3, true)
CYLLM_QMV_QKV_WIDE(qmv_qkv_q5_k,       QF_q5_k, false)
CYLLM_QMV_QKV_ROPE_WIDE(qmv_qkv_rope_q5_k, QF_q5_k, false)
CYLLM_QMV_QKV_WIDE(qmv_qkv_q5_k_norm,  QF_q5_k, true)
CYLLM_QMV_QKV_ROPE_WIDE(qmv_qkv_rope_q5_k_norm, QF_q5_k, true)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_q5_k, QF_q5_k, 0)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_silu_q5_k, QF_q5_k, 2)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_gelu_q5_k, QF_q5_k, 3)
CYLLM_QDEQ(qdeq_f16_q5_k,              QF_q5_k)
CYLLM_QROWS(qrows_f32_q5_k,            QF_q5_k)
CYLLM_QMM(qmm_c4_q5_k,               QF_q5_k, 4)
CYLLM_QMM(qmm_c8_q5_k,               QF_q5_k, 8)
CYLLM_QMMA(qmma16_q5_k,                QF_q5_k, 2)
CYLLM_QMMA(qmma32_q5_k,                QF_q5_k, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q5_k,        QF_q5_k, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q5_k,        QF_q5_k, 4)
#endif
#if defined(QMV_ALL) || defined(QMV_q6_k)
CYLLM_QMV_WIDE(qmv_q6_k,               QF_q6_k, 0, false)
CYLLM_QMV_WIDE(qmv_q6_k_norm,          QF_q6_k, 0, true)
CYLLM_QMV_WIDE(qmv_add_q6_k,           QF_q6_k, 1, false)
CYLLM_QMV_WIDE(qmv_add_q6_k_norm,      QF_q6_k, 1, true)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q6_k,  QF_q6_k, 2, false)
CYLLM_QMV_WIDE(qmv_gate_up_silu_q6_k_norm, QF_q6_k, 2, true)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q6_k,  QF_q6_k, 3, false)
CYLLM_QMV_WIDE(qmv_gate_up_gelu_q6_k_norm, QF_q6_k, 3, true)
CYLLM_QMV_QKV_WIDE(qmv_qkv_q6_k,       QF_q6_k, false)
CYLLM_QMV_QKV_ROPE_WIDE(qmv_qkv_rope_q6_k, QF_q6_k, false)
CYLLM_QMV_QKV_WIDE(qmv_qkv_q6_k_norm,  QF_q6_k, true)
CYLLM_QMV_QKV_ROPE_WIDE(qmv_qkv_rope_q6_k_norm, QF_q6_k, true)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_q6_k, QF_q6_k, 0)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_silu_q6_k, QF_q6_k, 2)
CYLLM_QMV_EXPERTS_WIDE(qmv_experts_gate_up_gelu_q6_k, QF_q6_k, 3)
CYLLM_QDEQ(qdeq_f16_q6_k,              QF_q6_k)
CYLLM_QROWS(qrows_f32_q6_k,            QF_q6_k)
CYLLM_QMM(qmm_c4_q6_k,               QF_q6_k, 4)
CYLLM_QMM(qmm_c8_q6_k,               QF_q6_k, 8)
CYLLM_QMMA(qmma16_q6_k,                QF_q6_k, 2)
CYLLM_QMMA(qmma32_q6_k,                QF_q6_k, 4)
CYLLM_QMMA_EXPERTS(qmma16_experts_q6_k,        QF_q6_k, 2)
CYLLM_QMMA_EXPERTS(qmma32_experts_q6_k,        QF_q6_k, 4)
#endif
