"""A model compiled once serves other batch sizes without recompiling."""

import torch

import fxfuse
from support import compile_fxfuse
from test_spellings import Chain, K


def _counting_frames():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_marked_dynamic_batch_runs_8_17_64_without_recompile():
    model = Chain(lambda m, y: torch.logsumexp(torch.nn.functional.group_norm(y * 2.0, 4), 1))
    compiled = compile_fxfuse(model)
    torch._dynamo.utils.counters.clear()
    for batch in (8, 17, 64):
        x = torch.randn(batch, K)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 1
    assert [r.status for r in fxfuse.last_report().rows] == ["fused"]


def test_automatic_dynamic_after_the_first_change_recompiles_once():
    model = Chain(lambda m, y: torch.relu(y) * m.vector)
    compiled = compile_fxfuse(model)
    torch._dynamo.utils.counters.clear()
    for batch in (8, 17, 64, 33):
        x = torch.randn(batch, K)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 2  # static 8, then one dynamic graph for the rest
    assert all(r.status == "fused" for r in fxfuse.last_report().rows)
