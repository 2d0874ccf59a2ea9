"""A minimal, zero-copy safetensors reader.

Layout (from the format's published description): 8-byte little-endian
header length N, N bytes of JSON, then the raw tensor data; an entry's
``data_offsets`` [begin, end) are relative to the first byte after the header.

The file is mmapped once; arrays are ``np.frombuffer`` views over the mmap,
which keep the mapping alive for as long as any view exists. The views are
read-only (the mmap is opened ACCESS_READ). ``safe_open(..., "numpy")`` copies
every tensor, which doubles the resident size of a model: not used.

BF16 has no numpy dtype; BF16 tensors are widened to float32 with a 16-bit
shift (a copy, unavoidable). Everything a file can get wrong raises
ModelLoadError naming the file and the tensor.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from ..jsonio import parse_json, read_json_file, short
from ..oneline import one_line
from .weights import first_overlap

# safetensors dtype tag -> numpy dtype (little-endian, as the format mandates).
# "BF16" is handled separately (raw uint16 bits).
_DTYPES = {
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "BF16": np.dtype("<u2"),
}
# a header larger than this is not a real checkpoint (the reference
# implementation uses the same order of magnitude as its sanity limit)
_MAX_HEADER = 100 * 1024 * 1024


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (same shape, new array).

    bfloat16 is the top half of an IEEE float32, so the conversion is exact.
    """
    return (bits.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """One .safetensors file: parsed, validated header + mmap of the data.

    ``raw(name)`` returns ``(dtype_tag, view)`` where a BF16 view holds the raw
    uint16 bits; ``get(name)`` returns a usable array (BF16 widened to f32).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mm = None
        where = self._where = one_line(self.path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ModelLoadError(f"cannot read {self._where}: {one_line(e.strerror or e)}") from None
        if size < 8:
            raise ModelLoadError(
                f"{self._where}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ModelLoadError(
                        f"{self._where}: corrupt safetensors file: header length {n} is larger "
                        f"than the file ({size} bytes); the file may be truncated")
                if n > _MAX_HEADER:
                    raise ModelLoadError(f"{self._where}: corrupt safetensors file: header length {n} is implausible")
                raw_header = f.read(n)
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelLoadError(f"cannot read {self._where}: {one_line(e.strerror or e)}") from None
        header = parse_json(raw_header, f"{where}: corrupt safetensors file: the header")
        if not isinstance(header, dict):
            raise ModelLoadError(f"{self._where}: corrupt safetensors file: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None)
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, data_len)
        shared = first_overlap((begin, begin + count * _DTYPES[dtype].itemsize, name)
                               for name, (dtype, _, begin, count) in self._entries.items() if count)
        if shared:
            raise ModelLoadError(f"{self._where}: corrupt safetensors file: tensors {short(shared[0], 80)} and "
                                 f"{short(shared[1], 80)} overlap")

    def _check_entry(self, name, entry, data_len):
        where = f"{self._where}: tensor {short(name, 80)}"
        if not isinstance(entry, dict):
            raise ModelLoadError(f"{where}: header entry is not an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in entry:
                raise ModelLoadError(f"{where}: header entry has no {key!r}")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise UnsupportedModelError(
                f"{where}: unsupported dtype {short(dtype)} (supported: {', '.join(_DTYPES)})")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ModelLoadError(f"{where}: bad shape {short(shape)}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
            raise ModelLoadError(f"{where}: bad data_offsets {short(offs)}")
        begin, end = offs
        if end < begin:
            raise ModelLoadError(f"{where}: data_offsets end {end} < start {begin}")
        if end > data_len:
            raise ModelLoadError(
                f"{where}: data_offsets [{begin}, {end}) run past the end of the file "
                f"(data section is {data_len} bytes); the file may be truncated")
        count = math.prod(shape)     # exact: np.prod in int64 wraps around on hostile shapes
        expected = count * _DTYPES[dtype].itemsize
        if end - begin != expected:
            raise ModelLoadError(
                f"{where}: holds {end - begin} bytes, but shape {shape} of {dtype} needs {expected}")
        return dtype, tuple(shape), begin, count

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype_of(self, name: str) -> str:
        return self._entry(name)[0]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name):
        try:
            return self._entries[name]
        except KeyError:
            raise ModelLoadError(f"{self._where}: no tensor {short(name)}") from None

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """(dtype tag, read-only view); BF16 comes back as uint16 bits.

        Zero-copy when the tensor starts at a multiple of its element size. The
        format does not promise that (a header length that is not a multiple of
        8 is valid, and the reference library loads it); the kernels need
        dtype-aligned arrays, so a misaligned tensor comes back as an aligned copy.
        """
        dtype, shape, begin, count = self._entry(name)
        start = self._data_start + begin
        dt = _DTYPES[dtype]
        if start % dt.itemsize == 0:
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=start)
        else:
            arr = np.frombuffer(self._mm, dtype=np.uint8, count=count * dt.itemsize, offset=start).copy().view(dt)
        return dtype, arr.reshape(shape)

    def get(self, name: str) -> np.ndarray:
        """The tensor as numpy: a zero-copy view, except BF16 -> float32 copy."""
        dtype, arr = self.raw(name)
        if dtype == "BF16":
            return bf16_bits_to_f32(arr)
        return arr


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one file (views; BF16 widened to float32)."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.keys()}


def open_checkpoint(directory: str | os.PathLike) -> dict[str, tuple[SafetensorsFile, str]]:
    """Map tensor name -> (open file, name) for a single-file or sharded checkpoint.

    Looks for ``model.safetensors`` first, then ``model.safetensors.index.json``.
    Raises ModelLoadError when neither exists or when the index is bad.
    """
    d = Path(directory)
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        f = SafetensorsFile(single)
        return {name: (f, name) for name in f.keys()}
    if index.is_file():
        return _open_sharded(index)
    hint = ""
    if any((d / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        hint = (" (pytorch_model.bin checkpoints are not supported: convert them to "
                "safetensors, e.g. load with transformers and save_pretrained())")
    else:
        hint = " (pytorch_model.bin is not supported: weights must be in safetensors format)"
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {one_line(d)}{hint}")


def _open_sharded(index: Path) -> dict[str, tuple[SafetensorsFile, str]]:
    spec = read_json_file(index, ModelLoadError)
    where = spec.where
    wm = spec.obj("weight_map")
    if not wm:
        raise ModelLoadError(f"{where}: no \"weight_map\" object")
    shards: dict[str, SafetensorsFile] = {}
    out = {}
    for name, shard in wm.items():
        if (not isinstance(shard, str) or not shard or "\0" in shard or os.path.isabs(shard)
                or ".." in Path(shard).parts):
            raise ModelLoadError(f"{where}: bad shard file name {short(shard)} for tensor {short(name)}")
        if shard not in shards:
            p = index.parent / shard
            if not p.is_file():
                raise ModelLoadError(f"{where}: shard {one_line(shard, 200)} (holding {short(name)}) is missing "
                                     f"from {one_line(index.parent)}")
            shards[shard] = SafetensorsFile(p)
        f = shards[shard]
        if name not in f:
            raise ModelLoadError(f"{where}: tensor {short(name)} is listed in {one_line(shard, 200)} but that file "
                                 "does not hold it")
        out[name] = (f, name)
    return out
