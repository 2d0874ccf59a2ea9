"""Weight formats: one table (the typed weight that carries a format is matrix.QuantMatrix).

A format is what ggml calls a type: a block of `block` consecutive elements of a
row stored in `block_bytes` bytes. The table below is the only place that knows
the sizes; the kernels (cython_ext/csrc/quant.h) are indexed by `kernel_id`.

Block layouts (little-endian, ggml's, so GGUF tensors are used as stored):
- q8_0  34 B / 32: f16 d, int8 q[32]                    w = d*q
- q4_0  18 B / 32: f16 d, u8 qs[16]                     w = d*(q-8)   q[j] = qs[j] & 15,
                                                         q[j+16] = qs[j] >> 4
- q4_1  20 B / 32: f16 d, f16 m, u8 qs[16]              w = d*q + m
- q5_0  22 B / 32: f16 d, u32 qh, u8 qs[16]             w = d*(q-16), bit 4 of q[j] = qh bit j
- q5_1  24 B / 32: f16 d, f16 m, u32 qh, u8 qs[16]      w = d*q + m
- q4_k 144 B / 256: f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale + 6-bit min), u8 qs[128]
                                                         w = d*sc_j*q - dmin*m_j (sub-block j of 32)
- q5_k 176 B / 256: as q4_k + u8 qh[32] (5th bits) before qs
- q6_k 210 B / 256: u8 ql[128], u8 qh[64], int8 scales[16], f16 d   w = d*sc_j*(q-32) (16 per j)

Activation formats (what x is quantized to before an integer dot product; cyllm's
own layout, not stored in files, see reference.quantize_act):
- "q8_0": per 32 elements: int8 q[32], f32 d, int32 sum(q)  (sum serves the -8/-16
  offsets of q4_0/q5_0 and the mins of q4_1/q5_1)
- "q8_k": per 256 elements: int8 q[256], f32 d, int16 sums of each 16 q (K-quant mins
  and the -32 offset of q6_k)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError, ModelLoadError

# kernel ids: the order of the per-format entries of cyllm_qkernels (quant.h)
KERNEL_IDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


@dataclass(frozen=True)
class WeightFormat:
    name: str           # cyllm's name, lower case ("q4_k")
    ggml_type: int      # GGML type id in GGUF files
    block: int          # elements per block
    block_bytes: int    # bytes per block
    act: str | None     # activation format of the integer dot ("q8_0" | "q8_k"); None: float format
    kernel_id: int      # index into the C table (quant.h CYLLM_QF_*); -1 for float formats

    @property
    def quantized(self) -> bool:
        return self.act is not None

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` elements (cols must be a multiple of block)."""
        return (cols // self.block) * self.block_bytes


def _fmt(name, ggml_type, block, block_bytes, act):
    kid = KERNEL_IDS.index(name) if name in KERNEL_IDS else -1
    return WeightFormat(name, ggml_type, block, block_bytes, act, kid)


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _fmt("f32", 0, 1, 4, None),
    _fmt("f16", 1, 1, 2, None),
    _fmt("bf16", 30, 1, 2, None),
    _fmt("q8_0", 8, 32, 34, "q8_0"),
    _fmt("q4_0", 2, 32, 18, "q8_0"),
    _fmt("q4_1", 3, 32, 20, "q8_0"),
    _fmt("q5_0", 6, 32, 22, "q8_0"),
    _fmt("q5_1", 7, 32, 24, "q8_0"),
    _fmt("q4_k", 12, 256, 144, "q8_k"),
    _fmt("q5_k", 13, 256, 176, "q8_k"),
    _fmt("q6_k", 14, 256, 210, "q8_k"),
)}
_BY_GGML = {f.ggml_type: f for f in FORMATS.values()}

# Layouts, not file formats (no GGML type, not in FORMATS): each quantized format with the rows of each
# group of 16 interleaved so that one 512-bit load serves 16 rows (cython_ext/csrc/quant.h has
# the byte order). The CPU backend makes them at load where its AVX512-VNNI kernels run; the
# bytes are the file's, reordered, and reference.dequantize reads them back.
Q4_K_R16 = WeightFormat("q4_k_r16", -1, 256, 144, "q8_k", len(KERNEL_IDS))
Q4_0_R16 = WeightFormat("q4_0_r16", -1, 32, 18, "q8_0", len(KERNEL_IDS) + 1)
Q8_0_R16 = WeightFormat("q8_0_r16", -1, 32, 34, "q8_0", len(KERNEL_IDS) + 2)
Q4_1_R16 = WeightFormat("q4_1_r16", -1, 32, 20, "q8_0", len(KERNEL_IDS) + 3)
Q6_K_R16 = WeightFormat("q6_k_r16", -1, 256, 210, "q8_k", len(KERNEL_IDS) + 4)
Q5_K_R16 = WeightFormat("q5_k_r16", -1, 256, 176, "q8_k", len(KERNEL_IDS) + 5)
Q5_0_R16 = WeightFormat("q5_0_r16", -1, 32, 22, "q8_0", len(KERNEL_IDS) + 6)
Q5_1_R16 = WeightFormat("q5_1_r16", -1, 32, 24, "q8_0", len(KERNEL_IDS) + 7)
R16_OF = {"q4_k": Q4_K_R16, "q4_0": Q4_0_R16, "q8_0": Q8_0_R16, "q4_1": Q4_1_R16,    # file format -> its r16 layout
          "q6_k": Q6_K_R16, "q5_k": Q5_K_R16, "q5_0": Q5_0_R16, "q5_1": Q5_1_R16}
R16_BASE = {lay.name: name for name, lay in R16_OF.items()}                               # layout name -> file format
R16_FORMATS = tuple(R16_OF.values())
R16_ROWS = 16
QUANTIZED = tuple(f.name for f in FORMATS.values() if f.quantized)

# activation formats: name -> (block, bytes per block in cyllm's layout)
ACT_FORMATS = {"q8_0": (32, 32 + 4 + 4), "q8_k": (256, 256 + 4 + 32)}


def format_by_name(name: str) -> WeightFormat:
    """The format called `name` (case-insensitive: "Q4_K" == "q4_k")."""
    key = str(name).strip().lower()
    if key not in FORMATS:
        raise InvalidArgumentError(
            f"unknown weight format {name!r} (supported: {', '.join(FORMATS)})")
    return FORMATS[key]


def format_by_ggml_type(type_id: int) -> WeightFormat:
    """The format of GGML type id `type_id`; ModelLoadError for a type cyllm does not know."""
    f = _BY_GGML.get(int(type_id))
    if f is None:
        raise ModelLoadError(
            f"GGML tensor type {int(type_id)} is not a native cyllm weight format "
            f"(native: {', '.join(f'{x.name}={x.ggml_type}' for x in FORMATS.values())})")
    return f


def act_bytes(act: str, n: int) -> int:
    """Bytes of one activation vector of n elements quantized to `act` (n a multiple of its block)."""
    block, per = ACT_FORMATS[act]
    return (n // block) * per
