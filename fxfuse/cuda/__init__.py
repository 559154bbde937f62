"""The CUDA path of ``fxfuse::linear_epilogue``: generated epilogue kernels after a cuBLAS GEMM.

Public API:

* ``available()`` -- a CUDA device, nvcc (with headers) and ninja are present;
* ``prepare(program, dtype)`` -- build or load the kernels of a program ahead of time (the backend
  calls it at compile time, never inside CUDA graph capture); raises ``BuildError``;
* ``prepare_many([(program, dtype), ...])`` -- the same for many, compiled in parallel processes;
* ``select(program, dtype, param_dtypes, (m, n, k), has_bias)`` -- measure the row path against the
  in-GEMM kernel's configurations (and, asked to, Inductor's kernels for the chain) at that shape
  and route such calls to fxfuse's fastest;
* ``BuildError`` -- the program cannot be compiled (unsupported, or the compiler failed);
* the op's CUDA kernel lives in the runtime module (C++, registered with the dispatcher when the
  first program is prepared); before that ``fxfuse.op`` sends CUDA calls to ``engine.call``
  (registered with it on import: ``op.register_device_kernels``). A call whose
  program was not prepared builds it on first use; a call the kernels do not cover (shapes, a
  training BatchNorm on one row, ...) runs the reference, which raises eager's errors.

Importing costs nothing on a CPU-only machine: no CUDA initialisation, no compiler lookup.
"""

from __future__ import annotations

import torch

from .. import op as _op
from ..ir import Program
from .codegen import has_generated_backward
from .engine import Engine
from .errors import BuildError

__all__ = ["available", "prepare", "prepare_many", "select", "BuildError", "engine"]


def _cuda_target(device: torch.device):
    from .build import cuda_target

    return cuda_target(device)


engine = Engine(_cuda_target)  # the GPU's modules
_op.register_device_kernels("cuda", _op.DeviceKernels(engine.call, engine.backward, has_generated_backward))


def available() -> bool:
    """Whether the CUDA kernels can be built and run here."""
    try:
        from torch.utils.cpp_extension import is_ninja_available

        from .build import find_cuda_home

        return bool(torch.cuda.is_available() and find_cuda_home(True) is not None and is_ninja_available())
    except Exception:  # noqa: BLE001 - any broken toolchain means "not available"
        return False


def prepare(program: Program, dtype: torch.dtype) -> None:
    """Build or load the kernels of ``program`` for ``dtype`` inputs on the current device."""
    if not torch.cuda.is_available():
        raise BuildError("CUDA is not available")
    engine.prepare(program, dtype, torch.device("cuda", torch.cuda.current_device()))


def prepare_many(items, workers: int | None = None, gemm_items=()) -> dict:
    """``prepare`` for many ``(program, dtype)`` pairs, and the in-GEMM modules of ``gemm_items``
    (``(program, dtype, param dtypes, rows)``: ``rows`` the calls' rows, None for any), compiling
    in parallel worker processes (they share the
    build cache), then loading every module here. Returns {(program string, dtype): BuildError}
    for the pairs that failed; prepared pairs are absent (a failed GEMM module only leaves its
    program on the row path)."""
    if not torch.cuda.is_available():
        raise BuildError("CUDA is not available")
    return engine.prepare_many(items, torch.device("cuda", torch.cuda.current_device()), workers, gemm_items)


def select(program: Program, dtype: torch.dtype, param_dtypes, shape, has_bias: bool, param_shapes=None,
           against_inductor: bool = False, weight_is_kn: bool = False, operands=None):
    """The path ``program``'s calls of ``shape`` (m, n, k) take on the current device, measured
    (``engine.Selection``), or None where it has no in-GEMM kernel and Inductor is not timed (the
    row path serves); ``against_inductor``: Inductor's kernels for the chain are timed beside
    fxfuse's paths (the row path alone, where no in-GEMM kernel takes it); ``weight_is_kn``:
    the weight is a (K, N) tensor read transposed (no GEMM configuration reads it so);
    ``operands``: (x, weight, bias, params) as the model computes them, to time on (else random)."""
    device = torch.device("cuda", torch.cuda.current_device())
    return engine.select(program, dtype, tuple(param_dtypes), tuple(shape), device, has_bias, param_shapes,
                         against_inductor, weight_is_kn, operands)
