// A chain of quantized decode matvecs as one persistent kernel (assembled after
// quant_matvec.cu, whose formats, item loads and dot products it uses).
//
// Why: a Llama-2-7B Q4_K_M token on an H100 is ~230 kernels, and each pays 1.5-4 us beyond
// the time of its bytes (bench/results/cuda_quant_model_h100.md): blocks can only preload
// their first weights once the previous kernel's blocks free the registers that hold them,
// and after each wait comes a serial stretch (stage x, dot, reduce, store) during which
// little is in flight. Here one block per SM runs a list of matvecs (ChainOp); a producer
// warp streams every weight byte the block will need, op after op, into a ring of shared
// memory with bulk asynchronous copies (cp.async.bulk, completion counted on an mbarrier
// per slot), and never waits for anything but a free slot. The consumer warps take the
// ops in order, with a grid-wide barrier where an op reads what an earlier one wrote, so
// the weights of the next ops are already arriving while the consumers wait.
//
// Work: op i's row tile t (32 rows, quant_matvec.cu's "lane = row" layout) runs on block
// (t + rot_i) % gridDim.x; its items (blocks or superblocks of each row) go through the
// ring in chunks of `ipc` items (one slot: main plane, then plane A, plane B, each a
// contiguous byte range of the layout, so three bulk copies at most). Every consumer warp
// takes a slice of each chunk's items; the warps' sums meet in shared memory at the tile's
// end. x is staged per op per block as quant_matvec.cu does (int8 codes, the CPU kernels'
// activation rounding), from L2 only (other blocks wrote it in this kernel).
//
// The grid must be co-resident (the backend launches one block per SM and asks for more
// than half of an SM's shared memory). bar: two counters per chain, zero at launch and
// zero again when the last block leaves (a grid-barrier count and a leave count).
// Needs sm_90 (cp.async.bulk, mbarrier transaction counts). Every row count a multiple of
// 32 (whole tiles: the bulk copies need 16-byte sizes and addresses).

#ifndef CH_WARPS
#define CH_WARPS 8                      // consumer warps; one producer warp more
#endif
#define CH_THREADS ((CH_WARPS + 1) * 32)
#ifndef CH_DEBUG
#define CH_DEBUG 0                      // timing experiments: 1 no grid barriers, 2 no dots, 4 no staging
#endif
#define CH_MAX_SLOTS 16                 // ring slots (the kernel's nslots argument) at most

struct ChainOp {                        // backends/cuda/chain.py OP_DTYPE mirrors this
    const unsigned char* w[3];          // gate_up: gate, up; otherwise the parts (a q/k/v stack)
    float* out;
    const float* x;                     // the input (the un-normed vector when nw is set)
    const float* nw;                    // folded rmsnorm weight, or null
    float* xn;                          // folded rmsnorm output (written), or null
    int rows[3];                        // rows of each part (gate_up: rows[0])
    int nparts;
    int nbi;                            // items per row
    int fmt;                            // index in backends/cuda/quant.py LAYOUTS
    int mode;                           // 0: out = Wx, 1: out += Wx, 2: silu(Wg x)*(Wu x), 3: gelu_tanh
    int sync;                           // grid barrier before this op
    int tiles;                          // row tiles over all parts
    int rot;                            // tile t runs on block (t + rot) % gridDim.x
    int ipc;                            // items per chunk (one ring slot)
    float eps;
    int pad[2];                         // to 112 bytes, as the host writes them
};

// per format: 16-byte units per item, plane A and plane B bytes per item
__device__ __forceinline__ void ch_geom(int fmt, int& upi, int& ea, int& eb) {
    switch (fmt) {
    case 0: upi = QF_q8_0::UPI; ea = QF_q8_0::EA; eb = QF_q8_0::EB; break;
    case 1: upi = QF_q4_0::UPI; ea = QF_q4_0::EA; eb = QF_q4_0::EB; break;
    case 2: upi = QF_q4_1::UPI; ea = QF_q4_1::EA; eb = QF_q4_1::EB; break;
    case 3: upi = QF_q5_0::UPI; ea = QF_q5_0::EA; eb = QF_q5_0::EB; break;
    case 4: upi = QF_q5_1::UPI; ea = QF_q5_1::EA; eb = QF_q5_1::EB; break;
    case 5: upi = QF_q4_k::UPI; ea = QF_q4_k::EA; eb = QF_q4_k::EB; break;
    case 6: upi = QF_q5_k::UPI; ea = QF_q5_k::EA; eb = QF_q5_k::EB; break;
    default: upi = QF_q6_k::UPI; ea = QF_q6_k::EA; eb = QF_q6_k::EB; break;
    }
}

// ---- mbarrier and bulk copy (sm_90) ------------------------------------------------------
__device__ __forceinline__ u32 ch_saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// wait for the completion of the barrier's phase of this parity
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n\t.reg .pred P;\n"
                 "CH_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n\t"
                 "@!P bra CH_WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_to_smem(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void ch_sync_consumers() {
    asm volatile("bar.sync 1, %0;" :: "n"(CH_WARPS * 32) : "memory");
}

// every consumer thread of every block: the writes before it are visible to the reads after
__device__ __forceinline__ void ch_grid_sync(unsigned* count, unsigned target) {
    ch_sync_consumers();
    if (threadIdx.x == 0) {
        // release: the block's writes (ordered before by the barrier above) come first
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(count) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
        } while (v < target);
        __threadfence();
    }
    ch_sync_consumers();
}

// op tile t -> (part, tile within the part)
__device__ __forceinline__ void ch_part(const ChainOp& op, int t, int& p, int& tp) {
    p = 0;
    tp = t;
    while (p + 1 < op.nparts && tp >= op.rows[p] / QMV_TILE) { tp -= op.rows[p] / QMV_TILE; ++p; }
}

__device__ __forceinline__ int ch_first_tile(const ChainOp& op) {
    const int g = (int)gridDim.x;
    return (((int)blockIdx.x - op.rot) % g + g) % g;
}

// ---- the producer: every chunk of every tile of every op this block runs, in order ----
__device__ void ch_produce(const ChainOp* __restrict__ ops, int nops, u32 ring, int slot_bytes,
                           int nslots, int inflight, u32 full0, u32 empty0)
{
    u32 seq = 0;
    for (int i = 0; i < nops; ++i) {
        const ChainOp op = ops[i];
        int upi, ea, eb;
        ch_geom(op.fmt, upi, ea, eb);
        const int nm = op.mode >= 2 ? 2 : 1;
        for (int t = ch_first_tile(op); t < op.tiles; t += gridDim.x) {
            int p, tp;
            ch_part(op, t, p, tp);
            for (int c0 = 0; c0 < op.nbi; c0 += op.ipc) {
                const int k = min(op.ipc, op.nbi - c0);
                for (int m = 0; m < nm; ++m) {
                    const unsigned char* w = op.w[nm == 2 ? m : p];
                    const size_t rows = (size_t)op.rows[nm == 2 ? 0 : p];
                    const size_t t0 = (size_t)QMV_TILE * tp * op.nbi;       // items before the tile
                    const size_t items = rows * op.nbi;
                    // at most `inflight` chunks on their way: more only queues every other
                    // access (the grid barrier, x) behind them, the bandwidth is reached before
                    if (seq >= (u32)inflight) {
                        const u32 old = seq - inflight;
                        mbar_wait(full0 + 8 * (old % nslots), (old / nslots) & 1);
                    }
                    const u32 slot = seq % nslots;
                    mbar_wait(empty0 + 8 * slot, ((seq / nslots) & 1) ^ 1);
                    const u32 mb = (u32)k * upi * 16 * QMV_TILE, ab = (u32)k * QMV_TILE * ea,
                              bb = (u32)k * QMV_TILE * eb;
                    const u32 full = full0 + 8 * slot, dst = ring + slot * (u32)slot_bytes;
                    mbar_expect_tx(full, mb + ab + bb);
                    bulk_to_smem(dst, w + (t0 * upi + (size_t)c0 * upi * QMV_TILE) * 16, mb, full);
                    if (ea) bulk_to_smem(dst + mb, w + items * upi * 16 + (t0 + (size_t)c0 * QMV_TILE) * ea, ab, full);
                    if (eb) bulk_to_smem(dst + mb + ab, w + items * (upi * 16 + ea) + (t0 + (size_t)c0 * QMV_TILE) * eb,
                                         bb, full);
                    ++seq;
                }
            }
        }
    }
}

// ---- the consumers -----------------------------------------------------------------------
// item s of a chunk of k items in a slot, this lane's row
template <class F>
__device__ __forceinline__ void ch_item(QItem<F>& it, const uint4* slot, int k, int s, int lane) {
    const uint4* p = slot + (size_t)s * F::UPI * QMV_TILE + lane;
#pragma unroll
    for (int j = 0; j < F::UPI; ++j) it.u[j] = p[j * QMV_TILE];
    const unsigned char* pa = reinterpret_cast<const unsigned char*>(slot + (size_t)k * F::UPI * QMV_TILE);
    const int f = s * QMV_TILE + lane;
    it.a0 = it.a1 = 0u;
    it.b = 0;
    if (F::EA == 4) it.a0 = reinterpret_cast<const u32*>(pa)[f];
    if (F::EA == 8) {
        const uint2 v = reinterpret_cast<const uint2*>(pa)[f];
        it.a0 = v.x;
        it.a1 = v.y;
    }
    if (F::EB == 2) it.b = reinterpret_cast<const unsigned short*>(pa + (size_t)k * QMV_TILE * F::EA)[f];
}

struct ChSmem {                         // the consumers' part of shared memory
    u32* xw;                            // int8 codes of x (n / 4 words)
    float4* xs;                         // one entry per 32 elements
    float* red;                         // 2 * CH_WARPS * 32 partial sums, then CH_WARPS sums of x^2
};

template <class F, int MODE, bool NORM>
__device__ void ch_op(const ChainOp& op, const ChSmem& sm, const uint4* ring, int slot_bytes, int nslots,
                      u32 full0, u32 empty0, u32& seq)
{
    constexpr int NM = MODE >= 2 ? 2 : 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = op.nbi * F::IE;

    // stage x: warp w takes 1/CH_WARPS of its F::IE-element blocks
    const int nblk = op.nbi;
    const int e0 = F::IE * (int)(((long long)nblk * warp) / CH_WARPS);
    const int e1 = F::IE * (int)(((long long)nblk * (warp + 1)) / CH_WARPS);
    float ss = 0.0f;
    if (!(CH_DEBUG & 4)) ss = qstage<NORM, F::IE, true>(op.x, op.nw, e0, e1, sm.xw, sm.xs, lane);
    float inv = 1.0f;
    if (NORM) {
        const float t = warp_sum(ss);
        if (lane == 0) sm.red[2 * CH_WARPS * 32 + warp] = t;
    }
    ch_sync_consumers();
    if (NORM) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < CH_WARPS; ++w) t += sm.red[2 * CH_WARPS * 32 + w];
        inv = rsqrtf(t / (float)n + op.eps);
        if (op.xn != nullptr) {         // the norm's own output, shared by all blocks
            const int step = (int)gridDim.x * CH_WARPS * 32;
            for (int j = (int)blockIdx.x * CH_WARPS * 32 + (int)threadIdx.x; j < n; j += step)
                op.xn[j] = ld_l2(op.x + j) * inv * op.nw[j];
        }
    }

    for (int t = ch_first_tile(op); t < op.tiles; t += gridDim.x) {
        int p, tp;
        ch_part(op, t, p, tp);
        float acc[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m] = 0.0f;
        for (int c0 = 0; c0 < op.nbi; c0 += op.ipc) {
            const int k = min(op.ipc, op.nbi - c0);
            // the tile's items go to the warps in turn (item g to warp g % CH_WARPS), so a
            // chunk of fewer items than warps leaves the others free for the next chunk
            const int sfirst = ((warp - c0) % CH_WARPS + CH_WARPS) % CH_WARPS;
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                const u32 slot = seq % nslots;
                mbar_wait(full0 + 8 * slot, (seq / nslots) & 1);
                const uint4* base = ring + (size_t)slot * (slot_bytes / 16);
                for (int s = sfirst; s < k && !(CH_DEBUG & 2); s += CH_WARPS) {
                    QItem<F> it;
                    ch_item<F>(it, base, k, s, lane);
                    const int sg = c0 + s;
                    acc[m] += qdot(it, reinterpret_cast<const uint4*>(sm.xw) + sg * (F::IE / 16),
                                   sm.xs + sg * (F::IE / 32));
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty0 + 8 * slot);
                ++seq;
            }
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) sm.red[(m * CH_WARPS + warp) * 32 + lane] = acc[m];
        ch_sync_consumers();
        if (warp == 0) {
            float r[NM];
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < CH_WARPS; ++w) s += sm.red[(m * CH_WARPS + w) * 32 + lane];
                r[m] = s * inv;
            }
            const float res = MODE == 2 ? silu_f(r[0]) * r[NM - 1]
                            : MODE == 3 ? gelu_tanh_f(r[0]) * r[NM - 1] : r[0];
            int row = QMV_TILE * tp + lane;
            for (int q = 0; q < p; ++q) row += op.rows[q];
            if (MODE == 1) op.out[row] = ld_l2(op.out + row) + res;
            else op.out[row] = res;
        }
        ch_sync_consumers();            // red is reused by the next tile
    }
}

template <class F>
__device__ __forceinline__ void ch_op_fmt(const ChainOp& op, const ChSmem& sm, const uint4* ring, int slot_bytes,
                                          int nslots, u32 full0, u32 empty0, u32& seq)
{
    const bool norm = op.nw != nullptr;
    switch (op.mode * 2 + (norm ? 1 : 0)) {
    case 0: ch_op<F, 0, false>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 1: ch_op<F, 0, true>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 2: ch_op<F, 1, false>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 3: ch_op<F, 1, true>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 4: ch_op<F, 2, false>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 5: ch_op<F, 2, true>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    case 6: ch_op<F, 3, false>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    default: ch_op<F, 3, true>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
    }
}

// shared memory: CH_MAX_SLOTS full barriers, CH_MAX_SLOTS empty barriers (8 bytes each),
// the ring (nslots x slot_bytes, slot_bytes a multiple of 128), then the consumers'
// staging (x codes and entries for the longest row, partial sums).
extern "C" __global__ void __launch_bounds__(CH_THREADS, 1)
qchain(const ChainOp* __restrict__ ops, int nops, unsigned* __restrict__ bar, int slot_bytes, int nslots,
       int inflight, int max_n)
{
    pdl_trigger();
    unsigned char* smem = reinterpret_cast<unsigned char*>(qmv_smem);
    const u32 full0 = ch_saddr(smem), empty0 = full0 + 8 * CH_MAX_SLOTS;
    uint4* ring = reinterpret_cast<uint4*>(smem + 16 * CH_MAX_SLOTS);
    ChSmem sm;
    sm.xw = reinterpret_cast<u32*>(smem + 16 * CH_MAX_SLOTS + (size_t)nslots * slot_bytes);
    sm.xs = reinterpret_cast<float4*>(sm.xw + max_n / 4);
    sm.red = reinterpret_cast<float*>(sm.xs + max_n / 32);
    if (threadIdx.x == 0) {
        for (int s = 0; s < nslots; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, CH_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    if (warp == CH_WARPS) {             // the producer: weights only, nothing to wait for
        if ((threadIdx.x & 31) == 0) ch_produce(ops, nops, ch_saddr(ring), slot_bytes, nslots, inflight, full0, empty0);
        return;
    }
    pdl_wait();                         // x, out, xn: the previous kernels' results
    u32 seq = 0;
    unsigned syncs = 0;
    for (int i = 0; i < nops; ++i) {
        const ChainOp op = ops[i];
        if (op.sync && !(CH_DEBUG & 1)) ch_grid_sync(bar, ++syncs * gridDim.x);
        switch (op.fmt) {
#if defined(QMV_ALL) || defined(QMV_q8_0)
        case 0: ch_op_fmt<QF_q8_0>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q4_0)
        case 1: ch_op_fmt<QF_q4_0>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q4_1)
        case 2: ch_op_fmt<QF_q4_1>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q5_0)
        case 3: ch_op_fmt<QF_q5_0>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q5_1)
        case 4: ch_op_fmt<QF_q5_1>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q4_k)
        case 5: ch_op_fmt<QF_q4_k>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q5_k)
        case 6: ch_op_fmt<QF_q5_k>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
#if defined(QMV_ALL) || defined(QMV_q6_k)
        case 7: ch_op_fmt<QF_q6_k>(op, sm, ring, slot_bytes, nslots, full0, empty0, seq); break;
#endif
        default: __trap();              // a format this module was not built with
        }
    }
    // the last block out resets the counters for the next launch (all blocks are past
    // every barrier once all have counted themselves out)
    ch_sync_consumers();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(bar + 1, 1u) == gridDim.x - 1) {
            bar[0] = 0u;
            bar[1] = 0u;
            __threadfence();
        }
    }
}
