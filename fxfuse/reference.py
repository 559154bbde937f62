"""The reference implementation of a Program in plain torch ops.

It is the fused op's CPU kernel and the oracle of the CUDA kernels: the GEMM in the input dtype (as
cuBLAS returns it), then the epilogue in eager's opmath type (float32; float64 for float64 inputs,
which gradcheck uses) with the rounding points the IR marks (where eager rounds), norms computed as eager computes them for the input dtype. Each vocabulary function and
norm is eager PyTorch's own function, so NaN/Inf behaviour and errors (a training-mode BatchNorm
over one row, say) are eager's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import expr as E
from . import masks
from .ir import Dropout, Keep, Narrow, Norm, Pointwise, Pool, Program, Reduce, Rotary, Widen, read_as
from .patterns.feature_pooling import feature_pool
from .patterns.rotary import rotate_heads
from .patterns.norms import FAMILY as NORMS
from .patterns.reductions import FAMILY as REDUCTIONS

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
    seconds = second_gemm_outputs(program, x, params)
    return epilogue(program, gemm(x, weight, bias), epilogue_values(program, params, seconds))


def op_forward(program: Program, x, weight, bias, params, save_gemm: bool):
    """The fused op's outputs ``(out, batch_stats, gemm, kept)``: gemm is the GEMM output when
    ``save_gemm`` (never the same tensor as out; with second GEMMs, all their outputs stacked:
    ``saved_gemm``), else empty; kept the value of the program's ``keep()`` stage, else empty."""
    y = gemm(x, weight, bias)
    seconds = second_gemm_outputs(program, x, params)
    out, stats, kept = epilogue_and_kept(program, y, epilogue_values(program, params, seconds))
    if not save_gemm:
        return out, stats, y.new_empty((0,)), kept
    if seconds:
        return out, stats, torch.stack([y, *seconds]), kept
    return (out.clone() if out.data_ptr() == y.data_ptr() else out), stats, y, kept


def second_gemm_outputs(program: Program, x: torch.Tensor, params) -> list[torch.Tensor]:
    """``x @ weight.T`` for each second GEMM's weight (a "gemm" parameter), in x's dtype."""
    return [gemm(x, params[i], None) for i in program.second_gemms]


def epilogue_values(program: Program, params, seconds) -> list[torch.Tensor]:
    """The parameters as the epilogue reads them: each second GEMM's weight replaced by its output."""
    values = list(params)
    for i, value in zip(program.second_gemms, seconds):
        values[i] = value
    return values


def saved_gemm_shape(program: Program, gemm_shape: tuple) -> tuple:
    """The shape of the op's saved GEMM output (its third output, for the backward): the GEMM's,
    or with second GEMMs all their outputs stacked in front, ``(1 + G, *gemm_shape)``."""
    count = len(program.second_gemms)
    return (1 + count, *gemm_shape) if count else tuple(gemm_shape)


def split_saved_gemm(program: Program, saved: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The saved GEMM output and the second GEMMs' (``saved_gemm_shape``'s inverse)."""
    if not program.second_gemms:
        return saved, []
    return saved[0], list(saved[1:])


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM in x's dtype, as cuBLAS returns it (no autocast re-cast: the op's inputs already
    have the dtype the GEMM runs in)."""
    with _no_autocast(x):
        return F.linear(x, weight, bias)


def epilogue(program: Program, y: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``program``'s stages applied to the GEMM output ``y``: ``(out, batch_stats)``."""
    out, stats, _ = epilogue_and_kept(program, y, params)
    return out, stats


def _as_operand(p: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """A parameter in the shape it broadcasts from against a value of ``shape``: (N,), (), the
    value's own shape, or (*rows, 1) — a per-row operand of fewer values (one per sample) expands."""
    if kind == "col":
        return p.reshape(shape[-1])
    if kind == "scalar":
        return p.reshape(())
    if read_as(kind) == "full":  # (fewer values: broadcast along the leading dims, expanded)
        return p.reshape(shape) if p.numel() == math.prod(shape) else p.expand(shape)
    if kind == "head":  # a table row of D values for every P-th output row (Rotary reads it)
        return p
    rows = (*shape[:-1], 1)
    return p.reshape(rows) if p.numel() == math.prod(rows) else p.expand(rows)


def epilogue_and_kept(program: Program, y: torch.Tensor,
                      params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, batch_stats, kept)``: kept is the value at the ``keep()`` stage in its dtype (empty
    without one); ``params`` as the epilogue reads them (``epilogue_values``). ``dtype`` is the dtype eager's op of each stage sees: the GEMM's, float32 from a
    Widen stage on."""
    dtype = y.dtype
    kept = y.new_empty((0,))
    n = y.shape[-1]
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    values = [p if kind == "seed" else _as_operand(p.to(opmath), kind, y.shape) for p, kind in zip(params, program.params)]
    stats = y.new_empty(EMPTY_STATS_SHAPE, dtype=torch.float32)
    with _no_autocast(y):
        v = y.to(opmath)
        for stage in program.stages:
            if isinstance(stage, Pointwise):
                v = _pointwise(stage, v, values)
            elif isinstance(stage, Norm):
                v, batch_stats = _norm(stage, v, list(params), dtype)
                if batch_stats is not None:
                    stats = batch_stats
            elif isinstance(stage, Widen):
                dtype = torch.promote_types(y.dtype, torch.float32)
            elif isinstance(stage, Narrow):  # the rounding is the expression's; later norms see y's dtype
                dtype = y.dtype
            elif isinstance(stage, Keep):
                kept = v.to(dtype, copy=True)  # never the output itself (an op's outputs may not alias)
            elif isinstance(stage, Dropout):
                v = _dropout(stage, v, params[stage.seed]).to(dtype).to(v.dtype)
            elif isinstance(stage, Pool):
                v = feature_pool(v, stage.kind, stage.kernel, stage.stride).to(dtype).to(v.dtype)
            elif isinstance(stage, Rotary):
                v = _rotary(stage, v, values[stage.cos], values[stage.sin], dtype)
            else:
                v = _reduce(stage, v)
        return v.to(program.output_dtype(y.dtype)), stats, kept


def _no_autocast(t: torch.Tensor):
    """The IR fixes every stage's dtype: nothing inside the op is re-cast by an autocast region."""
    device_type = t.device.type if t.device.type in ("cuda", "cpu") else "cpu"
    return torch.autocast(device_type, enabled=False)


def _pointwise(stage: Pointwise, v: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    def symbol(s):
        return v if s == E.X else values[E.param_index(s)]

    result = E.evaluate(stage.expr, symbol, lambda fn, args: fn.row.reference(*args))
    if not isinstance(result, torch.Tensor):  # an expression without x (never matched, but total)
        result = torch.full_like(v, result)
    if result.shape == v.shape:
        return result
    return result.expand(torch.broadcast_shapes(result.shape, v.shape))  # (a reduction's value broadcast back)


def _norm(stage: Norm, v: torch.Tensor, params: list[torch.Tensor], dtype: torch.dtype):
    """The norm as eager computes it for a ``dtype`` input (its input is already rounded to
    ``dtype`` at this point, so this is eager's own arithmetic), returned in ``v``'s dtype, and a
    training batch norm's batch statistics (float32 mean and unbiased variance)."""
    n = v.shape[-1]

    def p(index):
        return None if index is None else params[index].reshape(n)

    out, statistics = NORMS[stage.kind].reference(stage, v.to(dtype), p)
    return out.to(v.dtype), statistics


def _dropout(stage: Dropout, v: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """v * (1 / (1 - p)) where the mask keeps the element, v * 0 elsewhere (NaN stays NaN)."""
    n = v.shape[-1]
    keep = masks.keep_mask(seed, v.numel() // n, n, stage.p).reshape(v.shape)
    factor = torch.where(keep, masks.scale(stage.p), 0.0).to(v.dtype)
    return v * factor


def _rotary(stage: Rotary, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every head of the rows rotated, each product and the sum rounded to ``dtype`` as eager's
    ops round them; output row r reads table row r mod P (the tables' P rows)."""
    d, shape = stage.head_dim, v.shape
    heads = v.reshape(-1, shape[-1] // d, d)
    repeats = heads.shape[0] // max(1, cos.numel() // d)
    cos, sin = (t.reshape(-1, d).repeat(repeats, 1).unsqueeze(1) for t in (cos, sin))
    return rotate_heads(heads, cos, sin, lambda t: t.to(dtype).to(v.dtype)).reshape(shape)


def _reduce(stage: Reduce, v: torch.Tensor) -> torch.Tensor:
    return REDUCTIONS[stage.kind].reference(v, stage)


def backward(
    program: Program,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    has_bias: bool,
    params: list[torch.Tensor],
    grad_kept: torch.Tensor | None = None,
    seconds: list[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """``(dx, dweight, dbias, dparams)`` of ``out = epilogue(linear(x, weight, bias))`` given the
    GEMM output ``y`` (and ``seconds``, the second GEMMs' outputs): dY by autograd through the
    epilogue (``epilogue_grads``), then the linear's gradients as eager's addmm/matmul backward
    computes them, a second GEMM's too (its weight's gradient, and its share of dx). Plain torch ops
    throughout, so AOTAutograd traces them into the backward graph. None for a running statistic.
    ``grad_kept``: the gradient of the kept value (a ``keep()`` stage), which joins the chain's there."""
    values = epilogue_values(program, params, seconds)
    dy, dparams = epilogue_grads(program, grad_out, y, values, grad_kept)
    dx, dweight = linear_grads(dy, x, weight)
    dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if has_bias else None
    for i in program.second_gemms:
        dx_i, dparams[i] = linear_grads(dparams[i], x, params[i])
        dx = dx + dx_i
    return dx, dweight, dbias, dparams


def epilogue_grads(
    program: Program, grad_out: torch.Tensor, y: torch.Tensor, params: list[torch.Tensor],
    grad_kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The gradients of the GEMM output ``y`` and of each parameter, by autograd through the
    epilogue recomputed from ``y``: each stage's derivative is eager's own (the vocabulary's and
    the norms' reference functions). None for a running statistic."""
    constant = program.constant_params
    with torch.enable_grad():
        y_leaf = y.detach().requires_grad_()
        leaves = [p.detach().requires_grad_(p.is_floating_point() and i not in constant)
                  for i, p in enumerate(params)]
        out, _, kept = epilogue_and_kept(program, y_leaf, leaves)
        wanted = [y_leaf] + [p for p in leaves if p.requires_grad]
        outputs, grads_in = [out], [grad_out]
        if program.keeps and grad_kept is not None:
            outputs.append(kept)
            grads_in.append(grad_kept)
        grads = torch.autograd.grad(outputs, wanted, grads_in, allow_unused=True)
    dy, rest = grads[0], iter(grads[1:])
    dparams = []
    for p in leaves:
        g = next(rest) if p.requires_grad else None
        dparams.append(torch.zeros_like(p) if p.requires_grad and g is None else g)
    return (torch.zeros_like(y) if dy is None else dy), dparams


def linear_grads(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``linear(x, weight)`` from the output's gradient ``dy``."""
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    return (dy2 @ weight).reshape(x.shape), dy2.t() @ x.reshape(-1, k)


def epilogue_backward(
    program: Program, grad_out: torch.Tensor, y: torch.Tensor, params: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fxfuse::epilogue_backward``'s CPU kernel (and the oracle of the generated backward
    kernel): ``(dy, sums)``, sums the (1 + len(params), N) float32 column sums of dy over the rows
    and of each parameter's gradient (zero for a running statistic). A column parameter's row
    holds its gradient; a scalar parameter's gradient is its row's sum (here all of it in column
    0). dy is never grad_out itself (an op's output may not alias its input), even for an identity
    epilogue."""
    # torch.func, not torch.autograd: an op's kernel runs below the autograd dispatch key; the
    # running statistics are constants (eager's batch_norm is not differentiable in them)
    free = [i for i in range(len(params)) if i not in program.constant_params]

    def out_of(v: torch.Tensor, *free_params: torch.Tensor) -> torch.Tensor:
        full = list(params)
        for i, p in zip(free, free_params):
            full[i] = p
        return epilogue(program, v, full)[0]

    _, vjp = torch.func.vjp(out_of, y, *(params[i] for i in free))
    dy, *dfree = vjp(grad_out)
    dparams: list[torch.Tensor | None] = [None] * len(params)
    for i, g in zip(free, dfree):
        dparams[i] = g
    if dy.untyped_storage().data_ptr() == grad_out.untyped_storage().data_ptr():
        dy = dy.clone()
    n = y.shape[-1]
    sums = y.new_zeros((1 + len(params), n), dtype=torch.float32)
    sums[0] = dy.reshape(-1, n).sum(0).float()  # eager sums in the dtype (float accumulation)
    for i, (kind, g) in enumerate(zip(program.params, dparams)):
        if g is None:  # a running statistic: no gradient
            continue
        if kind == "col":
            sums[1 + i] = g.float().reshape(n)
        else:
            sums[1 + i, 0] = g.float().sum()
    return dy, sums
