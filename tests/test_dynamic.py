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


def _one_dynamic_graph_for_every_batch(model: torch.nn.Module):
    """``model`` compiled with ``dynamic=True``, equal to eager at batches of 8, 17 and 64 from one
    graph (the report reset before it)."""
    fxfuse.reset_report()
    compiled = compile_fxfuse(model, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for batch in (8, 17, 64):
        x = torch.randn(batch, K)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 1
    return compiled


class Scaled(torch.nn.Module):
    """An epilogue whose constants are the module's float attributes."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(K, 32)
        self.divisor, self.slope = 10.0, 0.2

    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.linear(x) / self.divisor, self.slope)


def test_under_dynamic_true_float_attributes_are_compiled_in_and_a_new_value_compiles_again():
    """``dynamic=True`` makes a module's floats graph inputs; the epilogue reads their values (the
    graph guards on them) while the batch stays symbolic: one graph serves every size, and a new
    value compiles again and is used."""
    model = Scaled()
    compiled = _one_dynamic_graph_for_every_batch(model)
    assert [r.status for r in fxfuse.last_report().rows] == ["fused"]
    fxfuse.reset_report()
    model.divisor = 3.0
    x = torch.randn(5, K)
    torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 2
    assert [r.status for r in fxfuse.last_report().rows] == ["fused"]


class SlopeOfTheBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(K, 32)

    def forward(self, x):
        return torch.nn.functional.leaky_relu(torch.relu(self.linear(x)), 1.0 / x.shape[0])


def test_a_constant_computed_from_the_batch_size_stays_symbolic_and_only_its_op_is_left_unfused():
    """A LeakyReLU slope of 1 / batch is no constant of the kernel: its op ends the chain, with the
    reason in the report, the GEMM and ReLU before it still fuse, and the graph still serves every
    batch size (the size is not specialized)."""
    _one_dynamic_graph_for_every_batch(SlopeOfTheBatch())
    (row,) = fxfuse.last_report().rows
    assert row.fused == ["linear", "relu"]
    assert "computed in the graph where a number is expected" in row.reason


def test_a_float_seen_to_change_between_calls_stays_symbolic_and_ends_the_chain_without_recompiles():
    """Without ``dynamic=True`` Dynamo makes a float symbolic once it changed: a scale passed to
    every call. Compiling its value in would compile again for every value; it stays an input,
    its op ends the chain (with the reason), and later values run the same graph."""

    class ScaledByCall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(K, 32)

        def forward(self, x, scale: float):
            return torch.relu(self.linear(x)) * scale

    model = ScaledByCall()
    compiled = compile_fxfuse(model)
    torch._dynamo.utils.counters.clear()
    x = torch.randn(8, K)
    fxfuse.reset_report()
    for scale in (0.5, 1.5, 2.5, 3.5):
        torch.testing.assert_close(compiled(x, scale), model(x, scale), atol=1e-4, rtol=1e-4)
    assert _counting_frames() == 2  # the first value static, then one graph for every value
    static, symbolic = fxfuse.last_report().rows
    assert static.fused == ["linear", "relu", "mul(0.5)"]
    assert symbolic.fused == ["linear", "relu"] and "symbolic scalar" in symbolic.reason


def test_a_restart_dynamo_asks_for_during_fusion_is_passed_on_not_taken_for_a_failure(monkeypatch):
    """Dynamo asks for its trace again by raising (as when a float it left symbolic was read as a
    number): fxfuse passes that on instead of skipping fusion for the graph, and the graph traced
    again fuses."""
    import warnings

    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    from fxfuse import backend

    real, asked = backend.canonicalize, []

    def restarting_once(graph):
        if not asked:
            asked.append(True)
            raise TensorifyScalarRestartAnalysis
        return real(graph)

    monkeypatch.setattr(backend, "canonicalize", restarting_once)
    model = Chain(lambda m, y: torch.relu(y) * m.vector)
    fxfuse.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "fusion skipped for this graph" would raise
        x = torch.randn(8, K)
        torch.testing.assert_close(compile_fxfuse(model)(x), model(x), atol=1e-4, rtol=1e-4)
    assert asked and [r.status for r in fxfuse.last_report().rows] == ["fused"]
