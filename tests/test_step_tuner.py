"""The decode step tuner (backends/step_tuner.py): which team size and prefetch choice it
settles on for given step times, how fast it answers a change, what probing costs on a
quiet machine; and that changing either between steps changes no bit of the logits (a
quantized model, whose activations are rounded to int8 blocks, and a float one)."""

import numpy as np
import pytest

from cyllm.backends.step_tuner import MAX_INTERVAL, StepTuner


def threads_only(n):
    return StepTuner(n, tune_prefetch=False)


def drive(tuner, step_time, steps, start=0):
    """Run `steps` steps where a step with setting (n, prefetch) takes step_time(n, step)
    (or step_time((n, prefetch), step) when it takes the setting); the sizes used."""
    used = []
    for i in range(start, start + steps):
        n, pf = tuner.next()
        assert 1 <= n <= tuner.max_threads
        try:
            t = step_time((n, pf), i)
        except KeyError:
            t = step_time(n, i)
        tuner.record((n, pf), t)
        used.append(n)
    return used


def noisy(table, seed=0, noise=0.03):
    rng = np.random.default_rng(seed)
    return lambda key, i: table[key] * (1.0 + noise * rng.standard_normal())


def test_quiet_machine_keeps_all_threads_and_probes_rarely():
    s = threads_only(2)
    used = drive(s, noisy({1: 1.6, 2: 1.0}), 4000)
    assert s.size == 2
    assert used[-1] == 2
    # probes back off to one every MAX_INTERVAL steps: ~3 of 512 steps after the first few hundred
    assert used[1000:].count(1) / 3000 < 4 / MAX_INTERVAL


def test_busy_core_moves_to_one_thread_within_a_few_steps():
    s = threads_only(2)
    used = drive(s, noisy({1: 1.0, 2: 2.5}), 1000)
    # 3 steps at 2 threads, then the probe of 1 thread interleaved with 3 more at 2
    assert 2 not in used[9:20]
    assert s.size == 1
    assert used[20:].count(2) / 980 < 0.05


def test_contention_starting_mid_generation_is_answered():
    s = threads_only(2)
    quiet, busy = noisy({1: 1.6, 2: 1.0}), noisy({1: 1.0, 2: 3.0}, seed=1)
    drive(s, quiet, 2000)
    assert s.size == 2
    used = drive(s, busy, 60, start=2000)
    # the jump test probed at once, not after the 512 steps the quiet run had backed off to
    assert used.index(1) < 8 and used[10:].count(1) >= 42
    # and back when the busy process ends
    used = drive(s, quiet, 200, start=2060)
    assert used[-100:].count(2) >= 95


def test_many_cores_climb_to_the_best_size():
    table = {n: 10.0 / min(n, 5) + 0.8 * max(0, n - 5) for n in range(1, 9)}   # best at 5
    s = threads_only(8)
    drive(s, noisy(table, noise=0.01), 600)
    assert s.size == 5


def test_one_thread_never_probes():
    s = threads_only(1)
    assert drive(s, lambda n, i: 1.0, 50) == [1] * 50


def test_set_max_starts_again():
    s = threads_only(2)
    drive(s, noisy({1: 1.0, 2: 2.5}), 100)
    assert s.size == 1
    s.set_max(4)
    assert s.size == 4 and s.next() == (4, True)


# -- the backend: switching sizes between steps is bitwise invisible -----------------------
try:
    from cyllm.backends.cpu import CpuBackend
    from cyllm.backends import cpu as cpu_mod
except Exception as e:                      # extension not built
    CpuBackend = None
    _why = str(e)


class Cycling:
    """A stand-in tuner: sizes 1, 2, 2, 1, 2, ... and prefetch on, off, ... whatever the times say."""

    def __init__(self):
        self.i = 0
        self.size = 2

    def next(self):
        self.i += 1
        return (1 if self.i % 3 == 1 else 2), self.i % 2 == 0

    def record(self, setting, dt):
        pass

    def set_max(self, n):
        pass


def _decode(path, quantize, tuner, steps=40):
    from cyllm.loading import load_path
    from cyllm.model import Model
    from cyllm.quant.convert import quantize_weights
    config, weights, tok = load_path(path)
    if quantize:
        quantize_weights(config, weights, quantize)
    m = Model.from_weights(config, weights, tok, backend=CpuBackend(2), context=128)
    m.backend._tuner = tuner
    rng = np.random.default_rng(3)
    ids = rng.integers(0, m.config.vocab_size, 8 + steps).tolist()
    m.prefill(ids[:8], 0)
    return np.array([m.forward(ids[8 + i], 8 + i).copy() for i in range(steps)])


@pytest.mark.parametrize("quantize", [None, "q8_0", "q4_k"])
def test_changing_team_size_and_prefetch_between_steps_is_bitwise_invisible(tmp_path, quantize):
    if CpuBackend is None:
        pytest.skip(f"cpu kernels not built: {_why}")
    pytest.importorskip("torch")
    from tinymodels import make_tiny_model
    path = make_tiny_model(tmp_path, "mistral_gqa", seed=2)
    fixed = _decode(path, quantize, StepTuner(2, threads=False, tune_prefetch=False))
    cycled = _decode(path, quantize, Cycling())
    assert np.all(np.isfinite(fixed))
    assert np.array_equal(fixed.view(np.uint32), cycled.view(np.uint32))


def test_adaptive_only_when_the_count_is_ours(monkeypatch):
    if CpuBackend is None:
        pytest.skip(f"cpu kernels not built: {_why}")
    from cyllm.errors import InvalidArgumentError
    monkeypatch.delenv("CYLLM_ADAPTIVE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert CpuBackend()._tuner.adapts_threads
    assert not CpuBackend(2)._tuner.adapts_threads       # -t given: exactly that many
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not CpuBackend()._tuner.adapts_threads
    monkeypatch.setenv("CYLLM_ADAPTIVE_THREADS", "1")
    assert CpuBackend(2)._tuner.adapts_threads
    monkeypatch.setenv("CYLLM_ADAPTIVE_THREADS", "0")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not CpuBackend()._tuner.adapts_threads
    monkeypatch.setenv("CYLLM_ADAPTIVE_THREADS", "maybe")
    with pytest.raises(InvalidArgumentError):
        CpuBackend()
    assert cpu_mod is not None


def test_prefetch_choice_by_environment(monkeypatch):
    if CpuBackend is None:
        pytest.skip(f"cpu kernels not built: {_why}")
    from cyllm.errors import InvalidArgumentError
    monkeypatch.delenv("CYLLM_PREFETCH", raising=False)
    t = CpuBackend(2)._tuner
    assert t.adapts and t.prefetch                         # measured, starting on
    monkeypatch.setenv("CYLLM_PREFETCH", "off")
    t = CpuBackend(2)._tuner
    assert not t.adapts and t.next() == (2, False)
    monkeypatch.setenv("CYLLM_PREFETCH", "on")
    assert CpuBackend(2)._tuner.next() == (2, True)
    monkeypatch.setenv("CYLLM_PREFETCH", "sometimes")
    with pytest.raises(InvalidArgumentError):
        CpuBackend(2)


# -- prefetch ---------------------------------------------------------------------------
def test_prefetch_off_wins_when_it_is_faster():
    s = StepTuner(2, threads=False)
    used = []
    table = {(2, True): 1.25, (2, False): 1.0}
    for i in range(400):
        setting = s.next()
        assert setting[0] == 2                             # the count was given: never moves
        s.record(setting, noisy(table)(setting, i))
        used.append(setting[1])
    assert s.prefetch is False
    assert used.index(False) < 8                           # the first probe tries it
    assert used[100:].count(True) / 300 < 0.05


def test_prefetch_kept_when_it_helps_and_probed_rarely():
    s = StepTuner(2, threads=False)
    table = {(2, True): 1.0, (2, False): 1.15}
    offs = 0
    for i in range(4000):
        setting = s.next()
        s.record(setting, noisy(table)(setting, i))
        offs += i >= 1000 and not setting[1]
    assert s.prefetch is True
    assert offs / 3000 < 4 / MAX_INTERVAL


def test_threads_and_prefetch_both_found():
    # a busy core (1 thread best) and a CPU where prefetch hurts: both moves are made
    table = {(1, True): 1.3, (1, False): 1.0, (2, True): 3.0, (2, False): 2.6}
    s = StepTuner(2)
    drive(s, noisy(table), 300)
    assert s.setting == (1, False)


def test_probe_judged_against_interleaved_steps():
    # the host's memory bandwidth halves for a stretch of steps and comes back (a shared
    # machine): prefetch off is 6% faster throughout. Judged against steps run before it,
    # a probe that falls in the slow stretch loses; against its interleaved steps it wins.
    table = {(2, True): 1.0, (2, False): 0.94}
    s = StepTuner(2, threads=False)
    slow = lambda i: 2.0 if 4 <= i < 40 else 1.0            # noqa: E731
    used = drive(s, lambda key, i: table[key] * slow(i) * (1.0 + 0.005 * np.sin(i)), 60)
    assert s.prefetch is False
    assert used == [2] * 60
    # and a probe of a setting that is slower stays a probe
    s = StepTuner(2, threads=False)
    drive(s, lambda key, i: {(2, True): 0.94, (2, False): 1.0}[key] * slow(i), 200)
    assert s.prefetch is True


def test_short_noisy_steps_probe_longer():
    # a 5 ms step with other processes' time slices in it (30% noise): probes of a few
    # steps would move to the slower size often; probes of >= PROBE_SECONDS rarely do
    from cyllm.backends import step_tuner
    s = threads_only(2)
    used = drive(s, noisy({1: 0.0075, 2: 0.005}, seed=4, noise=0.3), 3000)
    assert s._probe_steps() >= int(step_tuner.PROBE_SECONDS / 0.005)
    assert used[500:].count(2) / 2500 > 0.95


def test_steps_run_op_by_op_follow_the_tuner_too():
    """A step that is not a captured program (Backend.data_dependent_steps, or ops no program
    holds, such as a role of experts in two formats) runs its ops on the team the tuner picks,
    restores the full team after, and reports its time."""
    if CpuBackend is None:
        pytest.skip(f"cpu kernels not built: {_why}")

    class One:
        recorded = []

        def next(self):
            return (1, True)

        def record(self, setting, seconds):
            self.recorded.append((setting, seconds))

    b = CpuBackend(2)
    b.data_dependent_steps = True
    b._tuner = One()
    seen = []
    b.decode_step(lambda token, pos: seen.append((b.threads, token, pos)), 5, 7)
    assert seen == [(1, 5, 7)] and b.threads == 2
    assert [s for s, _ in One.recorded] == [(1, True)] and One.recorded[0][1] >= 0
    assert b.step_info() is None                 # nothing was captured
