"""What the backend hands to Inductor: the graph around the fused ops, and nothing when nothing is
left but fused ops of an inference graph (Inductor's wrapper would only add per-call CPU time). A
graph that records a backward always goes: Inductor compiles the fused ops' backward."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.compile_fx as inductor

from examples.suite import build
from support import compile_fxfuse


@pytest.fixture
def inductor_calls(monkeypatch):
    calls = []
    compile_fx = inductor.compile_fx

    def recording(gm, example_inputs, **kwargs):
        calls.append(gm)
        return compile_fx(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", recording)
    torch._dynamo.reset()
    return calls


def run(row_id: str, **options) -> None:
    torch.manual_seed(0)
    model, inputs = build(row_id, "small")
    expected = model(*inputs)
    actual = compile_fxfuse(model, **options)(*inputs)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("row_id", ["S01", "S11", "S20"])
def test_an_inference_graph_of_fused_ops_alone_skips_inductor(row_id, inductor_calls):
    with torch.no_grad():
        run(row_id)
    assert inductor_calls == []


@pytest.mark.parametrize("row_id", ["S03", "S19"], ids=["batch-norm-update", "unfused-gemm"])
def test_a_graph_with_other_ops_goes_to_inductor(row_id, inductor_calls):
    run(row_id)
    assert inductor_calls  # (compile_fx may re-enter itself)


def test_inductor_gets_dynamos_metadata_with_the_fused_graph(inductor_calls):
    """AOTAutograd reads Dynamo's compile id, parameter sources and placeholder sources off the
    graph: with them parameters and buffers are static inputs (CUDA graphs capture a graph that
    updates BatchNorm's running statistics)."""
    run("S03")
    gm = inductor_calls[0]
    assert "dynamo_compile_id" in gm.meta and hasattr(gm, "_param_name_to_source")
    assert all(hasattr(p, "_dynamo_source") for p in gm.graph.find_nodes(op="placeholder"))
    assert any(n.target is torch.ops.fxfuse.linear_epilogue.default for n in gm.graph.nodes)


def test_a_mode_or_an_option_for_inductor_always_reaches_it(inductor_calls):
    run("S01", max_autotune=False)
    assert inductor_calls  # (compile_fx may re-enter itself)


def test_a_training_graph_of_fused_ops_goes_to_inductor_and_trains(inductor_calls):
    torch.manual_seed(0)
    model, inputs = build("S01", "small")
    expected = model(inputs[0].clone().requires_grad_())
    expected.sum().backward()
    want = [model.linear.weight.grad.clone(), model.linear.bias.grad.clone()]
    model.zero_grad()
    x = inputs[0].clone().requires_grad_()
    compile_fxfuse(model)(x).sum().backward()
    assert inductor_calls
    for got, ref in zip([model.linear.weight.grad, model.linear.bias.grad], want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
