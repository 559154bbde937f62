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



def test_automatic_dynamic_after_the_first_change_recompiles_once():
    model = Chain(lambda m, y: torch.relu(y) * m.vector)
    compiled = compile_fxfuse(model)
    torch._dynamo.utils.counters.clear()
    for batch in (8, 17, 64, 33):
        x = torch.randn(batch, K)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 2  # static 8, then one dynamic graph for the rest
    assert all(r.status == "fused" for r in fxfuse.last_report().rows)


def test_on_the_gpu_a_symbolic_batch_is_measured_at_its_traced_size_and_the_graph_serves_every_size(monkeypatch):
    """The GPU back end's build and selection see the size a symbolic batch was traced with (an
    int), and asking for it guards on nothing: the dynamic graph fuses and serves later sizes
    without a recompile. Here the back end is stood in for: the chains count as CUDA chains,
    nothing builds, and the selection records the shapes it is asked to time."""
    import warnings

    from fxfuse import backend, cuda

    timed = []

    def select(program, dtype, param_dtypes, shape, *args, **kwargs):
        timed.append(shape)
        return None  # no in-GEMM kernel: the row path serves

    monkeypatch.setattr(backend, "_on_cuda", lambda chain: chain.fusion is not None)
    monkeypatch.setattr(cuda, "prepare_many", lambda items, workers=None, gemm_items=(): {})
    monkeypatch.setattr(cuda, "select", select)
    model = Chain(lambda m, y: torch.relu(y) * m.vector).requires_grad_(False)  # inference: the GEMM is timed
    compiled = compile_fxfuse(model)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "fusion skipped for this graph" would raise
        for batch in (8, 17, 64, 33):
            x = torch.randn(batch, K)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 2  # static 8, then one dynamic graph for 17, 64 and 33
    assert [shape[0] for shape in timed] == [8, 17]
    assert all(type(size) is int for shape in timed for size in shape)
    assert all(r.status == "fused" for r in fxfuse.last_report().rows)
