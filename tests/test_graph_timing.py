"""The whole-graph check of policy "fastest" (fxfuse/graph_timing.py): where a graph's chains won a
selection against Inductor's kernels, the graph compiled with them fused is timed against
Inductor's compile of the graph as traced, and the faster one runs; the report says which.
The timing itself runs on the GPU (tests/gpu/test_graph_timing_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxfuse import backend, graph_timing
from fxfuse.cuda.engine import INDUCTOR, Selection
from fxfuse.cuda.timing import GRAPH_TIMING
from fxfuse.graph_timing import GraphTimes, worth_timing
from fxfuse.match import Decision
from support import captured
from test_policy import _residual_chain

WON = Selection("row", -1, {"row": 100.0, INDUCTOR: 120.0}, GRAPH_TIMING)  # Inductor's kernels lost


def test_the_fused_graph_is_slower_when_slower_by_either_measure():
    assert not GraphTimes(100.0, 100.0, 110.0, 110.0).fused_is_slower
    assert GraphTimes(101.0, 100.0, 100.0, 110.0).fused_is_slower  # GPU time
    assert GraphTimes(90.0, 100.0, 111.0, 110.0).fused_is_slower  # back-to-back launches


def test_only_graphs_with_a_measured_decision_on_the_gpu_are_timed():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.proj(x))

    gm, inputs = captured(Model(), torch.randn(4, 8))
    assert not worth_timing([_residual_chain(None)], gm.graph, inputs)  # decided by the rules
    assert not worth_timing([_residual_chain(WON)], gm.graph, inputs)  # CPU inputs: nothing to time


def _measuring(monkeypatch, tmp_path, times: GraphTimes) -> dict:
    """Timing returns ``times``; Inductor's compile of the traced graph returns a name; the
    measurements are kept under ``tmp_path``. Counts both."""
    calls = {"timed": 0, "compiled": 0}

    def timed(fused, inductor, inputs):
        calls["timed"] += 1
        return times

    def compiled(gm, inputs, mode, options):
        calls["compiled"] += 1
        return "inductor's graph"

    monkeypatch.setattr(graph_timing, "time_both", timed)
    monkeypatch.setattr(graph_timing, "_timing_file", lambda traced, rewritten, inputs: tmp_path / "graph.json")
    monkeypatch.setattr(backend, "_compiled", compiled)
    return calls


def _decide(monkeypatch, tmp_path, times: GraphTimes):
    chain = _residual_chain(WON)
    _measuring(monkeypatch, tmp_path, times)
    return chain, backend._faster_of("fxfuse's graph", [chain], gm=None, fused=None, example_inputs=[])


def test_where_inductors_whole_graph_is_faster_it_runs_and_the_chains_say_why(monkeypatch, tmp_path):
    chain, (compiled, (row,)) = _decide(monkeypatch, tmp_path, GraphTimes(3412.0, 3397.0, 3500.0, 3300.0))
    assert compiled == "inductor's graph"
    assert row.status == "not_fused" and row.fusion is None and row.decision is None
    assert row.reason.startswith("Inductor's compile of the whole graph is faster")
    assert "fxfuse 3412.0 us GPU time" in row.reason and "policy='always' fuses it" in row.reason


def test_where_the_fused_graph_is_not_slower_it_runs_and_its_path_shows_both_times(monkeypatch, tmp_path):
    chain, (compiled, (row,)) = _decide(monkeypatch, tmp_path, GraphTimes(3000.0, 3397.0, 3100.0, 3300.0))
    assert compiled == "fxfuse's graph"
    assert row.status == "fused" and row.fusion is chain.fusion
    assert row.path == f"{WON.describe()}; whole graph: fxfuse 3000.0 us GPU time, 3100.0 us per launched " \
                       "call; Inductor alone 3397.0 / 3300.0 us"


@pytest.mark.parametrize("fused_wins", [True, False], ids=["fused_wins", "inductor_wins"])
def test_a_graph_is_timed_once_later_compiles_read_the_measurement(monkeypatch, tmp_path, fused_wins):
    """The first compile compiles Inductor's graph and times both; a later one of the same graph
    reads the times back and compiles Inductor's graph only where it is the one to run."""
    times = GraphTimes(1.0, 2.0, 1.0, 2.0) if fused_wins else GraphTimes(2.0, 1.0, 2.0, 1.0)
    calls = _measuring(monkeypatch, tmp_path, times)
    first = backend._faster_of("fxfuse's graph", [_residual_chain(WON)], gm=None, fused=None, example_inputs=[])
    assert calls == {"timed": 1, "compiled": 1}
    again = backend._faster_of("fxfuse's graph", [_residual_chain(WON)], gm=None, fused=None, example_inputs=[])
    assert calls == {"timed": 1, "compiled": 1 if fused_wins else 2}
    assert again[0] == first[0] == ("fxfuse's graph" if fused_wins else "inductor's graph")
    assert [c.reason for c in again[1]] == [c.reason for c in first[1]]


def test_a_graph_that_cannot_be_timed_keeps_the_chains_measurements(monkeypatch, tmp_path):
    chain = _residual_chain(WON)

    def broken(fused, inductor, inputs):
        raise RuntimeError("capture failed")

    _measuring(monkeypatch, tmp_path, GraphTimes(1.0, 2.0, 1.0, 2.0))
    monkeypatch.setattr(graph_timing, "time_both", broken)
    compiled, chains = backend._faster_of("fxfuse's graph", [chain], gm=None, fused=None, example_inputs=[])
    assert compiled == "fxfuse's graph" and chains == [chain]
    assert isinstance(chain.decision, Decision)


@pytest.mark.parametrize("winner", ["inductor", "fused"])
def test_both_compiled_graphs_run_on_the_compiles_inputs_and_either_serves_the_model(monkeypatch, tmp_path, winner):
    """The two compiles of one graph (fused, and Inductor's of the graph as traced) both run on
    the example inputs the timing uses, agree, and whichever is returned serves later calls."""
    def timed(fused, inductor, inputs):
        a, b = graph_timing._caller(fused, inputs)(), graph_timing._caller(inductor, inputs)()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return GraphTimes(1.0, 2.0, 1.0, 2.0) if winner == "fused" else GraphTimes(2.0, 1.0, 2.0, 1.0)

    monkeypatch.setattr(graph_timing, "time_both", timed)
    monkeypatch.setattr(graph_timing, "_timing_file", lambda traced, rewritten, inputs: tmp_path / "graph.json")

    def fxfuse_timed_whole(gm, example_inputs):
        fused, chains = backend.fuse_chains(gm, allow_cpu=True, policy="always", example_inputs=example_inputs)
        compiled, chains = backend._faster_of(backend._compiled(fused, example_inputs, None, {}), chains, gm,
                                              fused, example_inputs)
        seen["rows"] = chains
        return compiled

    seen = {}
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
    compiled = torch.compile(model, backend=fxfuse_timed_whole)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert [c.status for c in seen["rows"]] == (["fused", "not_fused"] if winner == "fused" else ["not_fused"] * 2)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_graph_with_dropout_in_training_draws_random_numbers_in_eval_it_does_not(train):
    """Timing a graph runs it many times: one that draws random numbers (a dropout in training,
    fused or not: its node is in the traced graph) is not timed."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train(train)
    gm, _ = captured(model, torch.randn(4, 8))
    assert any(graph_timing._draws_random_numbers(n) for n in gm.graph.nodes) is train
