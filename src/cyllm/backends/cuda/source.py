"""Where the CUDA kernel sources are, and how they become one NVRTC source string."""

from __future__ import annotations

from pathlib import Path

from ...errors import BackendUnavailableError


def kernel_dir():
    """Where the .cu files are: the installed ``cyllm._cuda`` package, else the repo's cuda/."""
    try:
        from importlib.resources import files
        d = files("cyllm._cuda")
        if d.joinpath("matvec.cu").is_file():
            return d
    except Exception:  # noqa: BLE001 - not installed as a package: running from a checkout
        pass
    d = Path(__file__).resolve().parents[4] / "cuda"     # src/cyllm/backends/cuda/source.py -> the repo
    if (d / "matvec.cu").is_file():
        return d
    raise BackendUnavailableError("the cuda backend's kernel sources (cuda/*.cu) are missing from the installation")


def assemble(files) -> str:
    """The files (common.cuh first) as one source string.

    CuPy caches compiled modules by source text only, so the header is inlined
    here rather than #included: an edit to it then recompiles.
    """
    d = kernel_dir()
    parts = []
    for name in files:
        text = d.joinpath(name).read_text()
        lines = [ln for ln in text.splitlines()
                 if ln.strip() not in ('#include "common.cuh"', "#pragma once")]
        parts.append(f"// ---- {name}\n" + "\n".join(lines))
    return "\n".join(parts) + "\n"
