"""`cyllm bench` / `cyllm tune` on the tiny synthetic preset: fast, well-formed, saved tuning used."""

import csv
import io
import json

import numpy as np
import pytest

from conftest import cpu_backend_available
from cyllm import saved_tuning
from cyllm.tools import bench, synthetic, tuning
from cyllm.tools.cli import main
from cyllm.errors import InvalidArgumentError, ModelLoadError
from cyllm.threads import logical_cpus

BACKEND = "cpu" if cpu_backend_available() else "numpy"
FAST = ["--synthetic", "tiny", "--backend", BACKEND, "-p", "8", "-n", "4", "-r", "2", "--no-progress"]


@pytest.fixture
def fake_bandwidth(monkeypatch):
    """Skip the 512 MB bandwidth probe where the test is not about it."""
    monkeypatch.setattr(bench, "read_bandwidth", lambda backend, threads, nbytes=None: (10.0, "test"))


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CYLLM_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg"


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- synthetic models ---------------------------------------------------------------
def test_synthetic_presets_have_real_sizes():
    assert round(synthetic.preset_config("smollm2-135m").n_params / 1e6, 1) == 134.5
    assert round(synthetic.preset_config("llama2-7b").n_params / 1e9, 2) == 6.74
    assert round(synthetic.preset_config("mistral-7b").n_params / 1e9, 2) == 7.24
    assert round(synthetic.preset_config("tinyllama-1.1b").n_params / 1e9, 2) == 1.10
    assert round(synthetic.preset_config("llama3.2-1b").n_params / 1e9, 2) == 1.24


def test_synthetic_is_deterministic_and_not_constant():
    c, w1 = synthetic.build_synthetic("tiny", seed=3)
    _, w2 = synthetic.build_synthetic("tiny", seed=3)
    _, w3 = synthetic.build_synthetic("tiny", seed=4)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert w1[q].dtype == np.float16 and w1["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(w1[q], w2[q])
    assert not np.array_equal(w1[q], w3[q])
    assert np.unique(w1[q]).size > 100 and not np.array_equal(w1[q][0], w1[q][1])
    assert not np.array_equal(w1[q], w1["model.layers.1.self_attn.q_proj.weight"])
    assert abs(float(w1["model.norm.weight"].mean()) - 1.0) < 0.2


def test_synthetic_model_runs():
    from cyllm.model import Model
    c, w = synthetic.build_synthetic("tiny")
    m = Model.from_weights(c, w, backend=BACKEND, context=16)
    logits = m.prefill([1, 2, 3], 0)
    assert logits.shape == (c.vocab_size,) and np.isfinite(logits).all()


def test_quantize_at_load_reports_what_is_held():
    """--quantize: the model column names the recipe and the size is the quantized bytes."""
    f16 = bench.load_source(synthetic="tiny")
    q = bench.load_source(synthetic="tiny", quantize="q8_0")
    assert f16.weight_format == "F16" and q.weight_format == "Q8_0"
    assert q.model_type.endswith(" Q8_0") and "--quantize q8_0" in q.label
    assert q.file_bytes == q.weight_bytes < f16.file_bytes


def test_synthetic_refuses_what_does_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(synthetic, "mem_available", lambda: 1 << 20)
    with pytest.raises(ModelLoadError, match="GB"):
        synthetic.build_synthetic("smollm2-135m")
    rc, out, err = run(capsys, "bench", "--synthetic", "llama2-7b", "--backend", BACKEND)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "memory" in err


# -- bench output -----------------------------------------------------------------------
def test_bench_json_only_json_on_stdout(capsys):
    # the real bandwidth probe runs here (once per thread count)
    rc, out, err = run(capsys, "bench", *FAST, "-t", "1", "-d", "0,8", "-o", "json")
    assert rc == 0
    rows = json.loads(out)                       # nothing but the JSON on stdout
    assert [r["test"] for r in rows] == ["pp8", "tg4", "tg4@d8"]
    for r in rows:
        for key in ("backend", "threads", "test", "tokens_per_s", "gb_per_s", "roofline_pct"):
            assert key in r
        assert r["backend"] == BACKEND and r["threads"] >= 1 and r["tokens_per_s"] > 0
        assert r["model_bytes"] > 0 and r["n_params"] > 0
    for r in rows[1:]:
        assert r["gb_per_s"] > 0 and r["roofline_pct"] > 0 and r["bytes_per_token"] > 0
    # deeper cache: more KV bytes read per token
    assert rows[2]["bytes_per_token"] > rows[1]["bytes_per_token"]


def test_bench_markdown_and_csv(capsys, fake_bandwidth):
    rc, out, _ = run(capsys, "bench", *FAST, "-t", "1")
    assert rc == 0
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert "| model |" in table[0] and len(table) == 4          # header, rule, pp8, tg4
    assert "pp8" in table[2] and "tg4" in table[3] and "%" in table[3]

    rc, out, _ = run(capsys, "bench", *FAST, "-t", "1", "-o", "csv")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    assert float(rows[1]["tokens_per_s"]) > 0 and float(rows[1]["roofline_pct"]) > 0
    assert rows[0]["roofline_pct"] == ""


@pytest.mark.skipif(not cpu_backend_available(), reason="threads only vary on the cpu backend")
def test_bench_thread_list_and_oversubscription_warning(capsys, fake_bandwidth):
    many = logical_cpus() + 1
    rc, out, err = run(capsys, "bench", *FAST, "-t", f"1,{many}", "-o", "json")
    assert rc == 0
    assert sorted({r["threads"] for r in json.loads(out)}) == [1, many]
    assert "warning" in err and "logical CPUs" in err


@pytest.mark.parametrize("bad", [
    ["-t", "0"], ["-t", "1,x"], ["-t", ""], ["--synthetic", "no-such-model"], ["-o", "xml"],
    ["-p", "-4"], ["-n", "abc"], ["-r", "0"], ["-d", "-1"], ["--backend", "tpu"],
    ["-p", "0", "-n", "0"],
])
def test_bench_bad_input_exits_2_with_one_line(capsys, bad):
    rc, out, err = run(capsys, "bench", *FAST, *bad)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("cyllm: error:")


def test_parse_int_list():
    assert bench.parse_int_list("1,2,4", "t", 1) == [1, 2, 4]
    assert bench.parse_int_list("1-3", "t", 1) == [1, 2, 3]
    assert bench.parse_int_list(512, "p") == [512]
    for bad in ("0", "1,,2", "a", "3-1", "-1"):
        with pytest.raises(InvalidArgumentError):
            bench.parse_int_list(bad, "t", 1)


# -- tune and the saved tuning -------------------------------------------------------------
def test_tune_saves_and_is_read_back(capsys, config_dir, fake_bandwidth, monkeypatch):
    argv = ["tune", "--synthetic", "tiny", "--pp", "8", "--tg", "4", "-r", "1", "--no-progress"]
    if BACKEND != "cpu":
        pytest.skip("tune sweeps the cpu backend")
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "best: decode" in out and "saved to" in out
    assert "#" in out                                           # the text chart
    saved = json.loads((config_dir / "tuning.json").read_text())
    entry = saved["machines"][saved_tuning.cpu_model_name()]["<500MB"]
    nbytes = synthetic.weight_bytes(synthetic.preset_config("tiny"))
    assert saved_tuning.tuned_threads(nbytes) == (entry["decode_threads"], entry["prefill_threads"])
    assert all(1 <= t <= logical_cpus() for t in saved_tuning.tuned_threads(nbytes))
    assert saved_tuning.tuned_threads(10**10) == (None, None)         # another size class
    assert any("decode" in ln for ln in saved_tuning.describe_saved_tuning())
    # `cyllm info` shows it
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "tuning" in out and "<500MB" in out
    # a different CPU model: the entry is ignored
    monkeypatch.setattr(saved_tuning, "cpu_model_name", lambda: "Some Other CPU 9000")
    assert saved_tuning.tuned_threads(nbytes) == (None, None)


def test_tuned_threads_robust(config_dir):
    assert saved_tuning.tuned_threads(1000) == (None, None)
    assert saved_tuning.describe_saved_tuning()                       # says "none saved"
    config_dir.mkdir(parents=True)
    (config_dir / "tuning.json").write_text("{not json")
    assert saved_tuning.tuned_threads(1000) == (None, None)
    path = tuning.save_tuning(1000, 1, 1)
    assert path == config_dir / "tuning.json"
    assert saved_tuning.tuned_threads(1000) == (1, 1)
    # a count above this machine's CPUs (tuned on a bigger allocation) is not used
    tuning.save_tuning(1000, 10_000, 1)
    assert saved_tuning.tuned_threads(1000) == (None, 1)


def test_best_threads_prefers_fewer_within_tolerance():
    assert tuning.best_threads({1: 100.0, 2: 101.0, 4: 60.0}) == 1
    assert tuning.best_threads({1: 50.0, 2: 100.0, 4: 99.0}) == 2
    assert tuning.size_class(269_000_000) == "<500MB"
    assert tuning.size_class(2_200_000_000) == "2GB-8GB"
    assert tuning.size_class(14_000_000_000) == ">=8GB"


@pytest.mark.parametrize("script,args", [
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--quantize", "q4_1"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--vary", "qmv_warps"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--bind-vary", "fuse_qkv=1,x"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--vary", "qmv_warps=8,q4_0+q6-k"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--vary", "compile_defines=1"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "--vary", "compile_defines=-DA+q4_0"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "-d", "0,x"]),
    ("sweep_cuda_decode.py", ["--synthetic", "tiny", "-n", "0"]),
    ("trace_cuda_decode.py", ["--synthetic", "tiny", "--tokens", "0"]),
])
def test_gpu_bench_scripts_bad_input_exit_2(script, args):
    """The device-only bench scripts refuse bad arguments (and, here, a machine without a GPU
    or CuPy) with one line and status 2, before loading anything."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / script
    r = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and err and err[-1].startswith(script.replace(".py", ""))


def _bench_module(name: str):
    """bench/NAME.py imported as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_values():
    """bench/sweep_cuda_decode.py's --vary values: numbers, none, format pairs, and compiler
    defines kept as written (case matters to the preprocessor)."""
    sw = _bench_module("sweep_cuda_decode")
    assert sw._value("8") == 8 and sw._value("0.5") == 0.5 and sw._value("None") is None
    assert sw._value("q4_0+q6_k") == ("q4_0", "q6_k") and sw._value("q4_0+") == ("q4_0",)
    assert sw._value("-DQMV_A+-DQMV_b") == ("-DQMV_A", "-DQMV_b")
    with pytest.raises(ValueError):
        sw._value("q4_0+q6-k")


def test_ncu_table_groups_launches(tmp_path):
    """bench/ncu_table.py on a log shaped like ncu --csv's: its notes skipped, launches grouped
    by kernel and shape, instructions a warp = inst_executed / warps_launched (medians), kernels
    ordered by summed time, an "n/a" value left out."""
    nt = _bench_module("ncu_table")
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def rows(i, name, grid, us, inst, warps, wait="1.5"):
        vals = {"gpu__time_duration.sum": f"{us * 1000:,.0f}", "smsp__inst_executed.sum": f"{inst:,}",
                "smsp__warps_launched.sum": str(warps), nt.stall_metric("wait"): wait}
        return [f'"{i}","1","py","h","{name}","1","7","(256, 1, 1)","({grid}, 1, 1)","0","9.0","s","{m}","u","{v}"'
                for m, v in vals.items()]
    log = ["==PROF== Connected to process 1", head]
    log += rows(0, "attn", 3, 10.0, 24_000, 24) + rows(1, "qmv_add_q4_0", 18, 5.0, 144_000, 144)
    log += rows(2, "qmv_add_q4_0", 18, 7.0, 216_000, 144, wait="n/a") + rows(3, "qmv_add_q4_0", 4096, 50.0, 10, 10)
    f = tmp_path / "ncu.csv"
    f.write_text("\n".join(log) + "\n")
    groups = nt.read(str(f))
    assert sorted(len(v) for v in groups.values()) == [1, 1, 2]
    lines = nt.table(groups)
    body = [ln for ln in lines[2:] if ln.startswith("|")]
    assert [ln.split(" | ")[0] for ln in body] == ["| qmv_add_q4_0", "| qmv_add_q4_0", "| attn"]
    q4 = body[1].split(" | ")
    assert q4[1:7] == ["18 x 256", "2", "6.00", "12.0", "nan", "1250"]     # (1000 + 1500) / 2 a warp
    assert q4[7 + nt.STALLS.index("wait")] == "1.50"                      # the n/a launch left out
    assert lines[-1] == "\nsummed: 72.0 us over 4 launches"


def test_ncu_table_memory_view(tmp_path):
    """--set memory: the metric list ncu is given, and a log of it tabled as GB/s (DRAM bytes
    over the kernel's time), DRAM % of peak, L2 hit rate, occupancy and sectors a request;
    values in the scaled units ncu prints by default (usecond, Mbyte) read as ns and bytes."""
    nt = _bench_module("ncu_table")
    listed = nt.metrics("memory").split(",")
    assert listed[0] == "gpu__time_duration.sum" and "lts__t_sector_hit_rate.pct" in listed
    assert not any(m.startswith("smsp__average_warps_issue_stalled") for m in listed)
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    vals = {"gpu__time_duration.sum": ("usecond", "10"), "dram__bytes_read.sum": ("Mbyte", "30"),
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "62.5"),
            "lts__t_sector_hit_rate.pct": ("%", "3.25"),
            "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", "18.75"),
            "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": ("sector", "4,000"),
            "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": ("", "1,000")}
    log = [head] + [f'"0","1","py","h","qmv_gate_up_silu_q4_k_norm","1","7","(128, 1, 1)","(344, 1, 1)","0",'
                    f'"9.0","s","{m}","{u}","{v}"' for m, (u, v) in vals.items()]
    f = tmp_path / "ncu.csv"
    f.write_text("\n".join(log) + "\n")
    lines = nt.table(nt.read(str(f)))
    assert lines[0].split(" | ")[5:] == ["GB/s", "MB read", "DRAM % peak", "L2 hit %", "occupancy %",
                                         "sectors a request |"]
    assert lines[2].split(" | ")[1:] == ["344 x 128", "1", "10.00", "10.0", "3000", "30.0", "62.5", "3.2",
                                         "18.8", "4.0 |"]


def test_trace_groups_block_records_into_launches():
    """bench/trace_cuda_decode.py's grouping of per-block records (tag<<40 | sm<<32 | block,
    start, wait return, end; ns): a kernel's blocks form one launch per block index, launches
    come in order of their last end, and the first and median wait returns are kept."""
    tr = _bench_module("trace_cuda_decode")
    att, mv = 0x1000, (1 << 8) | 1 << 2          # attention; q4_0 out += W x

    def rows(tag, blocks):
        return [((tag << 40) | (sm << 32) | b, s, w, e) for b, sm, s, w, e in blocks]
    rec = np.array(rows(att, [(0, 0, 100, 150, 300), (1, 1, 110, 160, 310)])
                   + rows(mv, [(0, 2, 250, 400, 1000), (1, 3, 260, 900, 990), (2, 4, 270, 1500, 980)])
                   + rows(att, [(0, 0, 1100, 1200, 1400), (1, 5, 1120, 0, 1130)]), dtype=np.uint64)
    ls = tr.launches(rec)
    assert [x["name"] for x in ls] == ["attention", "add q4_0", "attention"]
    assert [x["blocks"] for x in ls] == [2, 3, 2] and [x["sms"] for x in ls] == [2, 3, 2]
    assert [(x["start"], x["wait"], x["end"]) for x in ls] == [(100, 150, 310), (250, 400, 1000), (1100, 1200, 1400)]
    assert ls[1]["wait_med"] == 900 and ls[2]["wait_med"] == 1200    # a block that never waited: left out
    assert [x["start_med"] for x in ls] == [105, 260, 1110]
    assert ls[1]["starts"].tolist() == [250, 260, 270]
    # the kernels' tags by name: a _qx variant (0x2000), norm and q/k/v bits, a K-quant
    assert tr.tag_name(0x2000 | mv) == "add q4_0 qx"
    assert tr.tag_name((9 << 8) | 2 << 2 | 2) == "gate_up+norm q4_k"
    assert tr.tag_name(0x2000 | (13 << 8) | 3) == "qkv+norm q6_k qx"


def test_trace_stage_marks():
    """The stage marks of cuda/common.cuh TRACE_MARK (record columns 4-7): per launch, the
    median over the blocks that marked every stage of wait -> mark 1 -> ... -> mark 4 -> end,
    in us; blocks with a missing mark, or that never waited, are left out."""
    tr = _bench_module("trace_cuda_decode")
    att = 0x1000
    rec = np.array([
        # id, start, wait, end, marks 1..4 (ns)
        ((att << 40) | 0, 0, 1000, 9000, 2000, 4000, 5000, 8000),
        ((att << 40) | 1, 0, 1000, 11000, 3000, 6000, 7000, 10000),
        ((att << 40) | 2, 0, 1000, 3000, 2000, 0, 0, 0),          # left early: no marks
        ((att << 40) | 3, 0, 0, 500, 0, 0, 0, 0),                 # never waited
    ], dtype=np.uint64)
    (launch,) = tr.launches(rec)
    assert launch["blocks"] == 4
    assert launch["stages"] == [1.5, 2.5, 1.0, 3.0, 1.0]
    assert tr.launches(rec[:, :4])[0]["stages"] is None            # records without marks
    assert tr.launches(rec[2:])[0]["stages"] is None               # no block marked them all


CUPY_SCRIPTS = {"bench_cuda.py", "bench_cuda_quant.py", "probe_cuda_read.py"}     # import CuPy at the top
HELPERS = {"cuda_switches.py", "shown_paths.py"}               # imported by the scripts, no main


def _bench_scripts():
    from pathlib import Path
    # not dot-files: a developer's git-ignored scratch scripts (pathlib's * matches them)
    return sorted(p.name for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py")
                  if not p.name.startswith("."))


@pytest.mark.parametrize("script", _bench_scripts())
def test_bench_scripts_import_and_answer_help(script):
    """Every script under bench/ still imports what it uses and prints its usage: a helper
    renamed in one script must not leave another one broken until somebody runs it."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path
    if script in CUPY_SCRIPTS and importlib.util.find_spec("cupy") is None:
        pytest.skip("needs CuPy")
    path = Path(__file__).resolve().parents[1] / "bench" / script
    if script in HELPERS:
        code = f"import sys; sys.path.insert(0, {str(path.parent)!r}); import {path.stem}"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout.lower(), (r.returncode, r.stdout[-500:], r.stderr[-2000:])
