"""Thread policy: flag > OMP_NUM_THREADS > saved tuning > physical cores."""

import pytest

import cyllm
from conftest import HOST_BACKENDS
from cyllm.threads import physical_cores, resolve_threads
from cyllm.saved_tuning import save_tuning
from tinymodels import make_tiny_model

pytestmark = pytest.mark.skipif("cpu" not in HOST_BACKENDS, reason="compiled cpu backend not built")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("thr"), "llama_tied")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CYLLM_CONFIG_DIR", str(tmp_path / "config"))


def test_default_is_physical_cores(clean_env, tiny):
    model = cyllm.load(tiny)
    assert model.threads_decode == physical_cores() == model.backend.threads


def test_saved_tuning_is_used_and_flags_win(clean_env, monkeypatch, tiny):
    weight_bytes = cyllm.load(tiny).weight_bytes
    save_tuning(weight_bytes, decode_threads=1, prefill_threads=2)
    model = cyllm.load(tiny)
    assert (model.threads_decode, model.threads_prefill) == (1, 2)
    assert model.backend.threads == 1
    # an explicit flag wins over the saved value
    assert cyllm.load(tiny, threads=2).threads_decode == 2
    # and so does OMP_NUM_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cyllm.load(tiny).threads_decode == 2


def test_threads_batch_differs_from_decode(clean_env, tiny):
    model = cyllm.load(tiny, threads=1, threads_batch=2)
    ids = model.tokenizer.encode("hello world")
    model.logits(ids)
    assert (model.threads_decode, model.threads_prefill, model.backend.threads) == (1, 2, 1)


def test_omp_num_threads_list_takes_first_level(clean_env, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")
    assert resolve_threads(None) == 3
