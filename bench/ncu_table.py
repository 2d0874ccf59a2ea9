#!/usr/bin/env python3
"""One decode token's kernels under ncu, as a table: time, instructions a warp, stalls.

    ncu --clock-control none --cache-control none --profile-from-start off --csv \
        --log-file ncu.csv --metrics "$(python bench/ncu_table.py --metrics)" \
        python3 -P bench/sweep_cuda_decode.py --synthetic smollm2-135m-untied --quantize q4_k -n 16 -r 1 --profile
    python bench/ncu_table.py ncu.csv [more.csv ...]

(`bash bench/device_profile.sh build ncu` runs this for SmolLM2-135M in F16, Q4_0 and Q4_K_M.)
ncu runs the graph's kernels one at a time, so the times are each kernel alone, without the
overlap programmatic dependent launch buys. What the table is for: in a one-wave grid a
kernel's time after its wait is the serial work of its warps, and "instructions a warp"
(smsp__inst_executed / smsp__warps_launched) is that work's size -- how SmolLM2's quantized
matvecs were found to issue 1000-1400 instructions a warp for ~150 of dots
(bench/results/cuda_quant_model_h100.md). The stall columns are warps stalled per issued
instruction, by reason (ncu's smsp__average_warps_issue_stalled_<reason>_per_issue_active).

`--metrics --set memory` (device_profile.sh: NCU_SET=memory) asks instead for the memory side:
DRAM bytes read and their rate, DRAM throughput as % of its peak, the L2 hit rate, achieved
occupancy and global-load sectors per request -- for a matvec that streams below the copy
bandwidth, whether the DRAM, the L2 or the SM's supply of requests is what falls short.
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import sys

# lg_throttle: the SM's queue of global loads is full (too many requests in flight from it)
STALLS = ("no_instruction", "long_scoreboard", "wait", "short_scoreboard", "barrier", "branch_resolving",
          "mio_throttle", "lg_throttle")
SHORT = {"no_instruction": "no inst", "long_scoreboard": "long sb", "short_scoreboard": "short sb",
         "branch_resolving": "branch", "mio_throttle": "mio", "lg_throttle": "lg"}
BASE = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__warps_launched.sum", "sm__cycles_active.max")


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


# the memory view: (metric, column, format); GB/s is derived from bytes and time
MEMORY = (("dram__bytes_read.sum", "MB read", lambda v: f"{v / 1e6:.1f}"),
          ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM % peak", lambda v: f"{v:.1f}"),
          ("lts__t_sector_hit_rate.pct", "L2 hit %", lambda v: f"{v:.1f}"),
          ("sm__warps_active.avg.pct_of_peak_sustained_active", "occupancy %", lambda v: f"{v:.1f}"),
          ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", None, None),
          ("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", None, None))


def metrics(kind: str = "stalls") -> str:
    if kind == "memory":
        return ",".join(BASE[:1] + tuple(m for m, _, _ in MEMORY))
    return ",".join(BASE + tuple(stall_metric(r) for r in STALLS))


# ncu scales units unless told --print-units base: values in ns and bytes whatever it chose
_SCALE = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
          "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def read(path: str) -> dict:
    """ncu --csv output -> {(kernel, grid, block): [{metric: value}, one per launch]}; times
    in ns and sizes in bytes, whatever unit the log gives them in."""
    with open(path, newline="") as f:
        rows = [ln for ln in f if ln.startswith('"')]        # ncu's own notes come first
    launches: dict = collections.defaultdict(dict)
    shape = {}
    for row in csv.DictReader(rows):
        i = int(row["ID"])
        shape[i] = (row["Kernel Name"], row["Grid Size"], row["Block Size"])
        try:
            scale = _SCALE.get(row.get("Metric Unit", ""), 1.0)
            launches[i][row["Metric Name"]] = float(row["Metric Value"].replace(",", "")) * scale
        except ValueError:          # "n/a": a metric this kernel did not report
            pass
    out: dict = collections.defaultdict(list)
    for i in sorted(launches):
        out[shape[i]].append(launches[i])
    return out


def table(groups: dict) -> list[str]:
    """Markdown rows, kernels by their summed time; medians over a kernel's launches. A log of
    the memory metrics (--set memory) gets the memory columns, any other the stall ones."""
    memory = any(MEMORY[0][0] in x for lst in groups.values() for x in lst)
    head = ["kernel", "grid x block", "launches", "us", "us summed"]
    if memory:
        head += ["GB/s"] + [col for _, col, _ in MEMORY if col] + ["sectors a request"]
    else:
        head += ["cycles active", "instructions a warp"] + [SHORT.get(r, r) for r in STALLS]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    total = 0.0

    def med(lst, name):
        vals = [x[name] for x in lst if name in x]
        return statistics.median(vals) if vals else float("nan")

    order = sorted(groups.items(), key=lambda kv: -sum(x.get(BASE[0], 0.0) for x in kv[1]))
    for (name, grid, block), lst in order:
        us = med(lst, BASE[0]) / 1000
        summed = sum(x.get(BASE[0], 0.0) for x in lst) / 1000
        total += summed
        dims = f"{grid.strip('()').split(',')[0]} x {block.strip('()').split(',')[0]}"
        cells = [name, dims, str(len(lst)), f"{us:.2f}", f"{summed:.1f}"]
        if memory:
            gbs = med(lst, MEMORY[0][0]) / (us * 1e3) if us else float("nan")     # bytes / ns
            cells += [f"{gbs:.0f}"] + [fmt(med(lst, m)) for m, col, fmt in MEMORY if col]
            req = med(lst, MEMORY[5][0])
            cells += [f"{med(lst, MEMORY[4][0]) / req:.1f}" if req else "nan"]
        else:
            warps = med(lst, BASE[2])
            per_warp = med(lst, BASE[1]) / warps if warps else float("nan")
            cells += [f"{med(lst, BASE[3]):.0f}", f"{per_warp:.0f}"]
            cells += [f"{med(lst, stall_metric(r)):.2f}" for r in STALLS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nsummed: {total:.1f} us over {sum(len(v) for v in groups.values())} launches")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", help="ncu --csv logs")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu and exit")
    ap.add_argument("--set", choices=("stalls", "memory"), default="stalls",
                    help="which metrics --metrics lists (default: time, instructions and stalls)")
    a = ap.parse_args(argv)
    if a.metrics:
        print(metrics(a.set))
        return 0
    if not a.csv:
        ap.error("give one or more ncu --csv logs (or --metrics)")
    for path in a.csv:
        try:
            groups = read(path)
        except (OSError, KeyError, ValueError, csv.Error) as e:
            print(f"ncu_table: {path}: not an ncu --csv log ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        if not groups:
            print(f"ncu_table: {path}: no kernels in it (did the profiled range run any?)", file=sys.stderr)
            return 2
        print(f"## {path}\n")
        print("\n".join(table(groups)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
