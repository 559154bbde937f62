"""The fused op, ``torch.ops.fxfuse.linear_epilogue``, and its backward.

One schema serves every program: the program's string form is the first argument, so a compiled
graph (or a cached one, in another process) needs nothing registered beyond this module. The CPU
kernel is the reference; CUDA calls go to fxfuse.cuda (its runtime module registers a C++ kernel
for the CUDA key once loaded); the fake kernel derives shapes from the Program, so batch dims may be
symbolic. The op returns ``(out, batch_stats, gemm)``: batch_stats is the (2, N) float32 mean and
unbiased variance of a training-mode BatchNorm stage, which the rewritten graph folds into the
running statistics with ordinary ops (empty when the program has no such stage); gemm is the GEMM
output when ``save_gemm`` asks for it (a graph that will run backward), else empty.

The backward is plain torch ops: dY by autograd through the reference epilogue recomputed from the
saved GEMM output, then dX = dY W, dW = dYᵀ X and db = Σ dY as eager's linear computes them. Under
torch.compile AOTAutograd traces it into the backward graph, so Inductor fuses the epilogue's
recompute and derivative into its kernels and runs the two GEMMs on cuBLAS.
"""

from __future__ import annotations

import torch

from . import reference
from .ir import Program

Tensor = torch.Tensor


@torch.library.custom_op("fxfuse::linear_epilogue", mutates_args=())
def linear_epilogue(
    program: str, x: Tensor, weight: Tensor, bias: Tensor | None, params: list[Tensor], save_gemm: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``program``'s chain applied to ``x @ weight.T + bias``; with ``save_gemm`` the GEMM output
    itself is returned too (third output, else empty), for the backward to start from."""
    if x.is_cuda:  # until the CUDA runtime registers its C++ kernel for this op
        from . import cuda

        return cuda.engine.call(program, x, weight, bias, params, save_gemm=save_gemm)
    return reference.op_forward(Program.parse(program), x, weight, bias, params, save_gemm)


@linear_epilogue.register_fake
def _linear_epilogue_fake(program, x, weight, bias, params, save_gemm):
    prog = Program.parse(program)
    n = weight.shape[0]
    out = x.new_empty(prog.output_shape(tuple(x.shape[:-1]), n))
    stats_shape = (2, n) if prog.batch_norm_training else reference.EMPTY_STATS_SHAPE
    gemm = x.new_empty((*x.shape[:-1], n) if save_gemm else (0,))
    return out, x.new_empty(stats_shape, dtype=torch.float32), gemm


def _setup_context(ctx, inputs, output):
    """Saves x and weight (for dX and dW, as eager's linear does), the parameters and the GEMM
    output when the op returned it (else the bias, to recompute it): nothing of the epilogue's
    intermediates, which the backward recomputes from the GEMM output."""
    program, x, weight, bias, params, save_gemm = inputs
    ctx.program = program
    ctx.has_bias = bias is not None
    gemm = output[2] if save_gemm else (bias if bias is not None else x.new_empty((0,)))
    ctx.gemm_saved = save_gemm
    ctx.save_for_backward(x, weight, gemm, *params)


def _backward(ctx, grad_out, grad_stats, grad_gemm):
    x, weight, saved, *params = ctx.saved_tensors
    if ctx.gemm_saved:
        y = saved
    else:  # called without save_gemm: recompute the GEMM
        y = reference.gemm(x, weight, saved if ctx.has_bias else None)
    dx, dweight, dbias, dparams = reference.backward(
        Program.parse(ctx.program), grad_out, x, weight, y, ctx.has_bias, params
    )
    return None, dx, dweight, dbias, dparams, None


linear_epilogue.register_autograd(_backward, setup_context=_setup_context)


def autograd_implementation():
    """The op's autograd kernel as torch.library builds it from the registration above,
    ``(keyset, program, x, weight, bias, params, save_gemm) -> (out, batch_stats, gemm)``. The CUDA runtime serves
    the AutogradCUDA key in C++ and calls this only when a backward node must be recorded, so a
    compiled graph's calls run no Python (a private torch API: the caller keeps the Python path if
    it is missing)."""
    from torch._library.autograd import make_autograd_impl

    return make_autograd_impl(linear_epilogue._opoverload, linear_epilogue)

