"""`cyllm quantize` from a Hugging Face directory, checked against llama.cpp's own tools.

The reference for every file is llama.cpp: its converter (convert_hf_to_gguf.py, F16)
followed by llama-quantize makes the file a llama.cpp user would get; cyllm's file of
the same HF directory must hold the same metadata, the same tensor names, shapes and
types (llama.cpp's per-tensor recipe), and -- from a float16 directory, where both
quantize the same values -- the very same blocks. From a float32 directory cyllm
quantizes the original values (llama.cpp goes through F16 first), so the bytes differ:
there llama-perplexity on both files must agree within 1%.

Needs llama.cpp's converter (tests/llamacpp_tools.py) and built tools
(tests/llamacpp_build.py); skips with the reason when either cannot be had.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llamacpp_tools import LlamaCppUnavailable, GGUF_KINDS, convert_many
from tinymodels import GGUF_PRE, KIND_TOKENIZER, KINDS, make_tiny_model

gguf = pytest.importorskip("gguf")

# llama.cpp's pre-tokenizer names with the same split (llama.cpp treats them alike); the
# converter names SmolLM3's by a hash of its token ids, cyllm by the split regex
SAME_PRE = {"smaug-bpe": "llama-bpe"}
# keys the converter derives from the directory name or the tokenizer's post-processor
# (add_sep_token: false either way, llama.cpp's default)
IGNORED_KEYS = {"general.name", "general.type", "general.size_label", "general.basename", "general.finetune",
                "tokenizer.ggml.add_sep_token"}

# a llama with rows that are multiples of 256, so the K-quant formats themselves are written
# (the family kinds' rows of 64-232 columns all fall back to Q5_0/Q5_1/Q8_0); 8 layers, so
# llama.cpp's "more bits" rule picks some layers and not others
KINDS["llama_k256"] = ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=64, intermediate_size=768, num_hidden_layers=8,
                                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                                     tie_word_embeddings=False))
KIND_TOKENIZER["llama_k256"] = "llama3"
# Mixtral with 8 experts: llama-quantize's rules for exactly 8 (attn_k and attn_v Q8_0, attn_output
# Q5_K in Q4_K_M), on rows of 256 so that the K-quants are written, 8 layers for "more bits"
KINDS["mixtral8"] = ("mixtral", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=64, intermediate_size=256, num_local_experts=8,
                                     num_experts_per_tok=2, num_hidden_layers=8, rms_norm_eps=1e-5,
                                     rope_theta=1e6, sliding_window=None))
KIND_TOKENIZER["mixtral8"] = "llama2"


def _tool(name: str) -> Path:
    from llamacpp_build import llamacpp_tool
    try:
        return llamacpp_tool(name)
    except LlamaCppUnavailable as e:
        pytest.skip(f"llama.cpp's tools cannot be built here: {e}")


class Material:
    """HF directories, llama.cpp F16 GGUFs and llama-quantize outputs, made once per module."""

    def __init__(self, root: Path):
        self.root = root
        self.hf: dict[tuple[str, str], Path] = {}
        self.f16: dict[tuple[str, str], Path] = {}

    def hf_dir(self, kind: str, dtype: str) -> Path:
        if (kind, dtype) not in self.hf:
            self.hf[(kind, dtype)] = make_tiny_model(self.root / "hf", kind, dtype=dtype, seed=0)
        return self.hf[(kind, dtype)]

    def convert(self, pairs) -> None:
        todo = [(k, d) for k, d in pairs if (k, d) not in self.f16]
        jobs = [(self.hf_dir(k, d), self.root / f"{k}-{d}-F16.gguf", "f16", GGUF_PRE[KIND_TOKENIZER[k]])
                for k, d in todo]
        try:
            outs = convert_many(jobs)
        except LlamaCppUnavailable as e:
            pytest.skip(f"llama.cpp's converter is unavailable: {e}")
        self.f16.update(zip(todo, outs))

    def llamacpp_quant(self, kind: str, dtype: str, qtype: str) -> Path:
        self.convert([(kind, dtype)])
        out = self.root / f"{kind}-{dtype}-lc-{qtype}.gguf"
        if not out.is_file():
            r = subprocess.run([str(_tool("llama-quantize")), str(self.f16[(kind, dtype)]), str(out), qtype, "2"],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return out

    def cyllm_quant(self, kind: str, dtype: str, qtype: str) -> Path:
        from cyllm.tools.quantize import quantize
        out = self.root / f"{kind}-{dtype}-cyllm-{qtype}.gguf"
        if not out.is_file():
            quantize(self.hf_dir(kind, dtype), out, qtype, threads=2)
        return out


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    m = Material(tmp_path_factory.mktemp("quanttool"))
    m.convert([(k, "float16") for k in GGUF_KINDS] + [("llama_k256", "float16"), ("llama_k256", "float32"),
                                                      ("mixtral8", "float16")])
    return m


def _fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return r, {k: f for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in IGNORED_KEYS}


def _assert_same_file(ours: Path, ref: Path, exact_vectors: bool = True) -> None:
    ra, fa = _fields(ours)
    rb, fb = _fields(ref)
    assert sorted(fa) == sorted(fb), (sorted(set(fa) - set(fb)), sorted(set(fb) - set(fa)))
    for k in fa:
        assert fa[k].types == fb[k].types, (k, fa[k].types, fb[k].types)
        va, vb = fa[k].contents(), fb[k].contents()
        if k == "tokenizer.ggml.pre":
            va, vb = SAME_PRE.get(va, va), SAME_PRE.get(vb, vb)
        if k == "tokenizer.ggml.scores":
            # llama.cpp's tokenizer reads the scores of normal pieces only
            types = fb["tokenizer.ggml.token_type"].contents()
            va = [s for s, t in zip(va, types) if t == 1]
            vb = [s for s, t in zip(vb, types) if t == 1]
        if isinstance(vb, float) or (isinstance(vb, list) and vb and isinstance(vb[0], float)):
            np.testing.assert_allclose(va, vb, rtol=1e-6, err_msg=k)
        else:
            assert va == vb, (k, str(va)[:200], str(vb)[:200])
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    assert sorted(ta) == sorted(tb)
    for name, b in tb.items():
        a = ta[name]
        assert (a.tensor_type.name, list(a.shape)) == (b.tensor_type.name, list(b.shape)), name
        da, db = np.asarray(a.data), np.asarray(b.data)
        if b.tensor_type == gguf.GGMLQuantizationType.F32:
            # vectors: llama.cpp's converter adds Gemma's +1 in float16 (one f16 step at 1.0),
            # rope_freqs are computed in float32 there, float64 here
            np.testing.assert_allclose(da, db, rtol=1e-6 if exact_vectors else 0, atol=0 if exact_vectors else 1e-3,
                                       err_msg=name)
        else:
            assert np.array_equal(da.view(np.uint8), db.view(np.uint8)), f"{name}: blocks differ"


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("kind", GGUF_KINDS + ("mixtral8",))
def test_families_match_llamacpp(material, kind, qtype):
    """A float16 HF directory of every family: cyllm's file == converter + llama-quantize's file
    (metadata, vocabulary, tensor names/shapes/types, blocks byte for byte)."""
    ref = material.llamacpp_quant(kind, "float16", qtype)
    ours = material.cyllm_quant(kind, "float16", qtype)
    _assert_same_file(ours, ref, exact_vectors=kind not in ("gemma", "gemma2", "gemma3"))


def test_glm4_with_llama3_split_is_written_as_glm4(tmp_path):
    """GLM-4's tokenizer splits text as Llama 3's; llama.cpp's converter names it glm4 (and then
    adds no BOS, where llama-bpe would), so cyllm's file does too."""
    from cyllm.tools.hf_gguf import hf_source
    d = make_tiny_model(tmp_path, "glm4", dtype="float16", tokenizer="llama3")
    kv = {k: v for k, v, _, _ in hf_source(d).metadata}
    assert kv["tokenizer.ggml.pre"] == "glm4"
    d2 = make_tiny_model(tmp_path, "qwen3", dtype="float16", tokenizer="llama3")
    assert {k: v for k, v, _, _ in hf_source(d2).metadata}["tokenizer.ggml.pre"] == "llama-bpe"


def test_olmo3_is_not_written_as_olmo2(tmp_path):
    """An OLMo 3 directory written as OLMo 2 would lose its windows and its second rope."""
    from cyllm.errors import UnsupportedModelError
    from cyllm.tools.quantize import quantize
    d = make_tiny_model(tmp_path, "olmo3", dtype="float16")
    with pytest.raises(UnsupportedModelError, match="OLMo 3"):
        quantize(d, tmp_path / "o.gguf", "q8_0", threads=1)
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.slow
def test_yarn_scaling_matches_llamacpp(material):
    """YaRN rope scaling travels as the converter writes it (type, factor, original context)."""
    ref = material.llamacpp_quant("qwen3_yarn", "float16", "q8_0")
    ours = material.cyllm_quant("qwen3_yarn", "float16", "q8_0")
    _assert_same_file(ours, ref)
    assert _fields(ours)[1]["qwen3.rope.scaling.type"].contents() == "yarn"


@pytest.mark.slow
def test_exaone4_hybrid_matches_llamacpp(material, tmp_path):
    """EXAONE 4's hybrid layers travel as the converter writes them (the window and a flag a
    layer) at 64 layers, the one depth llama.cpp slides at, and read back as llama.cpp runs
    them; at any other depth the file would run all full layers, so cyllm refuses to write it."""
    from cyllm.errors import UnsupportedModelError
    from cyllm.loading.gguf import config_from_gguf, read_gguf
    from cyllm.tools.quantize import quantize
    ref = material.llamacpp_quant("exaone4_swa64", "float16", "q8_0")
    ours = material.cyllm_quant("exaone4_swa64", "float16", "q8_0")
    _assert_same_file(ours, ref)
    fields = _fields(ours)[1]
    assert fields["exaone4.attention.sliding_window"].contents() == 16
    assert fields["exaone4.attention.sliding_window_pattern"].contents() == [True, True, True, False] * 16
    c = config_from_gguf(read_gguf(ours))
    assert c.sliding_window == 16 and c.nope_layers == tuple(range(3, 64, 4))
    d = make_tiny_model(tmp_path, "exaone4_swa", dtype="float16")
    with pytest.raises(UnsupportedModelError, match="only at 64 layers"):
        quantize(d, tmp_path / "e.gguf", "q8_0", threads=1)
    assert not (tmp_path / "e.gguf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_k_quant_rows_match_llamacpp(material, qtype):
    """Rows that are multiples of 256: the K-quant blocks and the Q4_K_M / Q5_K_M per-layer
    choices (Q6_K on some attn_v / ffn_down) are llama-quantize's."""
    ref = material.llamacpp_quant("llama_k256", "float16", qtype)
    ours = material.cyllm_quant("llama_k256", "float16", qtype)
    _assert_same_file(ours, ref)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(ours)).tensors}
    want = {"q8_0": {"Q8_0"}, "q4_0": {"Q4_0", "Q6_K"}, "q4_k_m": {"Q4_K", "Q6_K"},
            "q5_k_m": {"Q5_K", "Q6_K"}, "q6_k": {"Q6_K"}}[qtype]
    assert want <= types, types


def _text(tmp_path: Path) -> Path:
    src = Path("/usr/share/common-licenses/GPL-3")
    text = src.read_text(encoding="utf-8")[:6000] if src.is_file() else \
        ("The quick brown fox jumps over the lazy dog. Hello world! How are you today? " * 80)
    p = tmp_path / "ppl.txt"
    p.write_text(text, encoding="utf-8")
    return p


def _llamacpp_ppl(model: Path, text: Path) -> dict[int, float]:
    """llama-perplexity's running estimate after each chunk, {chunk: PPL} (stdout; its
    "Final estimate" line goes through an asynchronous logger that may lose it at exit,
    and so may the last chunk's value: callers compare at a chunk both runs reached)."""
    r = subprocess.run([str(_tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128",
                        "-b", "128", "-t", "2", "--chunks", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    found = {int(k): float(v) for k, v in re.findall(r"\[(\d+)\]([0-9.]+),", r.stdout)}
    assert len(found) >= 6, (r.stdout + r.stderr)[-3000:]
    return found


def _common(*runs: dict[int, float]) -> list[float]:
    k = max(set.intersection(*(set(r) for r in runs)))
    return [r[k] for r in runs]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_k_m", "q8_0"])
def test_float32_dir_perplexity_within_1pct_of_llamacpp(material, tmp_path, qtype):
    """From float32 weights cyllm quantizes the original values; llama.cpp's perplexity on
    cyllm's file is within 1% of its perplexity on its own quantization of the same model."""
    ref = material.llamacpp_quant("llama_k256", "float32", qtype)
    ours = material.cyllm_quant("llama_k256", "float32", qtype)
    text = _text(tmp_path)
    p_ref, p_ours, p_f16 = _common(_llamacpp_ppl(ref, text), _llamacpp_ppl(ours, text),
                                   _llamacpp_ppl(material.f16[("llama_k256", "float32")], text))
    print(f"{qtype}: llama.cpp PPL on llama.cpp's file {p_ref:.4f}, on cyllm's {p_ours:.4f}, F16 {p_f16:.4f}")
    assert abs(p_ours / p_ref - 1) < 0.01, (p_ours, p_ref)
    # not the same bytes (the test would say nothing about quantizing from float32 otherwise)
    a = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(str(ref)).tensors}
    assert any(a[n] != b[n] for n in a)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["f16", "native"])
def test_cyllm_loads_its_file_like_llamacpps(material, monkeypatch, mode):
    """cyllm reads the file it wrote as it reads llama-quantize's file of the same model
    (float16 directory: the same blocks, so the same logits), on both weight paths."""
    import cyllm
    monkeypatch.setenv("CYLLM_QUANT", mode)
    ids = [400, 17, 42, 99, 7, 123, 250, 3]
    out = []
    for path in (material.cyllm_quant("llama_k256", "float16", "q4_k_m"),
                 material.llamacpp_quant("llama_k256", "float16", "q4_k_m")):
        m = cyllm.load(path, backend="cpu")
        out.append(np.array(m.logits(ids)))
        assert isinstance("".join(m.generate("Hello world", max_tokens=8, temperature=0)), str)
    np.testing.assert_array_equal(out[0], out[1])


def test_cli_unknown_type_lists_supported(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cyllm", "quantize", str(tmp_path), str(tmp_path / "o.gguf"),
                        "--type", "q3_k_xl"], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("cyllm: error:") and "q3_k_xl" in lines[0]
    for t in ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"):
        assert t in lines[0]


def test_cli_directory_without_config(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    r = subprocess.run([sys.executable, "-m", "cyllm", "quantize", str(d), str(tmp_path / "o.gguf"),
                        "--type", "q8_0"], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "config.json" in lines[0], r.stderr
    assert not list(tmp_path.glob("o.gguf*"))          # nor a partial file left behind


def _tiny_gguf(tmp_path, qtype="F16"):
    from test_gguf import write_tiny_gguf
    p = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(p, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    return p


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_cli_output_that_is_not_a_regular_file(tmp_path):
    """The file is written aside and renamed over the output, so an output that is a pipe or
    a device would be replaced by a regular file (run as root, `quantize ... /dev/null
    --force` replaced /dev/null itself): refused in one line, the pipe left as it was."""
    import stat
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    r = subprocess.run([sys.executable, "-m", "cyllm", "quantize", str(_tiny_gguf(tmp_path)), str(pipe),
                        "--type", "q8_0", "--force"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "not a regular file" in lines[0], r.stderr
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "tiny-F16.gguf"]


def test_partial_file_has_a_name_of_its_own(tmp_path):
    """The partial output is not `OUT.part`, which may be someone's file: that one is left
    alone, and nothing partial stays behind."""
    from cyllm.tools.quantize import quantize
    out = tmp_path / "o.gguf"
    theirs = tmp_path / "o.gguf.part"
    theirs.write_text("mine")
    quantize(_tiny_gguf(tmp_path), out, "q8_0", threads=1)
    assert theirs.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf", "o.gguf.part", "tiny-F16.gguf"]
    assert gguf.GGUFReader(str(out)).tensors


def test_partial_files_of_killed_runs_are_removed(tmp_path, capsys):
    """A run killed with SIGKILL leaves its partial file; the next run to the same output
    removes it (and says so), but not a partial file whose process still runs, one written to
    recently, another output's, or a file of another name."""
    from cyllm.tools import quantize as Q
    src = _tiny_gguf(tmp_path)
    out = tmp_path / "o.gguf"
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed.kill()
        killed.wait()
        old = time.time() - 2 * Q.STALE_AFTER_S
        made = {}
        for key, name in (("stale", f".o.gguf.{killed.pid}-0123abcd.part"),
                          ("fresh", f".o.gguf.{killed.pid}-89abcdef.part"),
                          ("running", f".o.gguf.{alive.pid}-00000000.part"),
                          ("other output", f".p.gguf.{killed.pid}-0123abcd.part"),
                          ("other name", f".o.gguf.{killed.pid}.part")):
            made[key] = tmp_path / name
            made[key].write_bytes(b"x" * 4096)
            if key != "fresh":
                os.utime(made[key], (old, old))
        Q.quantize(src, out, "q8_0", threads=1)
        assert not made["stale"].exists()
        assert all(p.exists() for k, p in made.items() if k != "stale")
        assert "removed 4 kB of partial files" in capsys.readouterr().err
        assert gguf.GGUFReader(str(out)).tensors
    finally:
        alive.kill()
        alive.wait()


def test_failed_write_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails -- after the partial file is open, or before (the output's parent is a
    file) -- is one InvalidArgumentError naming the output, never the partial file, and leaves
    no partial file behind."""
    import errno

    import cyllm.quant.convert as convert
    from cyllm.errors import InvalidArgumentError
    from cyllm.tools.quantize import quantize
    src = _tiny_gguf(tmp_path)
    out = tmp_path / "o.gguf"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(convert, "quantize_rows_f32", full)
        with pytest.raises(InvalidArgumentError, match=r"cannot write .*o\.gguf \(No space left on device\)"):
            quantize(src, out, "q8_0", threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-F16.gguf"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(InvalidArgumentError, match=r"cannot write .*afile/o\.gguf \(Not a directory\)"):
        quantize(src, afile / "o.gguf", "q8_0", threads=1)
    long_name = tmp_path / ("o" * 240 + ".gguf")             # 245 bytes: a valid name
    quantize(src, long_name, "q8_0", threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", long_name.name, "tiny-F16.gguf"]


def test_dangling_symlink_output_needs_force(tmp_path):
    """A symlink at the output counts as an existing output even when it points nowhere."""
    from cyllm.errors import InvalidArgumentError
    from cyllm.tools.quantize import quantize
    link = tmp_path / "o.gguf"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(InvalidArgumentError, match="exists; choose another name or pass --force"):
        quantize(_tiny_gguf(tmp_path), link, "q8_0", threads=1)
    assert link.is_symlink()


def test_notes_go_to_sys_stderr_of_the_call(tmp_path, monkeypatch):
    """The requantizing note goes to sys.stderr as it is when quantize runs: a default bound at
    import wrote to whatever stream was current then (a closed one, in the fuzzer's worker:
    an internal error)."""
    import io

    from cyllm.tools.quantize import quantize
    src = _tiny_gguf(tmp_path, "Q8_0")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    quantize(src, tmp_path / "o.gguf", "q4_0", threads=1)
    assert "requantizing Q8_0 tensors" in err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_k_m", "q6_k"])
@pytest.mark.parametrize("kind", ["llama_k256", "phi3"])
def test_gguf_input_matches_llamacpp(material, tmp_path, kind, qtype):
    """The GGUF input path: llama.cpp's F16 file -> cyllm quantize == llama-quantize's file."""
    from cyllm.tools.quantize import quantize
    material.convert([(kind, "float16")])
    ours = tmp_path / "ours.gguf"
    quantize(material.f16[(kind, "float16")], ours, qtype, threads=2)
    _assert_same_file(ours, material.llamacpp_quant(kind, "float16", qtype))


def _hostile_dirs(base: Path) -> dict[str, Path]:
    """Tiny HF directories with one hostile edit each (config or tokenizer files)."""
    import json
    import shutil

    src = make_tiny_model(base / "src", "llama_tied")
    dirs = {}

    def edit(name, fname, change):
        d = base / name
        shutil.copytree(src, d)
        p = d / fname
        data = json.loads(p.read_text(encoding="utf-8"))
        change(data)
        p.write_text(json.dumps(data), encoding="utf-8")
        dirs[name] = d

    edit("context_2_32", "config.json", lambda c: c.update(max_position_embeddings=1 << 32))
    edit("model_5", "tokenizer.json", lambda t: t.update(model=5))
    edit("merge_not_pair", "tokenizer.json", lambda t: t["model"].update(merges=[[1]]))
    edit("no_merges", "tokenizer.json", lambda t: t["model"].pop("merges"))
    edit("added_5", "tokenizer.json", lambda t: t.update(added_tokens=5))
    edit("split_regex_list", "tokenizer.json", lambda t: t.update(
        pre_tokenizer={"type": "Split", "pattern": {"Regex": [1]}, "behavior": "Isolated", "invert": False}))
    edit("single_object", "tokenizer.json", lambda t: t.update(
        post_processor={"type": "TemplateProcessing", "single": {"a": 1}, "pair": [], "special_tokens": {}}))
    edit("decoder_5", "tokenizer_config.json", lambda c: c.update(added_tokens_decoder=5))
    edit("deep", "tokenizer.json", lambda t: None)
    p = dirs["deep"] / "tokenizer.json"
    p.write_text(p.read_text(encoding="utf-8")[:-1] + ', "x": ' + "[" * 3000 + "]" * 3000 + "}", encoding="utf-8")
    return dirs


def test_cli_hostile_directories_get_one_line(tmp_path):
    """Hostile config and tokenizer files end in one clear line and status 2 (or a file, where
    the value is only odd), never a traceback: each of these crashed `quantize` (a fuzzing
    run, thirty-second session)."""
    from hostile import problem, run_batch
    dirs = _hostile_dirs(tmp_path)
    g = gguf.GGUFWriter(str(tmp_path / "nested.gguf"), "llama")        # a metadata value llama.cpp's
    g.add_key_value("x.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)  # writer cannot write back
    g.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    cases = [["quantize", str(d), str(tmp_path / f"{name}.gguf"), "--type", "q8_0"] for name, d in dirs.items()]
    cases.append(["quantize", str(tmp_path / "nested.gguf"), str(tmp_path / "n.gguf"), "--type", "q8_0"])
    results = run_batch(cases, tmp_path)
    for argv, r in zip(cases, results):
        assert problem(r["code"], r["stderr"]) is None, (argv[1], r["code"], r["stderr"][-400:])
    codes = {Path(argv[1]).name: r["code"] for argv, r in zip(cases, results)}
    for refused in ("context_2_32", "model_5", "merge_not_pair", "no_merges", "deep", "nested.gguf"):
        assert codes[refused] == 2, (refused, codes)
