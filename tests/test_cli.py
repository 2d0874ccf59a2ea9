"""The command line as a new user meets it: llama.cpp's habits, typos, help defaults,
piped prompts, `info -m`, built-in chat templates, context shift."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

from cyllm.tools import cli
from cyllm.tools.argparsing import llama_cpp_flag
from cyllm.tools.cli import build_parser, main
from tinymodels import make_tiny_model, write_tokenizer, make_tokenizer

BACKEND = "numpy"       # float32 reference: greedy text that does not depend on the build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli"), "llama_mqa_odd")


@pytest.fixture(scope="module")
def tiny_no_template(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("cli-nt"), "llama_tied")
    write_tokenizer(d, make_tokenizer(), chat_template=None)
    return d


def run(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:            # --help / --version
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("cyllm: error:"), err
    return lines[0]


# -- the parser -----------------------------------------------------------------------------
def test_no_parser_accepts_abbreviations(capsys):
    parser = build_parser()
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in parser.commands.values())
    code, _, err = run(capsys, "generate", "--max-token", "8", "-p", "x")
    assert code == 2
    assert "did you mean --max-tokens?" in one_error_line(err)


@pytest.mark.parametrize("argv, suggestion", [
    (["generate", "--temperture", "0.5", "-p", "x"], "--temperature"),
    (["genrate", "-p", "x"], "generate"),
    (["chat", "--sytem", "x"], "--system"),
    (["bench", "--synthtic", "tiny"], "--synthetic"),
    (["perplxity", "-f", "x"], "perplexity"),
])
def test_typos_get_a_suggestion(capsys, argv, suggestion):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert f"did you mean {suggestion}?" in one_error_line(err)


def test_llama_cpp_spellings_are_aliases():
    a = build_parser().parse_args(["generate", "-p", "x", "--n-predict", "5", "-r", "User:",
                                   "--reverse-prompt", "###", "--ctx-size", "64", "--repeat-penalty", "1.1",
                                   "-tb", "2"])
    assert (a.max_tokens, a.stop, a.context, a.repeat_penalty, a.threads_batch) == (5, ["User:", "###"], 64, 1.1, "2")
    c = build_parser().parse_args(["chat", "--system-prompt", "Be terse.", "--n-predict", "7"])
    assert (c.system, c.max_tokens) == ("Be terse.", 7)


@pytest.mark.parametrize("flag", [["-ngl", "99"], ["-ngl99"], ["--n-gpu-layers", "32"], ["--gpu-layers=10"]])
def test_ngl_points_to_backend_cuda(capsys, flag):
    code, _, err = run(capsys, "generate", *flag, "-p", "x")
    assert code == 2
    line = one_error_line(err)
    assert "--backend cuda" in line and "whole number" not in line


def test_hf_flag_points_to_model_names(capsys):
    code, _, err = run(capsys, "generate", "-hf", "org/repo:Q4_K_M", "-p", "x")
    assert code == 2 and "-m org/repo" in one_error_line(err)


def test_a_prompt_that_looks_like_a_flag_is_a_prompt():
    assert llama_cpp_flag(["generate", "-p", "-ngl"]) is None
    assert llama_cpp_flag(["generate", "--", "-ngl"]) is None


def test_a_bare_word_after_generate_says_to_use_p(capsys):
    code, _, err = run(capsys, "generate", "hello")
    assert code == 2 and "-p TEXT" in one_error_line(err)


def test_help_defaults_are_the_real_defaults(capsys):
    parser = build_parser()
    chat = parser.commands["chat"]
    assert chat.parse_args([]).max_tokens == 512
    assert "(default 512)" in chat.format_help()
    gen = parser.commands["generate"]
    assert gen.parse_args(["-p", "x"]).max_tokens == 128 and "(default 128)" in gen.format_help()
    ppl = parser.commands["perplexity"].format_help()
    assert "default 512" in " ".join(ppl.split())
    for name in ("bench", "tune"):
        assert "--threads-batch" not in parser.commands[name].format_help()
    code, _, err = run(capsys, "bench", "--synthetic", "tiny", "--threads-batch", "2")
    assert code == 2 and "--threads-batch" in one_error_line(err)


def test_cuda_hint_says_what_works(monkeypatch):
    hint = cli.CUDA_INSTALL_HINT
    assert "'.[cuda]'" in hint and "cupy-cuda12x" in hint and "cupy-cuda13x" in hint
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy -> ImportError
    status = cli._cuda_status()
    assert status.startswith("not available") and "cupy-cuda12x" in status
    assert "pip install cyllm[cuda]" not in status


# -- prompts ------------------------------------------------------------------------------------
def _fake_stdin(monkeypatch, data: bytes):
    stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    stream.isatty = lambda: False
    monkeypatch.setattr(sys, "stdin", stream)


def test_piped_prompt_loses_the_newline_echo_adds(capsys, monkeypatch, tiny):
    import cyllm
    text = "The quick brown fox"
    tok = cyllm.load(tiny, backend=BACKEND).tokenizer
    assert tok.encode(text + "\n") != tok.encode(text)       # the newline would change the input
    common = ["generate", "-m", tiny, "--backend", BACKEND, "--temp", "0", "-n", "6", "--no-stats"]
    code, by_flag, _ = run(capsys, *common, "-p", text)
    assert code == 0
    _fake_stdin(monkeypatch, (text + "\n").encode())
    code, piped, _ = run(capsys, *common)
    assert code == 0 and piped == by_flag
    _fake_stdin(monkeypatch, (text + "\n").encode())
    code, dash, _ = run(capsys, *common, "-p", "-")
    assert code == 0 and dash == by_flag


def test_only_one_newline_is_stripped():
    assert cli.strip_one_newline("a\n") == "a"
    assert cli.strip_one_newline("a\r\n") == "a"
    assert cli.strip_one_newline("a\n\n") == "a\n"
    assert cli.strip_one_newline("a") == "a"


def test_context_beyond_the_trained_length_warns(capsys, tiny):
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", BACKEND, "-p", "hi", "-n", "1",
                       "-c", "1024", "--no-stats")
    assert code == 0
    assert "cyllm: warning: --context 1024 is larger than the 512 tokens" in err
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", BACKEND, "-p", "hi", "-n", "1",
                       "-c", "256", "--no-stats")
    assert code == 0 and "warning" not in err


# -- info -m -------------------------------------------------------------------------------------
def test_info_of_a_hf_directory(capsys, tiny):
    from tinymodels import load_reference
    code, out, _ = run(capsys, "info", "-m", tiny)
    assert code == 0
    info = dict(line.split(": ", 1) for line in out.splitlines())
    cfg = json.loads((tiny / "config.json").read_text())
    ref = load_reference(tiny)                                   # transformers counts the parameters
    n = sum(p.numel() for p in ref.parameters())
    assert info["family"] == "LlamaForCausalLM"
    assert info["parameters"] == f"{n / 1e6:.1f} M"
    assert f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}" in info["sizes"]
    assert info["context"] == f"{cfg['max_position_embeddings']} tokens (trained)"
    assert info["quantization"] == "none (F32 weights)"
    assert info["chat template"] == "yes"
    assert info["tokenizer"].startswith("BPE")
    # K and V, float16, every layer: 2 * layers * kv_heads * head_dim * 2 bytes
    from cyllm.tools.modelinfo import fmt_bytes
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert info["KV cache"].startswith(f"{fmt_bytes(kv)} per token of context")


def test_info_of_a_gguf_file_matches_the_gguf_package(capsys, tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_gguf import write_tiny_gguf
    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, qtype=gguf.GGMLQuantizationType.Q8_0)
    code, out, _ = run(capsys, "info", "-m", path)
    assert code == 0
    info = dict(line.split(": ", 1) for line in out.splitlines())
    reader = gguf.GGUFReader(str(path))                          # independent parser
    from collections import Counter
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    assert info["tensor types"] == ", ".join(f"{k} x{v}" for k, v in counts.most_common())
    assert info["family"] == "llama"
    assert info["quantization"] == "not stated (no general.file_type)"
    assert info["tokenizer"].startswith("llama (SentencePiece)")
    assert info["chat template"].startswith("none")


def test_info_shows_tokenizer_values_of_the_wrong_type(capsys, tmp_path):
    """tokenizer.ggml.model and .pre written as arrays (a hostile or broken file) are shown as
    they are; info does not crash on them."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.model", [1, 2])
    w.add_array("tokenizer.ggml.pre", [3])
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, out, _ = run(capsys, "info", "-m", path)
    assert code == 0
    info = dict(line.split(": ", 1) for line in out.splitlines())
    assert info["tokenizer"] == "[1 2], 2 tokens, pre-tokenizer [3]"


def test_info_of_the_default_model_names_its_quantization(capsys, default_model_file):
    code, out, _ = run(capsys, "info", "-m", default_model_file)
    assert code == 0
    info = dict(line.split(": ", 1) for line in out.splitlines())
    assert info["quantization"] == "Q4_1 (general.file_type 3)"     # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1 = 3
    assert info["context"] == "8192 tokens (trained)"
    assert info["chat template"].startswith("yes")


def test_info_of_a_missing_model(capsys, tmp_path):
    code, _, err = run(capsys, "info", "-m", tmp_path / "nope.gguf")
    assert code == 2 and "not found" in one_error_line(err)


# -- chat templates ----------------------------------------------------------------------------
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


@pytest.mark.parametrize("name, expected", [
    # the formats as published on the model cards (ChatML / Llama 3 / Gemma / Phi-3)
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
               "<|im_start|>assistant\n"),
    ("llama3", "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("gemma", "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"),
    ("phi3", "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
             "<|user|>\nBye<|end|>\n<|assistant|>\n"),
])
def test_builtin_templates_render_the_published_format(tiny, name, expected):
    import cyllm
    from cyllm.chat_templates import resolve_chat_template
    tok = cyllm.load(tiny, backend=BACKEND).tokenizer       # bos_token "<s>"
    tok.set_chat_template(resolve_chat_template(name).source)
    assert tok.apply_chat_template(CONV, add_generation_prompt=True) == expected


def test_chat_template_from_a_file_and_bad_names(tmp_path, tiny, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    code, out, err = run(capsys, "generate", "-m", tiny, "--backend", BACKEND, "-p", "hi", "-n", "2",
                         "--chat-template", f, "--no-stats")
    assert code == 0, err
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", BACKEND, "-p", "hi",
                       "--chat-template", "chatmll")
    assert code == 2 and "chatml, llama3, gemma, phi3" in one_error_line(err)
    (tmp_path / "bad.jinja").write_text("{% for %}")
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", BACKEND, "-p", "hi",
                       "--chat-template", tmp_path / "bad.jinja")
    assert code == 2 and "template" in one_error_line(err)


def test_chat_without_a_template_fails_before_any_typing(capsys, monkeypatch, tiny_no_template):
    _fake_stdin(monkeypatch, b"hello\n")
    code, out, err = run(capsys, "chat", "-m", tiny_no_template, "--backend", BACKEND, "-n", "3")
    assert code == 2 and out == ""
    assert "--chat-template" in one_error_line(err)
    _fake_stdin(monkeypatch, b"hello\n")
    code, out, err = run(capsys, "chat", "-m", tiny_no_template, "--backend", BACKEND, "-n", "3",
                         "--chat-template", "chatml", "--temp", "0")
    assert code == 0, err
    assert "chat: 1 answer |" in err


# -- context shift ---------------------------------------------------------------------------------
def test_context_shift_continues_like_a_fresh_run_of_the_shifted_text(tiny):
    import cyllm
    from cyllm.context_shift import _shifting_tokens, shifted_ids
    from cyllm.generate import GenerationStats, Session
    from cyllm.sampling import SamplingParams

    ctx, keep, n = 20, 3, 45
    model = cyllm.load(tiny, backend=BACKEND, context=ctx)
    ids = model.tokenizer.encode("The rain in Spain")
    shifts = []
    stats = GenerationStats()
    got = list(_shifting_tokens(Session(model), ids, n, SamplingParams(), stats, keep, shifts.append))
    assert shifts, "the context never filled"
    # reference: every token from a fresh evaluation of the window the shift rule leaves
    eos = set(model.config.eos_token_ids) | set(model.tokenizer.eos_ids)
    window, want = list(ids), []
    while len(want) < n:
        t = int(np.argmax(model.logits(window)[-1]))
        if t in eos:
            break
        want.append(t)
        window = shifted_ids(window + [t], keep) if len(window) >= ctx else window + [t]
    assert got == want
    assert shifted_ids(list(range(10)), 2) == [0, 1, 6, 7, 8, 9]


def test_generate_context_shift_flag(capsys, tiny):
    common = ["generate", "-m", tiny, "--backend", BACKEND, "-p", "hello", "-n", "40", "-c", "16", "--temp", "0"]
    code, _, err = run(capsys, *common)
    assert code == 0 and "context window is full" in err and "--context-shift" in err
    code, _, err = run(capsys, *common, "--context-shift")
    assert code == 0 and "context full: dropped" in err
    code, _, err = run(capsys, *common, "--context-shift", "--keep", "-5")     # -1 is the only negative
    assert code == 2 and "--keep" in err and len(err.strip().splitlines()) == 1


# -- bench output, tune noise, perplexity progress -------------------------------------------------
def test_bench_names_the_weight_format_and_file_size(capsys, default_model_file, monkeypatch):
    import os
    from cyllm.tools import bench
    monkeypatch.setattr(bench, "read_bandwidth", lambda backend, threads, nbytes=None: (1e-3, "test"))
    code, out, _ = run(capsys, "bench", "-m", default_model_file, "-p", "8", "-n", "2", "-r", "1",
                       "-t", "1", "--no-progress", "-o", "jsonl")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["test"] for r in rows] == ["pp8", "tg2"]
    assert rows[0]["model_type"] == "llama 135M Q4_1"                 # as llama-bench names it
    assert rows[0]["file_bytes"] == os.path.getsize(default_model_file)
    # a probe that underestimates the bandwidth never yields a roofline above 100%
    assert rows[1]["roofline_pct"] == 100.0 and rows[1]["roofline_pct_measured"] > 100.0
    code, out, _ = run(capsys, "bench", "-m", default_model_file, "-p", "0", "-n", "2", "-r", "1",
                       "-t", "1", "--no-progress")
    row = [ln for ln in out.splitlines() if "tg2" in ln][0]
    assert row.startswith("| llama 135M Q4_1 | 93.81 MiB |") and row.endswith("| 100.0%* |")
    assert "* measured above the probed bandwidth" in out


def test_bench_probe_is_sized_like_the_working_set(monkeypatch):
    from cyllm.tools import bench
    seen = []

    class FakeCpu:
        name = "cpu"

        def measure_bandwidth(self, nbytes, threads=None):
            seen.append(nbytes)
            return 10.0, "fake"
    monkeypatch.setattr(bench, "_BW_CACHE", {})
    bench.read_bandwidth(FakeCpu(), 1, 3 << 20)
    bench.read_bandwidth(FakeCpu(), 1, 10 << 30)
    bench.read_bandwidth(FakeCpu(), 1, 100)
    assert seen == [3 << 20, bench.PROBE_MAX_BYTES, bench.PROBE_MIN_BYTES]


def test_tune_does_not_save_noise(capsys, monkeypatch, tmp_path):
    import itertools
    from cyllm import saved_tuning
    from cyllm.tools import bench
    monkeypatch.setenv("CYLLM_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "read_bandwidth", lambda backend, threads, nbytes=None: (10.0, "test"))
    durations = itertools.cycle([0.01, 0.02])                     # every run alternates: a 67% spread
    monkeypatch.setattr(bench, "time_test", lambda model, test, n, rng: next(durations))
    argv = ["tune", "--synthetic", "tiny", "--pp", "8", "--tg", "4", "-r", "3", "-t", "1", "--no-progress"]
    code, out, err = run(capsys, *argv)
    assert code == 0
    assert "repetitions disagree by up to" in err and "not saved" in err
    assert not saved_tuning.tuning_path().exists()
    code, out, err = run(capsys, *argv, "--save-anyway")
    assert code == 0 and "repetitions disagree" in err and saved_tuning.tuning_path().exists()


def test_perplexity_progress_only_on_a_terminal(tiny, tmp_path):
    from ptyrun import PtyProcess, cyllm_argv
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    args = ["perplexity", "-m", tiny, "--backend", BACKEND, "-f", text, "-c", "32"]
    for extra, bar in (([], True), (["--no-progress"], False)):
        p = PtyProcess(cyllm_argv(*args, *extra))
        try:
            assert p.wait(120) == 0, p.text()
        finally:
            p.close()
        assert ("chunk/s" in p.text() or "chunk]" in p.text()) == bar, p.text()
        assert "PPL = " in p.text()
    r = __import__("subprocess").run(cyllm_argv(*args), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("PPL = ")
