"""The CPU backend's captured decode step (CpuBackend.decode_step, kernels.DecodeProgram).

The model calls backend.decode_step(issue_ops, token, pos) for every token; the
first call records the ops, later calls run them as one C program inside one
OpenMP parallel region. Its logits must be bitwise those of the op-by-op path
(CYLLM_FUSED=0), and the same for 1 and 2 threads, on every tiny model kind
(MQA with odd sizes, explicit head_dim, Llama 3 rope, GQA, Qwen2 biases, tied
embeddings, mixtures of experts), including positions past the 256-position attention block.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import cyllm  # noqa: E402
from cyllm.errors import InvalidArgumentError  # noqa: E402

try:
    from cyllm.backends.cpu import CpuBackend
    from cyllm._ext import kernels as _k
except Exception as e:                     # extension not built
    pytest.skip(f"cpu kernels not built: {e}", allow_module_level=True)

from cyllm.loading import load_path  # noqa: E402
from cyllm.model import Model  # noqa: E402
from tinymodels import make_tiny_model  # noqa: E402

_LOADED = {}


def load(path, backend, context):
    """Model.from_weights on a cached (config, weights, tokenizer) of path, bound to `backend`."""
    if path not in _LOADED:
        _LOADED[path] = load_path(path)
    config, weights, tok = _LOADED[path]
    return Model.from_weights(config, weights, tok, backend=backend, context=context)

KINDS = ["llama_mqa_odd", "llama_explicit_head_dim", "llama3_rope", "mistral_gqa", "qwen2_bias",
         "llama_tied", "qwen3moe", "mixtral", "olmoe"]
VARIANTS = [v for v in ("generic", "avx2", "avx512") if v in _k.available_variants()]


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=5)


def decode_logits(path, threads, fused, variant, steps, prompt_len=20, context=400):
    m = load(path, CpuBackend(threads, variant=variant, fused=fused), context)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, m.config.vocab_size, prompt_len + len(steps)).tolist()
    m.prefill(ids[:prompt_len], 0)
    out = []
    for i in steps:
        out.append(m.forward(ids[prompt_len + i], prompt_len + i).copy())
    return m, np.array(out)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_bitwise_equal_op_by_op(model_dir, variant):
    steps = list(range(6))
    runs = {}
    for threads in (1, 2):
        for fused in (False, True):
            m, runs[(threads, fused)] = decode_logits(model_dir, threads, fused, variant, steps)
            if fused:
                info = m.backend.step_info()
                assert info is not None and info["ops"] > 0
    base = runs[(1, False)]
    assert np.all(np.isfinite(base))
    for key, val in runs.items():
        assert np.array_equal(val.view(np.uint32), base.view(np.uint32)), key


def test_fused_long_context_bitwise(model_dir):
    """Past the 256-position attention block (blocked, merged attention), 1 vs 2 threads."""
    steps = list(range(0, 300, 1))
    variant = VARIANTS[-1]
    runs = [decode_logits(model_dir, t, f, variant, steps, prompt_len=10, context=320)[1]
            for t, f in ((1, False), (2, True), (1, True))]
    for r in runs[1:]:
        assert np.array_equal(r.view(np.uint32), runs[0].view(np.uint32))


def test_recapture_for_another_model(model_dir):
    """One backend shared by two models: each model's issue_ops gets its own program."""
    b = CpuBackend(2)
    m1 = load(model_dir, b, 64)
    m2 = load(model_dir, b, 64)
    ref = load(model_dir, CpuBackend(2, fused=False), 64)
    for pos, tok in enumerate([3, 9, 4, 1]):
        a = m1.forward(tok, pos).copy()
        c = m2.forward(tok, pos).copy()
        r = ref.forward(tok, pos).copy()
        assert np.array_equal(a, r) and np.array_equal(c, r)


def test_bad_step_arguments(model_dir):
    m = load(model_dir, CpuBackend(2), 32)
    m.forward(1, 0)
    with pytest.raises(cyllm.errors.CyllmError):
        m.forward(m.config.vocab_size, 1)
    with pytest.raises(cyllm.errors.CyllmError):
        m.forward(1, 32)
    prog = m.backend._step_program
    with pytest.raises(InvalidArgumentError):
        prog.run(-1, 0, 2)
    with pytest.raises(InvalidArgumentError):
        prog.run(0, 32, 2)
    with pytest.raises(InvalidArgumentError):
        prog.run(0, 0, 0)


def test_env_switch_off():
    code = ("from cyllm.backends.cpu import CpuBackend\n"
            "print(CpuBackend(1).fused)\n")
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, CYLLM_FUSED=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want


def test_not_capturable_falls_back():
    """An issue_ops with an op the program cannot express still runs (op by op)."""
    b = CpuBackend(1)
    out = np.zeros(4, np.float32)
    table = np.arange(40, dtype=np.float16).reshape(10, 4)

    def issue(token, pos):
        b.embed(out, table, token)
        b.embed(out, table, 2)             # a token other than the step's: not capturable

    b.decode_step(issue, 5, 0)
    assert b.step_info() is None and np.array_equal(out, table[2].astype(np.float32))
    b.decode_step(issue, 7, 1)
    assert np.array_equal(out, table[2].astype(np.float32))


@pytest.mark.parametrize("qtype", [None, "q4_k", "q8_0"])
def test_stolen_rows_keep_the_bits(qtype, tmp_path_factory):
    """A decode step's idle threads take chunks of the others' matvec rows (program.c,
    run_claimed); whoever computes a row, the logits are bitwise those of fixed shares and of
    the op-by-op path. Mode 2 makes every thread start with its neighbour's share, so rows do
    change hands; 3 threads leave uneven shares."""
    from cyllm.quant.convert import quantize_weights
    path = make_tiny_model(tmp_path_factory.mktemp("steal"), "mistral_gqa", seed=7)
    config, weights, tok = load_path(path)
    if qtype:
        weights = quantize_weights(config, weights, qtype)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config.vocab_size, 24).tolist()

    def logits(threads, fused, steal):
        old = _k._set_steal(steal)
        try:
            m = Model.from_weights(config, weights, tok, backend=CpuBackend(threads, fused=fused), context=64)
            m.prefill(ids[:18], 0)
            return np.array([m.forward(ids[18 + i], 18 + i).copy() for i in range(6)])
        finally:
            _k._set_steal(old)

    base = logits(1, False, 1)
    assert np.all(np.isfinite(base))
    for threads in (2, 3):
        for steal in (0, 1, 2):
            got = logits(threads, True, steal)
            assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), (threads, steal)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe"])
def test_moe_program_bitwise_and_mixed_experts_op_by_op(kind, qtype, tmp_path_factory):
    """A mixture of experts' decode is one program (the router, the choice and the chosen
    experts in C: program.c, moe_layer_step) with the op-by-op path's bits, quantized experts
    included (qwen3moe's rows of 40 keep down in float16 beside quantized gate/up). Experts of
    two formats in one role cannot be one program: the step runs op by op, with those bits."""
    from cyllm.quant.convert import quantize_matrix, quantize_weights
    from cyllm.quant.matrix import QuantMatrix
    path = make_tiny_model(tmp_path_factory.mktemp("moe"), kind, seed=7)
    config, weights, tok = load_path(path)
    weights = quantize_weights(config, dict(weights), qtype)
    assert any(isinstance(a, QuantMatrix) for n, a in weights.items() if ".experts." in n)
    mixed = dict(weights)
    name = next(n for n, a in weights.items() if ".experts.1." in n and isinstance(a, QuantMatrix))
    mixed[name] = quantize_matrix(weights[name].dequantize().astype(np.float16), "q8_0" if qtype != "q8_0"
                                  else "q4_0", name)
    ids = np.random.default_rng(3).integers(0, config.vocab_size, 20).tolist()

    def logits(w, threads, fused):
        b = CpuBackend(threads, fused=fused)
        m = Model.from_weights(config, w, tok, backend=b, context=64)
        m.prefill(ids[:14], 0)
        out = np.array([m.forward(ids[14 + i], 14 + i).copy() for i in range(6)])
        return out, b.step_info()

    for w, captured in ((weights, True), (mixed, False)):
        base, _ = logits(w, 1, False)
        assert np.all(np.isfinite(base))
        for threads in (1, 2):
            got, info = logits(w, threads, True)
            assert (info is not None) == captured
            assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), (captured, threads)


def test_steal_mode_checked():
    with pytest.raises(ValueError):
        _k._set_steal(5)
    with pytest.raises(ValueError):
        _k._set_wide_prefetch(-1, 8192)


def test_program_refuses_a_second_thread(model_dir):
    """A run releases the GIL, and its row claims and scratch serve one run at a time: a
    second thread entering the same program gets an error, never a shared step."""
    import threading
    m, _ = decode_logits(model_dir, 2, True, VARIANTS[-1], [0, 1])
    prog = m.backend._step_program
    assert prog is not None
    import time
    done, errors = threading.Event(), []

    def runner():
        # until the other thread has met a run in progress (a fixed count of runs could all
        # finish between its attempts on a loaded machine), or 30 s
        deadline = time.monotonic() + 30
        try:
            while not errors and time.monotonic() < deadline:
                prog.run(1, 3, 2)
        finally:
            done.set()

    t = threading.Thread(target=runner)
    t.start()
    while not done.is_set():
        try:
            prog.run(1, 3, 2)
        except RuntimeError as e:
            errors.append(str(e))
    t.join()
    assert errors and "already running" in errors[0]
