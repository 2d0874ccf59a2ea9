"""The GGUF container (llama.cpp's single-file format): header, metadata and tensor table.

Shared by every reader of GGUF files: the model loader (gguf.py), the tokenizer builder
(gguf_tokenizer.py), `cyllm info`, `cyllm quantize` and `cyllm convert`. It knows the
file layout and nothing about models.

The header is parsed here rather than with ``gguf.GGUFReader``: the reader builds
numpy views for every element of every metadata array (two per string), which
costs ~3 s on the 100k vocabulary strings of a small model; this parser reads
them in ~0.1 s, checks every length against the file size (so a truncated or
hostile file is a clean ModelLoadError), and memory-maps the tensor data.

Facts about the format this code relies on:
- little-endian header: b"GGUF", uint32 version (2 or 3), uint64 tensor_count,
  uint64 kv_count, then kv pairs, then tensor infos, then (aligned to
  ``general.alignment``, default 32) the tensor data.
- a tensor's dims are listed fastest-first (ne0 = columns), so a (out, in)
  row-major matrix is stored with dims [in, out].
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError
from ..memory import drop_mapped_pages
from ..oneline import one_line
from .weights import first_overlap

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types (GGUF spec)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, \
    _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_FMT = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I",
               _INT32: "<i", _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q",
               _FLOAT64: "<d"}
_SCALAR_NP = {_UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4",
              _INT32: "<i4", _FLOAT32: "<f4", _BOOL: "<u1", _UINT64: "<u8", _INT64: "<i8",
              _FLOAT64: "<f8"}

# ggml tensor types: id -> (name, elements per block, bytes per block).
# Only the ones we accept need exact sizes; the rest are listed for naming.
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
SUPPORTED_TENSOR_TYPES = {
    F32: ("F32", 1, 4), F16: ("F16", 1, 2), BF16: ("BF16", 1, 2),
    Q8_0: ("Q8_0", 32, 34), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    Q4_K: ("Q4_K", 256, 144), Q5_K: ("Q5_K", 256, 176), Q6_K: ("Q6_K", 256, 210),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 29: ("IQ1_M", 256, 56),
}
_OTHER_TYPE_NAMES = {9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32",
                     27: "I64", 28: "F64", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

MAX_ARRAY_DEPTH = 16     # metadata arrays of arrays (real files: at most 2)


def clip(name, limit: int = 80) -> str:
    """A name from the file, safe for a one-line message (a corrupt file can hold anything)."""
    s = str(name)
    if not s.isprintable():
        s = repr(s)[1:-1]
    return s if len(s) <= limit else s[:limit] + "..."


def ggml_type_name(t: int) -> str:
    if t in SUPPORTED_TENSOR_TYPES:
        return SUPPORTED_TENSOR_TYPES[t][0]
    return _OTHER_TYPE_NAMES.get(t, f"type {t}")


# ----------------------------------------------------------------------------- file parsing

@dataclass
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]          # GGUF order: fastest-varying first
    ggml_type: int
    offset: int                    # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (row-major) shape: the GGUF dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    buf: Any = field(repr=False)   # the read-only mmap the tensors live in

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """uint8 view of one tensor's raw data: zero-copy when it starts at a multiple of its
        element size, else an aligned copy.

        A file may use any ``general.alignment`` (1 is valid); the kernels need F32 at
        4-byte and F16/BF16 (and the f16 scales of quantized blocks) at 2-byte addresses.
        The mmap itself starts on a page, so the file offset decides the alignment.
        """
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        need = 4 if info.ggml_type == F32 else 2
        return raw if info.offset % need == 0 else raw.copy()

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop a tensor's file pages from this process once it has been converted.

        Quantized data is read once; without this, the mapped file pages count
        in the resident set next to the FP16 copy. Pages are only unmapped from
        this process (the file is read-only), so a later read faults them back in:
        safe even where the range touches a neighbour that is still used as a view.
        """
        drop_mapped_pages(self.buf, info.offset, info.nbytes)


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like object."""

    def __init__(self, buf, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = one_line(path)     # for messages only

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelLoadError(
                f"{self.path}: GGUF file is truncated or corrupt (reading {clip(what)} at byte "
                f"{self.pos} needs {n} bytes, file has {self.size})")

    def scalar(self, vtype: int, what: str):
        fmt = _SCALAR_FMT[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp vocabularies can hold invalid UTF-8 pieces; keep them readable
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR_FMT:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise ModelLoadError(f"{self.path}: GGUF file is corrupt (metadata {clip(what)} has an "
                                 f"unknown value type {vtype})")
        # arrays of arrays are read with an explicit stack, not recursion: a hostile file
        # can nest them thousands deep; real files nest at most two
        etype, count = self._array_header(what)
        if etype != _ARRAY:
            return self._flat_array(etype, count, what)
        root: list = []
        stack = [[root, count]]              # [list being filled, items still to read]
        while stack:
            top = stack[-1]
            if top[1] == 0:
                stack.pop()
                continue
            top[1] -= 1
            etype, count = self._array_header(what)
            if etype == _ARRAY:
                if len(stack) >= MAX_ARRAY_DEPTH:
                    raise ModelLoadError(f"{self.path}: GGUF metadata {clip(what)} nests arrays more "
                                         f"than {MAX_ARRAY_DEPTH} deep; not a real model file")
                child: list = []
                top[0].append(child)
                stack.append([child, count])
            else:
                top[0].append(self._flat_array(etype, count, what))
        return root

    def _array_header(self, what: str) -> tuple[int, int]:
        etype = self.u32(what)
        count = self.u64(what)
        # every element costs at least this many bytes of the file: absurd counts end here
        least = 12 if etype == _ARRAY else 8 if etype == _STRING else (
            np.dtype(_SCALAR_NP[etype]).itemsize if etype in _SCALAR_NP else 0)
        if etype not in _SCALAR_NP and etype not in (_STRING, _ARRAY):
            raise ModelLoadError(f"{self.path}: GGUF file is corrupt (metadata {clip(what)} has an "
                                 f"unknown array element type {etype})")
        self.need(count * least, what)
        return etype, count

    def _flat_array(self, etype: int, count: int, what: str):
        """An array of scalars (a numpy array) or of strings (a list of str)."""
        if etype in _SCALAR_NP:
            dt = np.dtype(_SCALAR_NP[etype])
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos += count * dt.itemsize
            return arr.astype(bool) if etype == _BOOL else arr
        out = []
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            raw = bytes(buf[pos:pos + n])
            pos += n
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw.decode("utf-8", errors="replace"))
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF header and memory-map its tensor data (nothing is dequantized)."""
    path = Path(path)
    where = one_line(path)
    try:
        size = path.stat().st_size
        if size < 24:
            raise ModelLoadError(f"{where}: not a GGUF file (only {size} bytes)")
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{where}: cannot read ({one_line(e.strerror or e)})") from None
    if buf[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{where}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version != 0:
            raise ModelLoadError(f"{where}: big-endian GGUF files are not supported")
        raise ModelLoadError(f"{where}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # each kv pair needs at least 8 (key len) + 4 (type) + 1 bytes; each tensor info >= 8+4+4+8
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise ModelLoadError(f"{where}: GGUF file is truncated or corrupt (implausible counts "
                             f"{n_kv} metadata / {n_tensors} tensors for {size} bytes)")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.u32(f"type of {key}")
        metadata[key] = cur.value(vtype, key)
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.u32(f"dims of {clip(name)}")
        if n_dims > 4:
            raise ModelLoadError(f"{where}: tensor {clip(name)} has {n_dims} dimensions (at most 4)")
        dims = tuple(cur.u64(f"dims of {clip(name)}") for _ in range(n_dims))
        ttype = cur.u32(f"type of {name}")
        offset = cur.u64(f"offset of {name}")
        infos.append((name, dims, ttype, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{where}: bad general.alignment {clip(repr(alignment))}")
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ttype, offset in infos:
        n_elems = math.prod(dims) if dims else 1
        if ttype in SUPPORTED_TENSOR_TYPES:
            _, block, bsize = SUPPORTED_TENSOR_TYPES[ttype]
            if not dims or dims[0] % block:
                raise ModelLoadError(f"{where}: tensor {clip(name)} ({ggml_type_name(ttype)}) has a row length "
                                     f"{dims[0] if dims else 0} that is not a multiple of {block}")
            nbytes = n_elems // block * bsize
        else:
            nbytes = 0   # refused by name when (if) the tensor is used
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(f"{where}: GGUF file is truncated (tensor {clip(name)} ends at byte "
                                 f"{start + nbytes}, file has {size})")
        if name in tensors:
            raise ModelLoadError(f"{where}: tensor {clip(name)} appears twice")
        tensors[name] = GGUFTensorInfo(name, dims, ttype, start, nbytes)
    shared = first_overlap((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    if shared:          # llama.cpp's reader wants the tensors one after another
        raise ModelLoadError(f"{where}: tensors {clip(shared[0])} and {clip(shared[1])} overlap in the file")
    return GGUFFile(path, version, metadata, tensors, buf)


# ----------------------------------------------------------------------------- metadata

def meta_value(md: dict, key: str, default=None, required=False):
    """A metadata value as a plain Python value (numpy scalars unwrapped), or ``default``."""
    if key in md:
        v = md[key]
        return v.item() if isinstance(v, np.generic) else v
    if required:
        raise ModelLoadError(f"GGUF metadata: missing required key {key!r}")
    return default
