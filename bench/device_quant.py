#!/usr/bin/env python3
"""The Python half of bench/device_quant.sh (quantized weights on the GPU, cyllm vs llama.cpp).

Subcommands (all resumable: what exists on disk is skipped; outputs appear whole, written
to NAME.part first):

  stash CARRY STATE     copy the carried material into STATE (it outlives the call while the
                        machine stays warm); join the default model once all its parts are
                        there and check its sha256 against the manifest
  make STATE            write the random-weight F16 GGUFs (Llama-2-7B and SmolLM2-135M shapes,
                        the tokenizer of each from the carried vocab files), then quantize each
                        with llama-quantize (waits for STATE/llama.done) to QUANT_TYPES
  bench STATE [--deadline UNIX_TIME] [--dry-run]
                        for each file (F16 first, then each type; 7B, then 135M, then the real
                        default model when present): `cyllm bench --backend cuda` then
                        `llama-bench -ngl 99`, same -p/-n/-d/-r, interleaved file by file, with
                        the peak GPU memory of each (nvidia-smi, polled) and the device copy
                        bandwidth measured in the same run; one JSON per (file, engine)
  table STATE           one markdown table of every result so far

--dry-run (bench) and `make --dry-run` print the commands instead of running them and
work on a machine without a GPU (what this machine's tests run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

P, N, D, R = "512", "128", "0,4096", "3"
SHAPES = {"llama2-7b": "vocab-llama-spm.gguf", "smollm2-135m": "vocab-smollm2.gguf"}
QUANT_TYPES = ("Q4_K_M", "Q8_0", "Q4_0")
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(msg: str) -> None:
    print(f"[device_quant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: Path) -> str:
    from cyllm.default_model import file_sha256     # the check the default model uses
    return file_sha256(path)


def _replace_part(part: Path, final: Path) -> None:
    os.replace(part, final)


# -- stash -------------------------------------------------------------------------------
def cmd_stash(carry: Path, state: Path) -> int:
    mat, dst = carry / "cuda_quant_material", state / "material"
    if mat.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for f in mat.rglob("*"):
            if f.is_file():
                t = dst / f.relative_to(mat)
                if not t.is_file() or t.stat().st_size != f.stat().st_size:
                    t.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, t)
        log(f"material in {dst}")
    bench = carry / "cuda_quant_bench"
    if bench.is_dir():
        (state / "bench").mkdir(parents=True, exist_ok=True)
        for f in bench.iterdir():
            if f.is_file() and not (state / "bench" / f.name).is_file():
                shutil.copyfile(f, state / "bench" / f.name)
    parts = state / "default_parts"
    for f in (carry / "cuda_quant_default").glob(f"{DEFAULT_NAME}.part*") if (carry / "cuda_quant_default").is_dir() else []:
        parts.mkdir(parents=True, exist_ok=True)
        if not (parts / f.name).is_file():
            shutil.copyfile(f, parts / f.name)
            log(f"stashed {f.name}")
    manifest = dst / "manifest.json"
    final = dst / DEFAULT_NAME
    if final.is_file() or not manifest.is_file():
        return 0
    info = json.loads(manifest.read_text()).get("default")
    if not info:
        return 0
    names = [Path(p["path"]).name for p in info["parts"]]
    have = [n for n in names if (parts / n).is_file()]
    if len(have) < len(names):
        log(f"default model: {len(have)} of {len(names)} parts here ({', '.join(have) or 'none'})")
        return 0
    part = final.with_name(final.name + ".part")
    with open(part, "wb") as out:
        for n in names:
            with open(parts / n, "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(part) != info["sha256"]:
        part.unlink()
        log("default model: joined parts do not match the manifest's sha256; parts dropped")
        shutil.rmtree(parts)
        return 1
    _replace_part(part, final)
    log(f"default model joined: {final}")
    return 0


# -- make ---------------------------------------------------------------------------------
def models_dir(state: Path) -> Path:
    return state / "models"


def f16_path(state: Path, shape: str) -> Path:
    return models_dir(state) / f"{shape}-F16.gguf"


def quant_path(state: Path, shape: str, t: str) -> Path:
    return models_dir(state) / f"{shape}-{t}.gguf"


def cmd_make(state: Path, dry: bool, threads: int) -> int:
    models_dir(state).mkdir(parents=True, exist_ok=True)
    for shape, vocab in SHAPES.items():
        out = f16_path(state, shape)
        if out.is_file():
            continue
        part = out.with_name(out.name + ".part")
        cmd = [sys.executable, str(HERE / "compare_llamacpp.py"), "--make-f16-gguf", str(part),
               "--synthetic", shape, "--tokenizer-gguf", str(state / "bench" / vocab)]
        log(" ".join(cmd))
        if dry:
            continue
        t0 = time.time()
        subprocess.run(cmd, check=True)
        _replace_part(part, out)
        log(f"wrote {out.name} ({out.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    quantize = state / "llama.cpp" / "build" / "bin" / "llama-quantize"
    if not dry:
        t0 = time.time()
        while not (state / "llama.done").is_file():
            if (state / "llama.failed").is_file() or time.time() - t0 > 1800:
                log("llama.cpp build failed or never finished: no quantized files")
                return 1
            time.sleep(5)
    for shape in SHAPES:
        for t in QUANT_TYPES:
            out = quant_path(state, shape, t)
            if out.is_file():
                continue
            part = out.with_name(out.name + ".part")
            cmd = [str(quantize), str(f16_path(state, shape)), str(part), t, str(threads)]
            log(" ".join(cmd))
            if dry:
                continue
            t0 = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                log("llama-quantize failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-10:]))
                return 1
            _replace_part(part, out)
            log(f"wrote {out.name} ({out.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    (state / "make.done").write_text("ok\n")
    return 0


# -- bench ---------------------------------------------------------------------------------
class GpuMemPeak:
    """Peak of nvidia-smi's memory.used (MiB) while the block runs, polled every 0.5 s, minus
    the reading just before (this process's own CUDA context stays out of the figure)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.peak = 0
        self.base = None
        self._stop = threading.Event()

    @staticmethod
    def read() -> int | None:
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
            return int(r.stdout.split()[0])
        except Exception:  # noqa: BLE001 - no nvidia-smi: no memory column
            return None

    def _poll(self):
        while not self._stop.wait(0.5):
            v = self.read()
            if v is not None:
                self.peak = max(self.peak, v)

    def __enter__(self):
        if not self.dry:
            self.base = self.read()
            self._t = threading.Thread(target=self._poll, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if not self.dry:
            self._t.join()

    @property
    def used_mib(self) -> int | None:
        if self.base is None or not self.peak:
            return None
        return self.peak - self.base


def bench_files(state: Path) -> list[Path]:
    files = []
    for shape in SHAPES:
        files.append(f16_path(state, shape))
        files += [quant_path(state, shape, t) for t in QUANT_TYPES]
    files.append(state / "material" / DEFAULT_NAME)
    return files


def copy_bandwidth(dry: bool) -> float | None:
    if dry:
        return None
    sys.path.insert(0, str(REPO / "src"))
    from cyllm.backends.cuda import CudaBackend
    import cupy as cp
    be = CudaBackend()
    bw = statistics.median(be.measure_copy_bandwidth() for _ in range(3))
    del be
    cp.get_default_memory_pool().free_all_blocks()      # the runs get the GPU's memory back
    return bw


def run_cyllm(path: Path, dry: bool) -> tuple[list[dict] | None, str]:
    env = dict(os.environ, CYLLM_QUANT="native", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-P", "-m", "cyllm", "bench", "--backend", "cuda", "-m", str(path), "-p", P, "-n", N,
           "-d", D, "-r", R, "-o", "jsonl", "--no-progress"]
    if dry:
        return None, " ".join(cmd)
    # from /tmp: the checkout's cuda/ folder must not shadow the `cuda` package CuPy imports
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", timeout=900)
    if r.returncode != 0:
        raise RuntimeError("cyllm bench failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-15:]))
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return [{"test": x["test"], "t_s": x["tokens_per_s"], "samples": x["samples_tokens_per_s"]} for x in rows], r.stderr


def run_llamacpp(path: Path, state: Path, dry: bool) -> tuple[list[dict] | None, str]:
    exe = state / "llama.cpp" / "build" / "bin" / "llama-bench"
    cmd = [str(exe), "-m", str(path), "-p", P, "-n", N, "-d", D, "-r", R, "-ngl", "99", "-o", "json"]
    if dry:
        return None, " ".join(cmd)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError("llama-bench failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-15:]))
    rows = []
    for x in json.loads(r.stdout[r.stdout.index("["):]):
        pp, tg, d = int(x["n_prompt"]), int(x["n_gen"]), int(x.get("n_depth", 0))
        name = f"pp{pp}" if pp else f"tg{tg}"
        rows.append({"test": name + (f" @ d{d}" if d else ""), "t_s": float(x["avg_ts"]),
                     "samples": x.get("samples_ts")})
    return rows, r.stderr


def _norm_test(name: str) -> str:
    """cyllm and llama-bench spell depth tests alike after this: 'tg128 @ d4096'."""
    import re
    return re.sub(r"\s*@\s*d", " @ d", name).strip()


def cmd_bench(state: Path, deadline: float | None, dry: bool) -> int:
    res = state / "results"
    res.mkdir(parents=True, exist_ok=True)
    bw_file = res / "copy_bandwidth.json"
    if not bw_file.is_file() or dry:
        bws = copy_bandwidth(dry)
        if not dry:
            bw_file.write_text(json.dumps({"copy_gb_s": bws, "time": time.time()}) + "\n")
    for path in bench_files(state):
        if not path.is_file() and not dry:
            log(f"not there (yet): {path.name}")
            continue
        for engine in ("cyllm", "llama.cpp"):
            out = res / f"{path.stem}.{engine}.json"
            if out.is_file() and not dry:
                continue
            if engine == "llama.cpp" and not (state / "llama.done").is_file() and not dry:
                log("llama-bench not built yet")
                continue
            if deadline and time.time() > deadline and not dry:
                log("deadline reached: the next call goes on from here")
                return 0
            t0 = time.time()
            with GpuMemPeak(dry) as mem:
                try:
                    rows, err = (run_cyllm(path, dry) if engine == "cyllm" else run_llamacpp(path, state, dry))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    log(f"{path.name} {engine}: {e}")
                    (res / f"{path.stem}.{engine}.error").write_text(str(e))
                    continue
            if dry:
                log(f"dry run: {err}")
                continue
            rec = {"file": path.name, "file_bytes": path.stat().st_size, "engine": engine,
                   "rows": [dict(r, test=_norm_test(r["test"])) for r in rows],
                   "gpu_mem_mib": mem.used_mib, "seconds": time.time() - t0}
            out.write_text(json.dumps(rec) + "\n")
            log(f"{path.name} {engine}: " + ", ".join(f"{r['test']} {r['t_s']:.1f}" for r in rec["rows"])
                + f"; GPU memory {mem.used_mib} MiB; {rec['seconds']:.0f} s")
    bws = copy_bandwidth(dry)
    if bws:
        bw_file.write_text(json.dumps({"copy_gb_s": bws, "before": json.loads(bw_file.read_text())["copy_gb_s"]}) + "\n")
    return 0


def cmd_table(state: Path, out: Path | None) -> int:
    res = state / "results"
    bw = None
    if (res / "copy_bandwidth.json").is_file():
        j = json.loads((res / "copy_bandwidth.json").read_text())
        bw = j["copy_gb_s"]
        bw_text = f"{bw:.0f} GB/s" + (f" (start of the run: {j['before']:.0f})" if j.get("before") else "")
    else:
        bw_text = "not measured"
    order = {p.name: i for i, p in enumerate(bench_files(state))}
    recs = [json.loads(f.read_text()) for f in sorted(res.glob("*.json")) if f.name != "copy_bandwidth.json"]
    recs.sort(key=lambda r: (order.get(r["file"], 99), r["engine"] != "cyllm"))
    lines = [f"Device copy bandwidth (cyllm's measure_copy_bandwidth, read + write): {bw_text}. "
             f"-p {P} -n {N} -d {D} -r {R}; roofline = copy bandwidth / file bytes per token.", "",
             "| file | engine | tg128 t/s | tg128 @d4096 | pp512 t/s | % of roofline (tg128) | GPU memory (peak - idle) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in recs:
        t = {x["test"]: x["t_s"] for x in r["rows"]}
        tg, tgd, pp = t.get("tg128"), t.get("tg128 @ d4096"), t.get("pp512")
        roof = f"{100 * tg * r['file_bytes'] / (bw * 1e9):.1f}%" if (tg and bw) else ""
        mem = f"{r['gpu_mem_mib'] / 1024:.2f} GiB" if r.get("gpu_mem_mib") else ""
        f = lambda v: f"{v:.1f}" if v else ""  # noqa: E731
        lines.append(f"| {r['file']} ({r['file_bytes'] / 2**30:.2f} GiB) | {r['engine']} | {f(tg)} | {f(tgd)} | "
                     f"{f(pp)} | {roof} | {mem} |")
    errors = sorted(res.glob("*.error"))
    if errors:
        lines += ["", "Failed: " + ", ".join(e.stem for e in errors)]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stash")
    s.add_argument("carry", type=Path)
    s.add_argument("state", type=Path)
    m = sub.add_parser("make")
    m.add_argument("state", type=Path)
    m.add_argument("--dry-run", action="store_true")
    m.add_argument("--threads", type=int, default=os.cpu_count() or 16)
    b = sub.add_parser("bench")
    b.add_argument("state", type=Path)
    b.add_argument("--deadline", type=float, default=None, help="unix time after which no new run starts")
    b.add_argument("--dry-run", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("state", type=Path)
    t.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "stash":
        return cmd_stash(a.carry, a.state)
    if a.cmd == "make":
        return cmd_make(a.state, a.dry_run, a.threads)
    if a.cmd == "bench":
        return cmd_bench(a.state, a.deadline, a.dry_run)
    return cmd_table(a.state, a.out)


if __name__ == "__main__":
    sys.exit(main())
