"""Summarise an ncu CSV (``--csv --page details``) into one line a kernel launch.

    python bench/ncu_summary.py ncu.csv

Used by bench/device_run.sh's profile stage: duration, DRAM and SM throughput, executed
instructions, issue slots, registers and occupancy of each epilogue kernel.
"""

from __future__ import annotations

import csv
import sys

KEEP = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Executed Instructions", "Issue Slots Busy",
        "Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy", "Block Size", "Grid Size")


def main(path: str) -> int:
    rows: dict = {}
    lines = [line for line in open(path) if line.startswith('"')]
    for r in csv.DictReader(lines):
        name = r["Kernel Name"].split("(")[0]
        short = name.split("<")[0] + "<" + ", ".join(a.strip() for a in name.split("<", 1)[-1].split(",")[2:])
        key = (r["ID"], short[:60])
        if r["Metric Name"] in KEEP:
            rows.setdefault(key, {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
    for (i, name), m in rows.items():
        print(i, name, " | ".join(f"{k}={m.get(k, '?')}" for k in KEEP))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
