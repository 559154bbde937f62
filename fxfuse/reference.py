"""The reference implementation of a Program in plain torch ops.

It is the fused op's CPU kernel and the oracle of the CUDA kernels: the GEMM in the input dtype (as
cuBLAS returns it), then the epilogue in eager's opmath type (float32; float64 for float64 inputs,
which gradcheck uses) with the rounding points the IR marks (where eager rounds), norms computed as eager computes them for the input dtype. Each vocabulary function and
norm is eager PyTorch's own function, so NaN/Inf behaviour and errors (a training-mode BatchNorm
over one row, say) are eager's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import expr as E
from .ir import Norm, Pointwise, Program, Reduce

EMPTY_STATS_SHAPE = (0,)


def forward(
    program: Program,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    params: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out, batch_stats)``; batch_stats is ``(2, N)`` float32 (mean, unbiased variance)
    of the batch-norm stage in training mode, else an empty tensor."""
    y = F.linear(x, weight, bias)
    out_dtype = y.dtype
    n = weight.shape[0]
    opmath = torch.float64 if out_dtype == torch.float64 else torch.float32
    values = [
        p.to(opmath).reshape(n) if kind == "col" else p.to(opmath).reshape(())
        for p, kind in zip(params, program.params)
    ]
    stats = y.new_empty(EMPTY_STATS_SHAPE, dtype=torch.float32)
    v = y.to(opmath)
    for stage in program.stages:
        if isinstance(stage, Pointwise):
            v = _pointwise(stage, v, values)
        elif isinstance(stage, Norm):
            v, batch_stats = _norm(stage, v, list(params), out_dtype)
            if batch_stats is not None:
                stats = batch_stats
        else:
            v = _reduce(stage, v)
    return v.to(out_dtype), stats


def _pointwise(stage: Pointwise, v: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    def symbol(s):
        return v if s == E.X else values[E.param_index(s)]

    result = E.evaluate(stage.expr, symbol, lambda fn, args: fn.row.reference(*args))
    if not isinstance(result, torch.Tensor):  # an expression without x (never matched, but total)
        result = torch.full_like(v, result)
    return result.expand_as(v) if result.shape != v.shape else result


def _norm(stage: Norm, v: torch.Tensor, params: list[torch.Tensor], dtype: torch.dtype):
    """The norm as eager computes it for a ``dtype`` input (its input is already rounded to
    ``dtype`` at this point, so this is eager's own arithmetic), returned in ``v``'s dtype."""
    n = v.shape[-1]

    def p(index):
        return None if index is None else params[index].reshape(n)

    x = v.to(dtype)
    weight, bias = p(stage.weight), p(stage.bias)
    if stage.kind == "group":
        out = F.group_norm(x, stage.groups, weight, bias, stage.eps)
    elif stage.kind == "layer":
        out = F.layer_norm(x, (n,), weight, bias, stage.eps)
    elif stage.kind == "rms":
        out = F.rms_norm(x, (n,), weight, stage.eps)
    elif not stage.training:
        running = p(stage.running_mean), p(stage.running_var)
        out = F.batch_norm(x, *running, weight, bias, False, 0.0, stage.eps)
    else:
        out = F.batch_norm(x, None, None, weight, bias, True, 0.0, stage.eps)
        with torch.no_grad():
            var, mean = torch.var_mean(v.detach(), dim=0, correction=1)
        return out.to(v.dtype), torch.stack([mean, var]).float()
    return out.to(v.dtype), None


def _reduce(stage: Reduce, v: torch.Tensor) -> torch.Tensor:
    k = stage.keepdim
    if stage.kind == "sum":
        return v.sum(-1, keepdim=k)
    if stage.kind == "mean":
        return v.mean(-1, keepdim=k)
    if stage.kind == "max":
        return v.amax(-1, keepdim=k)
    if stage.kind == "min":
        return v.amin(-1, keepdim=k)
    if stage.kind == "logsumexp":
        return torch.logsumexp(v, -1, keepdim=k)
    if stage.kind == "softmax":
        return F.softmax(v, -1)
    return F.log_softmax(v, -1)


def backward(
    program: Program,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    params: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Gradients of ``forward``'s output for x, weight, bias and every parameter, by recomputing
    the reference under autograd. Absent, non-float or constant inputs get an empty tensor."""
    inputs = [x, weight, bias, *params]
    constant = {3 + i for i in program.constant_params}
    with _autograd_inside_kernel(), torch.enable_grad():
        leaves = [
            None if t is None else t.detach().requires_grad_(t.is_floating_point() and i not in constant)
            for i, t in enumerate(inputs)
        ]
        out, _ = forward(program, leaves[0], leaves[1], leaves[2], leaves[3:])
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
    result = []
    for t in leaves:
        if t is None or not t.requires_grad:
            result.append(grad_out.new_empty((0,)))
            continue
        g = next(grads)
        result.append(torch.zeros_like(t) if g is None else g)
    return result


_AUTOCAST_KEYS = [k for name, k in torch._C.DispatchKey.__members__.items() if name.startswith("Autocast")]


@contextlib.contextmanager
def _autograd_inside_kernel():
    """A kernel runs below the Autograd dispatch key; the reference backward needs autograd back.
    Autocast stays excluded, so nothing inside is re-cast."""
    exclude = torch._C.DispatchKeySet(_AUTOCAST_KEYS[0])
    for key in _AUTOCAST_KEYS[1:]:
        exclude = exclude | torch._C.DispatchKeySet(key)
    with torch._C._ForceDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect), exclude):
        yield
