"""Every supported model family against Hugging Face transformers, from an HF directory
and from the GGUF that llama.cpp's own converter writes of the same weights.

The material (tiny random models of each family, built with transformers' own
classes, and their GGUF conversions) comes from tests/tinymodels.py and
tests/llamacpp_tools.py; see FAMILY_FEATURES there for what each kind exercises
(sliding windows shorter than the sequence, two rope bases, partial rotary,
longrope past its original context, NoPE layers, q/k norms, fused tensors...).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cyllm  # noqa: E402
from conftest import HOST_BACKENDS, cuda_available  # noqa: E402
from llamacpp_tools import (VOCABS, family_material, llamacpp_template, llamacpp_vocab,  # noqa: E402,F401
                            llamacpp_vocab_file)
from tinymodels import (FAMILY_FEATURES, FAMILY_KINDS, GGUF_FAITHFUL, GGUF_PRE, KIND_TOKENIZER,  # noqa: E402
                        MOE_ARCHS, load_reference, make_tiny_model)

MOE_KINDS = {k for k, (arch, _) in FAMILY_KINDS.items() if arch in MOE_ARCHS}
SEQ = 70          # crosses every window (16) and original rope context (32) of the material
PROMPT = 40       # greedy-text prompt: past the longrope original context from the first token
N_GEN = 16
BACKENDS = HOST_BACKENDS + [pytest.param("cuda", marks=pytest.mark.cuda)]


def _backend(name):
    if name == "cuda" and not cuda_available():
        pytest.skip("no CUDA GPU")
    return name


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _ids(model, n=SEQ):
    """A fixed pseudo-random token sequence of the model's vocabulary (special tokens avoided)."""
    rng = np.random.default_rng(7)
    return rng.integers(3, model.config.vocab_size - 8, n).tolist()


@pytest.fixture(scope="module")
def reference(family_material):
    """kind -> (transformers model, its float32 logits of the test sequence)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            ref = load_reference(family_material.hf_dir(kind))
            cache[kind] = ref
        return cache[kind]
    return get


def _hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()       # (T, vocab)


# A mixture of experts picks a token's experts by the order of its router probabilities. Where
# the last chosen expert and the next one are within cyllm's rounding of each other (its KV
# cache is float16, transformers' float32: ~1e-4 of a probability here), the two sides may
# choose differently, and that token's logits then differ by far more than the 1e-2 asked (on
# the tiny models, flips were measured at margins of 7e-5 and 9e-5, giving 8e-2 and 1e-1).
NEAR_TIE = 1e-3
# cuda's prefill rounds activations to float16 for its GEMMs: ~1e-3 of each, so its choices may
# differ from transformers' at margins ten times wider
NEAR_TIE_CUDA = 1e-2


def _router_margins(ref, ids):
    """(T,) for a mixture of experts: at each position, the smallest margin over layers between
    the router probability of the last expert transformers chooses and the next one's; None for
    a dense model. Read from the input of each layer's MoE block (_router: its router)."""
    blocks = _moe_blocks(ref)
    if not blocks:
        return None
    k = ref.config.num_experts_per_tok
    margins = []

    def hook(block, args):
        h = args[0].reshape(-1, args[0].shape[-1])
        p = torch.sort(torch.softmax(h.float() @ _router(block).weight.float().T, -1), -1, descending=True).values
        margins.append((p[:, k - 1] - p[:, k]).numpy())
    handles = [b.register_forward_pre_hook(hook) for b in blocks]
    try:
        _hf_logits(ref, ids)
    finally:
        for h in handles:
            h.remove()
    return np.min(margins, axis=0)


def _assert_parity(ours, theirs):
    assert ours.shape == theirs.shape
    assert rel_err(ours, theirs) < 1e-2
    assert float(np.mean(ours.argmax(-1) == theirs.argmax(-1))) > 0.98


def _moe_blocks(ref):
    return [m for m in ref.modules() if (hasattr(m, "gate") or hasattr(m, "router")) and hasattr(m, "experts")]


def _router(block):
    """The module whose output is (logits, weights, chosen ids): Granite MoE's router, the others' gate."""
    return block.router if hasattr(block, "router") else block.gate


def _router_outputs(output) -> tuple[str, str, str]:
    """What each of a router's three outputs is, in its order: the chosen ids are the integer
    tensor, their weights the float one as wide as it, the logits the other (transformers 5.24
    returns (logits, weights, ids) for every family; 5.17's Granite MoE (ids, weights, logits))."""
    ids = next(i for i, t in enumerate(output) if not t.is_floating_point())
    k = output[ids].shape[-1]
    names = ["logits"] * 3
    names[ids] = "chosen"
    names[next(i for i, t in enumerate(output) if i != ids and t.shape[-1] == k)] = "scores"
    return tuple(names)


def _recording_routes(model, op, run):
    """run() with the backend's moe op ``op`` recording the experts each call chose: (its result,
    the chosen experts of every call, (rows, k) each, in call order). A recorded step (cpu's
    decode program, cuda's graph) calls no op when replayed, so each step's ops run as issued
    meanwhile; where cuda routes on the device, the choice is read back from there."""
    b, routes = model.backend, []
    inner = getattr(b, op)

    def record(out, x, router, experts, n_used, norm, act, scratch):
        inner(out, x, router, experts, n_used, norm, act, scratch)
        rows = 1 if x.ndim == 1 else x.shape[0]
        if getattr(scratch, "dev", None) is not None:         # cuda routed on the device
            chosen = scratch.dev.ids[:rows * n_used].get().reshape(rows, n_used)
            routes.append(chosen.astype(scratch.ids.dtype))
        else:
            routes.append(scratch.ids[:rows].copy())
    setattr(b, op, record)
    saved = b.data_dependent_steps, b.data_dependent_prefill
    b.data_dependent_steps = b.data_dependent_prefill = True
    try:
        return run(), routes
    finally:
        delattr(b, op)
        b.data_dependent_steps, b.data_dependent_prefill = saved


def _assert_argmax_where_clear(got, want):
    """The same argmax at every position but near-ties: where the two differ, the reference's
    gap between its choice and ours is within four times the typical (median) size of the
    two sides' difference at a position. A position whose logits alone go wrong fails."""
    a, b = want.argmax(-1), got.argmax(-1)
    rows = np.arange(len(a))
    gap = want[rows, a] - want[rows, b]
    typical = float(np.median(np.max(np.abs(got - want), -1)))
    bad = np.flatnonzero((a != b) & (gap > 4 * typical))
    assert bad.size == 0, (f"argmax differs without a near-tie at positions {bad.tolist()} "
                           f"(gaps {gap[bad].tolist()}, typical difference {typical:.3g})")


def _our_logits(model, ids):
    """model.logits(ids) and, for a mixture of experts, the experts it chose: (layers, T, k)."""
    if not model.config.moe:
        return model.logits(ids), None
    logits, routes = _recording_routes(model, "moe_batch", lambda: model.logits(ids))
    assert len(routes) == model.config.n_layers          # one prefill chunk
    return logits, np.stack(routes)[:, :len(ids)]


def _hf_logits_routed(ref, ids, routes):
    """transformers' logits with each layer's router made to choose the experts ``routes`` names
    (their weights still its own probabilities, renormalized where its own choice was), and what
    it would have chosen itself: (logits, [(its experts (T, k), margins (T,)) per layer]), the
    margin between the probabilities of its last chosen expert and the next one."""
    gates = [_router(blk) for blk in _moe_blocks(ref)]
    assert len(gates) == len(routes)
    own = []

    def hook_for(layer):
        def hook(gate, args, output):
            order = _router_outputs(output)
            logits, scores, chosen = (output[order.index(name)] for name in ("logits", "scores", "chosen"))
            probs = torch.softmax(logits.float(), -1)
            k = chosen.shape[-1]
            top = torch.sort(probs, -1, descending=True).values
            own.append((chosen.numpy().copy(), (top[:, k - 1] - top[:, k]).numpy()))
            renormalized = not torch.allclose(scores.float(), probs.gather(-1, chosen), atol=1e-7)
            forced = torch.as_tensor(routes[layer], dtype=chosen.dtype)
            w = probs.gather(-1, forced)
            if renormalized:
                w = w / w.sum(-1, keepdim=True)
            mine = {"logits": logits, "scores": w.to(scores.dtype), "chosen": forced}
            return tuple(mine[name] for name in order)
        return hook
    handles = [g.register_forward_hook(hook_for(i)) for i, g in enumerate(gates)]
    try:
        out = _hf_logits(ref, ids)
    finally:
        for h in handles:
            h.remove()
    return out, own


def _assert_model_parity(model, ref, ids):
    """The model's logits of ids within 1e-2 of transformers'. For a mixture of experts, with
    transformers' routers made to choose the experts this model chose, after checking that
    they are the ones transformers chooses wherever its choice is clear (no near-tie): a
    near-tie decided the other way would otherwise change that token and, through attention,
    the ones after it by more than 1e-2."""
    ours, routes = _our_logits(model, ids)
    if routes is None:
        _assert_parity(ours, _hf_logits(ref, ids))
        return
    theirs, own = _hf_logits_routed(ref, ids, routes)
    near, clear = NEAR_TIE_CUDA if model.backend.name == "cuda" else NEAR_TIE, 0
    for layer, (chosen, margin) in enumerate(own):
        for t in np.flatnonzero(margin >= near):
            assert set(routes[layer][t]) == set(chosen[t]), f"layer {layer} position {t}"
        clear += int(np.sum(margin >= near))
    # most choices are clear (measured on the tiny models: 75-95% at cuda's margin, OLMoE's 8
    # experts lowest), so the check above is not vacuous
    assert clear > 0.6 * routes.shape[0] * routes.shape[1]
    _assert_parity(ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(FAMILY_KINDS), ids=list(FAMILY_KINDS))
def test_hf_dir_logits_match_transformers(family_material, reference, kind, backend):
    """Logits at all 70 positions (prefill) within 1e-2 of transformers' float32 eager forward."""
    model = cyllm.load(family_material.hf_dir(kind), backend=_backend(backend))
    _assert_model_parity(model, reference(kind), _ids(model))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(FAMILY_KINDS), ids=list(FAMILY_KINDS))
def test_greedy_text_matches_transformers(family_material, reference, kind, backend):
    model = cyllm.load(family_material.hf_dir(kind), backend=_backend(backend))
    ids = _ids(model, PROMPT)
    ref = reference(kind)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=N_GEN, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    margins = _router_margins(ref, out[0].tolist())
    if margins is not None:
        # a near-tie of experts may fork the text there: compare the tokens before it
        near = np.flatnonzero(margins[len(ids) - 1:] < NEAR_TIE)
        if near.size:
            expected = expected[:near[0]]
    # cyllm's own loop on the same ids; EOS is not special here (eos_token_id=None above)
    session_ids = list(ids)
    logits = model.prefill(session_ids)
    ours = []
    for i in range(N_GEN):
        t = int(np.argmax(logits))
        ours.append(t)
        logits = model.forward(t, len(ids) + i)
    assert model.tokenizer.decode(ours[:len(expected)]) == model.tokenizer.decode(expected)


def _decode_and_prefill_routed_alike(batched, step, ids):
    """(prefill's logits, decode's logits) of a mixture of experts at the positions before the
    first token the two paths route differently: they may decide a near-tie of experts either
    way (cuda's prefill rounds x to float16)."""
    want, batch_routes = _our_logits(batched, ids)
    got, step_routes = _recording_routes(
        step, "moe", lambda: np.stack([step.forward(t, i).copy() for i, t in enumerate(ids)]))
    step_routes = np.stack(step_routes).reshape(len(ids), -1, step_routes[0].shape[-1]).swapaxes(0, 1)
    same = np.array([[set(a) == set(b) for a, b in zip(la, lb)] for la, lb in zip(batch_routes, step_routes)])
    assert same.mean() > 0.95, f"decode and prefill route {(~same).sum()} of {same.size} tokens differently"
    first = len(ids) if same.all() else int(np.argmin(same.all(0)))
    cuda = step.backend.name == "cuda"
    assert first >= (1 if cuda else len(ids) // 2), f"routes part at position {first}"
    return want[:first], got[:first]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(FAMILY_KINDS), ids=list(FAMILY_KINDS))
def test_decode_equals_prefill(family_material, kind, backend):
    """One token at a time through decode gives the batched prefill's logits."""
    backend = _backend(backend)
    path = family_material.hf_dir(kind)
    batched = cyllm.load(path, backend=backend)
    ids = _ids(batched)
    step = cyllm.load(path, backend=backend)
    if batched.config.moe:
        want, got = _decode_and_prefill_routed_alike(batched, step, ids)
    else:
        want = batched.logits(ids)
        got = np.stack([step.forward(t, i).copy() for i, t in enumerate(ids)])
    # Not bitwise: the GEMM and the matvec sum in different orders (~1e-7), and a K or V value
    # that lands on an FP16 rounding boundary then differs by one FP16 ulp (~5e-4 of itself) in
    # the cache; measured worst case 1.03e-4 on cpu (llama32). The cuda prefill also feeds
    # cuBLAS FP16 inputs. Measured worst case on the host backends: 4.4e-4 (mistral_swa, numpy).
    # cuda: its prefill rounds activations to FP16 for cuBLAS (measured 1.8e-3 on an H100, llama32)
    assert rel_err(got, want) < (5e-3 if backend == "cuda" else 1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(GGUF_FAITHFUL))
def test_gguf_from_llamacpp_converter_matches_transformers(family_material, reference, kind, backend):
    """The same weights as a GGUF written by llama.cpp's converter (its conventions: q/k
    permutation, Gemma's +1 norms, fused Phi-3 tensors, rope_freqs / rope_factors)."""
    model = cyllm.load(family_material.gguf(kind, "f32"), backend=_backend(backend))
    assert model.config.arch == FAMILY_KINDS[kind][0] or (kind, model.config.arch) == ("llama32", "llama")
    _assert_model_parity(model, reference(kind), _ids(model))


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3_longrope"])
def test_gguf_f16_and_q8_0_files(family_material, reference, kind):
    """F16 and Q8_0 conversions: F16 at the HF tolerance, Q8_0 near the F16 logits (8-bit weights:
    measured up to 5.3e-2 on these tiny random models) with the same argmax nearly everywhere."""
    backend = HOST_BACKENDS[-1]
    f16 = cyllm.load(family_material.gguf(kind, "f16"), backend=backend)
    ids = _ids(f16)
    l16 = f16.logits(ids)
    _assert_parity(l16, _hf_logits(reference(kind), ids))
    q8 = cyllm.load(family_material.gguf(kind, "q8_0"), backend=backend)
    l8 = q8.logits(ids)
    assert rel_err(l8, l16) < 1e-1
    assert float(np.mean(l8.argmax(-1) == l16.argmax(-1))) > 0.9


@pytest.mark.parametrize("backend", [HOST_BACKENDS[-1], pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", sorted(MOE_KINDS))
def test_moe_f16_and_q8_0_files(family_material, reference, kind, backend):
    """The experts stacked in one tensor a layer, as F16 (at the HF tolerance) and as Q8_0, each
    expert a row range of the stack in its block format: the native kernels against the
    reference's math on the same blocks (numpy_ref with activations rounded to int8 blocks as
    the kernels round them), its routers made to choose as the backend did. Against the F16
    file instead, 8-bit weights move the router's probabilities by ~1e-3, so that many
    positions of these tiny models pick another expert somewhere (measured: logits 0.24 and
    0.18 apart)."""
    from cyllm.backends.numpy_ref import NumpyBackend
    from cyllm.loading import load_path
    from cyllm.model import Model
    from cyllm.quant.matrix import QuantMatrix
    backend = _backend(backend)
    f16 = cyllm.load(family_material.gguf(kind, "f16"), backend=backend)
    ids = _ids(f16)
    _assert_model_parity(f16, reference(kind), ids)
    path = family_material.gguf(kind, "q8_0")
    q8 = cyllm.load(path, backend=backend)
    assert backend != "cpu" or all(isinstance(L.experts[0][0], QuantMatrix) for L in q8.layers)
    got, routes = _our_logits(q8, ids)
    # the reference chooses the experts the backend chose: near-ties of the router, which cuda's
    # float16 tiles (its prefill of 70 rows) can decide either way, would otherwise make the two
    # differ by far more than their arithmetic does
    config, weights, tokenizer = load_path(path)
    ref = Model(config, weights, tokenizer, backend=NumpyBackend(quantized_activations=True))
    want = _logits_routed_as(ref, ids, routes)
    per_position = np.max(np.abs(got - want), -1) / np.max(np.abs(want))
    if backend != "cuda":
        # The same math but for the order of float32 sums: equal to ~1e-7 until that order moves
        # a value across an int8 rounding boundary, after which the tokens that attend to it
        # drift (measured: from position 16-25 on, at most 1.3e-2; granitemoe from position 6,
        # ~1e-3)
        assert np.all(per_position[:6] < 1e-5)
    assert rel_err(got, want) < 5e-2
    assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.95


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(MOE_KINDS))
def test_moe_decode_routes_on_the_device(family_material, kind):
    """Experts on cuda: each role's experts in one array (Q8_0 blocks; qwen3moe's and olmoe's
    down, whose rows of 40 and 56 are no whole 32-blocks, F16 in the file), picked on the device
    by the router's choice, so decode is captured as one graph per step. Its logits are bitwise
    those of the same steps run op by op, and those are prefill's (which routes on the host) to
    its tolerance, up to the first token the two route differently."""
    from cyllm.backends.cuda.experts import CudaExperts
    _backend("cuda")
    path = family_material.gguf(kind, "q8_0")
    batched, step, graphed = (cyllm.load(path, backend="cuda") for _ in range(3))
    assert all(isinstance(L.experts, CudaExperts) for L in graphed.layers)
    assert graphed.backend.captures_decode and not graphed.backend.data_dependent_steps
    ids = _ids(batched)
    replayed = np.stack([graphed.forward(t, i).copy() for i, t in enumerate(ids)])
    assert graphed.backend._graph is not None, "decode was not captured"
    step.backend.use_graphs = False
    eager = np.stack([step.forward(t, i).copy() for i, t in enumerate(ids)])
    np.testing.assert_array_equal(replayed, eager)
    want, got = _decode_and_prefill_routed_alike(batched, step, ids)
    # decode rounds x to int8 blocks; prefill too where its experts are grouped on the device
    # (mixtral), else to float16 (70 rows: cuBLAS tiles). A handful of positions may be all
    # there is before the routes part, so near-ties are told apart, not counted
    assert rel_err(got, want) < 5e-2
    _assert_argmax_where_clear(got, want)


@pytest.mark.cuda
def test_moe_prefill_routes_on_the_device(family_material):
    """Mixtral's Q8_0 file, whose experts stack in every role: a prompt's chunk is routed and
    grouped by expert on the device (no read-back) and captured in a prefill graph. The
    graph's logits are bitwise the eager chunk's; the device's choice of experts is the
    host-routed path's (moe_on_device off: logits read back, experts one by one) but at
    near-ties of the router, and the logits agree up to the first token routed otherwise."""
    _backend("cuda")
    path = family_material.gguf("mixtral", "q8_0")
    dev, host = cyllm.load(path, backend="cuda"), cyllm.load(path, backend="cuda")
    assert all(dev.backend.captures_moe_batch(L.experts, dev.prefill_chunk, dev.config.n_experts_used)
               for L in dev.layers)
    assert not dev.backend.data_dependent_prefill
    ids = _ids(dev)
    eager = dev.logits(ids)                 # run as issued, then recorded
    assert dev.backend._prefill_graphs, "the chunk was not captured"
    np.testing.assert_array_equal(dev.logits(ids), eager)       # replayed
    host.backend.moe_on_device = False
    want, host_routes = _our_logits(host, ids)
    got, dev_routes = _our_logits(dev, ids)     # as issued, 70 rows (the graph's were padded to 128)
    assert rel_err(got, eager) < 1e-2
    same = np.array([[set(a) == set(b) for a, b in zip(la, lb)] for la, lb in zip(host_routes, dev_routes)])
    assert same.mean() > 0.95, f"the two paths route {(~same).sum()} of {same.size} tokens differently"
    first = len(ids) if same.all() else int(np.argmin(same.all(0)))
    assert first >= 1
    # the same int8 products where the host's expert gets at most qmm_few_max rows (else its
    # FP16 tiles), summed in the same order
    assert rel_err(got[:first], want[:first]) < 5e-2
    _assert_argmax_where_clear(got[:first], want[:first])


def _logits_routed_as(model, ids, routes):
    """A host model's logits of ids with its routers made to choose ``routes`` (layers, T, k),
    in that order, each weighted by its own probability (renormalized as the model does)."""
    from cyllm.backends import moe
    rows = [r for layer in routes for r in layer]          # moe_batch routes layer by layer, row by row

    def forced(scores, n_used, norm, ids_out, weights_out):
        p = np.exp(scores - scores.max())
        p /= p.sum()
        pick = rows.pop(0)
        ids_out[:n_used] = pick
        weights_out[:n_used] = p[pick] / (p[pick].sum() if norm else 1.0)

    real = moe.route
    moe.route = forced
    try:
        out = model.logits(ids)
    finally:
        moe.route = real
    assert not rows
    return out


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_yarn_rope_matches_transformers(tmp_path, backend):
    """YaRN scaling (Qwen3 with factor 8 over an original context of 32, the sequence past it):
    from the HF directory, and from the GGUF llama.cpp's converter writes of it."""
    from llamacpp_tools import LlamaCppUnavailable, convert_hf_to_gguf
    d = make_tiny_model(tmp_path, "qwen3_yarn")
    ref = load_reference(d)
    model = cyllm.load(d, backend=backend)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    ids = _ids(model)
    want = _hf_logits(ref, ids)
    _assert_parity(model.logits(ids), want)
    try:
        path = convert_hf_to_gguf(d, tmp_path / "yarn.gguf", "f32", GGUF_PRE[KIND_TOKENIZER["qwen3_yarn"]])
    except LlamaCppUnavailable as e:
        pytest.skip(str(e))
    g = cyllm.load(path, backend=backend)
    assert g.config.rope_scaling["rope_type"] == "yarn"
    _assert_parity(g.logits(ids), want)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_exaone4_hybrid_matches_transformers(tmp_path, backend):
    """EXAONE 4's hybrid layers (the 32B's kind: three sliding layers of window 16 in four, the
    fourth without rope) over a 70-token sequence, from the HF directory."""
    d = make_tiny_model(tmp_path, "exaone4_swa")
    model = cyllm.load(d, backend=backend)
    c = model.config
    assert c.layer_types == ("sliding", "sliding", "sliding", "full") and c.sliding_window == 16
    assert c.nope_layers == (3,)
    ids = _ids(model)
    _assert_parity(model.logits(ids), _hf_logits(load_reference(d), ids))


@pytest.mark.parametrize("pattern", ["LLLG", "LLG", 4, 2])
def test_exaone4_sliding_pattern_as_transformers_reads_it(pattern):
    """A config.json with a window but no layer_types: its sliding_window_pattern (a period, or a
    string of L and G) names the sliding layers as Exaone4Config makes them; full layers lose
    rope only where a window is set."""
    import transformers

    from cyllm.families import config_from_hf, family_for_hf
    raw = dict(architectures=["Exaone4ForCausalLM"], model_type="exaone4", hidden_size=64, intermediate_size=96,
               num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
               sliding_window=32, sliding_window_pattern=pattern)
    want = transformers.Exaone4Config(**{k: v for k, v in raw.items() if k != "architectures"}).layer_types \
        if isinstance(pattern, int) else \
        ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(7)]
    assert family_for_hf(raw).name == "exaone4"
    c = config_from_hf(raw)
    assert [("sliding_attention" if t == "sliding" else "full_attention") for t in c.layer_types] == list(want)
    assert c.nope_layers == tuple(i for i, t in enumerate(want) if t == "full_attention")
    c = config_from_hf({**raw, "sliding_window": None})
    assert c.sliding_window == 0 and c.nope_layers == () and c.layer_types is None
    # no key at all: Exaone4Config's default window and period
    bare = {k: v for k, v in raw.items() if k not in ("sliding_window", "sliding_window_pattern")}
    hf = transformers.Exaone4Config(**{k: v for k, v in bare.items() if k != "architectures"})
    c = config_from_hf(bare)
    assert c.sliding_window == hf.sliding_window
    assert [("sliding_attention" if t == "sliding" else "full_attention") for t in c.layer_types] == hf.layer_types


def test_exaone4_gguf_follows_llama_cpp():
    """llama.cpp's exaone4 slides only in the 64-layer 32B (the file's pattern, else three layers
    of four; its window, else 4096), with no rope on the other layers; any other depth is all
    full layers with rope, whatever the file names."""
    from cyllm.families import family
    f = family("exaone4").gguf_features
    p = "exaone4."
    assert f({p + "block_count": 30, p + "attention.sliding_window": 4096}, p, {}) == dict(qk_norm=True, post_norms=True)
    out = f({p + "block_count": 64}, p, {})
    assert out["sliding_window"] == 4096 and out["layer_types"][:4] == ("sliding",) * 3 + ("full",)
    assert out["nope_layers"] == tuple(range(3, 64, 4))
    pattern = [i % 2 == 0 for i in range(64)]
    out = f({p + "block_count": 64, p + "attention.sliding_window": 128, p + "attention.sliding_window_pattern": pattern,
             p + "rope.freq_base_swa": 5e5}, p, {})
    assert out["sliding_window"] == 128 and out["nope_layers"] == tuple(range(1, 64, 2))
    assert out["rope_theta"] == 5e5         # the sliding layers' base: they alone have rope
    for period, full in ((2, range(1, 64, 2)), (0, ())):        # a period, as llama.cpp reads one
        out = f({p + "block_count": 64, p + "attention.sliding_window_pattern": period}, p, {})
        assert out["nope_layers"] == tuple(full)
    # anything else is refused in one line, not read as the default pattern or window
    from cyllm.errors import ModelLoadError
    for key, bad in (("attention.sliding_window_pattern", [True] * 63), ("attention.sliding_window_pattern", ["x"] * 64),
                     ("attention.sliding_window_pattern", -1), ("attention.sliding_window_pattern", "LLLG"),
                     ("attention.sliding_window", True), ("attention.sliding_window", 2.7),
                     ("attention.sliding_window", "abc")):
        with pytest.raises(ModelLoadError, match=key.split(".")[-1]):
            f({p + "block_count": 64, p + key: bad}, p, {})


def test_granitemoe_gguf_with_shared_experts_refused():
    """llama.cpp's converter writes GraniteMoeShared as granitemoe with a shared expert's size:
    refused by that key, in one line."""
    from cyllm.errors import UnsupportedModelError
    from cyllm.families import family
    p = "granitemoe."
    md = {p + "expert_count": 4, p + "expert_used_count": 2, p + "expert_shared_feed_forward_length": 64}
    with pytest.raises(UnsupportedModelError, match="shared experts"):
        family("granitemoe").gguf_features(md, p, {})


def test_every_family_has_material():
    """Each family cyllm supports is exercised by at least one kind above."""
    from cyllm.families import FAMILIES
    covered = {FAMILY_KINDS[k][0] for k in FAMILY_KINDS}
    assert {f.name for f in FAMILIES} <= covered | {"llama"}, covered
    assert set(FAMILY_FEATURES) == set(FAMILY_KINDS)


@pytest.mark.parametrize("vocab", VOCABS)
def test_gguf_tokenizer_matches_llamacpp_test_vectors(vocab):
    """The tokenizer rebuilt from a real vocabulary GGUF (llama.cpp's ggml-vocab-*.gguf: its
    tokenizer.ggml.pre, merges or SentencePiece scores, special tokens) gives the ids llama.cpp's
    own tokenizer test expects for its test texts."""
    from cyllm.loading.gguf import read_gguf
    from cyllm.loading.gguf_tokenizer import build_tokenizer, make_tokenizer
    path, cases = llamacpp_vocab(vocab)
    tok = make_tokenizer(build_tokenizer(read_gguf(path)))
    bad = [(text, want, got) for text, want in cases
           if (got := tok.encode(text, add_special_tokens=False)) != want]
    assert not bad, f"{len(bad)}/{len(cases)} texts differ, first: {bad[0]!r}"


def test_gguf_pieces_spelled_twice_decode_as_written():
    """A real vocabulary (llama.cpp's MPT test GGUF) spells 23 pieces twice: runs of spaces as
    byte-level pieces and again, later, as raw-text user-defined tokens. Each such id decodes
    to the text the file gives it (llama.cpp's detokenizer writes a user-defined token as it
    is), and every id of the list decodes, alone and streamed, where the later twins and
    every id past the vocabulary's distinct pieces had been out of range."""
    from cyllm.loading.gguf import read_gguf
    from cyllm.loading.gguf_tokenizer import TOKEN_USER_DEFINED, build_tokenizer, make_tokenizer
    gf = read_gguf(llamacpp_vocab_file("mpt"))
    tokens, types = gf.metadata["tokenizer.ggml.tokens"], gf.metadata["tokenizer.ggml.token_type"]
    tok = make_tokenizer(build_tokenizer(gf))
    assert tok.vocab_size == len(tokens)
    twins = [i for i, t in enumerate(tokens) if types[i] == TOKEN_USER_DEFINED and t.strip(" ") == ""]
    assert len(twins) == 23
    for i in twins:
        assert tok.decode([i]) == tokens[i]
        assert tok.token_bytes(i) == tokens[i].encode()
    ids = list(range(len(tokens) - 200, len(tokens))) + twins
    sd = tok.stream_decoder()
    assert "".join(sd.add(i) for i in ids) + sd.flush() == tok.decode(ids)


def test_padded_embedding_rows_decode_like_transformers(family_material):
    """Phi-3 (here its tiny model) has 3 more embedding rows than tokenizer pieces, as Qwen2.5
    and Phi-3 do: a sampled id there decodes as transformers decodes it (to no text), alone and
    streamed, instead of stopping the generation as out of range."""
    from transformers import AutoTokenizer
    d = family_material.hf_dir("phi3")
    llm = cyllm.load(d, backend="numpy")
    hf = AutoTokenizer.from_pretrained(d)
    n = llm.config.vocab_size
    assert n == len(hf) + 3
    ids = [5, len(hf), n - 1, 7, n - 2, 9]
    assert llm.tokenizer.decode(ids) == hf.decode(ids)
    sd = llm.tokenizer.stream_decoder()
    assert "".join(sd.add(i) for i in ids) + sd.flush() == hf.decode(ids)
    assert llm.tokenizer.token_bytes(n - 1) == b""
    with pytest.raises(cyllm.errors.InvalidArgumentError):
        llm.tokenizer.decode([n])


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "HuggingFaceTB-SmolLM3-3B",
                                  "microsoft-Phi-3.5-mini-instruct", "google-gemma-2-2b-it",
                                  "meta-llama-Llama-3.2-3B-Instruct"])
def test_real_chat_templates_render_like_transformers(family_material, name):
    """The chat templates these families ship render a conversation as transformers renders it."""
    from transformers import AutoTokenizer
    template = llamacpp_template(name)
    d = family_material.hf_dir("qwen2")
    hf_tok = AutoTokenizer.from_pretrained(d)
    ours = cyllm.load(d, backend="numpy").tokenizer
    ours.chat_template = template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]
    if "gemma" in name:
        messages = messages[1:]          # Gemma's template refuses a system turn
    want = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want


@pytest.mark.parametrize("kind", ["llama32", "gemma3", "phi3_longrope", "smollm3", "qwen3moe", "mixtral", "olmoe",
                                  "ernie4_5", "hunyuan_dense", "glm4"])
def test_convert_gguf_back_to_a_directory_transformers_loads(family_material, reference, kind, tmp_path):
    """`cyllm convert` writes the family's config.json and tensor names (Gemma's norms back to w,
    Phi-3's fused tensors, llama3 rope parameters recovered from rope_freqs, Ernie 4.5's q/k
    rows in its interleaved rotary order, Hunyuan's alpha-stretched rope base as a plain one)."""
    from cyllm.tools.convert import convert_gguf_to_hf
    out = convert_gguf_to_hf(family_material.gguf(kind, "f32"), tmp_path / "hf")
    converted = load_reference(out)
    ids = np.random.default_rng(1).integers(3, converted.config.vocab_size - 8, SEQ).tolist()
    _assert_parity(_hf_logits(converted, ids), _hf_logits(reference(kind), ids))


@pytest.mark.parametrize("kind,outtype", [("llama32", "q8_0"), ("llama32", "f16"), ("qwen2", "q8_0"),
                                          ("mixtral", "q8_0"), ("qwen3moe", "q8_0")])
def test_fused_gguf_tensors_read_as_the_split_ones(family_material, kind, outtype):
    """llama.cpp's converter with --fuse-qkv writes q, k and v (weights and biases) as one
    attn_qkv a layer, and llama.cpp reads either form. cyllm cuts it back into the table's
    tensors (llama-style q/k rows unpermuted part by part): the same logits as the split file,
    bit for bit."""
    from cyllm.loading.gguf import read_gguf
    split, fused = family_material.gguf(kind, outtype), family_material.gguf(kind, outtype + ":fused")
    names = set(read_gguf(fused).tensors)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("blk.0.attn_qkv.bias" in names) == (kind == "qwen2")
    a, b = cyllm.load(split, backend="cpu"), cyllm.load(fused, backend="cpu")
    ids = _ids(a)
    np.testing.assert_array_equal(b.logits(ids), a.logits(ids))


def test_convert_refuses_stacked_expert_checkpoints(family_material, tmp_path):
    """Granite MoE's checkpoints keep gate and up of every expert in one tensor; cyllm reads
    them but does not write them: `cyllm convert` of its GGUF says so in one line."""
    from cyllm.errors import InvalidArgumentError
    from cyllm.tools.convert import convert_gguf_to_hf
    with pytest.raises(InvalidArgumentError, match="granitemoe file cannot be converted") as e:
        convert_gguf_to_hf(family_material.gguf("granitemoe", "f32"), tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def test_moe_refused_by_a_backend_without_its_ops(family_material):
    """A backend that lacks the moe ops refuses a mixture of experts when the model is built,
    in one line, instead of failing at the first token."""
    from cyllm.backends.numpy_ref import NumpyBackend
    from cyllm.errors import UnsupportedModelError
    from cyllm.loading import load_path
    from cyllm.model import Model

    class Dense(NumpyBackend):
        moe = moe_batch = None

    config, weights, tokenizer = load_path(family_material.hf_dir("qwen3moe"))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts") as e:
        Model(config, weights, tokenizer, backend=Dense())
    assert "\n" not in str(e.value)
