"""L2 prefetch of the next quantized matvec's weights in a captured CUDA decode step
(backends/cuda/l2_prefetch.py, l2_prefetch_share in cuda/common.cuh).

The plan (record the order in the eager pass, give launch i the ranges of launch i + 1 at
capture) runs on the CPU with numpy tables; on a GPU, a decode with prefetch gives the
same logits bit for bit as one without, and the table the kernels read names exactly the
weights of the next quantized launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from cyllm.backends.cuda.l2_prefetch import RANGES, WeightPrefetch, cap_from_env, capped, ranges_of
from cyllm.errors import InvalidArgumentError


class _Mem:
    def __init__(self, ptr):
        self.ptr = ptr


class _Arr:
    """What ranges_of reads of a CuPy array: .data.ptr and .nbytes."""

    def __init__(self, ptr, nbytes):
        self.data = _Mem(ptr)
        self.nbytes = nbytes


def _launches():
    # a layer: qkv (three arrays), o, gate+up (two), down; sizes not multiples of 16 on purpose
    a = [_Arr(0x1000 * (i + 1) << 20, 1000 + 37 * i) for i in range(7)]
    return [(a[0], a[1], a[2]), (a[3],), (a[4], a[5]), (a[6],)]


def test_table_gives_each_launch_the_next_ones_ranges():
    pf = WeightPrefetch(1 << 30)
    seq = _launches()
    pf.record()
    assert all(pf.arg(w) == 0 for w in seq)          # the eager pass prefetches nothing
    pf.capture()
    ptrs = [int(pf.arg(w)) for w in seq]
    pf.stop()
    row_bytes = 2 * RANGES * 8
    assert ptrs == [pf._base + i * row_bytes for i in range(len(seq))]
    for i in range(len(seq)):
        nxt = seq[(i + 1) % len(seq)]                # the last launch gets the first's (next token)
        row = pf.table[i].reshape(RANGES, 2)
        want = [(a.data.ptr, a.nbytes // 16 * 16) for a in nxt]
        assert [tuple(int(v) for v in r) for r in row[:len(nxt)]] == want
        assert not row[len(nxt):].any()
        assert all(int(n) % 16 == 0 for _, n in row)
    assert pf.arg(seq[0]) == 0                       # after stop(): nothing


def test_a_launch_off_the_recorded_order_gets_no_prefetch():
    pf = WeightPrefetch(1 << 30)
    seq = _launches()
    pf.record()
    for w in seq:
        pf.arg(w)
    pf.capture()
    assert pf.arg(seq[0]) != 0
    assert pf.arg(seq[2]) == 0                       # recorded second: seq[1]
    assert pf.arg(seq[2]) != 0                       # third launch, as recorded
    assert pf.arg(seq[3]) != 0
    assert pf.arg(seq[0]) == 0                       # past the recording


def test_cap_takes_the_leading_bytes():
    r = ((0x10000, 4096), (0x20000, 4096), (0x30000, 4096))
    assert capped(r, 6000) == ((0x10000, 4096), (0x20000, 1904 // 16 * 16))
    assert capped(r, 100000) == r
    assert capped(r, 0) == ()
    many = tuple((0x10000 * (i + 1), 64) for i in range(RANGES + 2))
    assert len(capped(many, 1 << 20)) == RANGES
    assert ranges_of([_Arr(0x4000, 100)]) == ((0x4000, 96),)


def test_cap_zero_turns_it_off():
    pf = WeightPrefetch(0)
    pf.record()
    for w in _launches():
        assert pf.arg(w) == 0
    pf.capture()
    assert all(pf.arg(w) == 0 for w in _launches())
    assert pf.table is None


def test_env_cap(monkeypatch):
    monkeypatch.setenv("CYLLM_CUDA_L2_PREFETCH", "8")
    assert cap_from_env() == 8 << 20
    monkeypatch.setenv("CYLLM_CUDA_L2_PREFETCH", "0")
    assert cap_from_env() == 0
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("CYLLM_CUDA_L2_PREFETCH", bad)
        with pytest.raises(InvalidArgumentError, match="CYLLM_CUDA_L2_PREFETCH"):
            cap_from_env()


@pytest.mark.cuda
def test_decode_with_prefetch_is_bitwise_the_same(tmp_path, monkeypatch):
    from conftest import require_cuda
    require_cuda()
    import cyllm
    from cyllm.backends.cuda.quant import CudaQuantMatrix
    from tinymodels import make_tiny_model

    path = make_tiny_model(tmp_path, "llama3_rope")
    monkeypatch.setenv("CYLLM_CUDA_L2_PREFETCH", "0")
    off = cyllm.load(path, backend="cuda", quantize="q4_0", context=64)
    monkeypatch.setenv("CYLLM_CUDA_L2_PREFETCH", "1")
    on = cyllm.load(path, backend="cuda", quantize="q4_0", context=64)
    assert off.backend.l2_prefetch.cap == 0 and on.backend.l2_prefetch.cap == 1 << 20
    ids = on.tokenizer.encode("The quick brown fox jumps over the lazy dog")[:10]
    for pos, tok in enumerate(ids):
        np.testing.assert_array_equal(on.forward(tok, pos), off.forward(tok, pos))
    assert on.backend._graph is not None and off.backend.l2_prefetch.table is None
    # every address in the table is the start of a quantized weight of this model
    quant = [w for L in on.layers for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)]
    quant = [w for w in quant + [on.output] if isinstance(w, CudaQuantMatrix)]
    table = on.backend.l2_prefetch.table
    assert table is not None and len(table) >= len(on.layers)
    named = {int(a) for a in table[:, 0::2].ravel() if a}
    assert named and named <= {int(w.data.data.ptr) for w in quant}
