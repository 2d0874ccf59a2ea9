"""Thread policy: flag > OMP_NUM_THREADS > saved tuning > physical cores."""

import sys

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_thread_probe_counts_what_openmp_can_start():
    """csrc/thread_probe.c against libgomp itself: every thread asked for starts on an
    unconstrained system; under an address-space cap that the default 8 MB stacks exhaust,
    fewer do, and the team the CPU backend then allows (the probe's count less its spare)
    really runs an OpenMP parallel region (the read-bandwidth kernel) under the same cap,
    where a team of the full 4000 ends the process with libgomp's "Thread creation failed"."""
    import subprocess
    import textwrap
    from cyllm._ext import kernels as k
    from cyllm.backends.cpu import kernel_info
    if not kernel_info()["openmp"]:
        pytest.skip("built without OpenMP: no team to start")
    assert [k._probe_threads(n) for n in (0, 1, 2, 17)] == [0, 1, 2, 17]
    code = textwrap.dedent("""
        import resource, sys
        from cyllm._ext import kernels as k
        cap = 1536 << 20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        n = int(sys.argv[1])
        got = k._probe_threads(4000)
        team = max(1, (got - 4) * 8 // 9) if n == 0 else n
        k.read_bandwidth_gbs(team, 1 << 20, 1, None)
        print(got, team)
    """)
    ok = subprocess.run([sys.executable, "-c", code, "0"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    got, team = map(int, ok.stdout.split())
    assert 1 <= got < 4000 and team < got
    over = subprocess.run([sys.executable, "-c", code, "4000"], capture_output=True, text=True, timeout=60)
    assert over.returncode != 0 and "Thread creation failed" in over.stderr, (over.returncode, over.stderr)


def test_too_many_threads_is_one_clear_error(tiny):
    """A team the system refuses (here: stacks past an address-space cap, as with a pids limit
    or ulimit -u) is one line and status 2, before OpenMP's "Thread creation failed" could end
    the process (the fuzzer found `-t 1017` doing that)."""
    from hostile import problem, run_cli
    for flags in (["-t", "1017"], ["-t", "1", "-tb", "1017"]):     # the prompt's team too
        code, err = run_cli(["generate", "-m", str(tiny), "-p", "Hello", "--no-stats", *flags, "-n", "4"])
        assert problem(code, err) is None, (flags, err)
        if code == 2:                       # a system with small default stacks may run them all
            assert "cannot run 1017 threads here" in err and "ask for at most" in err, (flags, err)


def test_quantizer_refuses_a_team_the_system_refuses(tiny, tmp_path, monkeypatch):
    """`cyllm quantize` runs its own OpenMP team (quant/convert.py, outside any backend):
    the same probe, so `-t 1017` or OMP_NUM_THREADS=1017 under an address-space cap is one
    line and status 2, not libgomp's "Thread creation failed" and status 1 as it was."""
    from hostile import problem, run_cli
    out = tmp_path / "out.gguf"
    for flags, env in ((["-t", "1017"], None), ([], "1017")):
        if env is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", env)
        code, err = run_cli(["quantize", *flags, "--type", "q8_0", "--force", str(tiny), str(out)])
        assert problem(code, err) is None, (flags, env, err)
        if code == 2:
            assert "cannot run 1017 threads here" in err, (flags, env, err)


def test_refused_prompt_team_fails_when_set(clean_env, monkeypatch, tiny):
    """A --threads-batch count the system refuses is refused by set_threads itself, not at the
    first prompt, and leaves the model as it was. The system's limit is stood in for: a probe
    that lets 8 threads start."""
    import cyllm.threads as threads
    from cyllm._ext import kernels
    from cyllm.errors import InvalidArgumentError
    monkeypatch.setattr(threads, "_STARTABLE", [1])
    monkeypatch.setattr(kernels, "_probe_threads", lambda n: min(n, 8))
    model = cyllm.load(tiny, threads=1)
    with pytest.raises(InvalidArgumentError, match="cannot run 64 threads here.*at most 3"):
        model.set_threads(1, 64)
    model.set_threads(1, 3)                 # 3 + 3 // 8 + 4 = 7 threads fit in 8
    assert model.threads_prefill == 3 and model.backend.threads == model.threads_decode == 1
    list(model.generate("Hello there", max_tokens=2))    # the prompt on 3 threads, then back to 1
    assert model.backend.threads == 1
