"""llama.cpp's own HF -> GGUF converter as a test tool (not a test module).

GGUF test files must follow llama.cpp's conventions (q/k row permutation, Gemma's
+1 on norm weights, fused Phi-3 tensors, rope_freqs / rope_factors tensors, the
metadata keys), so they are written by llama.cpp's ``convert_hf_to_gguf.py``,
never by cyllm: a file we wrote ourselves would only test our own reading.

Where the converter comes from: the llama-cpp-python source distribution
(``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36``) vendors
llama.cpp; from it we extract ``vendor/llama.cpp/convert_hf_to_gguf.py``, its
``conversion/`` package and ``gguf-py/`` into a cache directory
(``$CYLLM_TEST_CACHE``, default ``~/.cache/cyllm-tests``), once; later runs reuse
it. Nothing of it enters the repository. The converter runs in a subprocess
with ``PYTHONPATH`` pointing at that ``gguf-py``, so the ``gguf`` package it
writes with is llama.cpp's of the same commit, not the installed one.

The one intervention, and why: for byte-level BPE vocabularies the converter
names the pre-tokenizer (``tokenizer.ggml.pre``) by hashing the token ids of a
fixed test string and refuses any hash it does not know. Our tiny tokenizers
are trained on a few sentences, so no hash can match, although each one uses
its family's real split regex (tests/tinymodels.py: llama3, qwen2, gpt-4o).
``_DRIVER`` below imports the converter, wraps only
``TextModel.get_vocab_base_pre``: a recognised tokenizer still gets the
converter's own answer; an unrecognised one gets the name passed as ``pre``
(the family's llama.cpp pre-tokenizer name) instead of the exception. Tensor
handling, metadata and every other vocabulary path (SentencePiece
``tokenizer.model`` for Gemma, Mistral and Phi-3) are the converter's, untouched.

API: ``convert_hf_to_gguf(hf_dir, out_path, outtype, pre)`` and ``convert_many(jobs)``;
``FamilyMaterial`` and the session fixtures ``family_material`` / ``family_gguf``
(the family kinds of tests/tinymodels.py as HF dirs and GGUFs, built once per
session); ``llamacpp_vocab(name)``: llama.cpp's tokenizer test vectors (a real
vocab-only GGUF + texts + expected ids) and ``llamacpp_template(name)``: real chat
templates, both from the same sdist.

Requirements of the converter itself: torch, numpy, transformers, pyyaml (all
test dependencies already) and ``sentencepiece`` for SentencePiece vocabularies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# what we take from the vendored llama.cpp tree: the converter, llama.cpp's tokenizer test
# vectors of the families' vocabularies (a vocab-only GGUF + .inp texts + .out token ids) and
# the real chat templates it tests with
VOCABS = ("llama-bpe", "qwen2", "phi-3", "llama-spm", "gpt-2", "deepseek-llm", "deepseek-coder", "qwen35")
# and vocabularies for decoding only: MPT's spells 23 pieces twice (runs of spaces as byte-level
# pieces and again as raw-text user-defined tokens)
DECODE_VOCABS = ("mpt",)
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE",
            "models/templates/") + tuple(f"models/ggml-vocab-{v}.gguf" for v in VOCABS + DECODE_VOCABS)
_LAYOUT = "\n".join(_MEMBERS)   # a cache extracted with other members is extracted again

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's source could not be obtained (no network, no pip)."""


class ConversionError(RuntimeError):
    """convert_hf_to_gguf.py failed; the message carries the tail of its output."""


_FAILED: list[str] = []   # a failed download is not retried within one process


def cache_dir() -> Path:
    """Where downloaded test tools live: $CYLLM_TEST_CACHE or ~/.cache/cyllm-tests."""
    return Path(os.environ.get("CYLLM_TEST_CACHE") or Path.home() / ".cache" / "cyllm-tests")


def llamacpp_dir() -> Path:
    """The extracted part of llama.cpp (convert_hf_to_gguf.py, conversion/, gguf-py/,
    models/templates/, models/ggml-vocab-*).

    Downloads the llama-cpp-python sdist with pip the first time; reuses the
    extraction afterwards. Raises LlamaCppUnavailable when pip cannot get it.
    """
    root = cache_dir()
    dest = root / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    marker = dest / ".cyllm-extracted"
    if marker.is_file() and marker.read_text() == _LAYOUT:
        return dest
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / _SDIST
    if not sdist.is_file():
        if _FAILED:
            raise LlamaCppUnavailable(_FAILED[0])
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--timeout", "60", "--retries", "2",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            _FAILED.append(f"pip download of llama-cpp-python failed: {e}")
            raise LlamaCppUnavailable(_FAILED[0]) from None
        if r.returncode != 0 or not sdist.is_file():
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            _FAILED.append(f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} "
                           f"failed: {' | '.join(tail)}")
            raise LlamaCppUnavailable(_FAILED[0])
    # extract into a temporary sibling, then rename: a concurrent or interrupted run
    # never sees a half-written tree
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=root))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for m in tar:
                rel = m.name[len(_VENDOR):] if m.name.startswith(_VENDOR) else None
                if not rel or not (m.isfile() and rel.startswith(_MEMBERS)) or ".." in rel.split("/"):
                    continue
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        if not (tmp / "convert_hf_to_gguf.py").is_file():
            raise LlamaCppUnavailable(f"{sdist} holds no {_VENDOR}convert_hf_to_gguf.py")
        (tmp / ".cyllm-extracted").write_text(_LAYOUT)
        if dest.exists() and not (marker.is_file() and marker.read_text() == _LAYOUT):
            shutil.rmtree(dest, ignore_errors=True)   # an older layout
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (marker.is_file() and marker.read_text() == _LAYOUT):   # lost a race: keep the winner's
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def llamacpp_vocab(name: str) -> tuple[Path, list[tuple[str, list[int]]]]:
    """llama.cpp's tokenizer test vectors for vocabulary ``name`` (see VOCABS).

    Returns the vocab-only GGUF (the real tokenizer of that family, written by
    llama.cpp's converter) and the (text, token ids) pairs llama.cpp's own
    tokenizer test expects (``models/ggml-vocab-NAME.gguf.inp`` / ``.out``; the ids
    are without BOS).
    """
    if name not in VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS}, not {name!r}")
    path = llamacpp_dir() / "models" / f"ggml-vocab-{name}.gguf"
    # .inp: each text followed by "\n__ggml_vocab_test__\n"; .out: one line of ids per text
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outs = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    texts.pop()   # what follows the last marker: nothing
    outs.pop()    # what follows the last newline: nothing
    if len(texts) != len(outs):
        raise RuntimeError(f"{path}: {len(texts)} test texts but {len(outs)} id lines")
    return path, [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def llamacpp_vocab_file(name: str) -> Path:
    """A real vocabulary-only GGUF of llama.cpp's tests (VOCABS or DECODE_VOCABS), without vectors."""
    if name not in VOCABS + DECODE_VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS + DECODE_VOCABS}, not {name!r}")
    return llamacpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


def llamacpp_template(name: str) -> str:
    """A real chat template from llama.cpp's tests (models/templates/NAME.jinja), e.g.
    "meta-llama-Llama-3.2-3B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
    "HuggingFaceTB-SmolLM3-3B", "microsoft-Phi-3.5-mini-instruct", "google-gemma-2-2b-it"."""
    return (llamacpp_dir() / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


# Runs in the subprocess: argv = [llama.cpp dir, JSON list of jobs]; a job is
# [hf_dir, outfile, outtype, pre]. One process converts them all: importing torch,
# transformers and the converter's ~90 modules costs more than converting a tiny model.
_DRIVER = r"""
import json, logging, runpy, sys
src, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base

_detect = base.TextModel.get_vocab_base_pre
_pre = [None]

def get_vocab_base_pre(self, tokenizer):
    try:
        return _detect(self, tokenizer)
    except NotImplementedError:
        if not _pre[0]:
            raise
        base.logger.info("tiny test tokenizer: tokenizer.ggml.pre = %r", _pre[0])
        return _pre[0]

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
script = src + "/convert_hf_to_gguf.py"
main = runpy.run_path(script, run_name="convert_hf_to_gguf")["main"]
for hf_dir, outfile, outtype, pre in jobs:
    _pre[0] = pre
    outtype, _, fused = outtype.partition(":")
    sys.argv = [script, hf_dir, "--outfile", outfile, "--outtype", outtype]
    if fused:                   # ":fused": the converter's --fuse-qkv (q, k, v as one attn_qkv)
        sys.argv += ["--fuse-qkv"]
    print("cyllm-job:", hf_dir, outtype, flush=True)
    main()
"""


def convert_many(jobs, timeout: float = 900) -> list[Path]:
    """Run several conversions in one converter process; jobs: (hf_dir, out_path, outtype, pre).

    See convert_hf_to_gguf for the arguments. Outputs appear only when complete
    (written to ``<name>.part``, then renamed). Returns the output paths.
    """
    jobs = [(str(h), Path(o), t, p or "") for h, o, t, p in jobs]
    for _, _, outtype, _ in jobs:
        if outtype.removesuffix(":fused") not in OUTTYPES:
            raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    if not jobs:
        return []
    src = llamacpp_dir()
    parts = []
    for hf_dir, out, outtype, pre in jobs:
        out.parent.mkdir(parents=True, exist_ok=True)
        parts.append([hf_dir, str(out.with_name(out.name + ".part")), outtype, pre])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(src / "gguf-py")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = [sys.executable, "-c", _DRIVER, str(src), json.dumps(parts)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        ok = r.returncode == 0
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        ok, log = False, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    done = []
    for (hf_dir, out, outtype, _), (_, part, _, _) in zip(jobs, parts):
        part = Path(part)
        if ok and part.is_file():
            os.replace(part, out)
            done.append(out)
        else:
            part.unlink(missing_ok=True)
    if not ok:
        tail = "\n".join(log.strip().splitlines()[-20:])
        raise ConversionError(f"convert_hf_to_gguf.py failed on one of "
                              f"{[(j[0], j[2]) for j in jobs]}:\n{tail}")
    return done


def convert_hf_to_gguf(hf_dir, out_path, outtype: str = "f32", pre: str | None = None,
                       timeout: float = 600) -> Path:
    """Write the GGUF of HF directory ``hf_dir`` to ``out_path`` with llama.cpp's converter.

    outtype: "f32" | "f16" | "bf16" | "q8_0" (the converter's --outtype; q8_0 keeps
    1-D tensors in f32 and falls back to f16 for rows not a multiple of 32).
    pre: the tokenizer.ggml.pre to write when the converter does not recognise a
    byte-level BPE tokenizer (see the module docstring); ignored otherwise.
    Raises ConversionError with the converter's last lines when it fails.
    """
    return convert_many([(hf_dir, out_path, outtype, pre)], timeout=timeout)[0]


# --- session material: the family kinds as HF directories and GGUF files -----------------

# kinds that get GGUF files (gemma3_qscale's GGUF would only lose its two features)
GGUF_KINDS = ("llama32", "mistral_swa", "qwen2", "qwen3", "seed_oss", "gemma", "gemma2", "gemma3", "phi3", "phi3_longrope",
              "smollm3", "granite", "olmo2", "exaone4", "ernie4_5", "glm4", "hunyuan_dense", "qwen3moe", "mixtral", "olmoe", "granitemoe")


class FamilyMaterial:
    """The family kinds of tests/tinymodels.py as HF directories and llama.cpp GGUFs, under root.

    ``hf_dir(kind)`` builds the HF directory once (seed 0, float32).
    ``gguf(kind, outtype)`` converts once. The first request converts every kind of
    ``GGUF_KINDS`` to every type of ``outtypes`` in one converter process: starting it
    (torch, transformers, ~90 converter modules) costs ~7 s, one tiny conversion well
    under a second. Raises LlamaCppUnavailable when the converter cannot be obtained.
    """

    def __init__(self, root, outtypes=("f32", "f16", "q8_0")):
        self.root = Path(root)
        self.outtypes = tuple(outtypes)
        self._hf: dict[str, Path] = {}
        self._gguf: dict[tuple[str, str], Path] = {}

    def hf_dir(self, kind: str) -> Path:
        from tinymodels import make_tiny_model
        if kind not in self._hf:
            self._hf[kind] = make_tiny_model(self.root / "hf", kind, dtype="float32", seed=0)
        return self._hf[kind]

    def gguf(self, kind: str, outtype: str = "f32") -> Path:
        from tinymodels import GGUF_PRE, KIND_TOKENIZER
        if (kind, outtype) not in self._gguf:
            wanted = [(kind, outtype)] + [(k, o) for o in self.outtypes for k in GGUF_KINDS]
            todo = [j for j in dict.fromkeys(wanted) if j not in self._gguf]
            jobs = [(self.hf_dir(k), self.root / "gguf" / f"{k}-{o.replace(':', '-')}.gguf", o,
                     GGUF_PRE[KIND_TOKENIZER[k]]) for k, o in todo]
            for key, path in zip(todo, convert_many(jobs)):
                self._gguf[key] = path
        return self._gguf[(kind, outtype)]


_MATERIAL: dict[str, FamilyMaterial] = {}


try:
    import pytest
except ImportError:   # imported outside pytest: no fixtures
    pytest = None

if pytest is not None:
    def or_skip(fn, *args):
        """fn(*args), the test skipped (not failed) where llama.cpp's source cannot be had."""
        try:
            return fn(*args)
        except LlamaCppUnavailable as e:
            pytest.skip(f"llama.cpp's source is unavailable (no network to PyPI?): {e}")

    @pytest.fixture(scope="session")
    def family_material(tmp_path_factory) -> FamilyMaterial:
        """One FamilyMaterial per test session (shared by every module that imports this)."""
        if "m" not in _MATERIAL:
            _MATERIAL["m"] = FamilyMaterial(tmp_path_factory.mktemp("families"))
        return _MATERIAL["m"]

    @pytest.fixture(scope="session")
    def family_gguf(family_material):
        """``family_gguf(kind, outtype="f32") -> Path``; skips when llama.cpp's source cannot be had."""
        def get(kind: str, outtype: str = "f32") -> Path:
            return or_skip(family_material.gguf, kind, outtype)
        return get
