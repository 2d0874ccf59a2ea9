"""Models by name through the Hugging Face cache, with no network (HF_HUB_OFFLINE=1).

The test builds a hub cache in huggingface_hub's own layout (blobs/ + snapshots/<rev>/
symlinks + refs/main) holding a tiny checkpoint and two tiny GGUF files, then runs
the real `cyllm` process against it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cyllm.errors import ModelLoadError
from cyllm.hub import parse_spec, pick_gguf, quant_tag
from tinymodels import make_tiny_model

REV = "0123456789abcdef0123456789abcdef01234567"


def add_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """Put ``files`` (name -> source) into ``cache`` the way huggingface_hub stores a download."""
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / REV
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(REV)
    for name, src in files.items():
        data = src.read_bytes()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    from test_gguf import write_tiny_gguf
    root = tmp_path_factory.mktemp("hub")
    tiny = make_tiny_model(root / "src", "llama_mqa_odd")
    cache = root / "cache"
    add_repo(cache, "org/tiny", {f.name: f for f in tiny.iterdir()})
    q8, f16 = root / "src" / "tiny-Q8_0.gguf", root / "src" / "tiny-F16.gguf"
    write_tiny_gguf(q8, qtype=gguf.GGMLQuantizationType.Q8_0)
    write_tiny_gguf(f16, qtype=gguf.GGMLQuantizationType.F16)
    add_repo(cache, "org/tiny-GGUF", {q8.name: q8, f16.name: f16})
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"}
    env.pop("HF_HOME", None)
    return {"cache": cache, "env": env, "tiny": tiny, "q8": q8, "f16": f16}


def cyllm(hub, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cyllm", *map(str, args)], capture_output=True, text=True,
                          env=hub["env"], timeout=300, cwd=cwd)


GEN = ["--backend", "numpy", "-p", "The quick brown", "-n", "8", "--temp", "1", "--top-k", "0", "--top-p", "1",
       "--min-p", "0", "--seed", "3", "--no-stats"]


def test_a_checkpoint_by_name_is_the_cached_snapshot(hub):
    by_name = cyllm(hub, "generate", "-m", "org/tiny", *GEN)
    by_path = cyllm(hub, "generate", "-m", hub["tiny"], *GEN)
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout and by_name.stdout.strip()


def test_a_gguf_by_quantization_tag(hub):
    by_name = cyllm(hub, "generate", "-m", "org/tiny-GGUF:Q8_0", *GEN)
    by_path = cyllm(hub, "generate", "-m", hub["q8"], *GEN)
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout
    f16 = cyllm(hub, "generate", "-m", "org/tiny-GGUF:f16", *GEN)          # tags are case-insensitive
    assert f16.returncode == 0 and f16.stdout == cyllm(hub, "generate", "-m", hub["f16"], *GEN).stdout
    exact = cyllm(hub, "generate", "-m", "org/tiny-GGUF:tiny-Q8_0.gguf", *GEN)
    assert exact.returncode == 0 and exact.stdout == by_path.stdout


def one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("cyllm: error:"), r.stderr
    return lines[0]


def test_absent_model_offline_is_one_line(hub):
    line = one_error_line(cyllm(hub, "generate", "-m", "org/absent", "-p", "hi"))
    assert "org/absent" in line and "HF_HUB_OFFLINE=1" in line and str(hub["cache"]) in line


def test_missing_quantization_and_ambiguous_repo(hub):
    line = one_error_line(cyllm(hub, "generate", "-m", "org/tiny-GGUF:Q4_K_M", "-p", "hi"))
    assert "no GGUF file for Q4_K_M" in line and "F16, Q8_0" in line
    line = one_error_line(cyllm(hub, "generate", "-m", "org/tiny-GGUF", "-p", "hi"))
    assert "org/tiny-GGUF:QUANT" in line


def test_a_local_path_wins_over_a_name(hub, tmp_path):
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)                       # exists, but is no model: the loader says so
    r = cyllm(hub, "generate", "-m", "org/tiny", "-p", "hi", cwd=tmp_path)
    assert "config.json" in one_error_line(r)


def test_models_lists_the_cache(hub):
    r = cyllm(hub, "models")
    assert r.returncode == 0, r.stderr
    names = [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert names == ["org/tiny", "org/tiny-GGUF:F16", "org/tiny-GGUF:Q8_0"]
    assert str(hub["cache"]) in r.stdout


def test_info_by_name(hub):
    r = cyllm(hub, "info", "-m", "org/tiny-GGUF:Q8_0")
    assert r.returncode == 0, r.stderr
    assert "tensor types: Q8_0 x" in r.stdout


# -- name rules (no processes) ------------------------------------------------------------
def test_parse_spec():
    assert parse_spec("HuggingFaceTB/SmolLM2-360M-Instruct") == ("HuggingFaceTB/SmolLM2-360M-Instruct", None)
    assert parse_spec("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == \
        ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    for not_a_name in ("model.gguf", "/abs/path", "./rel/dir", "a/b/c", "../x/y", "a/..", "org/repo:bad/tag", ""):
        assert parse_spec(not_a_name) is None, not_a_name


def test_quant_tags():
    assert quant_tag("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_tag("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert quant_tag("model-IQ4_XS.gguf") == "IQ4_XS"
    assert quant_tag("qwen2.5-0.5b-instruct-fp16.gguf") is None
    assert quant_tag("x-bf16.gguf") == "BF16"


def test_pick_gguf():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf"]
    assert pick_gguf("o/r", files, None) == "m-Q4_K_M.gguf"              # llama.cpp's default
    assert pick_gguf("o/r", files, "q8_0") == "m-Q8_0.gguf"
    assert pick_gguf("o/r", ["config.json", "model.safetensors"], None) is None
    with pytest.raises(ModelLoadError, match="split"):
        pick_gguf("o/r", ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], "Q4_K_M")
    with pytest.raises(ModelLoadError, match="has no GGUF files"):
        pick_gguf("o/r", ["config.json"], "Q4_K_M")
    with pytest.raises(ModelLoadError, match="several GGUF files match"):
        pick_gguf("o/r", ["a-Q4_0.gguf", "b-Q4_0.gguf"], "Q4_0")


def test_no_network_is_one_line_and_fast(hub):
    env = {**hub["env"], "HF_ENDPOINT": "https://hub.example.invalid"}    # .invalid never resolves
    env.pop("HF_HUB_OFFLINE")
    t0 = __import__("time").monotonic()
    r = subprocess.run([sys.executable, "-m", "cyllm", "generate", "-m", "org/elsewhere", "-p", "hi"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert __import__("time").monotonic() - t0 < 30
    line = one_error_line(r)
    assert "cannot reach hub.example.invalid" in line and "no network?" in line
