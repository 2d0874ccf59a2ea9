"""The CUDA backend's held-back producer matvec (backends/cuda/prequant.py), on the host: which
launches go out, in which order and with which buffers, for every way the next op can go.
Needs no GPU: the backend's folding mixins run over stand-in arrays and a launch recorder.
The kernels' side (what a producer writes, what a _qx kernel reads) is tested on a GPU in
tests/test_cuda_quant.py (test_decode_prequantized_chain, test_decode_graph)."""

from __future__ import annotations

import numpy as np
import pytest

from cyllm.backends.cuda import prequant
from cyllm.backends.cuda.norm_fold import NormFolding
from cyllm.backends.cuda.prequant import PrequantFolding, qx_bytes
from cyllm.backends.cuda.rope_fold import RopeFolding


class Vec:
    """A device vector as the mixins see one: its address, size and layout."""

    def __init__(self, ptr: int, n: int):
        self.data = type("Ptr", (), {"ptr": ptr})()
        self.size = n
        self.shape = (n,)
        self.nbytes = 4 * n
        self.flags = type("Flags", (), {"c_contiguous": True})()


class Buf:
    def __init__(self, n):
        self.size = n


class FakeCupy:
    """prequant's cupy: empty() and whether the current stream is capturing."""

    def __init__(self):
        self.capturing = False
        stream = type("S", (), {"is_capturing": lambda s: self.capturing})()
        self.cuda = type("C", (), {"get_current_stream": staticmethod(lambda: stream)})
        self.uint8 = np.uint8

    def empty(self, n, dtype):
        return Buf(n)


class Be(PrequantFolding, RopeFolding, NormFolding):
    def __init__(self):
        self.prequant = True
        self._held_mv = None
        self._qx_bufs = None
        self._qx_flip = 0
        self._device_mode = True
        self.fuse_norm = True
        self._pending_norm = None
        self.fold_rope = True
        self._pending_qkv = None
        self._qx_norm = None
        self.launches = []          # (what, extra arguments)

    def _launch(self, k, grid, block, args, shared_mem=0):
        self.launches.append((k, args[-2:]))

    def _k(self, name):
        return lambda grid, block, args: self.launches.append((name, ()))


@pytest.fixture
def be(monkeypatch):
    monkeypatch.setattr(prequant, "cp", FakeCupy())
    return Be()


def hold(be, out, name="p"):
    """A quantized matvec into ``out`` (its arguments end with the consumer's qx slot)."""
    assert be._hold_producer(name, (1,), (32,), ("args", 0), 0, out)


def test_unrelated_op_launches_the_producer_as_it_was(be):
    h = Vec(0x1000, 4096)
    hold(be, h)
    assert be.launches == []
    be._flush()                                 # what every other op does first
    assert be.launches == [("p", (prequant._NULL, prequant._NULL))]
    assert be._held_mv is None


def test_consumer_through_a_folded_norm_takes_codes_of_out_times_w(be):
    h, xb, w = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(xb, h, w, 1e-5)
    assert be._held_mv is not None and be._pending_norm is not None and be.launches == []
    norm = be._take_norm(Vec(0x40000, 11008), xb)
    assert norm is not None and norm[1] is h
    qx = be._take_producer(norm[1], norm[2])
    assert isinstance(qx, Buf) and qx.size >= qx_bytes(4096)
    assert be.launches == [("p", (qx, w))]      # the producer writes x's codes, scaled by w


def test_direct_consumer_takes_plain_codes_and_buffers_alternate(be):
    g, o = Vec(0x1000, 11008), Vec(0x9000, 4096)
    hold(be, g)
    qa = be._take_producer(g, None)
    assert be.launches[-1] == ("p", (qa, prequant._NULL))
    hold(be, o, "q")                            # the consumer holds in turn
    qb = be._take_producer(o, None)
    assert qb is not qa                         # it reads qa while writing qb
    hold(be, g, "r")
    assert be._take_producer(g, None) is qa


def test_norm_of_another_vector_launches_the_producer_first(be):
    h, x, xb, w = Vec(0x1000, 4096), Vec(0x5000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(xb, x, w, 1e-5)                  # not the producer's output
    assert be.launches == [("p", (prequant._NULL, prequant._NULL))]
    assert be._pending_norm is not None
    be._flush()
    assert [k for k, _ in be.launches] == ["p", "rmsnorm_f32"]


def test_flush_keeps_the_callers_order_with_a_held_norm(be):
    h, xb, w = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(xb, h, w, 1e-5)
    be._flush()                                 # e.g. to_host: the matvec, then its norm
    assert [k for k, _ in be.launches] == ["p", "rmsnorm_f32"]
    assert be.launches[0][1] == (prequant._NULL, prequant._NULL)


def test_a_norm_that_cannot_fold_runs_after_the_producer(be):
    h, w = Vec(0x1000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(h, h, w, 1e-5)                   # in place: never folded
    assert [k for k, _ in be.launches] == ["p", "rmsnorm_f32"]


def test_a_consumer_of_another_vector_gets_none(be):
    h, x = Vec(0x1000, 4096), Vec(0x5000, 4096)
    hold(be, h)
    assert be._take_producer(x, None) is None
    assert be.launches == [("p", (prequant._NULL, prequant._NULL))]


def test_no_hold_outside_decode_step_or_for_partial_tiles(be):
    be._device_mode = False
    assert not be._hold_producer("p", (1,), (32,), ("args", 0), 0, Vec(0x1000, 4096))
    be._device_mode = True
    assert not be._hold_producer("p", (1,), (32,), ("args", 0), 0, Vec(0x1000, 4100))
    be.prequant = False
    assert not be._hold_producer("p", (1,), (32,), ("args", 0), 0, Vec(0x1000, 4096))


def test_no_buffer_is_allocated_inside_a_graph_capture(be):
    h = Vec(0x1000, 4096)
    prequant.cp.capturing = True
    hold(be, h)
    assert be._take_producer(h, None) is None   # the producer goes out as it was
    assert be.launches == [("p", (prequant._NULL, prequant._NULL))]
    prequant.cp.capturing = False
    hold(be, h)
    q = be._take_producer(h, None)
    prequant.cp.capturing = True                # allocated before the capture: reused in it
    hold(be, h)
    assert be._take_producer(h, None) is not None and q is not None


def test_dropped_pass_forgets_the_producer(be):
    hold(be, Vec(0x1000, 4096))
    be._drop_held()
    be._flush()
    assert be.launches == []


def test_a_second_norm_of_the_output_never_runs_before_the_producer(be):
    h, xb1, xb2, w = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0xD000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(xb1, h, w, 1e-5)                 # held with the producer
    be.rmsnorm(xb2, h, w, 1e-5)                 # the first norm goes out: after the producer
    assert [k for k, _ in be.launches] == ["p", "rmsnorm_f32"]
    be._flush()
    assert [k for k, _ in be.launches] == ["p", "rmsnorm_f32", "rmsnorm_f32"]


def test_an_fp16_matvec_takes_the_norm_and_the_producer_goes_first(be):
    """CudaBackend._mv (FP16 weights) folds the norm but reads x as floats: the held producer
    goes out as it was, before it."""
    h, xb, w = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    hold(be, h)
    be.rmsnorm(xb, h, w, 1e-5)
    norm, qx = be._take_input(Vec(0x40000, 4096), xb, quantized=False)
    assert norm is not None and qx is None
    assert be.launches == [("p", (prequant._NULL, prequant._NULL))]


def test_attention_hands_over_codes_but_never_through_a_norm(be):
    """A producer that cannot apply a norm's weight (attention: scales=False) has one extra
    argument; a consumer through a folded norm gets no codes from it."""
    o, h, xb, w = Vec(0x1000, 4096), Vec(0x5000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    assert be._hold_producer("attn", (32, 1), (256,), ("args", 0), 0, o, scales=False)
    qx = be._take_producer(o, None)
    assert qx is not None and be.launches == [("attn", (0, qx))]     # the recorder keeps the last two
    assert be._hold_producer("attn", (32, 1), (256,), ("args", 0), 0, o, scales=False)
    be.rmsnorm(xb, o, w, 1e-5)
    norm = be._take_norm(h, xb)
    assert be._take_producer(norm[1], norm[2]) is None
    assert be.launches[-1] == ("attn", (0, prequant._NULL))       # its one extra: null


def test_k_and_v_fold_the_norm_from_the_codes_q_read(be):
    """q folds the norm of h and reads h's codes; k and v, reading the norm's output, take the
    same codes and norm (not writing its output again); not after another op, nor after a
    matvec that wrote the norm's output."""
    h, xb, w = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096)
    q, k, v = Vec(0x40000, 4096), Vec(0x50000, 1024), Vec(0x60000, 1024)
    hold(be, h, "down")
    be.rmsnorm(xb, h, w, 1e-5)
    norm, qx = be._take_input(q, xb)
    assert norm is not None and norm[0] is xb and qx is not None
    hold(be, q, "q")
    nk, qk = be._take_input(k, xb)
    assert be.launches[-1] == ("q", (prequant._NULL, prequant._NULL))     # q goes out as it was
    assert qk is qx and nk == (None, xb, w, 1e-5)
    hold(be, k, "k")
    nv, qv = be._take_input(v, xb)
    assert qv is qx and nv[0] is None
    be._flush()                                 # e.g. rope_store
    assert be._take_input(v, xb) == (None, None)


@pytest.mark.parametrize("quantized", [True, False])
def test_codes_of_the_norm_output_are_dropped_when_it_is_written(be, quantized):
    """A matvec (quantized or FP16) writing xb: the codes q read no longer stand for it."""
    h, xb, w, q = Vec(0x1000, 4096), Vec(0x9000, 4096), Vec(0x20000, 4096), Vec(0x40000, 4096)
    hold(be, h, "down")
    be.rmsnorm(xb, h, w, 1e-5)
    be._take_input(q, xb)
    assert be._take_input(xb, q, quantized=quantized) == (None, None)
    assert be._take_input(q, xb) == (None, None)
