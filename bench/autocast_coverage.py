"""Which part of each suite chain fuses under ``torch.autocast("cuda", torch.bfloat16)`` over the
float32 model, and why the rest does not (the coverage report of each row, one line a GEMM, and
the fused program: its bf16 rounding points and the ``float32()`` stage where it widens).

    python bench/autocast_coverage.py [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import fxfuse
from examples import suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    for row in suite.ROWS:
        if row.id.startswith("S23"):
            continue
        mod = suite.load(row)
        model = mod.Model(*mod.get_init_inputs("small")).to(device).train(not row.eval_mode)
        fxfuse.reset_report()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxfuse", options={"policy": "always", "allow_cpu": True})
        with torch.autocast(device, dtype=torch.bfloat16):
            compiled(*[t.to(device) for t in mod.get_inputs("small")])
        for chain in fxfuse.last_report().rows:
            print(f"{row.id}  {chain.status:9s}  {' > '.join(chain.fused) or '-'}  {chain.reason or ''}")
            if chain.program:  # where the chain rounds to bf16 and where it widens to float32
                print(f"     {chain.program}")


if __name__ == "__main__":
    main()
