"""Summarise an ncu CSV (``--csv --page details``) into one line a kernel launch.

    python bench/ncu_summary.py ncu.csv [--flops M,N,K]

Used by bench/device_run.sh's profile and gemmncu stages: duration, mean SM clock (the GEMMs run at
the card's power limit, their clocks differ by kernel), DRAM and SM throughput, executed
instructions, issue slots, warp cycles per issued instruction, registers and occupancy of each
kernel; with ``--flops``, the TFLOP/s a kernel of that GEMM's 2 M N K flops achieved (the in-GEMM
kernels against cuBLAS's: bench/gemm_configs.py --profile).
"""

from __future__ import annotations

import csv
import sys

KEEP = ("Duration", "SM Frequency", "DRAM Throughput", "Compute (SM) Throughput", "Executed Instructions",
        "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Achieved Occupancy",
        "Theoretical Occupancy", "Block Size", "Grid Size")
# ncu writes a duration's unit either way, by version
SECONDS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
           "second": 1.0, "s": 1.0}


def tflops(duration: str, flops: float) -> str:
    """``flops`` over an ncu duration ("171.52 usecond"), in TFLOP/s."""
    value, unit = duration.split()
    scale = SECONDS.get(unit)
    if scale is None:
        return f"? TFLOP/s (duration in {unit})"
    return f"{flops / (float(value.replace(',', '')) * scale) / 1e12:.0f} TFLOP/s"


def main(path: str, flops: float | None = None) -> int:
    rows: dict = {}
    lines = [line for line in open(path) if line.startswith('"')]
    for r in csv.DictReader(lines):
        name = r["Kernel Name"].split("(")[0]
        short = name.split("<")[0] + "<" + ", ".join(a.strip() for a in name.split("<", 1)[-1].split(",")[2:])
        key = (r["ID"], short[:60])
        if r["Metric Name"] in KEEP:
            rows.setdefault(key, {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
    for (i, name), m in rows.items():
        rate = f" | {tflops(m['Duration'], flops)}" if flops and "Duration" in m else ""
        print(i, name, " | ".join(f"{k}={m.get(k, '?')}" for k in KEEP) + rate)
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--flops", help="M,N,K of the GEMM: each kernel's TFLOP/s at 2 M N K flops")
    args = parser.parse_args()
    m_n_k = [int(v) for v in args.flops.split(",")] if args.flops else None
    sys.exit(main(args.csv, 2.0 * m_n_k[0] * m_n_k[1] * m_n_k[2] if m_n_k else None))
