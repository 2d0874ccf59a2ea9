"""`cyllm quantize IN OUT --type T`: a GGUF file -> a quantized GGUF file llama.cpp loads.

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

import os
import sys
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, ModelLoadError
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
        fmt = rec.format_of(name, shape) if len(shape) == 2 else None
        if fmt is not None and info.ggml_type not in _FLOAT_TYPES:
            try:
                if format_by_ggml_type(info.ggml_type).name == fmt:
                    fmt = None               # already in the target format: copied as stored
            except ModelLoadError:
                pass
        out.append((name, info, fmt))
    return out


def quantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, overwrite: bool = False,
                  threads: int | None = None, log=sys.stderr) -> dict:
    """Write `dst`, the GGUF file `src` quantized to `qtype` (see FILE_TYPES).

    Returns {format name: number of tensors} of what was written."""
    import gguf

    from ..loading.gguf import SUPPORTED_TENSOR_TYPES, _dequantize, config_from_gguf, read_gguf
    from ..quant.convert import quantize_rows_f32
    from ..quant.formats import format_by_name

    key = qtype.strip().lower() if isinstance(qtype, str) else qtype
    if key not in FILE_TYPES:
        raise InvalidArgumentError(f"unknown quantization type {qtype!r} (supported: {', '.join(FILE_TYPES)})")
    src, dst = Path(src), Path(dst)
    if src.is_dir():
        raise InvalidArgumentError(
            f"{src} is a directory: `cyllm quantize` reads GGUF files (convert a Hugging Face "
            "directory with llama.cpp's convert_hf_to_gguf.py, or load it with --quantize)")
    if dst.exists() and not overwrite:
        raise InvalidArgumentError(f"{dst} exists; choose another name or pass --force")
    if dst.resolve() == src.resolve():
        raise InvalidArgumentError("the output must not be the input file")
    gf = read_gguf(src)
    cfg = config_from_gguf(gf)                 # the model must be one cyllm knows
    rec = recipe(key, cfg.n_layers, has_output="output.weight" in gf.tensors)
    plan = _plan(gf, rec)
    for name, info, _ in plan:
        if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"{src}: tensor {name} has type {info.type_name}, which cannot be read")
    requant = sorted({info.type_name for _, info, fmt in plan
                      if fmt is not None and info.ggml_type not in _FLOAT_TYPES})
    if requant:
        print(f"cyllm: note: requantizing {', '.join(requant)} tensors: the result carries both "
              "quantization errors (quantize an F16/BF16/F32 file for the best quality)", file=log)

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(None, str(cfg_arch(gf)))
    for k, field in reader.fields.items():
        if k in _SKIP_KEYS or k.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        w.add_key_value(k, field.contents(), vtype, sub_type=sub)
    w.add_file_type(LLAMA_FTYPE[key])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    counts: dict[str, int] = {}
    for name, info, fmt in plan:
        if fmt is None:
            tname = info.type_name
            raw = gguf.GGMLQuantizationType(info.ggml_type)
            if info.ggml_type in (0, 1):
                dt = np.dtype(np.float32 if info.ggml_type == 0 else np.float16)
                w.add_tensor_info(name, info.shape, dt, info.nbytes)
            else:
                rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
                w.add_tensor_info(name, (*info.shape[:-1], info.nbytes // max(rows, 1)), np.dtype(np.uint8),
                                  info.nbytes, raw_dtype=raw)
        else:
            f = format_by_name(fmt)
            tname = fmt.upper()
            rows, cols = info.shape
            w.add_tensor_info(name, (rows, f.row_bytes(cols)), np.dtype(np.uint8), rows * f.row_bytes(cols),
                              raw_dtype=gguf.GGMLQuantizationType(f.ggml_type))
        counts[tname] = counts.get(tname, 0) + 1

    tmp = dst.with_name(dst.name + ".part")
    try:
        w.path = tmp
        w.open_output_file(tmp)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        step_elems = 1 << 22
        for name, info, fmt in plan:
            if fmt is None:
                data = gf.tensor_bytes(info)
                if info.ggml_type in (0, 1):
                    data = data.view(np.float32 if info.ggml_type == 0 else np.float16).reshape(info.shape)
                w.write_tensor_data(data)
                continue
            f = format_by_name(fmt)
            rows, cols = info.shape
            out = np.empty((rows, f.row_bytes(cols)), np.uint8)
            step = max(1, step_elems // cols)
            for r0 in range(0, rows, step):
                part = slice(r0, min(r0 + step, rows))
                x = np.asarray(_dequantize(gf, info, part), np.float32)
                out[part] = quantize_rows_f32(x, f, name, threads)
            w.write_tensor_data(out)
            gf.release(info)
        w.close()
        os.replace(tmp, dst)
    except OSError as e:
        raise InvalidArgumentError(f"cannot write {dst} ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return counts


def cfg_arch(gf) -> str:
    return str(gf.metadata.get("general.architecture"))


# -- the CLI subcommand -------------------------------------------------------------------

def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a GGUF file (llama.cpp's recipes and formats)")
    q.add_argument("input", help="input .gguf file (F16/BF16/F32 for the best quality)")
    q.add_argument("output", help="output .gguf file")
    q.add_argument("--type", required=True, metavar="TYPE",
                   help=f"one of {', '.join(FILE_TYPES)} (llama-quantize's Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K)")
    q.add_argument("-t", "--threads", type=int, help="threads (default: physical cores)")
    q.add_argument("--force", action="store_true", help="overwrite the output file")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(a) -> int:
    if a.threads is not None and a.threads < 1:
        raise InvalidArgumentError(f"--threads must be >= 1, got {a.threads}")
    counts = quantize_gguf(a.input, a.output, a.type, overwrite=a.force, threads=a.threads)
    size = Path(a.output).stat().st_size
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    print(f"wrote {a.output} ({size / 2**20:.1f} MiB): {kinds}", file=sys.stderr)
    return 0
