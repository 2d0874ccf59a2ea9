"""Whole models on the GPU from quantized GGUF files, against the CPU backend on the SAME file.

The CPU backend is the independent reference here: its quantized kernels are checked
against numpy_ref's dequantized math and its perplexity against llama.cpp's on the same
files (tests/test_quant_*.py); the CUDA path shares none of its code (repacked layout,
NVRTC kernels, FP16 tiles for cuBLAS in prefill).

Material (built where pip and llama.cpp are, by tests/make_cuda_quant_material.py, and
carried to the GPU machine): ``$CYLLM_CUDA_MATERIAL`` is its ``cuda_quant_material``
folder -- ``families/<kind>_q-<TYPE>.gguf`` (every model family, converted by llama.cpp's
converter to Q8_0 and quantized by llama-quantize to Q4_0 / Q4_K_M / Q5_K_M / Q6_K, each a
mix of types through llama.cpp's fallbacks for short rows) and ``ppl_text.txt``. The
default model (SmolLM2-135M-Instruct Q4_1) is ``$CYLLM_CUDA_MATERIAL/<its file name>``
(bench/device_quant.sh joins the carried parts there) or, where a cached copy exists,
cyllm's own default-model cache. Tests skip with the reason when material is missing.

Checks (rel_err = max |a - b| / max |b|, over every position and the whole vocabulary):
- against the CUDA path's own math computed by numpy_ref (``CudaMath`` below: the
  dequantized weights; prefill products in float, as cuBLAS on FP16 tiles computes them,
  except chunks of at most qmm_few_max rows; those and decode products with x rounded to
  int8 blocks of 32 for every format, as the CPU kernels round it for the 32-element formats
  (q8_0); the CPU rounds the K-quants' per 256): prefill logits of the cuBLAS path rel_err
  < 1e-2 (the issue's bound), token-by-token decode logits (the captured CUDA
  graph) < DECODE_RTOL on the tiny random models (see there), greedy text identical or
  different only after a near-tie of the reference's logits (then xfail);
- against the CPU backend on the same file: decode within DECODE_RTOL where both round x
  alike (files of 32-element formats only), else CPU_RTOL; prefill within CPU_RTOL (the CPU
  rounds x to int8 in prefill too),
  argmax agreement; the default model's perplexity within 0.5% of the CPU's (the issue's
  criterion that holds: its logits criterion, < 1e-2 against the CPU, does not, see CPU_RTOL);
- the quantized matrices of the file are on the GPU byte for byte (no dequantized copy),
  and GPU memory after load = the file's tensor bytes (the repack has the same size and
  replaces the raw upload) + KV cache + a small workspace.
Host-side (no GPU): fused q/k/v and gate/up QuantMatrix tensors cut on the host for a
backend without quantized row views give the same logits as the row views.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import cyllm
from cyllm.loading import load_path

MATERIAL = os.environ.get("CYLLM_CUDA_MATERIAL")
RTOL = 1e-2                # the logits criterion
# Decode on the tiny random family models: rounding x to int8 is discontinuous, and where two
# implementations put one element on different sides of a rounding boundary (float order of
# the norm before it) the logits move by ~1% from that position on, carried by the KV cache.
# Measured with the CPU backend against numpy_ref on Q8_0 files (same rounding rule): exact
# (< 1e-5) until the first such flip, then 0.8-1.9e-2 (smollm3, phi3, qwen2); CUDA against
# numpy_ref on every file (H100): 2e-7 .. 2.4e-2. A kernel bug (a wrong scale, row, block or
# bit) moves them by O(1).
DECODE_RTOL = 5e-2
# CUDA vs CPU where more than float order differs. Prefill: CUDA multiplies float x (FP16
# for cuBLAS), the CPU rounds x to int8 blocks; measured (numpy float vs CPU native, every
# file) 1.1e-2 .. 5.5e-2. Decode of the default model (both sides the same integer math):
# 4.8e-2 after 30 tokens on an H100 -- the flips above, in a real model over 30 layers. Making
# CUDA's prefill round x too was measured: 6.2e-2, no closer (the FP16 rounding of weights
# and x then flips a few percent of the codes). So the 1e-2 between backends holds
# only for float math; for int8 activations the perplexity criterion (0.5%) is the one kept.
# Decode of files with K-quant matrices, whose x CUDA rounds per 32 and the CPU per 256:
# measured (the per-32 numpy_ref model against the CPU backend, every K-quant family file)
# 0 .. 5.7e-2, argmax agreement 0.87-1. Prefill chunks of at most qmm_few_max rows, whose x
# CUDA rounds as in decode, against CudaMath rounding alike: the default model's 29-token
# prompt 5.1e-2 on an H200 (its 116-token prompt on the FP16 tiles: 2.8e-3). A kernel bug is O(1).
CPU_RTOL = 1e-1
PPL_RTOL = 5e-3            # perplexity within 0.5%
SEQ = 70                   # crosses the material's sliding windows (16) and rope contexts (32)
PROMPT = 40
N_GEN = 16


@pytest.fixture(autouse=True)
def _native_quant(monkeypatch):
    """Quantized GGUF matrices arrive as QuantMatrix whatever the default is."""
    monkeypatch.setenv("CYLLM_QUANT", "native")


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite logits"
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _material() -> Path:
    if not MATERIAL:
        pytest.skip("CYLLM_CUDA_MATERIAL is not set (build it with tests/make_cuda_quant_material.py)")
    p = Path(MATERIAL)
    if not (p / "families").is_dir():
        pytest.skip(f"CYLLM_CUDA_MATERIAL={MATERIAL} has no families/ folder")
    return p


def _family_files() -> list[str]:
    if not MATERIAL or not (Path(MATERIAL) / "families").is_dir():
        return ["(no material)"]
    return sorted(f.name for f in (Path(MATERIAL) / "families").glob("*.gguf")) or ["(no material)"]


def _default_model() -> Path:
    from cyllm.default_model import FILE_NAME, FILE_SIZE, default_model_path
    for p in ([Path(MATERIAL) / FILE_NAME] if MATERIAL else []) + [default_model_path(download=False)]:
        if p.is_file() and p.stat().st_size == FILE_SIZE:
            return p
    pytest.skip(f"the default model ({FILE_NAME}) is neither in CYLLM_CUDA_MATERIAL nor in the cache")


def _ids(vocab: int, n: int, seed: int = 7) -> list[int]:
    """Fixed pseudo-random tokens of the vocabulary (the lowest and highest ids avoided)."""
    return np.random.default_rng(seed).integers(3, vocab - 8, n).tolist()


def _decode_rows(model, ids) -> np.ndarray:
    return np.stack([model.forward(t, i).copy() for i, t in enumerate(ids)])


def _greedy(model, ids, n) -> list[int]:
    out = []
    logits = model.prefill(list(ids))
    for i in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = model.forward(t, len(ids) + i)
    return out


def _assert_same_greedy(gpu_ids, cpu_ids, cpu_model, prompt, what, tie=1e-2):
    """Identical ids, or a difference that starts at a near-tie of the reference's own logits
    (within `tie` of the largest |logit|)."""
    if gpu_ids == cpu_ids:
        return
    k = next(i for i, (a, b) in enumerate(zip(gpu_ids, cpu_ids)) if a != b)
    lg = cpu_model.prefill(list(prompt) + cpu_ids[:k]).copy()
    gap = float(lg[cpu_ids[k]] - lg[gpu_ids[k]])
    assert gap < tie * float(np.max(np.abs(lg))), (
        f"{what}: greedy tokens differ at {k} without a near-tie (CPU logit gap {gap:.4f}, "
        f"max |logit| {np.max(np.abs(lg)):.3f}): cuda {gpu_ids} != cpu {cpu_ids}")
    pytest.xfail(f"{what}: near-tie at generated token {k} (logit gap {gap:.2e})")


def _cuda_math_backend(few_max: int):
    """numpy_ref computing what the CUDA backend computes: dequantized weights; x rounded to
    int8 blocks of 32 for every format (q8_0's activation; the CPU's K-quant kernels round per
    256) in decode and in prefill chunks of at most ``few_max`` rows (the backend's
    qmm_few_max: its few-column kernels take the decode's rounded x); products in float in
    longer chunks (cuBLAS on FP16 tiles)."""
    from cyllm.backends.numpy_ref import NumpyBackend
    from cyllm.quant.matrix import QuantMatrix

    class CudaMath(NumpyBackend):
        def upload(self, a):
            w = super().upload(a)
            if isinstance(a, QuantMatrix):
                w.act = "q8_0"
            return w

        @staticmethod
        def _as_cuda(w, x):
            return w if x.shape[0] <= few_max else np.asarray(w)    # a plain ndarray: float products

        def matmul(self, out, w, x):
            super().matmul(out, self._as_cuda(w, x), x)

        def matmul_add(self, out, w, x):
            super().matmul_add(out, self._as_cuda(w, x), x)

        def gate_up_batch(self, out, w_gate, w_up, x, act="silu"):
            super().gate_up_batch(out, self._as_cuda(w_gate, x), self._as_cuda(w_up, x), x, act)

    return CudaMath(quantized_activations=True)


def _reference_model(path, gpu, context=None):
    """The file on CudaMath, the rows bound taken from the model ``gpu`` it is compared with."""
    from cyllm.model import Model
    cfg, w, tok = load_path(path)
    return Model.from_weights(cfg, w, tok, backend=_cuda_math_backend(gpu.backend.qmm_few_max),
                              context=context)


def _quant_mats(model) -> list:
    """The distinct CudaQuantMatrix weights the model holds (tied tables once)."""
    from cyllm.backends.cuda.quant import CudaQuantMatrix
    seen = {id(model.embedding): model.embedding, id(model.output): model.output}
    for L in model.layers:
        for a in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down, L.wqkv):
            if a is not None:
                seen[id(a)] = a
    return [a for a in seen.values() if isinstance(a, CudaQuantMatrix)]


def _quant_bytes(model) -> int:
    """Bytes of the model's quantized matrices in the file's formats, after checking that each
    holds exactly those bytes or, where widen.py's rule says so, the q8_0 blocks of its values."""
    from cyllm.backends.cuda import widen
    be = model.backend
    for a in _quant_mats(model):
        if a.file_fmt is a.fmt:
            assert a.nbytes == a.file_nbytes, a
        else:
            assert a.fmt is widen.Q8_0 and a.nbytes == widen.widened_bytes(a.rows, a.cols), a
            assert widen.widens(a.file_fmt, a.rows, a.cols, be.sm_count, be.widen_kib_per_sm), a
    return sum(a.file_nbytes for a in _quant_mats(model))


def _rounds_apart(model) -> bool:
    """Whether the CPU rounds some matrix's x otherwise than CUDA (blocks of 32): a K-quant."""
    return any(a.fmt.act != "q8_0" for a in _quant_mats(model))


def _file_bytes(path) -> tuple[int, int]:
    """(bytes of every tensor, bytes of the quantized matrices) from the GGUF header."""
    from cyllm.loading.gguf import read_gguf
    gf = read_gguf(path)
    infos = list(gf.tensors.values())
    quant = sum(t.nbytes for t in infos if len(t.shape) == 2 and t.type_name not in ("F32", "F16", "BF16"))
    return sum(t.nbytes for t in infos), quant


# -- host side: no GPU needed -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope"])
def test_fused_quant_tensors_cut_on_host(tmp_path, kind):
    """A backend whose quantized matrices have no row views (cuda) gets fused q/k/v and
    gate/up cut on the host: same weights, so the same logits as the row views."""
    cpu_mod = pytest.importorskip("cyllm.backends.cpu")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cyllm.model import Model
    from cyllm.quant import QuantMatrix
    from cyllm.quant.convert import quantize_weights
    from tinymodels import make_tiny_model

    class NoRowViews(cpu_mod.CpuBackend):
        quant_row_views = False

    path = make_tiny_model(tmp_path, kind, dtype="float32", seed=0)
    results = []
    for be in (cpu_mod.CpuBackend(1), NoRowViews(1)):
        cfg, w, tok = load_path(path)
        quantize_weights(cfg, w, "q8_0")
        fused = [k for k, v in w.items() if isinstance(v, QuantMatrix) and ("qkv" in k or "gate_up" in k)]
        assert fused, "the material has no quantized fused tensor: the test would prove nothing"
        m = Model.from_weights(cfg, w, tok, backend=be, context=64)
        L = m.layers[0]
        assert (L.wqkv is None) == (not be.quant_row_views)
        ids = _ids(cfg.vocab_size, 24)
        results.append((m.logits(ids), _decode_rows(m, ids[:8])))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=0, atol=1e-5 * np.abs(results[0][0]).max())
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=0, atol=1e-5 * np.abs(results[0][1]).max())


# -- on the GPU -------------------------------------------------------------------------------
def _require_cuda():
    from conftest import require_cuda
    return require_cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("name", _family_files())
def test_family_file_cuda_matches_reference_and_cpu(name):
    """Every family x quantization: prefill logits, decode logits and greedy text."""
    _require_cuda()
    path = _material() / "families" / name
    if not path.is_file():
        pytest.skip(f"no {name}")
    gpu = cyllm.load(path, backend="cuda")
    # every quantized matrix of the file is on the GPU in its own format, byte for byte, or
    # small q5_0 ones as q8_0 of the same values (fused Phi-3 tensors cut in parts, tied
    # tables once): nothing was dequantized
    _, quant = _file_bytes(path)
    assert quant > 0, f"{name} has no quantized matrix: the material is wrong"
    assert _quant_bytes(gpu) == quant
    ref = _reference_model(path, gpu)
    cpu = cyllm.load(path, backend="cpu")
    ids = _ids(gpu.config.vocab_size, SEQ)
    got, got_dec = gpu.logits(ids), _decode_rows(gpu, ids)
    want, want_dec = ref.logits(ids), _decode_rows(ref, ids)
    errs = {"prefill": rel_err(got, want), "decode": rel_err(got_dec, want_dec)}
    lim = {"prefill": RTOL, "decode": DECODE_RTOL}
    print(f"{name}: vs the CUDA math on numpy_ref {errs}")
    assert all(errs[k] < lim[k] for k in lim), f"{name}: vs the CUDA math on numpy_ref {errs} (limits {lim})"
    # the CPU backend: the same decode math (up to float order), x rounded in its prefill too
    c_pre, c_dec = cpu.logits(ids), _decode_rows(cpu, ids)
    cpu_errs = {"prefill": rel_err(got, c_pre), "decode": rel_err(got_dec, c_dec)}
    agree = float(np.mean(got_dec.argmax(-1) == c_dec.argmax(-1)))
    print(f"{name}: vs the CPU backend {cpu_errs}, decode argmax agreement {agree:.3f}")
    lim = {"prefill": CPU_RTOL, "decode": CPU_RTOL if _rounds_apart(gpu) else DECODE_RTOL}
    assert all(cpu_errs[k] < lim[k] for k in lim), f"{name}: vs the CPU backend {cpu_errs} (limits {lim})"
    assert agree >= 0.8
    prompt = ids[:PROMPT]
    # a flip is accepted within the decode tolerance: where rounding x to int8 lands one
    # element on the other side of a boundary the logits move by up to DECODE_RTOL, and each of
    # the two leading logits may move so, so their order can flip within twice that (H100:
    # mistral's sliding window, Q8_0, a 2.3% gap; smollm3 Q6_K, a 5.7% gap)
    _assert_same_greedy(_greedy(gpu, prompt, N_GEN), _greedy(ref, prompt, N_GEN), ref, prompt, name,
                        tie=2 * DECODE_RTOL)


@pytest.fixture(scope="module")
def default_pair():
    _require_cuda()
    path = _default_model()
    return path, cyllm.load(path, backend="cuda", context=1024), cyllm.load(path, backend="cpu", context=1024)


@pytest.mark.cuda
def test_default_model_logits(default_pair):
    """Prefill vs the CUDA math on numpy_ref: a prompt longer than qmm_few_max (the float
    products of the FP16 tiles) within the issue's 1e-2; a short one (x rounded to int8, as in
    decode) within CPU_RTOL, the bound of the same rounding over 30 layers. Decode vs the CPU
    backend (the same integer math on both, within CPU_RTOL: see there why not 1e-2)."""
    path, gpu, cpu = default_pair
    text = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a small village "
            "by the sea, there lived an old fisherman who")
    short = gpu.tokenizer.encode(text)
    few_max = gpu.backend.qmm_few_max
    long = gpu.tokenizer.encode(" ".join([text] * (few_max // len(short) + 2)))
    assert 16 < len(short) <= few_max < len(long) <= 256
    ref = _reference_model(path, gpu, 256)
    e_long = rel_err(gpu.logits(long), ref.logits(long))
    e_short = rel_err(gpu.logits(short), ref.logits(short))
    e_decode = rel_err(_decode_rows(gpu, short), _decode_rows(cpu, short))
    msg = (f"default model: prefill vs the CUDA math {e_long:.2e} ({len(long)} tokens), "
           f"{e_short:.2e} ({len(short)} tokens, x rounded); decode vs cpu {e_decode:.2e}")
    print(msg)
    assert e_long < RTOL and e_short < CPU_RTOL and e_decode < CPU_RTOL, msg


@pytest.mark.cuda
def test_default_model_greedy_text_matches_cpu(default_pair):
    """CUDA's greedy text = the CPU's: the continuation is decode (the same integer math on
    both); the prompt's last logits come from the same matvec."""
    _, gpu, cpu = default_pair
    ids = gpu.tokenizer.encode("What is the capital of France? Answer in one sentence.")
    n = 32
    g, c = _greedy(gpu, ids, n), _greedy(cpu, ids, n)
    _assert_same_greedy(g, c, cpu, ids, "default model")
    assert gpu.tokenizer.decode(g) == cpu.tokenizer.decode(c)


@pytest.mark.cuda
def test_default_model_perplexity_matches_cpu():
    _require_cuda()
    from cyllm.tools.perplexity import perplexity
    path = _default_model()
    text = (_material() / "ppl_text.txt").read_text()
    ppl = {}
    for be in ("cuda", "cpu"):
        m = cyllm.load(path, backend=be, context=256)
        ppl[be], _ = perplexity(m, text, 256, progress=False)
        del m
    assert np.isfinite(ppl["cuda"]) and 1.0 < ppl["cpu"] < 1e4
    if abs(ppl["cuda"] / ppl["cpu"] - 1.0) >= PPL_RTOL:
        # say whether CUDA sits with float math (the CPU on the file dequantized to F16)
        os.environ["CYLLM_QUANT"] = "f16"
        f16 = perplexity(cyllm.load(path, backend="cpu", context=256), text, 256, progress=False)[0]
        pytest.fail(f"perplexity cuda {ppl['cuda']:.4f} vs cpu {ppl['cpu']:.4f} "
                    f"({100 * (ppl['cuda'] / ppl['cpu'] - 1):+.2f}%); cpu on F16-dequantized weights {f16:.4f}")


# Allowance for what the pool holds besides weights and KV cache after load: the decode run
# state (logits: vocab floats), rope tables (context x head_dim/2 x 2 floats), norm vectors
# and the pool's 512-byte rounding. A dequantized FP16 copy of the default model's weights
# would add ~270 MB; of its embedding table alone 57 MB.
WORKSPACE = 16 << 20


@pytest.mark.cuda
def test_default_model_gpu_memory_is_file_bytes():
    cp = _require_cuda()
    path = _default_model()
    import gc
    pool = cp.get_default_memory_pool()
    gc.collect()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.used_bytes()
    ctx = 512
    m = cyllm.load(path, backend="cuda", context=ctx)
    m.backend.synchronize()
    after_load = pool.used_bytes() - before
    # nothing the load freed stays cached in the pool, where nvidia-smi would count it
    # (the upload's transients are allocated outside it: cuda/quant.py upload)
    assert pool.free_bytes() < 8 << 20, f"{pool.free_bytes() / 2**20:.1f} MiB free in CuPy's pool after the load"
    file_bytes, quant = _file_bytes(path)
    c = m.config
    kv = 2 * c.n_layers * c.n_kv_heads * ctx * c.head_dim * 2
    assert _quant_bytes(m) == quant > 0
    file_bytes += sum(a.nbytes - a.file_nbytes for a in _quant_mats(m))    # widened matrices, if any
    detail = (f"pool used after load {after_load / 2**20:.1f} MiB; file tensors {file_bytes / 2**20:.1f} MiB "
              f"(with any widening), KV cache {kv / 2**20:.1f} MiB, allowance {WORKSPACE / 2**20:.0f} MiB")
    assert file_bytes + kv <= after_load <= file_bytes + kv + WORKSPACE, detail
    # decoding (graph capture, attention scratch, the gate/up split buffer) adds little
    ids = m.tokenizer.encode("Hello there")
    for i, t in enumerate(ids):
        m.forward(t, i)
    m.backend.synchronize()
    grew = pool.used_bytes() - before - after_load
    assert grew < 8 << 20, f"decode allocated {grew / 2**20:.1f} MiB more ({detail})"
    print(detail + f"; decode added {grew / 2**20:.2f} MiB")
