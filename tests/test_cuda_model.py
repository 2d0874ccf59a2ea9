"""The whole model on the GPU (needs CuPy, a GPU, torch and transformers).

Tiny random Hugging Face checkpoints (tests/tinymodels.py) are loaded with
``cyllm.load(path, backend="cuda")`` and compared, at every position, with the
host backends (numpy, and cpu where its extension is built) and with
transformers running on the same GPU: logits within 1e-2 (relative to the
largest logit) and the same greedy text. Prefill goes through the batched ops
(cuBLAS GEMMs, the flash-attention kernel), decoding through the CUDA graph.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from conftest import require_cuda  # noqa: E402

cp = require_cuda()
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cyllm  # noqa: E402
from tinymodels import load_reference, make_tiny_model  # noqa: E402


def _host_backends() -> list[str]:
    try:
        importlib.import_module("cyllm.backends.cpu")
        return ["numpy", "cpu"]
    except Exception:  # noqa: BLE001 - extension not built on this machine
        return ["numpy"]


HOST_BACKENDS = _host_backends()
KINDS = ["llama_mqa_odd", "mistral_gqa", "qwen2_bias", "llama_tied"]
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory):
    kind = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(kind), kind, dtype="float32", seed=3)
    return kind, path


@pytest.fixture(scope="module")
def reference(case):
    """transformers' model of the case, float32 on the GPU."""
    _, path = case
    ref = load_reference(path).to("cuda")
    yield ref
    del ref
    torch.cuda.empty_cache()


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("host", HOST_BACKENDS)
def test_logits_match_host_backend(case, host):
    _, path = case
    gpu = cyllm.load(path, backend="cuda")
    assert gpu.backend.name == "cuda" and gpu.batched_prefill
    ref = cyllm.load(path, backend=host)
    ids = gpu.tokenizer.encode(PROMPT)
    assert len(ids) > 8
    want = ref.logits(ids)                                    # (T, vocab)
    got = gpu.logits(ids)                                     # batched prefill on the GPU
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-2
    # token by token: decode_step's CUDA graph, position read on the device
    dec = cyllm.load(path, backend="cuda")
    rows = np.stack([dec.forward(t, i).copy() for i, t in enumerate(ids)])
    assert rel_err(rows, want) < 1e-2


def test_logits_match_transformers(case, reference):
    _, path = case
    gpu = cyllm.load(path, backend="cuda")
    ids = gpu.tokenizer.encode(PROMPT)
    got = gpu.logits(ids)
    with torch.no_grad():
        want = reference(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    assert rel_err(got, want) < 1e-2
    # a prefill split over positions, then decode: the cache written by both paths agrees
    gpu2 = cyllm.load(path, backend="cuda")
    half = len(ids) // 2
    first = gpu2.prefill(ids[:half], 0, all_logits=True)
    rest = np.stack([gpu2.forward(t, half + i).copy() for i, t in enumerate(ids[half:])])
    assert rel_err(np.concatenate([first, rest]), want) < 1e-2


def _greedy_ids(model, ids, n):
    """Our greedy continuation as token ids (prefill, then one token at a time)."""
    out = []
    logits = model.prefill(ids, 0)
    for i in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = model.forward(tok, len(ids) + i)
    return out


def test_greedy_text_matches(case, reference):
    _, path = case
    model = cyllm.load(path, backend="cuda")
    prompt = "Hello world! How are"
    ids = model.tokenizer.encode(prompt)
    n = 16
    eos = sorted(model.tokenizer.eos_ids) or None
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)
    expected_ids = out[0, len(ids):].tolist()
    expected = model.tokenizer.decode(expected_ids, skip_special_tokens=True)
    ours = "".join(model.generate(prompt, max_tokens=n, temperature=0.0))
    host = cyllm.load(path, backend=HOST_BACKENDS[-1])
    host_text = "".join(host.generate(prompt, max_tokens=n, temperature=0.0))
    if ours == expected:
        assert host_text == ours
        return
    # Different text is accepted only at a genuine near-tie of transformers' own logits
    # (f16 weights and activations against its f32 ones): the first differing token must
    # be within 1% of the largest logit of transformers' choice.
    mine = _greedy_ids(cyllm.load(path, backend="cuda"), ids, n)
    k = next(i for i, (a, b) in enumerate(zip(mine, expected_ids + [-1] * n)) if a != b)
    with torch.no_grad():
        lg = reference(torch.tensor([ids + expected_ids[:k]], device="cuda")).logits[0, -1].float().cpu().numpy()
    gap = float(lg[expected_ids[k]] - lg[mine[k]])
    assert gap < 1e-2 * float(np.max(np.abs(lg))), (
        f"greedy text differs at token {k} without a near-tie (gap {gap:.4f}): {ours!r} != {expected!r}")
    pytest.xfail(f"near-tie at generated token {k} (logit gap {gap:.2e}); text differs from there on")


def test_graph_replay_identical_to_eager(case, monkeypatch):
    """decode_step's replayed graph computes bit for bit what the same ops do eagerly."""
    _, path = case
    graph = cyllm.load(path, backend="cuda")
    monkeypatch.setenv("CYLLM_CUDA_GRAPHS", "0")
    eager = cyllm.load(path, backend="cuda")
    assert graph.backend.use_graphs and not eager.backend.use_graphs
    ids = graph.tokenizer.encode(PROMPT)[:12]
    for pos, tok in enumerate(ids):
        a = graph.forward(tok, pos).copy()
        b = eager.forward(tok, pos).copy()
        np.testing.assert_array_equal(a, b)
    assert graph.backend._graph is not None and eager.backend._graph is None
    # jump back: the graph reads the position from the device, the cache is overwritten in place
    np.testing.assert_array_equal(graph.forward(ids[3], 3), eager.forward(ids[3], 3))


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_prefill_graph_replays_equal_eager_chunks(case, quantize, monkeypatch):
    """Prefill chunks replayed from their graphs compute bit for bit what the eager chunks of
    the same length do, at other positions than the ones they were captured at, for the last
    logits and for all of them; the KV caches they leave are the same, and so is the decoding
    after them. A short chunk is padded to a power of two (16 here) or the full chunk (32) and
    captured the first time; a length the context's end cut short, the second time it comes.
    Quantized weights too (dequantized tiles for the GEMMs, inside the graph): there the
    all-logits chunk dequantizes the head, which grows the tile buffer, and the chunks captured
    before keep replaying from the buffers they were recorded with."""
    _, path = case
    ctx = 96
    graph = cyllm.load(path, backend="cuda", quantize=quantize, context=ctx)
    monkeypatch.setenv("CYLLM_CUDA_PREFILL_GRAPHS", "0")
    eager = cyllm.load(path, backend="cuda", quantize=quantize, context=ctx)
    for m in (graph, eager):
        m.backend.prefill_chunk = 32
        m.batch = None
    be = graph.backend
    # the eager model pads its chunks as the graph model does (the rows decide cuBLAS's sums)
    monkeypatch.setattr(eager.backend, "prefill_rows", be.prefill_rows)
    assert be.prefill_rows(13, 32) == 16 and be.prefill_rows(21, 32) == 32 and be.prefill_rows(20, 20) == 20
    ids = (graph.tokenizer.encode(PROMPT) * 8)[:ctx]
    assert len(ids) == ctx
    recorded = []
    record = be._record_chunk
    monkeypatch.setattr(be, "_record_chunk", lambda key, *a: (recorded.append(key[1:]), record(key, *a))[1])

    def same(n, pos0, **kw):
        np.testing.assert_array_equal(graph.prefill(ids[:n], pos0, **kw), eager.prefill(ids[:n], pos0, **kw))
    for pos0, n in ((0, 45), (3, 21), (0, 45), (11, 13)):      # 32 + 13 (as 16), 21 (as 32), ..., 13
        same(n, pos0)
    assert recorded == [(32, False), (16, False)] and {k[1:] for k in be._prefill_graphs} == set(recorded)
    for _ in range(2):
        same(21, 2, all_logits=True)
    assert recorded[2:] == [(32, True)] and len(be._prefill_graphs) == 3
    assert not eager.backend._prefill_graphs
    for L, E in zip(graph.layers, eager.layers):
        np.testing.assert_array_equal(cp.asnumpy(L.k_cache[:, :23]), cp.asnumpy(E.k_cache[:, :23]))
        np.testing.assert_array_equal(cp.asnumpy(L.v_cache[:, :23]), cp.asnumpy(E.v_cache[:, :23]))
    for pos in (23, 24):
        np.testing.assert_array_equal(graph.forward(ids[pos], pos), eager.forward(ids[pos], pos))
    # decoding captured its own graph and kept the prefill ones: the next prompt replays
    same(13, 5)
    assert len(recorded) == 3
    # the last 20 positions: no room to pad, so 20 rows, eager once and then captured
    same(ctx - 20, 0)
    for _ in range(3):
        np.testing.assert_array_equal(graph.prefill(ids[:20], ctx - 20), eager.prefill(ids[:20], ctx - 20))
    assert recorded[3:] == [(20, False)] and len(be._prefill_graphs) == 4


def test_graph_per_attention_regime(case, monkeypatch):
    """Positions in each of decode attention's four ranges (bounds lowered to 3, 6 and 8 here:
    one head a block, then two, then two without K/V rows before pdl_wait, then the whole
    group) replay four graphs, each bit for bit the eager ops; going back below a bound
    replays the first graph again."""
    _, path = case
    graph = cyllm.load(path, backend="cuda")
    monkeypatch.setenv("CYLLM_CUDA_GRAPHS", "0")
    eager = cyllm.load(path, backend="cuda")
    for be in (graph.backend, eager.backend):
        def plan(pos, n_kv, group, chunk, be=be):
            if be._device_mode:
                be._attn_bounds = (3, 6, 8)
            return pos < 6, 1 if pos < 3 else min(2, group) if pos < 8 else group
        be._attn_plan = plan
    ids = graph.tokenizer.encode(PROMPT)[:10]
    for pos, tok in enumerate(ids):
        np.testing.assert_array_equal(graph.forward(tok, pos), eager.forward(tok, pos))
    if graph.backend._attn_bounds is None:      # head_dim off the fast path (24): one graph
        assert set(graph.backend._graphs) == {None}
        return
    assert set(graph.backend._graphs) == {0, 1, 2, 3}
    first = graph.backend._graphs[0]
    np.testing.assert_array_equal(graph.forward(ids[1], 1), eager.forward(ids[1], 1))
    assert graph.backend._graph is first


def test_norm_folding_matches_unfolded(case, monkeypatch):
    """rmsnorm folded into the matvecs (the default) against separate rmsnorm launches."""
    _, path = case
    folded = cyllm.load(path, backend="cuda")
    monkeypatch.setenv("CYLLM_CUDA_FUSE_NORM", "0")
    plain = cyllm.load(path, backend="cuda")
    assert folded.backend.fuse_norm and not plain.backend.fuse_norm
    ids = folded.tokenizer.encode(PROMPT)[:10]
    for pos, tok in enumerate(ids):
        # the f16 KV cache turns last-bit differences into f16 rounding flips: 1e-3, not 1e-6
        assert rel_err(folded.forward(tok, pos), plain.forward(tok, pos)) < 1e-3
