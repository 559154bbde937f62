"""The fused op, ``torch.ops.fxfuse.linear_epilogue``, and its backward.

One schema serves every program: the program's string form is the first argument, so a compiled
graph (or a cached one, in another process) needs nothing registered beyond this module. The CPU
kernel is the reference; CUDA calls go to fxfuse.cuda (its runtime module registers a C++ kernel
for the CUDA key once loaded); the fake kernel derives shapes from the Program, so batch dims may be
symbolic. The op returns ``(out, batch_stats)``: batch_stats is the (2, N) float32 mean and unbiased
variance of a training-mode BatchNorm stage, which the rewritten graph folds into the running
statistics with ordinary ops (empty when the program has no such stage).
"""

from __future__ import annotations

import torch

from . import reference
from .ir import Program

Tensor = torch.Tensor


@torch.library.custom_op("fxfuse::linear_epilogue", mutates_args=())
def linear_epilogue(
    program: str, x: Tensor, weight: Tensor, bias: Tensor | None, params: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """``program``'s chain applied to ``x @ weight.T + bias``."""
    if x.is_cuda:  # until the CUDA runtime registers its C++ kernel for this op
        from . import cuda

        return cuda.engine.call(program, x, weight, bias, params)
    return reference.forward(Program.parse(program), x, weight, bias, params)


@linear_epilogue.register_fake
def _linear_epilogue_fake(program, x, weight, bias, params):
    prog = Program.parse(program)
    n = weight.shape[0]
    out = x.new_empty(prog.output_shape(tuple(x.shape[:-1]), n))
    stats_shape = (2, n) if prog.batch_norm_training else reference.EMPTY_STATS_SHAPE
    return out, x.new_empty(stats_shape, dtype=torch.float32)


@torch.library.custom_op("fxfuse::linear_epilogue_backward", mutates_args=())
def linear_epilogue_backward(
    program: str,
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    params: list[Tensor],
) -> list[Tensor]:
    """Gradients for ``[x, weight, bias, *params]`` (empty where there is none)."""
    return reference.backward(Program.parse(program), grad_out, x, weight, bias, params)


@linear_epilogue_backward.register_fake
def _linear_epilogue_backward_fake(program, grad_out, x, weight, bias, params):
    constant = {3 + i for i in Program.parse(program).constant_params}
    return [
        torch.empty_like(t)
        if t is not None and t.is_floating_point() and i not in constant
        else grad_out.new_empty((0,))
        for i, t in enumerate((x, weight, bias, *params))
    ]


def _setup_context(ctx, inputs, output):
    program, x, weight, bias, params = inputs
    ctx.program = program
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias if bias is not None else x.new_empty((0,)), *params)


def _backward(ctx, grad_out, grad_stats):
    x, weight, bias, *params = ctx.saved_tensors
    bias = bias if ctx.has_bias else None
    grads = linear_epilogue_backward(ctx.program, grad_out.contiguous(), x, weight, bias, params)
    constant = Program.parse(ctx.program).constant_params
    dx, dweight, dbias, *dparams = grads
    dparams = [None if i in constant else g for i, g in enumerate(dparams)]
    return None, dx, dweight, dbias if ctx.has_bias else None, dparams


linear_epilogue.register_autograd(_backward, setup_context=_setup_context)


def autograd_implementation():
    """The op's autograd kernel as torch.library builds it from the registration above,
    ``(keyset, program, x, weight, bias, params) -> (out, batch_stats)``. The CUDA runtime serves
    the AutogradCUDA key in C++ and calls this only when a backward node must be recorded, so a
    compiled graph's calls run no Python (a private torch API: the caller keeps the Python path if
    it is missing)."""
    from torch._library.autograd import make_autograd_impl

    return make_autograd_impl(linear_epilogue._opoverload, linear_epilogue)

