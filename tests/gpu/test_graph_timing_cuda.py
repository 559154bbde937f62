"""Policy "fastest" on the GPU: a graph whose chains won their selection against Inductor's kernels
is timed whole, fused and as Inductor alone compiles it; whichever runs computes eager's values,
and every fused row's path (or every unfused row's reason) gives both graphs' times."""

from __future__ import annotations

import pytest
import torch

import fxfuse
from examples import suite
from support import assert_under_rule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_s26_runs_the_faster_whole_graph_and_the_report_says_which():
    torch.manual_seed(0)
    mod = suite.load("S26")
    dims = dict(batch=2, seq_len=512, hidden=1024, ffn=2816)
    model = mod.Model(dims["hidden"], dims["ffn"]).cuda().to(torch.bfloat16).eval()
    x = torch.rand(dims["batch"], dims["seq_len"], dims["hidden"], device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    fxfuse.reset_report()
    with torch.no_grad():
        out = torch.compile(model, backend="fxfuse")(x)
        eager = model(x)
        exact = model.double()(x.double())
    assert_under_rule(out, eager, exact, 1e-2)
    rows = fxfuse.last_report().rows
    kept = [r for r in rows if r.status == "fused" and r.path]  # the ops' rows (a second GEMM's has no path)
    left = [r for r in rows if (r.reason or "").startswith("Inductor's compile of the whole graph is faster")]
    assert bool(kept) != bool(left), [(r.status, r.reason, r.path) for r in rows]
    assert all("; whole graph: fxfuse " in r.path for r in kept)
