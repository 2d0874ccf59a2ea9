"""The CUDA backend launches kernels by whole names from its tables: each one exists in cuda/*.cu.

Runs without a GPU: it reads the sources, so a renamed or removed kernel fails here first.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_PKG = ROOT / "src" / "cyllm" / "backends" / "cuda"


def _defined_kernels() -> set[str]:
    src = "".join(p.read_text() for p in (ROOT / "cuda").glob("*.cu"))
    names = set(re.findall(r'__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(', src))
    suffixes = {"CYLLM_MATVEC_VEC": ("", "_u8", "_norm", "_u8_norm"), "CYLLM_MATVEC_SCALAR": ("",),
                "CYLLM_ATTN_SPLIT": ("", "_ve", "_fold", "_ek"), "CYLLM_ATTN_BATCH": ("", "_v4"),
                "CYLLM_MATVEC_EXPERTS": ("",), "CYLLM_QKNORM_ROPE_STORE": ("",)}
    for macro, ends in suffixes.items():
        for base in re.findall(macro + r"\((\w+),", src):
            names |= {base + e for e in ends}
    return names


def _tables() -> dict[str, dict]:
    tree = ast.parse((CUDA_PKG / "kernel_names.py").read_text())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.endswith("_KERNELS")}


def test_every_kernel_in_the_tables_exists():
    tables = _tables()
    assert {"MATVEC_KERNELS", "ATTN_SPLIT_KERNELS", "ATTN_BATCH_KERNELS", "GLU_KERNELS"} <= set(tables)
    defined = _defined_kernels()
    missing = sorted(v for t in tables.values() for v in t.values() if v not in defined)
    assert not missing


def test_no_kernel_name_is_assembled_from_pieces():
    for path in CUDA_PKG.glob("*.py"):
        assert not re.search(r'_(k|launch)\(f"', path.read_text()), path.name
