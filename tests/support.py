"""Helpers for the CPU tests: compile with fxfuse on the CPU and compare with eager."""

from __future__ import annotations

import copy
from typing import Callable

import torch

import fxfuse
from fxfuse.accuracy import rule_breaks

TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def compile_fxfuse(model: torch.nn.Module, mode: str | None = None, dynamic: bool | None = None, **options):
    """fxfuse with the reference kernel on CPU, and every chain fused (policy "always"): the tests
    specify what fusion does, also where the default policy would leave a chain to Inductor.
    With a ``mode`` the options are fxfuse's defaults: torch.compile takes a mode or options.
    ``dynamic`` is torch.compile's."""
    if mode is not None:
        return torch.compile(model, backend="fxfuse", mode=mode, dynamic=dynamic)
    return torch.compile(model, backend="fxfuse", dynamic=dynamic,
                         options={"allow_cpu": True, "policy": "always", **options})


def captured(model: torch.nn.Module, *inputs) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of ``model`` and the example inputs it hands a backend."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    return seen["gm"], seen["inputs"]


def check_against_eager(
    make_model: Callable[[], torch.nn.Module],
    make_inputs: Callable[[], list],
    *,
    dtype: torch.dtype = torch.float32,
    draws: int = 5,
    train: bool = True,
    grads: bool = False,
    device: str = "cpu",
    autocast: torch.dtype | None = None,
    mode: str | None = None,
    dynamic: bool | None = None,
) -> fxfuse.Report:
    """Run eager and fxfuse side by side on ``draws`` fresh inputs; assert outputs, dtypes,
    buffers (BatchNorm statistics) and, with ``grads``, input and parameter gradients agree.
    Returns the coverage report of the compiled model. With ``autocast`` both run under
    ``torch.autocast(device, autocast)`` over a ``dtype`` model (the tolerance is autocast's);
    ``mode`` and ``dynamic`` are torch.compile's (the mode reaches Inductor).

    Low-precision results (bf16, fp16, autocast) are judged by the correctness rule against a
    float64 run of the same model (its low-precision parameters, widened): an output element
    agrees when it is within the tolerance of eager's or no further from the float64 value than
    eager's (``assert_under_rule``; fused chains compute in float32 and round once, where eager
    rounds after every op). A gradient agrees when it is within the tolerance of eager's, or --
    where rounding noise dominates it (a parameter a training BatchNorm nearly cancels: S07's
    scale, S18's bias) -- when it is off the float64 model's by no more than the tolerance or
    twice eager's own distance from it."""
    fxfuse.reset_report()
    eager = make_model().to(device=device, dtype=dtype).train(train)
    fused = copy.deepcopy(eager)
    compiled = compile_fxfuse(fused, mode=mode, dynamic=dynamic)
    tol = TOLERANCE[autocast or dtype]
    region = torch.autocast(device, dtype=autocast, enabled=autocast is not None)
    for _ in range(draws):
        inputs = [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                  for t in make_inputs()]
        eager_inputs = [t.clone().requires_grad_(grads and t.is_floating_point()) for t in inputs]
        fused_inputs = [t.clone().requires_grad_(grads and t.is_floating_point()) for t in inputs]
        rounded = (autocast or dtype) in (torch.bfloat16, torch.float16)
        exact = copy.deepcopy(eager).double() if rounded else None  # the float64 truth
        with torch.set_grad_enabled(grads), region:
            expected = outputs(eager(*eager_inputs))
            actual = outputs(compiled(*fused_inputs))
        assert len(actual) == len(expected)
        truths = outputs(_float64_output(exact, inputs)) if rounded else [None] * len(expected)
        for got, want, truth in zip(actual, expected, truths):
            assert got.dtype == want.dtype and got.shape == want.shape
            if rounded:
                assert_under_rule(got, want, truth, tol)
            else:
                torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)
        for (name, b1), (_, b2) in zip(eager.named_buffers(), fused.named_buffers()):
            torch.testing.assert_close(b2, b1, atol=tol, rtol=tol, msg=lambda m, name=name: f"buffer {name}: {m}")
        if grads:
            grad_out = [torch.randn_like(t) for t in expected]
            torch.autograd.backward(expected, grad_out)
            torch.autograd.backward(actual, grad_out)
            pairs = [(a.grad, b.grad, "input") for a, b in zip(eager_inputs, fused_inputs)]
            pairs += [(p1.grad, p2.grad, n) for (n, p1), p2 in zip(eager.named_parameters(), fused.parameters())]
            truths = _float64_gradients(exact, inputs, grad_out) if rounded else [None] * len(pairs)
            for (g1, g2, name), truth in zip(pairs, truths):
                scale = max(1.0, g1.abs().max().item()) if g1 is not None else 1.0
                _assert_agrees(g2, g1, tol * scale, tol, f"grad of {name}", None if truth is None else lambda t=truth: t)
            eager.zero_grad(set_to_none=True)
            fused.zero_grad(set_to_none=True)
    return fxfuse.last_report()


def outputs(value) -> list[torch.Tensor]:
    """A model's output as a list of tensors (a model may return a tuple: S27's h and norm(h))."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _assert_agrees(fused, eager, atol: float, rtol: float, what: str, truth: Callable[[], torch.Tensor] | None):
    """``fused`` equals ``eager`` within tolerance, or (given the float32 truth) is rounding noise
    around the same value as eager's (_no_further_from)."""
    try:
        torch.testing.assert_close(fused, eager, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        if truth is None or not _no_further_from(truth(), fused, eager, atol):
            raise


def assert_under_rule(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, tol: float) -> None:
    """The correctness rule, element by element (fxfuse.accuracy): within ``tol`` of eager's
    result, or no further from the float64 truth ``exact`` than eager's; NaN where eager has NaN,
    infinities equal."""
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert torch.equal(out.isnan(), eager.isnan()), "NaN positions differ from eager's"
    bad = rule_breaks(out, eager, exact, tol)
    o, e = out.double(), eager.double()
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. out {o[bad][:4].tolist()} eager {e[bad][:4].tolist()}"


def _float64_output(model: torch.nn.Module, inputs: list) -> torch.Tensor:
    """The float64 copy's output (no autocast), the truth a low-precision output rounds."""
    with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False):
        return model(*[t.double() if t.is_floating_point() else t for t in inputs])


def _float64_gradients(model: torch.nn.Module, inputs: list, grad_out: list[torch.Tensor]) -> list:
    """Gradients of input and parameters of the float64 copy, in check_against_eager's order."""
    xs = [t.double().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autocast(inputs[0].device.type, enabled=False):
        torch.autograd.backward(outputs(model(*xs)), [g.double() for g in grad_out])
    return [x.grad for x in xs] + [p.grad for p in model.parameters()]


def _no_further_from(truth: torch.Tensor, fused: torch.Tensor, eager: torch.Tensor, atol: float) -> bool:
    """The fused low-precision result is off the float32 one by at most ``atol`` or twice eager's
    own distance from it: both are rounding noise around the same value."""
    if fused is None or eager is None:
        return False
    eager_error = (eager.float() - truth).abs().max().item()
    return (fused.float() - truth).abs().max().item() <= max(atol, 2 * eager_error)
