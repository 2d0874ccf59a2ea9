"""Decode attention's plan by position (backends/cuda/shapes.py): pure rules, no GPU needed.

The kernels each plan picks are checked against numpy_ref in test_cuda_ops.py (every heads-a-block
value forced); here, which plan a position gets and that the plans only ever widen as the cache
grows (each change starts a graph regime of its own: graphs._regime).
"""

from __future__ import annotations

import pytest

from cyllm.backends.cuda.shapes import attn_bounds, attn_chunk, attn_heads_per_block


def plan(pos, n_kv, group, max_ctx, sm_count=132):
    chunk = attn_chunk(n_kv, max_ctx, sm_count)
    return attn_heads_per_block(pos, *attn_bounds(n_kv, group, chunk, sm_count), group)


def test_mistral_shape_on_132_sms():
    """8 KV heads in groups of 4, chunks of 256: one head a block below one chunk, two up to
    1.5 x the one-wave bound (16 chunks), the whole group past it."""
    assert attn_chunk(8, 32768, 132) == 256
    assert attn_bounds(8, 4, 256, 132) == (256, 4096, 6144)
    got = {pos: plan(pos, 8, 4, 32768) for pos in (0, 255, 256, 4095, 4096, 6143, 6144, 30000)}
    assert got == {0: 1, 255: 1, 256: 2, 4095: 2, 4096: 2, 6143: 2, 6144: 4, 30000: 4}


def test_groups_without_a_wider_range():
    """MHA never shares a block; a group of 2 is whole at two a block, so it has no far bound."""
    assert attn_bounds(32, 1, 256, 132)[0::2] == (0, 0)
    assert all(plan(p, 32, 1, 4096) == 1 for p in (0, 300, 4095))
    near, short, far = attn_bounds(16, 2, 256, 132)
    assert near == 256 and far == 0
    assert [plan(p, 16, 2, 8192) for p in (0, 256, short, 8000)] == [1, 2, 2, 2]


@pytest.mark.parametrize("sm_count", [20, 78, 132])
@pytest.mark.parametrize("n_kv,group", [(1, 16), (2, 6), (3, 3), (4, 7), (8, 4), (8, 8), (32, 1), (40, 3)])
def test_plans_widen_with_the_cache(n_kv, group, sm_count):
    """Bounds ordered, heads a block within 1..group and never fewer at a later position
    (MQA with 16 heads: the whole 20000-position cache fits one wave of two-head blocks)."""
    max_ctx = 20000
    chunk = attn_chunk(n_kv, max_ctx, sm_count)
    near, short, far = attn_bounds(n_kv, group, chunk, sm_count)
    assert 0 <= near <= short and (far == 0 or far > short)
    last = 1
    for pos in range(0, max_ctx, 97):
        hpb = plan(pos, n_kv, group, max_ctx, sm_count)
        assert last <= hpb <= group
        last = hpb
    # a cache that fits one wave of two-head blocks never needs whole groups
    assert last == (group if max_ctx > max(short, far) else min(2, group))
