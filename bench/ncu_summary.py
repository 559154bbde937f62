"""Summarise an ncu CSV (``--csv --page details``) into one line a kernel launch.

    python bench/ncu_summary.py ncu.csv [--flops M,N,K]

Used by bench/device_run.sh's profile and gemmncu stages: duration, mean SM clock (the GEMMs run at
the card's power limit, their clocks differ by kernel), DRAM and SM throughput, executed
instructions, issue slots, warp cycles per issued instruction, registers and occupancy of each
kernel; with ``--flops``, the TFLOP/s a kernel of that GEMM's 2 M N K flops achieved (the in-GEMM
kernels against cuBLAS's: bench/gemm_configs.py --profile). Where the CSV also holds
gemm_configs.py's "ROW profiled: PATH" lines, a table of each path's kernels follows: the launches
grouped by the GEMM that starts each path (cuBLAS's or CUTLASS's, then the passes after it), the
path's total time, its ratio to the row's F.linear and the GEMM kernel's cycles.
"""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import dataclass

KEEP = ("Duration", "SM Frequency", "DRAM Throughput", "Compute (SM) Throughput", "Executed Instructions",
        "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Achieved Occupancy",
        "Theoretical Occupancy", "Block Size", "Grid Size")
# ncu writes a duration's unit either way, by version
SECONDS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
           "second": 1.0, "s": 1.0}


def number(value: str) -> float:
    """An ncu value ("171,936", "1,618,990,551.92")."""
    return float(value.replace(",", ""))


def seconds(duration: str) -> float | None:
    """An ncu duration ("171.52 usecond", "171,520 ns") in seconds; None in a unit not known."""
    value, unit = duration.split()
    scale = SECONDS.get(unit)
    return None if scale is None else number(value) * scale


def tflops(duration: str, flops: float) -> str:
    """``flops`` over an ncu duration, in TFLOP/s."""
    time = seconds(duration)
    if time is None:
        return f"? TFLOP/s (duration in {duration.split()[1]})"
    return f"{flops / time / 1e12:.0f} TFLOP/s"


@dataclass
class Launch:
    """One profiled kernel launch: its ID, name and the KEEP metrics (value and unit)."""

    id: int
    name: str
    metrics: dict

    @property
    def is_gemm(self) -> bool:
        """A GEMM kernel (cuBLAS's nvjet or gemm kernels, CUTLASS's): it starts a path."""
        return self.name.startswith("nvjet") or "gemm" in self.name.lower() or "cutlass::device_kernel" in self.name

    def microseconds(self) -> float | None:
        time = seconds(self.metrics.get("Duration", "? ?"))
        return None if time is None else time * 1e6

    def gigahertz(self) -> float | None:
        value, unit = self.metrics.get("SM Frequency", "? ?").split()
        scale = {"hz": 1e-9, "Mhz": 1e-3, "MHz": 1e-3, "Ghz": 1.0, "GHz": 1.0}.get(unit)
        return None if scale is None else number(value) * scale


def read_launches(lines: list[str]) -> list[Launch]:
    """The launches of an ncu ``--csv --page details`` file's rows, in ID order."""
    launches: dict[int, Launch] = {}
    for r in csv.DictReader(line for line in lines if line.startswith('"')):
        launch = launches.setdefault(int(r["ID"]), Launch(int(r["ID"]), r["Kernel Name"], {}))
        if r["Metric Name"] in KEEP:
            launch.metrics[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
    return [launches[i] for i in sorted(launches)]


PROFILED = re.compile(r"^(\S+)\s+profiled: (.*)$")


def paths(lines: list[str], launches: list[Launch]) -> list[tuple[str, str, list[Launch]]] | None:
    """(row, path, its launches) for each "ROW profiled: PATH" line of gemm_configs.py, the
    launches split where a GEMM kernel starts; None where the two do not pair up."""
    labels = [found.groups() for line in lines if (found := PROFILED.match(line.strip()))]
    groups: list[list[Launch]] = []
    for launch in launches:
        if launch.is_gemm or not groups:
            groups.append([])
        groups[-1].append(launch)
    if not labels or len(labels) != len(groups):
        return None
    return [(row, path, group) for (row, path), group in zip(labels, groups)]


def path_table(rows: list[tuple[str, str, list[Launch]]]) -> list[dict]:
    """Each path's total time, its ratio to its row's F.linear, and its GEMM kernel's clock and
    cycles (the card's power limit sets the clock: cycles compare kernels, time what a user gets)."""
    base: dict[str, float] = {}
    table = []
    for row, path, group in rows:
        times = [launch.microseconds() for launch in group]
        total = None if None in times else sum(times)
        if path == "F.linear" and total is not None:
            base[row] = total
        clock = group[0].gigahertz()
        table.append({"row": row, "path": path, "kernels": len(group),
                      "us": None if total is None else round(total, 1),
                      "/ F.linear": round(total / base[row], 3) if total is not None and row in base else None,
                      "GEMM GHz": None if clock is None else round(clock, 3),
                      "GEMM kcycles": None if clock is None or times[0] is None else round(times[0] * clock, 1)})
    return table


def main(path: str, flops: float | None = None) -> int:
    lines = open(path).read().splitlines()
    launches = read_launches(lines)
    for launch in launches:
        name = launch.name.split("(")[0]
        short = name.split("<")[0] + "<" + ", ".join(a.strip() for a in name.split("<", 1)[-1].split(",")[2:])
        m = launch.metrics
        rate = f" | {tflops(m['Duration'], flops)}" if flops and "Duration" in m else ""
        print(launch.id, short[:60], " | ".join(f"{k}={m.get(k, '?')}" for k in KEEP) + rate)
    grouped = paths(lines, launches)
    if grouped is None:
        if any(PROFILED.match(line.strip()) for line in lines):
            print("(the launches do not pair up with the profiled paths: no table of paths)")
        return 0
    from tabulate import tabulate

    print(tabulate(path_table(grouped), headers="keys"))
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--flops", help="M,N,K of the GEMM: each kernel's TFLOP/s at 2 M N K flops")
    args = parser.parse_args()
    m_n_k = [int(v) for v in args.flops.split(",")] if args.flops else None
    sys.exit(main(args.csv, 2.0 * m_n_k[0] * m_n_k[1] * m_n_k[2] if m_n_k else None))
