"""Sampling rules against their definitions, computed independently in the tests."""

import numpy as np
import pytest

from cyllm.errors import InvalidArgumentError
from cyllm.sampling import Sampler, SamplingParams


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def draw(logits, n=4000, **kw):
    s = Sampler(len(logits), SamplingParams(seed=1, **kw))
    return np.bincount([s.sample(logits) for _ in range(n)], minlength=len(logits))


LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=np.float32))


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert Sampler(1000).sample(x) == int(np.argmax(x))


def test_same_seed_same_tokens_and_different_seed_differs():
    x = np.zeros(50, dtype=np.float32)
    a = [Sampler(50, SamplingParams(temperature=1.0, seed=7)).sample(x) for _ in range(1)]
    s1, s2, s3 = (Sampler(50, SamplingParams(temperature=1.0, seed=s)) for s in (7, 7, 8))
    seq1 = [s1.sample(x) for _ in range(30)]
    seq2 = [s2.sample(x) for _ in range(30)]
    seq3 = [s3.sample(x) for _ in range(30)]
    assert seq1 == seq2 and seq1 != seq3 and a[0] == seq1[0]


def test_temperature_one_matches_softmax_frequencies():
    counts = draw(LOGITS, temperature=1.0)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, softmax(LOGITS), atol=0.03)


def test_top_k_keeps_only_k_best():
    counts = draw(LOGITS, temperature=1.0, top_k=2)
    assert counts[2:].sum() == 0
    p = softmax(LOGITS[:2])
    np.testing.assert_allclose(counts[:2] / counts.sum(), p, atol=0.03)


def test_top_p_keeps_smallest_nucleus():
    # cumulative 0.40, 0.65, 0.80: top_p=0.7 needs the first three tokens
    counts = draw(LOGITS, temperature=1.0, top_p=0.7)
    assert counts[3:].sum() == 0 and counts[2] > 0


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_p_zero_keeps_only_the_best_token_even_among_ties(top_k):
    """OpenAI's top_p is in [0, 1]; 0 keeps the most probable token alone: the one greedy
    decoding (np.argmax: the first of equal best logits) picks, never no token at all."""
    rng = np.random.default_rng(3)
    for trial in range(20):
        x = rng.standard_normal(100).astype(np.float32)
        x[rng.choice(100, size=3, replace=False)] = x.max() + 1        # three tokens tie for the top
        s = Sampler(100, SamplingParams(temperature=1.0, top_p=0.0, top_k=top_k, seed=trial))
        assert [s.sample(x) for _ in range(20)] == [int(np.argmax(x))] * 20


def test_min_p_cuts_relative_to_best():
    # min_p 0.3 keeps p >= 0.12: tokens 0, 1, 2
    counts = draw(LOGITS, temperature=1.0, min_p=0.3)
    assert counts[3:].sum() == 0 and counts[2] > 0


def test_repetition_penalty_follows_ctrl_rule():
    x = np.array([2.0, 1.5, -1.0, 0.5], dtype=np.float32)
    s = Sampler(4, SamplingParams(repetition_penalty=2.0))
    # token 0 penalised: 2.0 / 2 = 1.0 < 1.5 -> token 1 wins
    assert s.sample(x, recent=[0]) == 1
    assert s.sample(x, recent=[]) == 0
    # the caller's logits are untouched
    assert x[0] == 2.0


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-1), dict(top_p=-0.1), dict(top_p=float("nan")),
                                dict(top_p=1.5), dict(min_p=2.0), dict(repetition_penalty=0.0)])
def test_bad_parameters_raise(kw):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(temperature=1e-40, repetition_penalty=1e-45),
                                dict(temperature=0.7, repetition_penalty=1e-45),
                                dict(temperature=0.0, repetition_penalty=1e-45),
                                dict(temperature=5e-324, top_p=0.5, min_p=0.9)])
def test_extreme_sampling_parameters_never_give_nan(kw):
    """Temperatures and penalties at the edge of float range choose a token (the likeliest
    one where the distribution collapses) instead of failing on NaN probabilities."""
    from cyllm.sampling import Sampler, SamplingParams
    rng = np.random.default_rng(0)
    logits = rng.normal(size=300).astype(np.float32) * 5
    s = Sampler(300, SamplingParams(seed=1, **kw))
    tok = s.sample(logits, recent=[5, 7, int(np.argmax(logits))])
    assert 0 <= tok < 300
    if kw.get("temperature", 1) < 1e-30 and kw.get("repetition_penalty", 1.0) == 1.0:
        assert tok == int(np.argmax(logits))


def test_seed_minus_one_means_random_and_other_negatives_are_refused():
    from cyllm.errors import InvalidArgumentError
    from cyllm.sampling import SamplingParams
    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    with pytest.raises(InvalidArgumentError):
        SamplingParams(temperature=1.0, seed=-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_an_error_not_a_token(bad, temperature):
    """Logits holding inf or nan (corrupt weights, an overflow) stop generation with one
    clear error instead of a token drawn from noise, greedy or not."""
    from cyllm.errors import CyllmError
    logits = np.linspace(-3, 3, 50).astype(np.float32)
    logits[17] = bad
    s = Sampler(50, SamplingParams(temperature=temperature, seed=1))
    with pytest.raises(CyllmError, match="not finite"):
        s.sample(logits, [])


@pytest.mark.parametrize("kw, words", [
    (dict(logit_bias={"1": 5, "01": -5}), "logit_bias names token 1 twice"),       # one id, two spellings
    (dict(logit_bias={"7": 1, 7: 2}), "logit_bias names token 7 twice"),
    (dict(repeat_penalty=0), r"repeat_penalty \(repetition_penalty\) must be > 0, got 0"),   # both spellings
    (dict(repeat_penalty=float("nan")), r"repeat_penalty \(repetition_penalty\) must be > 0"),
    (dict(repeat_penalty="x"), "^repeat_penalty must be a number"),                # the name the caller gave
    (dict(repetition_penalty="x"), "^repetition_penalty must be a number"),
    (dict(repetition_penalty=-1.0), r"\(repetition_penalty\) must be > 0"),
])
def test_sampling_params_refusals_name_what_was_given(kw, words):
    from cyllm.generate import sampling_params
    with pytest.raises(InvalidArgumentError, match=words):
        sampling_params(**kw)
    assert sampling_params(repeat_penalty=1.1, logit_bias={"1": 5, "2": -5}).logit_bias == {1: 5.0, 2: -5.0}
