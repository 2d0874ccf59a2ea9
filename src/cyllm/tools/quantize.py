"""`cyllm quantize IN OUT --type T`: a GGUF file or a Hugging Face directory -> a quantized
GGUF file llama.cpp loads.

A Hugging Face directory is read through cyllm.hf_gguf (the metadata, tensor names and
q/k row order llama.cpp's converter gives the family) and quantized from its own
precision in the same pass; what follows about the recipe holds for both inputs.

A tool above the engine (it uses the loader's GGUF reader and the quantizers of
cyllm.quant, and the `gguf` package's GGUFWriter). What it writes follows what
llama-quantize writes, so the file works wherever a llama.cpp file does:
- every metadata key of the input is copied with its type (tokenizer, chat template,
  rope settings...), general.file_type set to llama.cpp's value for the type and
  general.quantization_version to 2;
- tensors in the input's order and layout (q/k rows stay in llama.cpp's order);
  vectors stay as stored; each matrix gets the format llama.cpp's recipe gives it
  (cyllm.quant.recipe): e.g. Q4_K_M is Q4_K with Q6_K for the output matrix and for
  attn_v/ffn_down of some layers, Q5_0 where a row is not a multiple of 256;
- the blocks are those of llama.cpp's reference quantizers (no importance matrix),
  computed by cyllm's C twin of them (cyllm.quant.convert).
A matrix already stored in its target format is copied byte for byte; one in another
quantized format is dequantized first (llama-quantize needs --allow-requantize for
that; a note says so). The output is streamed: memory stays near one matrix.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InvalidArgumentError, ModelLoadError
from ..oneline import one_line
from ..quant.recipe import FILE_TYPES, LLAMA_FTYPE, recipe

_SKIP_KEYS = {"general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment"}
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


def _plan(gf, rec):
    """[(name, info, target format or None: copy)] in file order."""
    from ..quant.formats import format_by_ggml_type
    out = []
    for name, info in gf.tensors.items():
        shape = info.shape
        fmt = rec.format_of(name, shape) if len(shape) in (2, 3) else None
        if fmt is not None and info.ggml_type not in _FLOAT_TYPES:
            try:
                if format_by_ggml_type(info.ggml_type).name == fmt:
                    fmt = None               # already in the target format: copied as stored
            except ModelLoadError:
                pass
        out.append((name, info, fmt))
    return out


@dataclass
class _Item:
    """One output tensor: name, numpy shape, and how its bytes are made."""
    name: str
    shape: tuple[int, ...]
    kind: str                       # "quant" (fmt) | "f32" | "f16" | "raw" (copied as stored)
    rows: Callable | None = None    # slice -> float32 rows (quant, f32, f16)
    fmt: str | None = None          # quant: the block format
    raw_type: int | None = None     # raw: GGML type id
    raw: Callable | None = None     # raw: () -> uint8 array of the stored bytes
    nbytes: int = 0                 # raw: byte size
    release: Callable | None = None  # called once the tensor is written

    @property
    def type_name(self) -> str:
        if self.kind == "quant":
            return self.fmt.upper()
        if self.kind == "raw":
            return _type_name(self.raw_type)
        return self.kind.upper()


def _type_name(t: int) -> str:
    from ..loading.gguf_file import ggml_type_name
    return ggml_type_name(t)


def _check_type(qtype) -> str:
    key = qtype.strip().lower() if isinstance(qtype, str) else qtype
    if key not in FILE_TYPES:
        raise InvalidArgumentError(f"unknown quantization type {qtype!r} (supported: {', '.join(FILE_TYPES)})")
    return key


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    if not src.exists():
        raise InvalidArgumentError(f"input not found: {src}")
    if os.path.lexists(dst) and not overwrite:       # a dangling symlink too
        raise InvalidArgumentError(f"{dst} exists; choose another name or pass --force")
    if dst.exists() and dst.resolve() == src.resolve():
        raise InvalidArgumentError("the output must not be the input file")
    if dst.is_dir():
        raise InvalidArgumentError(f"{dst} is a directory; the output is a .gguf file")
    if dst.exists() and not dst.is_file():
        # the file is written aside and renamed over the output: that would put a regular
        # file in place of a device or a pipe (as root, /dev/null itself)
        raise InvalidArgumentError(f"{dst} is not a regular file (a device, pipe or socket); "
                                   "the output is a .gguf file")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, overwrite: bool = False,
             threads: int | None = None, log=None) -> dict:
    """Write `dst`, the model `src` (a GGUF file or a Hugging Face directory) quantized to
    `qtype` (see FILE_TYPES). Returns {type name: number of tensors} of what was written."""
    src = Path(src)
    if src.is_dir():
        return quantize_hf(src, dst, qtype, overwrite, threads)
    return quantize_gguf(src, dst, qtype, overwrite, threads, log)


def quantize_hf(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, overwrite: bool = False,
                threads: int | None = None) -> dict:
    """A Hugging Face directory (safetensors F32/F16/BF16) -> quantized GGUF, in llama.cpp's
    conventions (cyllm.hf_gguf): the model as llama.cpp's converter would write it, then
    quantized as llama-quantize would, in one pass and from the source precision."""
    import gguf

    from .hf_gguf import hf_source
    key = _check_type(qtype)
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, overwrite)
    # the tokenizer as loading reads it: a file cyllm would refuse to load (bad merges, lying ids)
    # is refused here, not written into a GGUF that then fails to load
    from ..tokenizer import Tokenizer
    Tokenizer.from_hf_dir(src)
    hs = hf_source(src)
    names = {t.name for t in hs.tensors}
    rec = recipe(key, hs.config.n_layers, has_output="output.weight" in names, n_experts=hs.config.n_experts)
    items = []
    for t in hs.tensors:
        if len(t.shape) == 1 or "ffn_gate_inp." in t.name:      # vectors, a MoE router: F32
            items.append(_Item(t.name, t.shape, "f32", rows=t.rows))
            continue
        fmt = rec.format_of(t.name, t.shape)
        items.append(_Item(t.name, t.shape, "quant", rows=t.rows, fmt=fmt) if fmt is not None
                     else _Item(t.name, t.shape, "f16", rows=t.rows))
    kvs = [kv for kv in hs.metadata if kv[0] != "general.architecture"]
    kvs.append(("general.file_type", LLAMA_FTYPE[key], gguf.GGUFValueType.UINT32, None))
    kvs.append(("general.quantization_version", gguf.GGML_QUANT_VERSION, gguf.GGUFValueType.UINT32, None))
    return _write(dst, hs.arch, kvs, items, threads)


def quantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, overwrite: bool = False,
                  threads: int | None = None, log=None) -> dict:
    """Write `dst`, the GGUF file `src` quantized to `qtype` (see FILE_TYPES).

    Returns {format name: number of tensors} of what was written. Notes go to `log`
    (default: sys.stderr as it is at the call, not as it was at import)."""
    import gguf

    from ..loading.gguf import SUPPORTED_TENSOR_TYPES, _dequantize, config_from_gguf, plan_tensors, read_gguf

    key = _check_type(qtype)
    src, dst = Path(src), Path(dst)
    if src.is_dir():
        return quantize_hf(src, dst, qtype, overwrite, threads)
    _check_paths(src, dst, overwrite)
    gf = read_gguf(src)
    cfg = config_from_gguf(gf)                 # the model must be one cyllm knows
    plan_tensors(gf, cfg)                      # ... and its tensors the shapes the family has
    _check_metadata_size(gf)
    rec = recipe(key, cfg.n_layers, has_output="output.weight" in gf.tensors, n_experts=cfg.n_experts)
    plan = _plan(gf, rec)
    for name, info, _ in plan:
        if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"{src}: tensor {name} has type {info.type_name}, which cannot be read")
    kvs = []
    try:            # the gguf package's reader is stricter than ours in places (string encoding, key types)
        reader = gguf.GGUFReader(str(src))
        for k, field in reader.fields.items():
            if k in _SKIP_KEYS or k.startswith("GGUF."):
                continue
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
            value = field.contents()
            if vtype == gguf.GGUFValueType.ARRAY and not len(value):
                raise ModelLoadError(f"{src}: metadata key {one_line(k, 60)} is an empty array, which the gguf "
                                     "package cannot write")
            kvs.append((k, value, vtype, sub))
    except (ValueError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
        raise ModelLoadError(f"{src}: the gguf package cannot read this file's metadata, so it cannot be "
                             f"rewritten ({type(e).__name__}: {one_line(e, 120)})") from None
    requant = sorted({info.type_name for _, info, fmt in plan
                      if fmt is not None and info.ggml_type not in _FLOAT_TYPES})
    if requant:
        print(f"cyllm: note: requantizing {', '.join(requant)} tensors: the result carries both "
              "quantization errors (quantize an F16/BF16/F32 file for the best quality)",
              file=sys.stderr if log is None else log)
    kvs.append(("general.file_type", LLAMA_FTYPE[key], gguf.GGUFValueType.UINT32, None))
    kvs.append(("general.quantization_version", gguf.GGML_QUANT_VERSION, gguf.GGUFValueType.UINT32, None))

    items = []
    for name, info, fmt in plan:
        def rows(part, info=info):
            return np.asarray(_dequantize(gf, info, part), np.float32)
        release = (lambda info=info: gf.release(info))
        if fmt is not None:
            items.append(_Item(name, info.shape, "quant", rows=rows, fmt=fmt, release=release))
        elif info.ggml_type in (0, 1):
            def whole(part, info=info):
                return gf.tensor_bytes(info).view(np.float32 if info.ggml_type == 0 else np.float16) \
                    .reshape(_row_shape(info.shape) if len(info.shape) > 1 else info.shape)[part]
            items.append(_Item(name, info.shape, "f32" if info.ggml_type == 0 else "f16", rows=whole,
                               release=release))
        else:
            items.append(_Item(name, info.shape, "raw", raw_type=info.ggml_type, nbytes=info.nbytes,
                               raw=lambda info=info: gf.tensor_bytes(info), release=release))
    return _write(dst, cfg_arch(gf), kvs, items, threads)


# metadata arrays past this many elements are refused: the gguf package's reader builds a
# numpy view per element (~700 bytes each), and the largest real arrays are vocabularies and
# merge lists of a few hundred thousand entries
MAX_META_ARRAY = 1 << 20
# entries of all metadata arrays together, nested ones included: the gguf package's reader,
# which the rewrite goes through, holds ~1.7 KB a string (a 262K-token vocabulary with its
# scores, types and merges is ~1.3 M)
MAX_META_ENTRIES = 3 << 20


def _entries(v) -> int:
    """Entries of a metadata value's arrays, nested arrays counted through (no recursion)."""
    n, stack = 0, [v]
    while stack:
        x = stack.pop()
        if isinstance(x, np.ndarray):
            n += x.size
        elif isinstance(x, (list, tuple)):
            n += len(x)
            stack.extend(e for e in x if isinstance(e, (list, tuple, np.ndarray)))
    return n


def _check_metadata_size(gf) -> None:
    total = 0
    for k, v in gf.metadata.items():
        n = _entries(v)
        if n > MAX_META_ARRAY:
            raise ModelLoadError(f"{gf.path}: metadata array {one_line(k, 60)} has {n} entries, beyond any "
                                 f"real model's (at most {MAX_META_ARRAY} are rewritten)")
        total += n
    if total > MAX_META_ENTRIES:
        raise ModelLoadError(f"{gf.path}: the metadata arrays hold {total} entries, beyond any real model's "
                             f"(at most {MAX_META_ENTRIES} are rewritten)")


def _write(dst: Path, arch: str, kvs: list, items: list[_Item], threads: int | None) -> dict:
    """Stream `items` into the GGUF `dst` (written to a partial file of its own beside it,
    then renamed over it): memory stays near one row chunk of one tensor (plus one quantized
    matrix)."""
    import gguf

    from ..quant.convert import quantize_rows_f32
    from ..quant.formats import format_by_name

    w = gguf.GGUFWriter(None, arch)
    for k, v, vtype, sub in kvs:
        w.add_key_value(k, v, vtype, sub_type=sub)
    counts: dict[str, int] = {}
    for it in items:
        if it.kind == "quant":
            f = format_by_name(it.fmt)
            rows, cols = _row_shape(it.shape)
            w.add_tensor_info(it.name, (*it.shape[:-1], f.row_bytes(cols)), np.dtype(np.uint8),
                              rows * f.row_bytes(cols), raw_dtype=gguf.GGMLQuantizationType(f.ggml_type))
        elif it.kind in ("f32", "f16"):
            dt = np.dtype(np.float32 if it.kind == "f32" else np.float16)
            w.add_tensor_info(it.name, it.shape, dt, int(np.prod(it.shape)) * dt.itemsize)
        else:
            n_rows = int(np.prod(it.shape[:-1])) if len(it.shape) > 1 else 1
            w.add_tensor_info(it.name, (*it.shape[:-1], it.nbytes // max(n_rows, 1)), np.dtype(np.uint8),
                              it.nbytes, raw_dtype=gguf.GGMLQuantizationType(it.raw_type))
        counts[it.type_name] = counts.get(it.type_name, 0) + 1

    # a short name of its own beside dst, renamed over it at the end (never someone's X.part,
    # never too long where dst is not; created by the writer, so the file gets the usual
    # permissions). A symlink at dst (with --force) is replaced, not written through.
    remove_stale_partials(dst)
    tmp = dst.with_name(f".{dst.name[:40]}.{os.getpid()}-{secrets.token_hex(4)}.part")
    try:
        w.path = tmp
        w.open_output_file(tmp)
        w.write_header_to_file()
        try:
            w.write_kv_data_to_file()
        except (ValueError, TypeError) as e:      # a value the format cannot hold (nested arrays)
            raise ModelLoadError(f"cannot write the metadata to a GGUF ({one_line(e, 120)})") from None
        w.write_ti_data_to_file()
        for it in items:
            if it.kind == "raw":
                w.write_tensor_data(it.raw())
            elif it.kind == "quant":
                f = format_by_name(it.fmt)
                rows, cols = _row_shape(it.shape)
                out = np.empty((rows, f.row_bytes(cols)), np.uint8)
                step = max(1, _STEP_ELEMS // cols)
                for r0 in range(0, rows, step):
                    part = slice(r0, min(r0 + step, rows))
                    out[part] = quantize_rows_f32(it.rows(part), f, it.name, threads)
                w.write_tensor_data(out)
            else:
                w.write_tensor_data(_float_tensor(it))
            if it.release is not None:
                it.release()
        w.close()
        os.replace(tmp, dst)
    except OSError as e:
        raise InvalidArgumentError(f"cannot write {dst} ({e.strerror or e})") from None
    finally:
        with contextlib.suppress(OSError):      # left open by an error; closing flushes, which may fail
            w.close()                           # again on a full disk: the partial file goes either way
        with contextlib.suppress(OSError):      # never created (the open failed): nothing to remove
            tmp.unlink()
    return counts


_STEP_ELEMS = 1 << 22
STALE_AFTER_S = 120         # a partial file untouched this long, of a process gone, is an orphan


def remove_stale_partials(dst: Path) -> int:
    """Remove the partial files of ``dst`` that a killed run (kill -9, a crash, a lost machine)
    left beside it: named by _write, their process no longer running here, and not written to
    for STALE_AFTER_S (a run on another machine sharing the folder keeps its file fresh). Each
    holds up to a whole model, and their unique names would otherwise pile up. Returns the
    bytes removed; a note says so."""
    pat = re.compile(r"\." + re.escape(dst.name[:40]) + r"\.(\d+)-[0-9a-f]{8}\.part")
    freed = 0
    try:
        names = [e.name for e in os.scandir(dst.parent) if pat.fullmatch(e.name)]
    except OSError:
        return 0                    # no folder to look in: the write says why
    now = time.time()
    for name in names:
        pid = int(pat.fullmatch(name).group(1))
        path = dst.parent / name
        try:
            st = path.lstat()
            if pid == os.getpid() or not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_AFTER_S:
                continue
            if _running(pid):
                continue
            path.unlink()
            freed += st.st_size
        except OSError:
            continue                # gone meanwhile, or not ours to remove
    if freed:
        from ..memory import fmt_bytes
        print(f"cyllm: note: removed {fmt_bytes(freed)} of partial files an interrupted run "
              f"left beside {dst.name}", file=sys.stderr)
    return freed


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _row_shape(shape: tuple) -> tuple:
    """(rows, cols) of a tensor seen as its rows: a stack of matrices (experts) has the rows of
    each in turn; a vector is one column. Every item's ``rows(part)`` slices these rows."""
    return (int(np.prod(shape[:-1])), int(shape[-1])) if len(shape) > 1 else (int(shape[0]), 1)


def _float_tensor(it: _Item) -> np.ndarray:
    """An F32/F16 tensor, converted chunk by chunk (F16: values beyond its range are refused)."""
    n, cols = _row_shape(it.shape)
    dt = np.float32 if it.kind == "f32" else np.float16
    step = max(1, _STEP_ELEMS // cols)
    out = np.empty((n, cols) if len(it.shape) > 1 else it.shape, dt)
    for r0 in range(0, n, step):
        part = slice(r0, min(r0 + step, n))
        a = it.rows(part)
        if dt is np.float16 and a.dtype != np.float16:
            big = max(float(np.max(a, initial=0.0)), -float(np.min(a, initial=0.0)))
            if not big <= 65504.0:
                raise InvalidArgumentError(f"tensor {it.name} has values up to {big:g}, beyond float16's "
                                           "range; it cannot be written as F16")
        out[part] = a
    return out.reshape(it.shape)


def cfg_arch(gf) -> str:
    return str(gf.metadata.get("general.architecture"))


# -- the CLI subcommand -------------------------------------------------------------------

def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a GGUF file or a Hugging Face directory to a GGUF file "
                                        "(llama.cpp's recipes and formats)")
    q.add_argument("input", help="input .gguf file (F16/BF16/F32 for the best quality) or Hugging Face model "
                                 "directory (safetensors F32/F16/BF16)")
    q.add_argument("output", help="output .gguf file")
    q.add_argument("--type", required=True, metavar="TYPE",
                   help=f"one of {', '.join(FILE_TYPES)} (llama-quantize's Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K)")
    q.add_argument("-t", "--threads", type=int, help="threads (default: physical cores)")
    q.add_argument("--force", action="store_true", help="overwrite the output file")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(a) -> int:
    if a.threads is not None and a.threads < 1:
        raise InvalidArgumentError(f"--threads must be >= 1, got {a.threads}")
    counts = quantize(a.input, a.output, a.type, overwrite=a.force, threads=a.threads)
    size = Path(a.output).stat().st_size
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    print(f"wrote {a.output} ({size / 2**20:.1f} MiB): {kinds}", file=sys.stderr)
    return 0
