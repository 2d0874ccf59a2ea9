"""Peak memory while generating stays within weights + KV cache + 150 MB."""

import subprocess
import sys

import pytest

from conftest import HOST_BACKENDS

pytestmark = [pytest.mark.skipif("cpu" not in HOST_BACKENDS, reason="compiled cpu backend not built"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")]

# VmHWM (this process image's own peak) rather than ru_maxrss, which Linux carries
# over from the forking parent: a pytest process that loaded transformers is large.
CHILD = r"""
import sys
import cyllm
model = cyllm.load(sys.argv[1], context=1024)
text = "".join(model.generate("Once upon a time", max_tokens=64, temperature=0.0))
kv = model.config.kv_bytes_per_token() * model.context
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(model.weight_bytes, kv, int(hwm) * 1024)
"""


def test_peak_rss_within_budget(default_model_file):
    r = subprocess.run([sys.executable, "-c", CHILD, str(default_model_file)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    weights, kv, peak = map(int, r.stdout.split()[-3:])
    budget = weights + kv + 150 * 2**20
    assert peak <= budget, f"peak RSS {peak / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"
