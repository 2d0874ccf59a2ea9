#!/usr/bin/env python3
"""Build the files the quantized-CUDA tests and the GPU benchmark need, HERE (where pip,
the `gguf` package, llama.cpp's converter and llama-quantize are), to be carried to the
GPU machine (which has none of them and no network).

    python tests/make_cuda_quant_material.py [--out .carry] [--skip-default] [--skip-llamacpp-src]

What it writes under OUT (default ``.carry`` in the repository root; .git/info/exclude
ignores /.carry/):

``cuda_quant_material/``  (small: a few MB; carry it in every call that runs the tests)
    ``families/<kind>-<TYPE>.gguf``: each model family of tests/tinymodels.py (the kinds
    llama.cpp's converter takes, tests/llamacpp_tools.py GGUF_KINDS) with dimensions chosen
    so that quantization really happens (rows of 256, or of 32 where a family's head
    layout forbids 256), converted by llama.cpp's converter to F16 and Q8_0, and the F16
    file quantized by llama.cpp's ``llama-quantize`` to Q4_0, Q4_K_M, Q5_K_M and Q6_K. Rows that
    are not a multiple of 256 fall back (Q4_K -> Q5_0, Q6_K -> Q8_0), rows that are not a
    multiple of 32 stay F16: every file is its own mix of types, written in manifest.json.
    ``manifest.json``: per file its size, sha256 and the count of each tensor type; the
    default model's parts and sha256.
    ``ppl_text.txt``: the first ~8 KB of /usr/share/common-licenses/GPL-3 (whole lines),
    the perplexity text (the GPU machine may not have that file).
``cuda_quant_default/SmolLM2-135M-Instruct.Q4_1.gguf.partN``  (the default model, 98 MB,
    cut into parts of at most --part-mb MB: the device call carries at most 64 MiB, so
    each part travels in its own call and bench/device_quant.sh joins them on the device
    and checks the sha256)
``cuda_quant_bench/``  (carry it in the call that builds llama.cpp and makes the bench files)
    ``llama.cpp-src.tar.xz``: llama.cpp's source from the llama-cpp-python 0.3.36 sdist
    (76 MB: too large to carry), without what a CUDA build of llama-bench and
    llama-quantize does not read (models, docs, tests, examples, other GPU backends);
    ``vocab-llama-spm.gguf`` (llama.cpp's own 32000-token Llama SPM vocabulary, for the
    Llama-2-7B shape) and ``vocab-smollm2.gguf`` (the default model's tokenizer only,
    49152 tokens, for the SmolLM2-135M shape): the random-weight GGUFs made on the device
    copy their tokenizer from these.

The gguf wheel. Loading a GGUF needs no `gguf` package when every tensor is F32/F16/BF16
or a native block type and CYLLM_QUANT=native (cyllm reads the file itself); the
package is imported only to dequantize other types (IQ4_NL, Q2_K, Q3_K, ... or any
quantized type without CYLLM_QUANT=native) and by bench/compare_llamacpp.py's GGUF
writer, which bench/device_quant.sh uses to write the random-weight F16 files. So carry
it (pure Python, ~100 KB; its needs numpy, pyyaml, tqdm are on the device):

    echo /.whl/ >> .git/info/exclude   # already there in the lead's checkout
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl gguf==0.19.0

(``--wheel`` below runs exactly that.)

Needs: the test requirements (torch, transformers, sentencepiece), llama.cpp's converter
and llama-quantize (tests/llamacpp_tools.py and tests/llamacpp_build.py fetch and build
them into $CYLLM_TEST_CACHE on first use: ~6 minutes of building on 2 cores), and the
default model (cyllm.default_model, fetched on first use).
Steps whose outputs exist are skipped; ``--force`` rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

QUANT_TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")    # made by llama-quantize from the F16 file
CONVERTER_TYPES = ("f16", "q8_0")               # made by llama.cpp's converter

# Material kinds: each family kind of tests/tinymodels.py with wider layers, so that the
# quantizers quantize (the originals have rows of 80 or 112: not a multiple of 32, F16 in
# every quantized file). Heads and head_dim keep each family's quirks; where the head
# layout allows, the hidden size is 256 (K-quants native), the FFN size alternates between
# 256 (ffn_down native in K-quants) and 288 (ffn_down falls back: Q4_K -> Q5_0, Q6_K ->
# Q8_0). qwen2 (7 heads of dim hidden/7), smollm3 and phi3_longrope (its longrope factor
# lists fix head_dim 32) keep rows that are a multiple of 32 only.
WIDE = {
    "llama32": dict(hidden_size=256, intermediate_size=256),
    "mistral_swa": dict(hidden_size=256, intermediate_size=288),
    "qwen2": dict(hidden_size=224, intermediate_size=256),
    "qwen3": dict(hidden_size=256, intermediate_size=256),
    "gemma2": dict(hidden_size=256, intermediate_size=256),
    "gemma3": dict(hidden_size=256, intermediate_size=288),
    "phi3": dict(hidden_size=256, intermediate_size=256),
    "phi3_longrope": dict(hidden_size=96, intermediate_size=128),
    "smollm3": dict(hidden_size=192, intermediate_size=256),
    "granite": dict(hidden_size=256, intermediate_size=288),
    "olmo2": dict(hidden_size=256, intermediate_size=256),
}
SUFFIX = "_q"     # material kind = family kind + SUFFIX
SHARP_QK = os.environ.get("CYLLM_MATERIAL_SHARP_QK", "0") == "1"

# llama.cpp source kept for a CUDA build of llama-bench and llama-quantize
_LLAMA_SKIP_TOP = {"models", "docs", "media", "tests", "benches", "examples", "pocs", "gguf-py",
                   "conversion", "grammars", "requirements", "ci", "licenses", "build", ".github",
                   ".devops", "app", "scripts", "prompts"}
_LLAMA_SKIP_GGML = {"ggml-cann", "ggml-et", "ggml-hexagon", "ggml-metal", "ggml-opencl", "ggml-openvino",
                    "ggml-sycl", "ggml-virtgpu", "ggml-vulkan", "ggml-webgpu", "ggml-zdnn", "ggml-zendnn",
                    "ggml-musa", "ggml-hip", "ggml-blas", "ggml-rpc"}
_LLAMA_SKIP_TOOLS = {"server", "ui", "cli", "rpc", "tuning"}

GGUF_WHEEL = "gguf==0.19.0"
# perplexity text: the first ~8 KB of the GPL-3 (whole lines), carried as ppl_text.txt
PPL_SOURCE = "/usr/share/common-licenses/GPL-3"
PPL_BYTES = 8192


def sha256(path: Path) -> str:
    from cyllm.default_model import file_sha256     # the check the default model uses
    return file_sha256(path)


def type_mix(path: Path) -> dict:
    """{GGML type name: tensor count} of the 2-D tensors of a GGUF (cyllm's own reader)."""
    from cyllm.loading.gguf import read_gguf
    gf = read_gguf(path)
    mix: dict = {}
    for t in gf.tensors.values():
        if len(t.shape) == 2:
            mix[t.type_name] = mix.get(t.type_name, 0) + 1
    return dict(sorted(mix.items()))


# -- the family files -----------------------------------------------------------------
def register_kinds() -> list[str]:
    import tinymodels as tm
    from llamacpp_tools import GGUF_KINDS
    kinds = []
    for kind in GGUF_KINDS:
        if kind not in WIDE:
            # the mixtures of experts: tests/test_cuda_quant_model.py compares whole models'
            # logits between cuda and cpu, where a router near-tie decided either way moves a
            # token far past its tolerance; tests/test_families.py covers them with forced routes
            continue
        arch, overrides = tm.KINDS[kind]
        name = kind + SUFFIX
        tm.KINDS[name] = (arch, {**overrides, **WIDE[kind]})
        if SHARP_QK:
            tm.FAMILY_KINDS[name] = tm.KINDS[name]     # the families' sharper q/k init
        tm.KIND_TOKENIZER[name] = tm.KIND_TOKENIZER[kind]
        kinds.append(name)
    return kinds


def make_families(out: Path, work: Path, force: bool) -> list[Path]:
    import tinymodels as tm
    from llamacpp_build import llamacpp_tool
    from llamacpp_tools import convert_many
    kinds = register_kinds()
    fam = out / "families"
    fam.mkdir(parents=True, exist_ok=True)
    f16_dir = work / "f16"
    jobs = []
    for kind in kinds:
        for t in CONVERTER_TYPES:
            target = (f16_dir if t == "f16" else fam) / f"{kind}-{t.upper()}.gguf"
            if force or not target.is_file():
                hf = work / "hf" / kind
                if force and hf.exists():
                    shutil.rmtree(hf)
                if not hf.exists():
                    made = tm.make_tiny_model(work / "hf-tmp", kind, dtype="float32", seed=0)
                    hf.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(made, hf)
                jobs.append((hf, target, t, tm.GGUF_PRE[tm.KIND_TOKENIZER[kind]]))
    if jobs:
        print(f"converting {len(jobs)} files with llama.cpp's converter", flush=True)
        convert_many(jobs)
    quantize = llamacpp_tool("llama-quantize")
    for kind in kinds:
        src = f16_dir / f"{kind}-F16.gguf"
        for t in QUANT_TYPES:
            target = fam / f"{kind}-{t}.gguf"
            if target.is_file() and not force:
                continue
            part = target.with_name(target.name + ".part")
            r = subprocess.run([str(quantize), str(src), str(part), t, "2"], capture_output=True, text=True)
            if r.returncode != 0 or not part.is_file():
                sys.exit(f"llama-quantize {t} {src.name} failed:\n" + "\n".join(
                    (r.stdout + r.stderr).strip().splitlines()[-15:]))
            os.replace(part, target)
    return sorted(fam.glob("*.gguf"))


# -- the default model, in parts ------------------------------------------------------------
def split_default(out: Path, part_mb: int, force: bool) -> dict:
    from cyllm.default_model import FILE_NAME, FILE_SHA256, default_model_path
    src = default_model_path()
    dest = out / "cuda_quant_default"
    dest.mkdir(parents=True, exist_ok=True)
    size = src.stat().st_size
    step = part_mb * 1000 * 1000
    n = -(-size // step)
    parts = [dest / f"{FILE_NAME}.part{i}" for i in range(n)]
    if force or not all(p.is_file() for p in parts):
        for old in dest.glob(f"{FILE_NAME}.part*"):
            old.unlink()
        with open(src, "rb") as f:
            for p in parts:
                p.write_bytes(f.read(step))
    return {"name": FILE_NAME, "bytes": size, "sha256": FILE_SHA256,
            "parts": [{"path": str(p.relative_to(out.parent)) if out.parent in p.parents else str(p),
                       "bytes": p.stat().st_size} for p in parts]}


# -- the bench's helpers: llama.cpp source and two vocabularies ---------------------------
def _keep_llama_member(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] in _LLAMA_SKIP_TOP or parts[0].startswith("build"):
        return False
    if parts[0] == "ggml" and len(parts) > 2 and parts[1] == "src" and parts[2] in _LLAMA_SKIP_GGML:
        return False
    if parts[0] == "tools" and len(parts) > 1 and parts[1] in _LLAMA_SKIP_TOOLS:
        return False
    return True


def slim_llamacpp_source(dest: Path, force: bool) -> Path:
    """llama.cpp from the llama-cpp-python sdist, without what a CUDA tools build never reads."""
    from llamacpp_build import _VENDOR, _sdist
    target = dest / "llama.cpp-src.tar.xz"
    if target.is_file() and not force:
        return target
    part = target.with_name(target.name + ".part")
    with tarfile.open(_sdist(), "r:gz") as src, tarfile.open(part, "w:xz", preset=9) as out:
        for m in src:
            if not m.name.startswith(_VENDOR):
                continue
            rel = m.name[len(_VENDOR):]
            if not rel or ".." in rel.split("/") or not (m.isfile() or m.isdir()):
                continue
            if not _keep_llama_member(rel):
                continue
            m2 = tarfile.TarInfo("llama.cpp/" + rel)
            m2.size, m2.mode, m2.mtime, m2.type = m.size, m.mode, m.mtime, m.type
            if m.isfile():
                with src.extractfile(m) as f:
                    out.addfile(m2, f)
            else:
                out.addfile(m2)
    os.replace(part, target)
    return target


def vocab_files(dest: Path, force: bool) -> list[Path]:
    from llamacpp_build import _VENDOR, _sdist
    spm = dest / "vocab-llama-spm.gguf"
    if force or not spm.is_file():
        with tarfile.open(_sdist(), "r:gz") as src:
            with src.extractfile(_VENDOR + "models/ggml-vocab-llama-spm.gguf") as f:
                spm.write_bytes(f.read())
    smol = dest / "vocab-smollm2.gguf"
    if force or not smol.is_file():
        import gguf
        from cyllm.default_model import default_model_path
        reader = gguf.GGUFReader(str(default_model_path()))
        w = gguf.GGUFWriter(str(smol) + ".part", "llama")
        w.add_name("SmolLM2-135M tokenizer (from the default model)")
        n = 0
        for key, field in reader.fields.items():
            if not key.startswith("tokenizer."):
                continue
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
            n += 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
        w.close()
        os.replace(str(smol) + ".part", smol)
        print(f"vocab-smollm2.gguf: {n} tokenizer fields", flush=True)
    return [spm, smol]


def download_wheel(repo: Path) -> None:
    whl = repo / ".whl"
    if any(whl.glob("gguf-*.whl")):
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(whl), GGUF_WHEEL]
    subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / ".carry"), help="folder for the three material folders")
    ap.add_argument("--work", default=None, help="scratch folder (HF dirs, F16 files); default OUT/.work")
    ap.add_argument("--part-mb", type=int, default=50, help="size of each default-model part (MB)")
    ap.add_argument("--skip-default", action="store_true", help="no default-model parts")
    ap.add_argument("--skip-llamacpp-src", action="store_true", help="no llama.cpp source / vocabularies")
    ap.add_argument("--wheel", action="store_true", help=f"also download the {GGUF_WHEEL} wheel into .whl/")
    ap.add_argument("--force", action="store_true", help="rebuild what exists")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    mat = out / "cuda_quant_material"
    work = Path(a.work).resolve() if a.work else out / ".work"
    os.environ.setdefault("CYLLM_QUANT", "native")
    files = make_families(mat, work, a.force)
    text = Path(PPL_SOURCE).read_bytes()[:PPL_BYTES]
    (mat / "ppl_text.txt").write_bytes(text[:text.rfind(b"\n") + 1])
    manifest = {"families": {}, "default": None, "wide": WIDE, "suffix": SUFFIX,
                "quant_types": list(QUANT_TYPES), "converter_types": [t.upper() for t in CONVERTER_TYPES]}
    for f in files:
        manifest["families"][f.name] = {"bytes": f.stat().st_size, "sha256": sha256(f), "types": type_mix(f)}
    old = mat / "manifest.json"
    if not a.skip_default:
        manifest["default"] = split_default(out, a.part_mb, a.force)
    elif old.is_file():     # parts made by an earlier run stay described
        manifest["default"] = json.loads(old.read_text()).get("default")
    if not a.skip_llamacpp_src:
        bench = out / "cuda_quant_bench"
        bench.mkdir(parents=True, exist_ok=True)
        slim_llamacpp_source(bench, a.force)
        vocab_files(bench, a.force)
    if a.wheel:
        download_wheel(REPO)
    (mat / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = 0
    for d in ("cuda_quant_material", "cuda_quant_default", "cuda_quant_bench"):
        p = out / d
        if p.is_dir():
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            total += size
            print(f"{p}: {size / 1e6:.1f} MB")
    for name, m in manifest["families"].items():
        print(f"  {name:32s} {m['bytes'] / 1e6:6.2f} MB  {m['types']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
