"""Decode attention's plan by position (backends/cuda/shapes.py): pure rules, no GPU needed.

The kernels each plan picks are checked against numpy_ref in test_cuda_ops.py (every heads-a-block
value forced); here, which plan a position gets, that the plans only ever widen as the cache grows,
and that every position where the plan changes is a bound the backend notes for its graphs (each
bound starts a graph regime of its own: graphs._regime).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cyllm.backends.cuda.shapes import attn_bounds, attn_chunk, attn_heads_per_block, attn_kernel


def plan(pos, n_kv, group, max_ctx, sm_count=132):
    chunk = attn_chunk(n_kv, max_ctx, sm_count)
    return attn_heads_per_block(pos, *attn_bounds(n_kv, group, chunk, sm_count), group)


def test_mistral_shape_on_132_sms():
    """8 KV heads in groups of 4, chunks of 256: one head a block below one chunk, two up to
    1.5 x the one-wave bound of whole-group blocks (16 chunks), the whole group past it."""
    assert attn_chunk(8, 32768, 132) == 256
    assert attn_bounds(8, 4, 256, 132) == (256, 4096, 6144)
    got = {pos: plan(pos, 8, 4, 32768) for pos in (0, 255, 256, 4095, 4096, 6143, 6144, 30000)}
    assert got == {0: 1, 255: 1, 256: 2, 4095: 2, 4096: 2, 6143: 2, 6144: 4, 30000: 4}


def test_groups_without_a_wider_range():
    """MHA has no bound of its own to split a group at; a group of 2 is whole at two a block, so
    it has no far bound and keeps two a block past short."""
    assert attn_bounds(32, 1, 256, 132) == (0, 256 * 4, 0)
    near, short, far = attn_bounds(16, 2, 256, 132)
    assert (near, short, far) == (256, 256 * 8, 0)
    assert [plan(p, 16, 2, 8192) for p in (0, 255, 256, short, 8000)] == [1, 1, 2, 2, 2]


@pytest.mark.parametrize("sm_count", [20, 78, 132])
@pytest.mark.parametrize("max_ctx", [600, 20000])
@pytest.mark.parametrize("n_kv,group", [(1, 16), (2, 6), (3, 3), (4, 7), (8, 4), (8, 8), (32, 1), (40, 3)])
def test_plans_widen_with_the_cache(n_kv, group, sm_count, max_ctx):
    """Bounds ordered; heads a block within 1..group, never fewer at a later position, and
    changing only at a bound (so one graph a range between bounds holds one plan). Caches of 600
    positions take chunks under 256 where the SMs outnumber the splits."""
    chunk = attn_chunk(n_kv, max_ctx, sm_count)
    near, short, far = attn_bounds(n_kv, group, chunk, sm_count)
    assert 0 <= near <= short and (far == 0 or far > short)
    bounds = {b for b in (near, short, far) if b > 0}
    last = plan(0, n_kv, group, max_ctx, sm_count)
    for pos in range(1, max_ctx):
        hpb = plan(pos, n_kv, group, max_ctx, sm_count)
        assert last <= hpb <= group
        assert hpb == last or pos in bounds, pos
        last = hpb
    # whole groups once the cache passes far (or short); before that, at most two a block
    assert last == (group if max_ctx > max(short, far) else min(2, group))


def test_backend_plan_wiring():
    """CudaBackend._attn_plan: the bounds noted while a step is captured, K/V rows early below
    short only, a forced heads-a-block value clamped to the group (no GPU: a stand-in self)."""
    from cyllm.backends.cuda.backend import CudaBackend
    noted = []
    be = SimpleNamespace(sm_count=132, _device_mode=True, attn_v_early=None, attn_heads_per_block=None,
                         _note_attn_bounds=lambda *b: noted.append(b))
    got = [CudaBackend._attn_plan(be, pos, 8, 4, 256) for pos in (0, 300, 5000, 7000)]
    assert got == [(True, 1), (True, 2), (False, 2), (False, 4)]
    assert noted == [(256, 4096, 6144)] * 4
    be._device_mode = False
    be.attn_heads_per_block, be.attn_v_early = 9, True
    assert CudaBackend._attn_plan(be, 7000, 8, 4, 256) == (True, 4)
    be.attn_heads_per_block = 0
    assert CudaBackend._attn_plan(be, 0, 8, 4, 256) == (True, 1)
    assert len(noted) == 4


@pytest.mark.parametrize("gt", [1, 2, 4, 8])
def test_attention_kernel_choice(gt):
    """Which split-attention kernel a launch gets: the short-cache kernel whatever the switches;
    the staged kernel that loads early rows only where a cache row fills whole 32-byte sectors
    (its later batches read row pos through L1), else the butterfly or fold staged kernel."""
    aligned = 1 << 20
    assert attn_kernel(gt, True, False, True, 128, aligned, aligned) == f"attn_split_g{gt}_ve"
    assert attn_kernel(gt, False, True, True, 128, aligned, aligned) == f"attn_split_g{gt}_ek"
    assert attn_kernel(gt, False, True, True, 16, aligned, aligned) == f"attn_split_g{gt}_ek"
    assert attn_kernel(gt, False, True, False, 128, aligned, aligned) == f"attn_split_g{gt}"
    assert attn_kernel(gt, False, False, True, 128, aligned, aligned) == f"attn_split_g{gt}_fold"
    # 16-byte rows, or a cache aligned to 16 bytes only: a sector may hold row pos and an early row
    assert attn_kernel(gt, False, True, True, 8, aligned, aligned) == f"attn_split_g{gt}"
    assert attn_kernel(gt, False, True, True, 128, aligned + 16, aligned) == f"attn_split_g{gt}"
    assert attn_kernel(gt, False, True, True, 128, aligned, aligned + 16) == f"attn_split_g{gt}"
