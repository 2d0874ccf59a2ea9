"""Resident memory generating from a quantized GGUF with native quantized weights:
peak RSS (VmHWM) of a process running `cyllm generate` <= file size + KV cache + 150 MB.

The file: the SmolLM2-360M shape (32 layers, dim 960, ffn 2560, vocab 49152, tied) with
random Q8_0 blocks (~386 MB), written once with the `gguf` package's writer into the test
cache ($CYLLM_TEST_CACHE or ~/.cache/cyllm-tests). At that size the bound is a real one:
a dequantized float16 twin of the weights (724 MB) would break it twice over.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import HOST_BACKENDS

pytestmark = [pytest.mark.skipif("cpu" not in HOST_BACKENDS, reason="compiled cpu backend not built"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")]

gguf = pytest.importorskip("gguf")

SHAPE = dict(dim=960, n_layers=32, n_heads=15, n_kv=5, head_dim=64, ffn=2560, vocab=49152, ctx=8192)
CONTEXT = 1024

# `cyllm generate` run in-process by a child, which then prints its own peak RSS (VmHWM: this
# process image's peak, not the forking parent's, which ru_maxrss would carry over)
CHILD = r"""
import sys
from cyllm.tools.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
status = open("/proc/self/status").read().split("\n")
get = lambda k: int([l for l in status if l.startswith(k + ":")][0].split()[1]) * 1024
print("RSS", get("VmHWM"), get("VmRSS"), rc, file=sys.stderr)
"""


def _vocab(n: int):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = "the quick brown fox jumps over lazy dog once upon a time there was".split()
    for w in words:
        for p in (w, "\u2581" + w):
            if p not in tokens:
                tokens.append(p)
                types.append(1)
    tokens += [f"\u2581x{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, types


def _q8_0_blocks(rng, rows: int, cols: int) -> np.ndarray:
    """(rows, cols/32*34) uint8: random int8 quants under an f16 scale of 0.02/127 per block."""
    nb = cols // 32
    out = np.empty((rows, nb, 34), np.uint8)
    out[:, :, :2] = np.frombuffer(np.float16(0.02 / 127).tobytes(), np.uint8)
    out[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 32), dtype=np.uint8)
    return out.reshape(rows, nb * 34)


def make_q8_0_file(path: Path) -> Path:
    if path.is_file():
        return path
    s = SHAPE
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    w.add_name("rss-test smollm2-360m shape")
    w.add_block_count(s["n_layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["dim"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(7)
    tokens, scores, types = _vocab(s["vocab"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    d, kv = s["dim"], s["n_kv"] * s["head_dim"]

    def mat(name, rows, cols):
        w.add_tensor(name, _q8_0_blocks(rng, rows, cols), raw_dtype=q8)

    def vec(name, n):
        w.add_tensor(name, np.ones(n, np.float32))

    mat("token_embd.weight", s["vocab"], d)
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", d, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d)
        mat(p + "attn_output.weight", d, d)
        vec(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", s["ffn"], d)
        mat(p + "ffn_up.weight", s["ffn"], d)
        mat(p + "ffn_down.weight", d, s["ffn"])
    vec("output_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".part", path)
    return path


@pytest.fixture(scope="module")
def q8_file():
    from llamacpp_tools import cache_dir
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return make_q8_0_file(root / "rss-smollm2-360m-shape-Q8_0.gguf")


@pytest.mark.slow
def test_native_quantized_rss_within_file_plus_kv(q8_file):
    env = {**os.environ, "CYLLM_QUANT": "native", "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", CHILD, "generate", "-m", str(q8_file), "-p", "once upon a time",
                        "-n", "16", "--temp", "0", "-c", str(CONTEXT)],
                       capture_output=True, text=True, timeout=300, env=env)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("RSS ")]
    assert line and line[-1].split()[3] == "0", r.stderr[-3000:]
    hwm, rss = map(int, line[-1].split()[1:3])
    size = q8_file.stat().st_size
    kv_bytes = 2 * SHAPE["n_layers"] * SHAPE["n_kv"] * SHAPE["head_dim"] * 2 * CONTEXT
    budget = size + kv_bytes + 150 * 2**20
    print(f"file {size / 2**20:.0f} MiB, KV {kv_bytes / 2**20:.0f} MiB, peak RSS {hwm / 2**20:.0f} MiB "
          f"(end {rss / 2**20:.0f}), budget {budget / 2**20:.0f} MiB")
    assert hwm <= budget, f"peak RSS {hwm / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_build_frees_the_row_permuted_qk_copies_layer_by_layer(q8_file):
    """A llama-style GGUF's q/k come out of the loader as row-permuted copies (anonymous
    memory). When the backend replaces them at upload (the CPU backend's r16 repack where the
    AVX512-VNNI kernels run; a GPU copy), Model(..., consume_weights=True), as cyllm.load builds
    it, lets each copy go once its layer is built rather than when the load returns: before
    that, a 7B Q4_K_M load held ~600 MB of them on top of the file."""
    import gc
    import weakref

    from cyllm.backends.cpu import CpuBackend
    from cyllm.loading import load_path
    from cyllm.model import Model

    config, weights, tok = load_path(q8_file)
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(config.n_layers) for p in "qk"]
    refs = [weakref.ref(weights[n].data) for n in names]       # the loader's permuted copies
    model = Model(config, weights, tok, backend=CpuBackend(threads=1), context=64, consume_weights=True)
    gc.collect()
    assert not weights, f"entries left in the dict: {sorted(weights)[:4]}"
    held = {id(L.wq.data) for L in model.layers} | {id(L.wk.data) for L in model.layers}
    for n, r in zip(names, refs):
        a = r()
        assert a is None or id(a) in held, f"{n}: the loader's copy outlived its upload"
    if model.backend.quant_variant == "avx512vnni":         # q8_0 is reordered there: all gone
        assert all(r() is None for r in refs)
