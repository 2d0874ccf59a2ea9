"""The typed weight: a matrix in a block format (its raw blocks, its format, its logical
shape). Loading makes them (usually zero-copy views of a GGUF memory map), backends
pick their kernel from ``fmt``, and numpy_ref dequantizes them with the reference."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, ModelLoadError
from .formats import R16_FORMATS, R16_ROWS, WeightFormat, format_by_name
from .reference import dequantize


class QuantMatrix:
    """A (rows, cols) weight matrix in a block format: raw block bytes + format + shape.

    data: (rows, row_bytes) uint8, C-contiguous, usually a zero-copy view into the
    memory map of a GGUF file. Nothing is decoded here; backends pick their kernel
    from `fmt` and numpy_ref dequantizes (cyllm.quant.reference).
    """

    __slots__ = ("data", "fmt", "rows", "cols")

    def __init__(self, data: np.ndarray, fmt: WeightFormat | str, shape: tuple[int, int],
                 name: str = "weight"):
        fmt = format_by_name(fmt) if isinstance(fmt, str) else fmt
        if not fmt.quantized:
            raise InvalidArgumentError(f"{name}: QuantMatrix holds block formats, not {fmt.name}")
        try:
            rows, cols = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise ModelLoadError(f"{name}: shape must be (rows, cols), got {shape!r}") from None
        if rows < 1 or cols < 1:
            raise ModelLoadError(f"{name}: shape {(rows, cols)} has an empty dimension")
        if cols % fmt.block:
            raise ModelLoadError(
                f"{name}: a row of {cols} elements is not a multiple of the {fmt.name} "
                f"block ({fmt.block} elements)")
        rb = fmt.row_bytes(cols)
        if not isinstance(data, np.ndarray):
            raise ModelLoadError(f"{name}: block data must be a numpy array, got {type(data).__name__}")
        if data.dtype != np.uint8:
            raise ModelLoadError(f"{name}: block data must be uint8, got {data.dtype}")
        if data.size != rows * rb:
            raise ModelLoadError(
                f"{name}: {fmt.name} {rows}x{cols} needs {rows * rb} bytes "
                f"({rows} rows x {rb}), the data has {data.size}")
        if data.ndim == 1:
            data = data.reshape(rows, rb)      # a view: never copies a contiguous buffer
        if fmt in R16_FORMATS and rows % R16_ROWS:
            raise ModelLoadError(f"{name}: a {fmt.name} matrix has a multiple of {R16_ROWS} rows, got {rows}")
        if data.shape != (rows, rb) or not data.flags.c_contiguous:
            raise ModelLoadError(
                f"{name}: block data must be C-contiguous (rows, row_bytes) = ({rows}, {rb}), "
                f"got shape {data.shape}")
        self.data = data            # (rows, row_bytes) uint8
        self.fmt = fmt
        self.rows = rows
        self.cols = cols

    @classmethod
    def from_buffer(cls, buf, offset: int, fmt: WeightFormat | str, shape: tuple[int, int],
                    name: str = "weight") -> "QuantMatrix":
        """Zero-copy view of `buf` (an mmap, bytes, ...) at byte `offset`."""
        fmt = format_by_name(fmt) if isinstance(fmt, str) else fmt
        rows, cols = (int(s) for s in shape)
        if cols % fmt.block or rows < 1 or cols < 1:
            return cls(np.empty(0, np.uint8), fmt, (rows, cols), name)   # raises the clear error
        n = rows * fmt.row_bytes(cols)
        if offset < 0 or offset + n > len(buf):
            raise ModelLoadError(
                f"{name}: {fmt.name} {rows}x{cols} needs {n} bytes at offset {offset}, "
                f"beyond the end of the data ({len(buf)} bytes)")
        return cls(np.frombuffer(buf, np.uint8, n, offset), fmt, (rows, cols), name)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    ndim = 2

    def __getitem__(self, rows) -> "QuantMatrix":
        """A run of whole rows (a slice with step 1): a zero-copy QuantMatrix of the same
        format (the model views fused q/k/v and gate/up matrices this way)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise InvalidArgumentError("a QuantMatrix is indexed by a slice of whole rows only")
        a, b, _ = rows.indices(self.rows)
        if self.fmt in R16_FORMATS and (a % R16_ROWS or max(a, b) % R16_ROWS):
            # the layout's byte rows are groups of 16 interleaved rows: only whole groups cut
            raise InvalidArgumentError(
                f"rows [{a}, {b}) of a {self.fmt.name} matrix: the cut must fall on a multiple of {R16_ROWS}")
        return QuantMatrix(self.data[a:max(a, b)], self.fmt, (max(0, b - a), self.cols))

    def take_rows(self, order: np.ndarray) -> "QuantMatrix":
        """A new QuantMatrix whose row i is row order[i] of this one: whole block rows move
        (a copy of the matrix: (rows, row_bytes) bytes)."""
        if self.fmt in R16_FORMATS:
            raise InvalidArgumentError(f"take_rows of a {self.fmt.name} matrix (its byte rows are not rows)")
        return QuantMatrix(np.ascontiguousarray(self.data[np.asarray(order)]), self.fmt, self.shape)

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.size

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32, via the NumPy reference."""
        return dequantize(self.data, self.fmt, self.cols)

    def __repr__(self) -> str:
        return f"QuantMatrix({self.fmt.name}, shape={self.shape}, {self.nbytes} bytes)"
