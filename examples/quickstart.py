"""Quickstart: compile a few suite models with fxfuse, check them against eager, show what fused.

    python examples/quickstart.py

On a CUDA machine the models run at their benchmark sizes and a timing table follows. On a
CPU-only machine they run at small sizes with ``options={"allow_cpu": True}``: fxfuse fuses CUDA
tensors only unless told otherwise. Exits non-zero if any compiled model disagrees with eager.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.suite import build, get_row

ROW_IDS = ["S01", "S02", "S04", "S03", "S11"]  # S03 is BatchNorm in training mode
TOL = 1e-4  # float32 with TF32 off (PyTorch's default), so the GEMMs themselves are exact fp32


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return a.shape == b.shape and torch.allclose(a, b, atol=TOL, rtol=TOL)
    return torch.equal(a, b)


def check_row(row_id: str, device: str, size: str, options: dict) -> bool:
    """Compile one suite model with fxfuse and compare output and buffers with eager."""
    import fxfuse

    row = get_row(row_id)
    torch.manual_seed(0)
    model, inputs = build(row, size, device, torch.float32)
    report = fxfuse.report(model, *inputs, **options)  # compiles and runs a copy of the model

    fused_model = copy.deepcopy(model)  # same parameters and BatchNorm statistics to start from
    compiled = torch.compile(fused_model, backend="fxfuse", options=options)

    with torch.no_grad():
        expected = model(*inputs)
        actual = compiled(*inputs)
    # Training-mode BatchNorm (S03) also updates its running statistics: those must match too.
    ok = same(actual, expected) and all(
        same(a, b) for a, b in zip(fused_model.buffers(), model.buffers())
    )
    err = (actual - expected).abs().max().item() if actual.shape == expected.shape else float("nan")
    print(f"{row.id} {row.description}: {'OK' if ok else 'MISMATCH'} (max abs err {err:.2e})")
    print(report)
    print()
    return ok


def main() -> int:
    cuda = torch.cuda.is_available()
    device, size = ("cuda", "full") if cuda else ("cpu", "small")
    options = {} if cuda else {"allow_cpu": True}
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}, sizes: {size}, float32\n")

    failed = []
    for row_id in ROW_IDS:
        try:
            if not check_row(row_id, device, size, options):
                failed.append(row_id)
        except Exception as e:  # keep going so the summary shows every row
            print(f"{row_id}: ERROR {type(e).__name__}: {e}\n")
            failed.append(row_id)

    if cuda:
        from bench.bench import run

        print("Timings (bf16; ratios below 1 mean fxfuse is faster):")
        run(rows=ROW_IDS, dtype="bf16", repeats=10)

    print("all OK" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
