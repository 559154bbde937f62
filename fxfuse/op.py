"""The fused op, ``torch.ops.fxfuse.linear_epilogue``, and its backward.

One schema serves every program: the program's string form is the first argument, so a compiled
graph (or a cached one, in another process) needs nothing registered beyond this module. The CPU
kernel is the reference; a GPU back end registers the kernels for its device type
(``register_device_kernels``: fxfuse.cuda does on import, and its runtime module registers a C++
kernel for the CUDA key once loaded), so this module depends on no back end; the fake kernel
derives shapes from the Program, so batch dims may be symbolic. The op returns ``(out,
batch_stats, gemm, kept)``: batch_stats is the (2, N) float32 mean and unbiased variance of a
training-mode BatchNorm stage, which the rewritten graph folds into the running statistics with
ordinary ops (empty when the program has no such stage); gemm is the GEMM output when
``save_gemm`` asks for it (a graph that will run backward), else empty; kept is the value of a
``keep()`` stage (a chain value the graph also reads elsewhere), else empty. A
program's second GEMMs (a gated MLP's up projection: "gemm" parameters, their weights among the
params) run inside the op on the same x; their outputs are saved stacked with the GEMM's.

The backward starts from the saved GEMM output. Pointwise, norm and reduction programs have a
generated backward, ``torch.ops.fxfuse.epilogue_backward``: one kernel that recomputes the forward
from the GEMM output and writes dY and, in the same pass, the column sums for db and for each
parameter's gradient (a norm's weight and bias included), its gradients in float32 and rounded
where a stage's output is (fxfuse/cuda/gradient.py, csrc/row_grad.cuh; its CPU kernel is autograd
through the reference). Norm programs (an eval-mode BatchNorm's too) take it by default, the
others on opt-in (``uses_generated_backward``); a training-mode BatchNorm's has none. Otherwise
dY comes from autograd through the reference epilogue, plain torch ops that AOTAutograd traces
into the backward graph for Inductor to fuse. Then dX = dY W and dW = dYᵀ X as eager's linear
computes them (cuBLAS, in Inductor's graph).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference
from .ir import Program, gradient_form

Tensor = torch.Tensor


@dataclass(frozen=True)
class DeviceKernels:
    """A back end's kernels for the ops on tensors of one device type."""

    forward: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]  # linear_epilogue's arguments
    backward: Callable[..., tuple[Tensor, Tensor]]  # epilogue_backward's arguments
    has_generated_backward: Callable[[Program], bool]  # its backward kernel covers the program


_DEVICE_KERNELS: dict[str, DeviceKernels] = {}


def register_device_kernels(device_type: str, kernels: DeviceKernels) -> None:
    """The ops run ``kernels`` for tensors of ``device_type`` (others: the reference)."""
    _DEVICE_KERNELS[device_type] = kernels


@torch.library.custom_op("fxfuse::linear_epilogue", mutates_args=())
def linear_epilogue(
    program: str, x: Tensor, weight: Tensor, bias: Tensor | None, params: list[Tensor], save_gemm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``program``'s chain applied to ``x @ weight.T + bias``; with ``save_gemm`` the GEMM output
    itself is returned too (third output, else empty), for the backward to start from; the value
    of a ``keep()`` stage is the fourth (else empty)."""
    kernels = _DEVICE_KERNELS.get(x.device.type)
    if kernels is not None:  # (on CUDA until the runtime registers its C++ kernel for this op)
        return kernels.forward(program, x, weight, bias, params, save_gemm=save_gemm)
    return reference.op_forward(Program.parse(program), x, weight, bias, params, save_gemm)


@linear_epilogue.register_fake
def _linear_epilogue_fake(program, x, weight, bias, params, save_gemm):
    prog = Program.parse(program)
    n = weight.shape[0]
    out = x.new_empty(prog.output_shape(tuple(x.shape[:-1]), n), dtype=prog.output_dtype(x.dtype))
    stats_shape = (2, n) if prog.batch_norm_training else reference.EMPTY_STATS_SHAPE
    gemm = x.new_empty(reference.saved_gemm_shape(prog, (*x.shape[:-1], n)) if save_gemm else (0,))
    kept = (x.new_empty((*x.shape[:-1], n), dtype=prog.kept_dtype(x.dtype)) if prog.keeps
            else x.new_empty((0,)))
    return out, x.new_empty(stats_shape, dtype=torch.float32), gemm, kept


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


def _backward(ctx, grad_out, grad_stats, grad_gemm, grad_kept):
    x, weight, saved, *params = ctx.saved_tensors
    program = Program.parse(ctx.program)
    if ctx.gemm_saved:
        y, seconds = reference.split_saved_gemm(program, saved)
    else:  # called without save_gemm: recompute the GEMMs
        y = reference.gemm(x, weight, saved if ctx.has_bias else None)
        seconds = reference.second_gemm_outputs(program, x, params)
    if not uses_generated_backward(program, y.device.type):
        dx, dweight, dbias, dparams = reference.backward(program, grad_out, x, weight, y, ctx.has_bias, params,
                                                         grad_kept, seconds)
        return None, dx, dweight, dbias, dparams, None
    dy, sums = epilogue_backward(ctx.program, grad_out, y, params)
    dx, dweight = reference.linear_grads(dy, x, weight)
    dbias = sums[0].to(y.dtype) if ctx.has_bias else None
    # eager's gradient of a parameter is a sum of products in the dtype the chain computes in
    # there (float32 once it widened), rounded to that dtype once
    sum_dtype = program.output_dtype(y.dtype)
    dparams = [
        None if i in program.constant_params
        else (row if kind == "col" else row.sum()).to(sum_dtype).to(p.dtype).reshape(p.shape)
        for i, (row, kind, p) in enumerate(zip(sums[1:], program.params, params))
    ]
    return None, dx, dweight, dbias, dparams, None


GENERATED_BACKWARD_ENV = "FXFUSE_GENERATED_BACKWARD"


def uses_generated_backward(program: Program, device_type: str) -> bool:
    """Whether the backward goes through the generated kernel. Norm programs (a group, layer or
    RMS norm, or an eval-mode BatchNorm, between pointwise stages): by default on CUDA, since their
    kernel measured faster than Inductor's backward of the same chain (S02, S08, S20 under bf16
    autocast on the H200 and H100) or than Inductor's fusion of the reference's derivative, the
    alternative once the chain is fused (S22, H100; BENCHMARKS.md section 6). Pointwise and
    reduction programs: opt-in (``FXFUSE_GENERATED_BACKWARD=1``), since theirs measured slower than
    Inductor's fusion of the same derivative. ``FXFUSE_GENERATED_BACKWARD=0`` turns all off. Read
    when the backward is traced (torch's compile caches key on it: fxfuse/cache_key.py)."""
    setting = os.environ.get(GENERATED_BACKWARD_ENV)
    if setting == "0":
        return False
    kernels = _DEVICE_KERNELS.get(device_type)
    if kernels is None:  # the reference: the derivative of any program with a gradient form
        return setting == "1" and gradient_form(program) is not None
    return kernels.has_generated_backward(program) and (setting == "1" or gradient_form(program) == "norm")


@torch.library.custom_op("fxfuse::epilogue_backward", mutates_args=())
def epilogue_backward(program: str, grad: Tensor, gemm: Tensor, params: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The backward of a pointwise, norm or reduction ``program`` from its saved GEMM output:
    ``(dgemm, sums)``, sums the (1 + len(params), N) float32 column sums of dgemm and of each
    parameter's gradient (a scalar parameter's gradient is its row's sum); ``grad`` has the op
    output's shape. CUDA: the program module's generated kernel."""
    kernels = _DEVICE_KERNELS.get(grad.device.type)
    if kernels is not None:  # (on CUDA until the runtime registers its C++ kernel for this op)
        return kernels.backward(program, grad, gemm, params)
    return reference.epilogue_backward(Program.parse(program), grad, gemm, list(params))


@epilogue_backward.register_fake
def _epilogue_backward_fake(program, grad, gemm, params):
    return torch.empty_like(gemm), gemm.new_empty((1 + len(params), gemm.shape[-1]), dtype=torch.float32)


linear_epilogue.register_autograd(_backward, setup_context=_setup_context)


def autograd_implementation():
    """The op's autograd kernel as torch.library builds it from the registration above,
    ``(keyset, program, x, weight, bias, params, save_gemm) -> (out, batch_stats, gemm)``. The CUDA runtime serves
    the AutogradCUDA key in C++ and calls this only when a backward node must be recorded, so a
    compiled graph's calls run no Python (a private torch API: the caller keeps the Python path if
    it is missing)."""
    from torch._library.autograd import make_autograd_impl

    return make_autograd_impl(linear_epilogue._opoverload, linear_epilogue)

