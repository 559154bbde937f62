"""Activations of the user's own: ``fxfuse.register_activation(target, expression)``.

An op Dynamo keeps as one call (a torch.library custom op, a builtin torch function fxfuse does not
spell) ends a chain until its expression over the pointwise vocabulary is registered; then it fuses,
its values and gradient are the expression's, and the chain goes on after it.
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn

import fxfuse
from fxfuse.patterns import activations
from fxfuse.patterns.activations import fn
from support import check_against_eager, compile_fxfuse

K, N = 24, 32


@torch.library.custom_op("fxfuse_tests::quick_gelu", mutates_args=())
def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


@quick_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _quick_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _quick_gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(1.702 * x)
    return grad * (s + 1.702 * x * s * (1 - s))


quick_gelu.register_autograd(_quick_gelu_backward, setup_context=_quick_gelu_setup)


class QuickGeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return torch.ops.fxfuse_tests.quick_gelu(self.proj(x)) * 2.0


class Erfc(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return torch.erfc(self.proj(x)) + 1.0


@pytest.fixture
def registry(monkeypatch):
    """Registrations made by a test end with it (and so do graphs compiled under them)."""
    from fxfuse import patterns

    monkeypatch.setattr(activations, "SPELLINGS", [])
    patterns.reset_table()
    torch._dynamo.reset()
    yield
    patterns.reset_table()
    torch._dynamo.reset()


def _fused_ops(report: fxfuse.Report) -> list[list[str]]:
    return [row.fused for row in report.rows if row.status != "not_fused"]


def test_an_unregistered_custom_op_ends_the_chain(registry):
    report = check_against_eager(QuickGeluMLP, lambda: [torch.randn(4, K)], train=False)
    assert _fused_ops(report) == []
    assert "quick_gelu" in str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_registered_custom_op_fuses_with_its_expression(registry, dtype):
    fxfuse.register_activation(torch.ops.fxfuse_tests.quick_gelu, lambda x: x * fn.sigmoid(1.702 * x))
    report = check_against_eager(QuickGeluMLP, lambda: [torch.randn(2, 8, K)], dtype=dtype, grads=True)
    assert len(_fused_ops(report)) == 1 and len(_fused_ops(report)[0]) == 3  # linear, quick_gelu, mul


def test_a_builtin_torch_function_fxfuse_does_not_spell_can_be_registered(registry):
    fxfuse.register_activation(torch.erfc, lambda x: 1.0 - fn.erf(x))
    report = check_against_eager(Erfc, lambda: [torch.randn(4, K)], grads=True)
    assert len(_fused_ops(report)) == 1 and len(_fused_ops(report)[0]) == 3


def test_the_program_holds_the_expression_not_the_op(registry):
    fxfuse.register_activation(torch.ops.fxfuse_tests.quick_gelu.default, lambda x: x * fn.sigmoid(1.702 * x))
    compiled = compile_fxfuse(QuickGeluMLP().eval())
    fxfuse.reset_report()
    with torch.no_grad():
        compiled(torch.randn(4, K))
    (row,) = [r for r in fxfuse.last_report().rows if r.status != "not_fused"]
    assert "sigmoid" in row.program and "quick_gelu" not in row.program


def test_a_registration_outside_the_vocabulary_is_refused(registry):
    with pytest.raises(ValueError, match="spelled already"):
        fxfuse.register_activation(torch.relu, lambda x: fn.relu(x))
    with pytest.raises(AttributeError, match="vocabulary"):
        fxfuse.register_activation(torch.erfc, lambda x: fn.digamma(x))
    with pytest.raises(ValueError, match="outside x"):
        fxfuse.register_activation(torch.erfc, lambda x: activations.Value(sympy.log(x.expr)))
    with pytest.raises(ValueError, match="not a value"):
        fxfuse.register_activation(torch.erfc, lambda x: 1.0)
    with pytest.raises(ValueError, match="string"):
        fxfuse.register_activation("erfc", lambda x: x)
    with pytest.raises(TypeError, match="takes 1 operand"):
        fxfuse.register_activation(torch.erfc, lambda x: fn.clamp(x, 0.0))
    assert activations.SPELLINGS == []
