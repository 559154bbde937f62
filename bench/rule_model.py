"""What the correctness rule makes of rounding alone, per suite row (CPU, float64; no GPU).

    python bench/rule_model.py S04 [--batch 16] [--draws 6] [--dtype bf16]

The suite row's model (one Linear, then the chain) at full size (``--batch`` rows), its GEMM
output ``y`` computed exactly (float64 from the low-precision parameters and inputs), and several
ways to round a result, each judged against eager by the correctness rule (``fxfuse.accuracy``:
within 1e-2 of eager's element, or no further from the float64 model than eager's):

- ``in-GEMM``: the chain in float64 on the exact ``y``, rounded once (the in-GEMM kernel's numerics);
- ``row pass, rounded once``: the chain in float64 on ``y`` rounded to the dtype (a cuBLAS output),
  rounded once;
- ``eager, GEMM summed otherwise``: eager itself on a ``y`` summed in float32 in another order
  (K in four slices, as a split-K GEMM sums it): how often the rule fails eager against itself;
- ``row pass, GEMM summed otherwise``: the same ``y``, the chain rounded once;
- ``eager`` and ``row pass, split-K added in the dtype``: the same on a ``y`` whose four slices
  were added in the low dtype (cuBLAS's reduced-precision split-K reduction).

Eager is this machine's (CPU) eager in the dtype; CUDA's eager rounds some statistics (group norm's
mean and 1/std up to torch 2.11) that this model does not. Counts are elements breaking the rule over
all draws. A chain where the control (eager against itself) breaks the rule is one where only the
in-GEMM numerics pass it element by element.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import suite  # noqa: E402
from fxfuse.accuracy import rule_breaks  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 1e-2


def breaks(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> int:
    """Elements of ``out`` that break the rule (fxfuse.accuracy, the tests' rule)."""
    return int(rule_breaks(out, eager, exact, TOL).sum())


def the_linear(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's one Linear (the suite's models start with it), None where it has not one."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return linears[0] if len(linears) == 1 else None


def on_gemm(model: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The model's chain after its Linear (``the_linear``), on the GEMM output ``y``."""
    gemm = the_linear(model)
    gemm.forward = lambda _x: y
    try:
        return model(torch.empty(y.shape[0], gemm.in_features, dtype=y.dtype, device=y.device))
    finally:
        del gemm.forward


def split_k_sums(x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    """x @ weight.T in float32 as a split-K GEMM computes it: one sum per quarter of K."""
    k = x.shape[1] // 4
    bounds = [(0, k), (k, 2 * k), (2 * k, 3 * k), (3 * k, x.shape[1])]
    return [x.float()[:, a:b] @ weight.float()[:, a:b].T for a, b in bounds]


def split_k_sum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, the quarters' sums added in pairs, last first: a GEMM that
    sums K in another order than the exact one."""
    s0, s1, s2, s3 = split_k_sums(x, weight)
    total = (s3 + s2) + (s1 + s0)
    return total if bias is None else total + bias.float()


def split_k_reduced_in(dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The slices' sums added one by one in ``dtype`` (cuBLAS's reduced-precision split-K
    reduction, which torch allows for bf16 and fp16 by default), the bias last."""
    total = None
    for part in split_k_sums(x, weight):
        total = part.to(dtype) if total is None else (total.float() + part).to(dtype)
    return total if bias is None else (total.float() + bias.float()).to(dtype)


def rule_counts(row_id: str, batch: int, draws: int, dtype: torch.dtype, size: str = "full") -> dict[str, int]:
    """Elements breaking the rule over ``draws`` draws, per way of rounding (the module's list)."""
    row = suite.get_row(row_id)
    mod = suite.load(row)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs(size)).to(dtype).train(not row.eval_mode)
    if the_linear(model) is None:
        raise ValueError(f"{row_id}: the model has not one Linear to start the chain at")
    exact_model = copy.deepcopy(model).double()
    weight, bias = the_linear(exact_model).weight, the_linear(exact_model).bias
    counts: dict[str, int] = {}
    with torch.no_grad():
        for _ in range(draws):
            x = torch.rand(batch, weight.shape[1]).to(dtype).double()
            y = torch.nn.functional.linear(x, weight, bias)  # exact
            y_other = split_k_sum(x, weight, bias)
            y_reduced = split_k_reduced_in(dtype, x, weight, bias)
            exact = exact_model(x)
            eager = on_gemm(model, y.to(dtype))
            results = {
                "in-GEMM": on_gemm(exact_model, y).to(dtype),
                "row pass, rounded once": on_gemm(exact_model, y.to(dtype).double()).to(dtype),
                "eager, GEMM summed otherwise": on_gemm(model, y_other.to(dtype)),
                "row pass, GEMM summed otherwise": on_gemm(exact_model, y_other.to(dtype).double()).to(dtype),
                "eager, split-K added in the dtype": on_gemm(model, y_reduced),
                "row pass, split-K added in the dtype": on_gemm(exact_model, y_reduced.double()).to(dtype),
            }
            for name, out in results.items():
                counts[name] = counts.get(name, 0) + breaks(out, eager, exact)
    return counts


def row_arguments(draws: int) -> argparse.Namespace:
    """A suite row's id and --batch (rows), --draws and --dtype (this script's and
    tests/gpu/rule_diagnose.py's command line)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--draws", type=int, default=draws)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    return parser.parse_args()


def main() -> int:
    args = row_arguments(draws=6)
    try:
        counts = rule_counts(args.row, args.batch, args.draws, DTYPES[args.dtype])
    except ValueError as error:
        raise SystemExit(str(error)) from None
    n = suite.load(suite.get_row(args.row)).get_init_inputs("full")[1]
    elements = args.draws * args.batch * n
    print(f"{args.row} at {args.batch} rows, {args.dtype}, {args.draws} draws ({elements} elements): "
          "elements breaking the rule")
    for name, count in counts.items():
        print(f"  {name:38} {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
