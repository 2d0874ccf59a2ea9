"""Quantized weight formats: the format table, the typed weight (QuantMatrix) and the
NumPy reference of the block math (dequantize, quantize, activation quantization and
the integer dot product). The native kernels live in cython_ext (quant.pxi)."""

from .formats import (ACT_FORMATS, FORMATS, KERNEL_IDS, QUANTIZED, WeightFormat, act_bytes,
                      format_by_ggml_type, format_by_name)
from .matrix import QuantMatrix

__all__ = ["ACT_FORMATS", "FORMATS", "KERNEL_IDS", "QUANTIZED", "QuantMatrix", "WeightFormat",
           "act_bytes", "format_by_ggml_type", "format_by_name"]
