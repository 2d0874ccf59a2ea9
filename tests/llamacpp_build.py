"""llama.cpp's command-line tools (llama-quantize, llama-perplexity, llama-bench) built
once into the test cache, for tests and benchmarks that compare with llama.cpp itself.

Where the source comes from: the llama-cpp-python sdist (the same file
tests/llamacpp_tools.py downloads: ``pip download --no-deps --no-binary llama-cpp-python
llama-cpp-python==0.3.36`` into ``$CYLLM_TEST_CACHE``, default ``~/.cache/cyllm-tests``),
whose ``vendor/llama.cpp`` is extracted next to it and built with cmake:

    cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF [x86 ISA flags]
    cmake --build build --target llama-perplexity llama-quantize ... -j N

GGML_NATIVE is off so a cache copied to another machine of the same kind still runs;
on x86 hosts with AVX2 the AVX/AVX2/FMA/F16C kernels are switched on explicitly
(a build without them is several times slower, which matters for llama-bench only).
Building takes ~6 minutes on 2 cores; it happens once (a marker file records what
was built), under a lock so concurrent test processes wait for one build.

API: ``llamacpp_tool(name)`` -> Path of the binary (builds on first use; raises
LlamaCppUnavailable with the reason when cmake, a compiler or the source is missing),
``build_tools(names)``. Run as a script to build ahead of the tests:
``python tests/llamacpp_build.py [--with-bench] [--native-bench]``.
"""

from __future__ import annotations

import fcntl
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
TOOLS = ("llama-quantize", "llama-perplexity", "llama-simple")
BENCH_TOOLS = TOOLS + ("llama-bench",)


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's tools cannot be built here (no cmake, no compiler, no source)."""


def cache_dir() -> Path:
    return Path(os.environ.get("CYLLM_TEST_CACHE") or Path.home() / ".cache" / "cyllm-tests")


def _sdist() -> Path:
    root = cache_dir()
    path = root / _SDIST
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
           "--timeout", "60", "--retries", "2", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
           "-d", str(root)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppUnavailable(f"pip download of llama-cpp-python failed: {e}") from None
    if r.returncode != 0 or not path.is_file():
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
        raise LlamaCppUnavailable(f"pip download of llama-cpp-python failed: {tail}")
    return path


def _isa_flags() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return []
    if {"avx2", "fma", "f16c"} <= set(flags):
        return ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    return []


def source_dir() -> Path:
    return cache_dir() / f"llama.cpp-src-{LLAMA_CPP_PYTHON_VERSION}"


def _extract(dest: Path) -> None:
    marker = dest / ".cyllm-extracted"
    if marker.is_file():
        return
    sdist = _sdist()
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-src-", dir=dest.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for m in tar:
                rel = m.name[len(_VENDOR):] if m.name.startswith(_VENDOR) else None
                if not rel or not m.isfile() or ".." in rel.split("/"):
                    continue
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(target, m.mode & 0o755 | 0o600)
        (tmp / ".cyllm-extracted").write_text(LLAMA_CPP_PYTHON_VERSION)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tools(names=TOOLS, jobs: int | None = None, log=None) -> dict[str, Path]:
    """Build the named tools (once; later calls return the cached binaries)."""
    if shutil.which("cmake") is None:
        raise LlamaCppUnavailable("cmake is not installed (needed to build llama.cpp's tools)")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise LlamaCppUnavailable("no C compiler to build llama.cpp's tools")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    bins = {n: src / "build" / "bin" / n for n in names}
    if all(p.is_file() for p in bins.values()):
        return bins
    with open(root / ".llama.cpp-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # one build at a time; others wait, then reuse it
        if all(p.is_file() for p in bins.values()):
            return bins
        _extract(src)
        out = log or subprocess.DEVNULL
        cfg = ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=OFF",
               "-DGGML_OPENMP=ON"] + _isa_flags()
        build = ["cmake", "--build", "build", "--target", *names, "-j", str(jobs or os.cpu_count() or 2)]
        for cmd in (cfg, build):
            r = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                               text=True)
            if r.returncode != 0:
                tail = (r.stderr or "").strip().splitlines()[-5:]
                raise LlamaCppUnavailable(f"building llama.cpp failed ({' '.join(cmd[:3])}): {' | '.join(tail)}")
    missing = [n for n, p in bins.items() if not p.is_file()]
    if missing:
        raise LlamaCppUnavailable(f"llama.cpp build produced no {', '.join(missing)}")
    return bins


def build_native_bench(jobs: int | None = None, log=None) -> Path:
    """llama-bench built with -DGGML_NATIVE=ON (llama.cpp's default: every ISA extension of
    this CPU, AVX-512/VNNI included) in build-native/, for speed comparisons on this host
    only (the binary may not run on another CPU)."""
    build_tools(TOOLS, jobs, log)                  # the source, extracted once
    src = source_dir()
    path = src / "build-native" / "bin" / "llama-bench"
    if path.is_file():
        return path
    with open(cache_dir() / ".llama.cpp-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        out = log or subprocess.DEVNULL
        for cmd in (["cmake", "-B", "build-native", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                     "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON",
                     "-DGGML_OPENMP=ON"],
                    ["cmake", "--build", "build-native", "--target", "llama-bench", "-j",
                     str(jobs or os.cpu_count() or 2)]):
            r = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                               text=True)
            if r.returncode != 0:
                tail = (r.stderr or "").strip().splitlines()[-5:]
                raise LlamaCppUnavailable(f"building llama.cpp failed ({' '.join(cmd[:3])}): {' | '.join(tail)}")
    return path


def llamacpp_tool(name: str) -> Path:
    """The path of llama.cpp tool ``name`` (built on first use)."""
    return build_tools(TOOLS if name in TOOLS else BENCH_TOOLS)[name]


if __name__ == "__main__":
    names = BENCH_TOOLS if "--with-bench" in sys.argv else TOOLS
    for n, p in build_tools(names, log=sys.stdout).items():
        print(n, p)
    if "--native-bench" in sys.argv:
        print("llama-bench (GGML_NATIVE=ON)", build_native_bench(log=sys.stdout))
