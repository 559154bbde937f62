"""Why a fused chain's low-precision output breaks the correctness rule (a script).

    python tests/gpu/rule_diagnose.py S04 [--batch 16] [--draws 5] [--dtype bf16]

A suite row at full size (``--batch`` rows instead of the row's own), compiled with fxfuse's
policy "always", against eager and the model in float64, on fresh inputs. Prints:

- the path the selection took (the report's path column);
- whether eager repeats itself: ``F.linear`` and the whole model called twice on one input, bit
  for bit (a GEMM whose split-K order varies makes eager fail the rule against itself);
- the row path's GEMM output (the op's saved GEMM) against eager's ``F.linear``, bit for bit;
- per path (the row path, each kernel of the GEMM module): elements equal to eager's, elements that
  break the rule, the largest distance to the float64 model beside eager's;
- a control: eager's own chain on a GEMM summed in another order (float32 inputs, rounded once),
  under the rule against eager: what the rule makes of eager's own noise;
- for a group norm chain, the (row, group)s where the row path departs from eager, and whether
  eager's statistics (``native_group_norm`` on the same GEMM output) explain the departure.

Tells a wrong kernel (one path far from the float64 model) from rounding that the element-wise
rule cannot absorb (every path, eager's control included, as far from it as eager).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse  # noqa: E402
import fxfuse.cuda as fxcuda  # noqa: E402
from bench.rule_model import DTYPES, TOL, on_gemm, row_arguments, the_linear  # noqa: E402
from examples import suite  # noqa: E402
from fxfuse.accuracy import rule_breaks  # noqa: E402
from fxfuse.canonicalize import canonicalize  # noqa: E402
from fxfuse.example_values import values_on_example_inputs  # noqa: E402
from fxfuse.ir import Program  # noqa: E402
from fxfuse.match import match_all  # noqa: E402
from gemm_harness import SCHEDULES, param_dtypes  # noqa: E402
from support import captured  # noqa: E402


def chain_operands(model: torch.nn.Module, x: torch.Tensor):
    """(program text, weight, bias, params) of the model's one fused chain, as the op receives them."""
    gm, inputs = captured(model, x)
    matched = match_all(gm.graph, canonicalize(gm.graph), allow_cpu=x.device.type == "cpu")
    chains = [c for c in matched if c.program is not None]
    assert len(chains) == 1, f"{len(chains)} fused chains; this script takes models with one"
    fusion = chains[0].fusion
    operands = [fusion.weight, fusion.bias, *fusion.params]
    values = values_on_example_inputs(gm.graph, gm, inputs, {n for n in operands if n is not None})
    weight, bias, *params = [None if n is None else values[n] for n in operands]
    return fusion.program.to_string(), weight, bias, params


def describe(name: str, out, eager, exact) -> None:
    bad = rule_breaks(out, eager, exact, TOL)
    equal = (out == eager).double().mean().item()
    mine, eagers = (out.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
    print(f"  {name:44} equal to eager {equal:7.4f}  break the rule {int(bad.sum()):5d}  "
          f"max |out - f64| {mine:.4f}  (eager's {eagers:.4f})")


def group_departures(model, y, out, eager_out) -> None:
    """Where the row path's output departs from eager's, per (row, group), and which statistics
    reproduce the row path's values there: eager's (``native_group_norm`` of the same GEMM
    output), eager's with 1/std one step up or down in the dtype (a statistic rounded the other
    way), or float32 ones never rounded."""
    norm = next((m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)), None)
    if norm is None:
        return
    rows, n = y.shape
    groups = norm.num_groups
    differs = (out != eager_out).view(rows, groups, -1).any(-1)
    print(f"  (row, group)s where the row path differs from eager: {int(differs.sum())} of {rows * groups}")
    _, mean, rstd = torch.ops.aten.native_group_norm(y, None, None, rows, n, 1, groups, norm.eps)
    grouped = y.float().view(rows, groups, -1)
    var32, mean32 = torch.var_mean(grouped, dim=-1, correction=0)
    up = torch.nextafter(rstd, torch.full_like(rstd, float("inf")))
    down = torch.nextafter(rstd, torch.zeros_like(rstd))
    candidates = {"eager's statistics": (mean, rstd), "1/std a step up": (mean, up), "1/std a step down": (mean, down),
                  "float32 statistics": (mean32, torch.rsqrt(var32 + norm.eps))}
    mask = differs.view(rows, groups, 1).expand(rows, groups, n // groups).reshape(rows, n)
    for name, (m, r) in candidates.items():
        got = with_statistics(model, norm, y, m, r)
        same = (got == out)[mask].double().mean().item() if mask.any() else float("nan")
        print(f"    {name:20} ({m.dtype}): equal to the row path in those groups {same:.3f}, "
              f"to eager everywhere {(got == eager_out).double().mean().item():.4f}")


def with_statistics(model, norm: torch.nn.GroupNorm, y: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """The model's chain on the GEMM output ``y`` with its group norm normalizing by the given
    statistics, as eager's kernel computes it: (y - mean) * rstd * weight + bias in float32."""

    def forward(t: torch.Tensor) -> torch.Tensor:
        rows, n = t.shape
        grouped = t.float().view(rows, norm.num_groups, -1)
        z = (grouped - mean.float().view(rows, -1, 1)) * rstd.float().view(rows, -1, 1)
        return torch.addcmul(norm.bias.float(), z.view(rows, n), norm.weight.float()).to(t.dtype)

    norm.forward = forward
    try:
        return on_gemm(model, y)
    finally:
        del norm.forward


def main() -> int:
    args = row_arguments(draws=5)
    torch.set_grad_enabled(False)  # forward calls only (the compiled model's guards see the same)
    dtype = DTYPES[args.dtype]
    mod = suite.load(suite.get_row(args.row))
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs("full")).cuda().to(dtype)
    exact_model = copy.deepcopy(model).double()
    fused = torch.compile(copy.deepcopy(model), backend="fxfuse", options={"policy": "always"})
    k = mod.get_init_inputs("full")[0]
    x = torch.rand(args.batch, k, device="cuda").to(dtype)
    fused(x)
    print(fxfuse.last_report())
    program, weight, bias, params = chain_operands(model, x)
    parsed = Program.parse(program)
    module = fxcuda.engine.prepare_gemm(parsed, dtype, param_dtypes(parsed, dtype), x.device)
    configs = [] if module is None else [c for c in range(0, len(module.config_names), SCHEDULES)
                                         if module.supports(args.batch, weight.shape[0], k, c)]
    for draw in range(args.draws):
        x = torch.rand(args.batch, k, device="cuda").to(dtype)
        eager, again, out = model(x), model(x), fused(x)
        exact = exact_model(x.double())
        y, y_again = F.linear(x, weight, bias), F.linear(x, weight, bias)
        row = fxcuda.engine.forward_kernels(program, x, weight, bias, params, save_gemm=True)
        other_order = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
        same_gemm = None if row is None else torch.equal(row[2], y)
        print(f"draw {draw}: eager repeats itself: F.linear {torch.equal(y, y_again)}, "
              f"the model {torch.equal(eager, again)}; the row path's GEMM output equals F.linear's: {same_gemm}")
        describe("the compiled model (the selection's path)", out, eager, exact)
        if row is not None:
            describe("the row path", row[0], eager, exact)
        for config in configs:
            got = fxcuda.engine.forward_kernels(program, x, weight, bias, params, gemm=module, config=config)
            describe(f"in-GEMM {module.config_names[config]}", got[0], eager, exact)
        control = on_gemm(model, other_order) if the_linear(model) is not None else None
        if control is not None:
            describe("control: eager's chain on a GEMM summed otherwise", control, eager, exact)
        if row is not None:
            group_departures(model, y, row[0], eager)
    return 0


if __name__ == "__main__":
    sys.exit(main())
