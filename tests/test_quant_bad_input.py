"""Bad quantized GGUF files and bad quantization types at the command line (issue 10):
one line `cyllm: error: ...`, exit 2, no traceback -- on the float16 path and on the
native quantized path (CYLLM_QUANT=native) alike.

The files start as a valid Q8_0 GGUF written by the `gguf` package (test_gguf's
write_tiny_gguf); one tensor record is then edited with tests/gguf_raw.py, which
rewrites the file byte for byte otherwise.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

import gguf_raw as G
from gguf_raw import RawGGUF

gguf = pytest.importorskip("gguf")
from test_gguf import write_tiny_gguf  # noqa: E402

QT = gguf.GGMLQuantizationType
TARGET = "blk.0.ffn_up.weight"        # (ffn 256, dim 256): dims [256, 256], Q8_0


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    p = tmp_path_factory.mktemp("badq") / "ok.gguf"
    write_tiny_gguf(p, qtype=QT.Q8_0)
    return p


def _edit(base, tmp_path, name, change):
    g = RawGGUF.parse(base.read_bytes())
    rec = next(t for t in g.tensors if t[0] == TARGET)
    change(g, rec)
    p = tmp_path / name
    p.write_bytes(g.to_bytes())
    return p


def _cli(*argv, quant="f16"):
    env = {**os.environ, "CYLLM_QUANT": quant, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "cyllm", *map(str, argv)], capture_output=True, text=True,
                          timeout=120, env=env)


def _one_line(r, *needles):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith("cyllm: error:"), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _row_not_multiple(g, rec):
    rec[1] = [rec[1][0] - 16, rec[1][1]]          # 240 columns of a 32-element block format


def _unknown_type(g, rec):
    rec[2] = 99


def _known_unsupported(g, rec):
    rec[2] = int(QT.TQ1_0)


def _more_blocks_than_file(g, rec):
    rec[1] = [rec[1][0], rec[1][1] * 64]          # 64x the rows: blocks past the end of the file


def _offset_past_end(g, rec):
    rec[3] = len(g.data) + 4096


CASES = {
    "row_not_multiple_of_block": (_row_not_multiple, ("blk.0.ffn_up.weight", "not a multiple of 32")),
    "unknown_type_id": (_unknown_type, ("blk.0.ffn_up.weight", "type 99")),
    "known_type_without_support": (_known_unsupported, ("blk.0.ffn_up.weight", "TQ1_0")),
    "block_count_beyond_file": (_more_blocks_than_file, ("blk.0.ffn_up.weight", "truncated")),
    "offset_beyond_file": (_offset_past_end, ("blk.0.ffn_up.weight", "truncated")),
}


@pytest.mark.parametrize("quant", ["f16", "native"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_quantized_tensor(base, tmp_path, case, quant):
    change, needles = CASES[case]
    p = _edit(base, tmp_path, f"{case}.gguf", change)
    _one_line(_cli("generate", "-m", p, "-p", "hi", "-n", "1", "--backend", "cpu", quant=quant), *needles)


@pytest.mark.parametrize("case", ["row_not_multiple_of_block", "unknown_type_id", "block_count_beyond_file"])
def test_bad_quantized_tensor_quantize_tool(base, tmp_path, case):
    """`cyllm quantize` refuses the same files the same way and leaves no output behind."""
    change, needles = CASES[case]
    p = _edit(base, tmp_path, f"{case}.gguf", change)
    out = tmp_path / "out.gguf"
    _one_line(_cli("quantize", p, out, "--type", "q4_0"), *needles)
    assert not out.exists() and not (tmp_path / "out.gguf.part").exists()


def test_the_base_file_is_fine(base):
    """The edits above are what breaks the files: the unedited one runs on both paths."""
    for quant in ("f16", "native"):
        r = _cli("generate", "-m", base, "-p", "hi", "-n", "2", "--backend", "cpu", quant=quant)
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("flag", [("generate", "-p", "hi", "-n", "1", "--quantize", "q3_k_xl"),
                                  ("quantize", "OUT", "--type", "q3_k_xl")])
def test_unknown_quantize_type_lists_supported(base, tmp_path, flag):
    argv = [a if a != "OUT" else tmp_path / "o.gguf" for a in flag]
    argv = [argv[0], "-m", base, *argv[1:]] if argv[0] == "generate" else [argv[0], base, *argv[1:]]
    line = _one_line(_cli(*argv), "q3_k_xl")
    want = ("q8_0", "q4_0", "q4_k") if flag[0] == "generate" else ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
    for t in want:
        assert t in line, line


def _metadata(key, vtype, value):
    def change(g, rec):
        g.set(key, vtype, value)
    return change


def _zero_columns(g, rec):
    rec[1] = [0, rec[1][1]]


def _scale_nan(g, rec):
    data = bytearray(g.data)
    data[rec[3]:rec[3] + 2] = b"\x00\x7e"            # the first block's f16 scale: a nan
    g.data = bytes(data)


# files our reader (and `generate`) takes or refuses cleanly, where the gguf package's reader or
# writer, which `cyllm quantize` uses to carry the metadata over, failed with an exception
QUANTIZE_CASES = {
    "empty_metadata_array": (_metadata("x.empty", G.ARRAY, G.Array(G.UINT32, [])), ("x.empty", "empty array")),
    "huge_metadata_array": (_metadata("x.blob", G.ARRAY, G.Array(G.UINT8, [0] * 2_000_000)),
                            ("x.blob", "2000000 entries")),
    "bool_alignment": (_metadata("general.alignment", G.BOOL, True), ("metadata", "alignment")),
    "zero_columns": (_zero_columns, ("blk.0.ffn_up.weight", "shape")),
}


@pytest.mark.parametrize("case", list(QUANTIZE_CASES))
def test_quantize_tool_metadata_and_shapes(base, tmp_path, case):
    change, needles = QUANTIZE_CASES[case]
    p = _edit(base, tmp_path, f"{case}.gguf", change)
    out = tmp_path / "out.gguf"
    _one_line(_cli("quantize", p, out, "--type", "q4_0"), *needles)
    assert not out.exists()


def test_nan_scale_refused_on_the_float16_path_too(base, tmp_path):
    """CYLLM_QUANT=f16 dequantizes to float16: a nan block scale was carried into the weights."""
    p = _edit(base, tmp_path, "nan.gguf", _scale_nan)
    for quant in ("f16", "native"):
        _one_line(_cli("generate", "-m", p, "-p", "hi", "-n", "1", "--backend", "cpu", quant=quant), "nan")


@pytest.mark.parametrize("tensor", ["blk.0.attn_norm.weight", "output_norm.weight"])
def test_nan_norm_weight_refused(base, tmp_path, tensor):
    """A nan in a norm of a quantized model: the next matvec rounds its input to int8 blocks,
    which turned the nan into finite noise and the model into wrong text with no error."""
    def change(g, rec):
        off = next(t[3] for t in g.tensors if t[0] == tensor)
        data = bytearray(g.data)
        data[off + 12:off + 16] = struct.pack("<f", float("nan"))
        g.data = bytes(data)
    p = _edit(base, tmp_path, "norm.gguf", change)
    for quant in ("f16", "native"):
        _one_line(_cli("generate", "-m", p, "-p", "hi", "-n", "1", "--backend", "cpu", quant=quant), "nan")
