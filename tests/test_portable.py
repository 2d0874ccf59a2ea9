"""The portable fallback really runs where AVX2 does not exist, and compiles for ARM.

Both checks need extra tools (qemu-user, an aarch64 cross compiler) and are
skipped without them; .ci/run installs them.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import HOST_BACKENDS
from cyllm.backends.numpy_ref import NumpyBackend

ROOT = Path(__file__).resolve().parents[1]
QEMU = shutil.which("qemu-x86_64")
ARM_CC = shutil.which("aarch64-linux-gnu-gcc")

# Runs under an emulated Sandy Bridge (AVX, no AVX2/FMA/F16C). It avoids numpy's
# BLAS-backed matmul, whose own kernels are not what is under test here.
CHILD = r"""
import site
import sys
# the parent's site-packages come as PYTHONPATH entries, whose .pth files Python does not
# read: an editable install's finder (which maps cyllm._ext to the build) lives in one
for p in list(sys.path):
    if p.endswith("site-packages"):
        site.addsitedir(p)
import numpy as np
import cyllm.backends.cpu as cpu
info = cpu.kernel_info()
assert info["variant"] == "generic", info
assert "avx2" not in info["cpu_features"], info
d = np.load(sys.argv[1])
b = cpu.CpuBackend(1)
out = np.empty(d["w"].shape[0], np.float32)
b.matvec(out, d["w"], d["x"])
att = np.empty_like(d["q"])
b.attention(att, d["q"], d["kc"], d["vc"], int(d["pos"]))
np.savez(sys.argv[2], matvec=out, attention=att)
"""


@pytest.mark.skipif(QEMU is None, reason="qemu-user is not installed")
@pytest.mark.skipif("cpu" not in HOST_BACKENDS, reason="compiled cpu backend not built")
def test_generic_kernels_run_on_a_cpu_without_avx2(tmp_path):
    rng = np.random.default_rng(0)
    n_kv, ctx, hd, n_heads = 2, 40, 24, 6
    data = dict(w=rng.standard_normal((37, 101)).astype(np.float16),
                x=rng.standard_normal(101).astype(np.float32),
                q=rng.standard_normal(n_heads * hd).astype(np.float32),
                kc=rng.standard_normal((n_kv, ctx, hd)).astype(np.float16),
                vc=rng.standard_normal((n_kv, ctx, hd)).astype(np.float16), pos=np.int64(29))
    np.savez(tmp_path / "in.npz", **data)
    # the child must import the cyllm this test imported (with its compiled _ext), not
    # a source tree that some other test module put on sys.path
    import cyllm
    paths = [str(Path(cyllm.__file__).resolve().parents[1])] + [p for p in sys.path if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop("CYLLM_KERNELS", None)
    r = subprocess.run([QEMU, "-cpu", "SandyBridge-v1", os.path.realpath(sys.executable), "-c", CHILD,
                        str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.load(tmp_path / "out.npz")
    ref = NumpyBackend()
    want = np.empty(37, np.float32)
    ref.matvec(want, ref.upload(data["w"]), data["x"])
    np.testing.assert_allclose(got["matvec"], want, rtol=1e-5, atol=1e-5)
    att = np.empty_like(data["q"])
    ref.attention(att, data["q"], data["kc"], data["vc"], 29)
    np.testing.assert_allclose(got["attention"], att, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ARM_CC is None, reason="no aarch64 cross compiler")
def test_portable_c_compiles_for_arm(tmp_path):
    csrc = ROOT / "cython_ext" / "csrc"
    portable = [f for f in sorted(csrc.glob("*.c")) if "avx" not in f.name]
    assert portable, "no portable C sources found"
    for src in portable:
        r = subprocess.run([ARM_CC, "-O2", "-fopenmp", "-Wall", "-Werror", "-c", str(src),
                            "-o", str(tmp_path / (src.stem + ".o"))], capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name}:\n{r.stderr}"
