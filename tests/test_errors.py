"""Bad input: one clear line on stderr and exit status 2 from the CLI, a CyllmError from the API."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cyllm
from cyllm.tools.cli import main
from cyllm.errors import (BackendUnavailableError, ContextFullError, CyllmError, InvalidArgumentError,
                          ModelLoadError, UnsupportedModelError)
from tinymodels import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("err"), "llama_mqa_odd")


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:            # argparse rejects before main's own handling
        code = e.code
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("cyllm: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, err)


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# -- model paths and files ----------------------------------------------------------

def test_missing_path(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tmp_path / "nope", "-p", "hi"), "not found")


def test_directory_without_config(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tmp_path, "-p", "hi"), "config.json")


def test_unsupported_architecture(capsys, tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(capsys, "generate", "-m", d, "-p", "hi"), "GPTNeoXForCausalLM")
    with pytest.raises(UnsupportedModelError):
        cyllm.load(d, backend="numpy")


def test_missing_config_key(capsys, tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(capsys, "generate", "-m", d, "-p", "hi"), "hidden_size")


def test_tensor_shape_mismatch(capsys, tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 4         # every MLP matrix now has the wrong shape
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(capsys, "generate", "-m", d, "-p", "hi"), "shape")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "huge_header"])
def test_broken_safetensors(capsys, tiny, tmp_path, damage):
    d = copy_model(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(os.urandom(4096))
    else:
        f.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    assert_one_line_error(*run_cli(capsys, "generate", "-m", d, "-p", "hi"), "safetensors")


# -- arguments -----------------------------------------------------------------------

@pytest.mark.parametrize("threads", ["0", "-2", "two", "1.5"])
def test_bad_threads(capsys, tiny, threads):
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tiny, "-p", "hi", "-t", threads), "threads")
    with pytest.raises(InvalidArgumentError):
        cyllm.load(tiny, threads=threads)


def test_unknown_backend(capsys, tiny):
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tiny, "-p", "hi", "--backend", "tpu"), "tpu")
    with pytest.raises(BackendUnavailableError):
        cyllm.load(tiny, backend="tpu")


def test_negative_token_count(capsys, tiny):
    code, err = run_cli(capsys, "generate", "-m", tiny, "-p", "hi", "-n", "-5")
    assert_one_line_error(code, err, "-5")


def test_prompt_longer_than_context(capsys, tiny):
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tiny, "-p", "hello world " * 20, "-c", "8",
                                   "--backend", "numpy"), "context")


def test_api_errors(tiny):
    model = cyllm.load(tiny, backend="numpy", context=16)
    with pytest.raises(InvalidArgumentError):
        model.logits([])
    with pytest.raises(InvalidArgumentError):
        model.logits([0, model.config.vocab_size])
    with pytest.raises(InvalidArgumentError):
        model.logits([-1])
    with pytest.raises(ContextFullError):
        model.logits([1] * 17)
    with pytest.raises(InvalidArgumentError):
        list(model.generate("hi", max_tokens=-1))
    with pytest.raises(CyllmError):
        cyllm.load(tiny, context=0)
    with pytest.raises(ModelLoadError):
        cyllm.load("/definitely/not/here")


def test_context_full_stops_with_notice(capsys, tiny):
    code = main(["generate", "-m", str(tiny), "-p", "hello", "-n", "50", "-c", "12", "--temp", "0",
                 "--backend", "numpy"])
    err = capsys.readouterr().err
    assert code == 0
    assert "context window is full" in err


def test_cli_entry_point_exit_status(tmp_path):
    """The real process: exit status 2 and a single line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "cyllm", "generate", "-m", str(tmp_path / "x"), "-p", "a"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


@pytest.mark.parametrize("call", ["load_int", "load_bytes", "logits_none", "logits_str"])
def test_python_api_wrong_types_are_cyllm_errors(call, default_model):
    """Wrong argument types give a CyllmError (one line), not TypeError from deep inside."""
    import cyllm
    from cyllm.errors import CyllmError
    calls = {"load_int": lambda: cyllm.load(123), "load_bytes": lambda: cyllm.load(b"model.gguf"),
             "logits_none": lambda: default_model.logits(None), "logits_str": lambda: default_model.logits("hi")}
    with pytest.raises(CyllmError) as e:
        calls[call]()
    assert "\n" not in str(e.value)
