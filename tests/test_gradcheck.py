"""The fused op's gradients (the reference backward) against finite differences, in float64.

Every stage kind of the IR — pointwise expressions over every vocabulary function, group / layer /
RMS / batch norms (training and eval), dropout (its mask fixed by the seed), row reductions (sum, mean, max, min, logsumexp, softmax,
log_softmax) and pointwise ops after them — through ``torch.autograd.gradcheck`` on x, weight, bias
and every parameter that has a gradient (running statistics have none, as in eager). The rounding
rows (bf16 / fp16) are left out: a cast is a step function whose gradient eager defines as 1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the shared program table

import fxfuse.op  # noqa: E402,F401 - defines torch.ops.fxfuse.linear_epilogue
from fxfuse.ir import Norm, Rotary  # noqa: E402
from fxfuse.vocabulary import POINTWISE, ROUNDING  # noqa: E402
from programs import PROGRAMS, TRACED_IN_BF16, make_params, vocabulary_program  # noqa: E402

CASES = {name: p for name, p in PROGRAMS.items() if not name.startswith("vocabulary_") and name not in TRACED_IN_BF16}
CASES["vocabulary"] = vocabulary_program([name for name in POINTWISE if name not in ROUNDING.values()])


def columns(program) -> int:
    """A row width every group norm and every rotary embedding's heads of ``program`` divide."""
    groups = [s.groups for s in program.stages if isinstance(s, Norm) and s.kind == "group"]
    width = 40 if 5 in groups else 16
    for stage in program.stages:
        if isinstance(stage, Rotary):
            width = math.lcm(width, stage.head_dim)
    return width


@pytest.mark.parametrize("generated", [False, True], ids=["autograd", "generated_backward_op"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_finite_differences(name, generated, monkeypatch):
    """``generated``: through fxfuse::epilogue_backward where the program has one (pointwise and
    norm programs)."""
    if generated:
        monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", "1")
    program = CASES[name]
    text = program.to_string()
    g = torch.Generator().manual_seed(0)
    n = columns(program)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(n, 5, generator=g, dtype=torch.float64) / 2).requires_grad_()
    b = torch.randn(n, generator=g, dtype=torch.float64).requires_grad_() if program.gemm.bias else None
    params = [p.double().requires_grad_(i not in program.constant_params) if p.is_floating_point() else p
              for i, p in enumerate(make_params(program, n, generator=g, lead=(6,), k=5))]  # a dropout's seed: as is

    def fused(x, w, b, *params):
        return torch.ops.fxfuse.linear_epilogue(text, x, w, b, list(params), True)[0]

    assert torch.autograd.gradcheck(fused, (x, w, b, *params), eps=1e-6, atol=1e-5, rtol=1e-4)
