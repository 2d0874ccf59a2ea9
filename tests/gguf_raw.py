"""A GGUF file as plain editable Python data, for tests that craft hostile files (not a test module).

``RawGGUF.parse(bytes)`` keeps every metadata value with its GGUF type, so a test
can change one value, type or tensor record and ``to_bytes()`` writes the file
back, byte for byte the same when nothing changed. Written from the format's
published layout (little-endian): b"GGUF", uint32 version, uint64 tensor count,
uint64 metadata count, the key/value pairs, the tensor records (name, uint32
n_dims, uint64 dims, uint32 type, uint64 offset), padding to the alignment
(``general.alignment``, default 32), then the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
              FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


@dataclass
class Array:
    etype: int
    items: list          # scalars, strings, or Array (nested)


@dataclass
class Raw:
    """A metadata value given as its encoded bytes (written verbatim after the type)."""
    data: bytes


def nested_array(depth: int) -> Raw:
    """An ARRAY value nested ``depth`` arrays deep around one uint8 (no recursion to build)."""
    return Raw(struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQB", UINT8, 1, 7))


@dataclass
class RawGGUF:
    version: int = 3
    kv: list = field(default_factory=list)        # [key, vtype, value]
    tensors: list = field(default_factory=list)   # [name, dims (fastest first), ggml type, offset]
    data: bytes = b""                             # the tensor data section
    alignment: int | None = None                  # None: general.alignment or 32

    # ------------------------------------------------------------------ reading
    @classmethod
    def parse(cls, buf: bytes) -> "RawGGUF":
        pos = 0

        def take(fmt):
            nonlocal pos
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = take("<Q")
            s = buf[pos:pos + n]
            pos += n
            return s.decode("utf-8", errors="surrogateescape")

        def value(t):
            if t in SCALAR_FMT:
                return take(SCALAR_FMT[t])
            if t == STRING:
                return string()
            et, n = take("<I"), take("<Q")
            return Array(et, [value(et) for _ in range(n)])

        assert buf[:4] == b"GGUF"
        pos = 4
        g = cls(version=take("<I"))
        n_t, n_kv = take("<Q"), take("<Q")
        for _ in range(n_kv):
            k = string()
            t = take("<I")
            g.kv.append([k, t, value(t)])
        for _ in range(n_t):
            name = string()
            nd = take("<I")
            dims = [take("<Q") for _ in range(nd)]
            g.tensors.append([name, dims, take("<I"), take("<Q")])
        align = g.get("general.alignment", 32)
        start = (pos + align - 1) // align * align
        g.data = bytes(buf[start:])
        return g

    def get(self, key, default=None):
        for k, _, v in self.kv:
            if k == key:
                return v
        return default

    def set(self, key, vtype, value) -> None:
        for row in self.kv:
            if row[0] == key:
                row[1], row[2] = vtype, value
                return
        self.kv.append([key, vtype, value])

    def remove(self, key) -> None:
        self.kv = [row for row in self.kv if row[0] != key]

    # ------------------------------------------------------------------ writing
    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv))

        def string(s):
            b = s.encode("utf-8", errors="surrogateescape") if isinstance(s, str) else bytes(s)
            out.extend(struct.pack("<Q", len(b)) + b)

        def value(t, v):
            if isinstance(v, Raw):
                out.extend(v.data)
            elif t in SCALAR_FMT:
                out.extend(struct.pack(SCALAR_FMT[t], v))
            elif t == STRING:
                string(v)
            else:
                out.extend(struct.pack("<IQ", v.etype, len(v.items)))
                for item in v.items:
                    value(v.etype, item)

        for k, t, v in self.kv:
            string(k)
            out += struct.pack("<I", t)
            value(t, v)
        for name, dims, ttype, offset in self.tensors:
            string(name)
            out += struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            out += struct.pack("<IQ", ttype, offset)
        align = self.alignment or self.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0:
            align = 32        # a hostile value: the reader decides what to make of it
        out += b"\0" * (-len(out) % align)
        return bytes(out + self.data)


def relayout(g: RawGGUF, alignment: int) -> RawGGUF:
    """The same tensors packed with ``alignment`` (each offset a multiple of it) and
    general.alignment set to match: a valid file whose tensors may sit at odd addresses."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data, offsets = bytearray(), {}
    for name, dims, ttype, off in g.tensors:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        n = 1
        for d in dims:
            n *= d
        data += b"\0" * (-len(data) % alignment)
        offsets[name] = len(data)
        data += g.data[off:off + n // block * size]
    g.tensors = [[n, d, t, offsets[n]] for n, d, t, _ in g.tensors]
    g.data = bytes(data)
    g.set("general.alignment", UINT32, alignment)
    return g
