"""Launch shapes of the F16 kernels: grid and block sizes from the problem size and the GPU,
and which decode-attention kernel and plan a launch takes.

Each rule is a measured choice (bench/results/bench_cuda_h200.md, cuda_ops_h200.md;
bench/bench_cuda.py sweeps the matvec shapes); the kernels accept any shape these give.
"""

from __future__ import annotations

from .kernel_names import ATTN_EARLY_KERNELS, ATTN_FOLD_KERNELS, ATTN_SPLIT_KERNELS

ATT_THREADS = 256             # ATT_THREADS in attention.cu
ATT_WARPS = ATT_THREADS // 32
SMEM_LIMIT = 48 * 1024        # default dynamic shared memory limit per block

# a matrix of at least this many weights is "large": decode time is its streaming time,
# so its launch shape is picked for the tail of the kernel (see matvec_shape)
MV_LARGE = 1 << 23


def blocks(n: int, threads: int) -> int:
    return (n + threads - 1) // threads


def matvec_shape(d: int, n: int, rmax: int, sm_count: int, rows: int | None = None,
                 warps: int | None = None, unroll: int | None = None, unroll_wide: int = 8,
                 rule: str = "large") -> tuple[int, int, int]:
    """(rows per warp, warps per block, loads in flight per lane) of a d x n matvec.

    rows, warps, unroll: fixed values (None = this heuristic); unroll_wide: loads in
    flight for large square/wide matrices when unroll is None.

    Measured on an H200 under PDL (bench/results/bench_cuda_h200.md, 7B decode):
    large matrices want several rows per warp (more bytes in flight per warp);
    tall ones (qkv, gate/up: many blocks, several waves) want small blocks, so
    the last wave ends evenly; square/wide ones (wo, down: one wave) want 2 rows,
    8 loads in flight and 16-warp blocks: one block per SM, every SM the same work
    (4096 rows: 128 blocks on 132 SMs).
    ``rule = "old"`` keeps the earlier rule (two blocks per SM for every matrix).
    """
    tall = 2 * d >= 5 * n
    large = rule != "old" and d * n >= MV_LARGE
    # measured on an H200: tall matrices (d >= 2.5 n) gain from 4 rows per warp
    r = min(rows or (4 if tall else 2 if large else 1), rmax)
    if warps is None:
        if large:
            warps = 2 if tall else 16
        else:
            # enough blocks to cover every SM twice, else thinner blocks
            warps = 8
            while warps > 2 and blocks(d, warps * r) < 2 * sm_count:
                warps //= 2
    # 1024 threads of a 4-row kernel would ask for more registers than an SM has
    warps = max(1, min(warps, 16))
    u = unroll
    if u is None:
        # 8 in flight measured no better on an H200 without PDL (bench/results/cuda_ops_h200.md);
        # with it, the square/wide matrices (wo, down) gain
        u = unroll_wide if (d <= n and large) else 4
    u = 8 if (u >= 8 and r <= 2) else 4
    return r, warps, u


def attn_chunk(n_kv: int, max_ctx: int, sm_count: int) -> int:
    """Cache positions per block of the split decode attention."""
    # large enough to amortise the block and keep the merge short, small enough that a
    # full cache still spreads over the SMs
    chunk = 256
    while chunk > 64 and 2 * n_kv * blocks(max_ctx, chunk) < sm_count:
        chunk //= 2
    return chunk


def attn_bounds(n_kv: int, group: int, chunk: int, sm_count: int) -> tuple[int, int, int]:
    """(near, short, far): the cache positions where decode attention changes plan.

    ``short`` is where the blocks holding positions 0..pos stop fitting one wave of the SMs
    (whole-group blocks, one a split of ``chunk`` positions a KV head). Below ``near`` each
    query head of a GQA group gets a block of its own; below ``far`` two share one; past it
    the whole group shares one (attn_heads_per_block). 0 means no such range: MHA has no
    group to split, and a group of 2 is whole at two a block. CudaBackend._attn_plan gives
    the timings behind each bound.
    """
    short = chunk * max(1, sm_count // n_kv)
    near = min(chunk, short) if group > 1 else 0
    far = short * 3 // 2 if group > 2 else 0
    return near, short, far


def attn_heads_per_block(pos: int, near: int, short: int, far: int, group: int) -> int:
    """Query heads of a GQA group that one decode-attention block takes at ``pos``."""
    hpb = 1 if pos < near else 2 if pos < max(short, far) else group
    return max(1, min(hpb, group))


def attn_kernel(gt: int, early_rows: bool, butterfly: bool, staged_early: bool, hd: int,
                k_ptr: int, v_ptr: int) -> str:
    """The split decode-attention kernel for tiles of ``gt`` heads: the short-cache one that
    loads its first K/V rows before pdl_wait (``early_rows``, _attn_plan), else the staged one,
    with a fold a score (not ``butterfly``), or with its first K rows early and its first V
    rows before the softmax (``staged_early``). The last only where a row fills whole 32-byte
    sectors (head_dim >= 16, both caches 32-byte aligned): its later batches load row pos, which
    the kernel before wrote, without bypassing L1, so no early load may share a sector with it."""
    if early_rows:
        return ATTN_SPLIT_KERNELS[(gt, True)]
    if not butterfly:
        return ATTN_FOLD_KERNELS[gt]
    if staged_early and hd >= 16 and k_ptr % 32 == 0 and v_ptr % 32 == 0:
        return ATTN_EARLY_KERNELS[gt]
    return ATTN_SPLIT_KERNELS[(gt, False)]


def attn_smem(gt: int, hd: int, chunk: int, n_split: int) -> int:
    """Dynamic shared memory of the split decode attention with gt query heads per tile."""
    return 4 * (gt * hd + gt * chunk + ATT_WARPS * gt * hd + 2 * gt + ATT_WARPS * n_split)
