"""Whole-graph timing of a suite row inside and outside the compile.

The backend's whole-graph check (fxfuse/graph_timing.py) times the graph compiled with its chains
fused against Inductor's compile of the same graph, during the compile. This script compiles the
row with fxfuse (which prints that measurement in the report's path) and with Inductor as users do,
then times the two compiled models with the same function after the compile, in both orders: if
the numbers after the compile differ from those inside it, the compile's timing is biased, not the
choice of what to time.

    python bench/whole_graph_timing.py --row S26
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import fxfuse
from examples.suite import build
from fxfuse.graph_timing import time_both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", default="S26")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, inputs = build(args.row, device="cuda", dtype=torch.bfloat16)
    fused = torch.compile(copy.deepcopy(model), backend="fxfuse")
    inductor = torch.compile(copy.deepcopy(model))
    fxfuse.reset_report()
    with torch.no_grad():
        fused(*inputs), inductor(*inputs)
    for row in fxfuse.last_report().rows:
        text = (row.path or "") + (row.reason or "")
        if "whole graph" in text:
            print("inside the compile:", text[text.index("whole graph"):])
            break
    else:
        print("inside the compile: not timed whole;", [(r.status, r.reason) for r in fxfuse.last_report().rows])
    print("after the compile, fxfuse first:", time_both(fused, inductor, inputs).describe())
    swapped = time_both(inductor, fused, inputs)
    print("after the compile, Inductor first (fused/Inductor swapped):", swapped.describe())


if __name__ == "__main__":
    main()
