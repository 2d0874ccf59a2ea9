"""Whole-model parity with Hugging Face transformers (torch CPU, float32) on tiny random models.

Each case writes a real checkpoint with transformers, loads it through cyllm's
loader, and compares logits at every position and the greedy continuation.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cyllm  # noqa: E402
from conftest import HOST_BACKENDS  # noqa: E402
from tinymodels import load_reference, make_tiny_model  # noqa: E402

CASES = [
    ("llama_mqa_odd", "float32", False),
    ("llama_explicit_head_dim", "float16", False),
    ("llama3_rope", "float32", False),
    ("mistral_gqa", "bfloat16", False),
    ("qwen2_bias", "float32", False),
    ("llama_tied", "float16", True),      # tied embeddings, sharded checkpoint
]
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-sharded' if c[2] else ''}")
def case(request, tmp_path_factory):
    kind, dtype, sharded = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(kind), kind, dtype=dtype, sharded=sharded, seed=3)
    ref = load_reference(path)
    return path, ref


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_logits_match_transformers(case, backend):
    path, ref = case
    model = cyllm.load(path, backend=backend, threads=2 if backend == "cpu" else None)
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > 8
    ours = model.logits(ids)                                          # (T, vocab)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()   # (T, vocab)
    assert ours.shape == theirs.shape
    assert rel_err(ours, theirs) < 1e-2


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_greedy_text_matches_transformers(case, backend):
    path, ref = case
    model = cyllm.load(path, backend=backend)
    prompt = "Hello world! How are"
    ids = model.tokenizer.encode(prompt)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                           eos_token_id=sorted(model.tokenizer.eos_ids) or None, pad_token_id=0)
    expected = model.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    ours = "".join(model.generate(prompt, max_tokens=16, temperature=0.0))
    assert ours == expected


@pytest.mark.skipif("cpu" not in HOST_BACKENDS, reason="compiled cpu backend not built")
def test_output_identical_at_one_and_two_threads(case):
    path, _ = case
    ids = None
    results = []
    for threads in (1, 2):
        model = cyllm.load(path, backend="cpu", threads=threads)
        ids = ids or model.tokenizer.encode(PROMPT)
        results.append(model.logits(ids))
    np.testing.assert_array_equal(results[0], results[1])
