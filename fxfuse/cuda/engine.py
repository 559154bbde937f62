"""The per-call path: program module lookup, the runtime's GEMM + epilogue call, the fallback.

An Engine owns the modules built for one kind of target (the GPU, or the host emulator in tests).
Every prepared program is registered with the runtime module, whose C++ kernel serves the op's
CUDA calls without Python. ``call`` is the path for everything else (and the tests'): it builds a
program on first use as a last resort, and runs the reference when the kernels do not cover a call
(the runtime returns None: an unsupported shape, a training BatchNorm on one row, ...) or when a
program could not be built.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import warnings
from typing import TYPE_CHECKING, Callable

import torch

from .. import reference
from ..ir import Program
from .errors import BuildError

if TYPE_CHECKING:
    from .build import Target

# fxfuse.cuda.build (code generator, toolchain) is imported on first use: importing fxfuse on a
# machine without a GPU only registers the kernel.

Key = tuple  # (program string, dtype, device index)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # FxDtype, csrc/fx_abi.h


class Engine:
    def __init__(self, target_for: Callable[[torch.device], Target]) -> None:
        self._target_for = target_for
        self._handles: dict[Key, int] = {}  # 0: no kernels for this key, use the reference
        self._modules: dict[Key, object] = {}  # ProgramModules: keep the libraries loaded
        self._runtime_module = None  # built once, on the first prepare
        self._flags = 0  # FxFlags: eager's rounding on this target, found when the runtime loads
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- building ----------------------------------------------------------------------------------

    def prepare(self, program: Program, dtype: torch.dtype, device: torch.device) -> None:
        """Build (or load from the cache) the runtime and the program module; BuildError if not."""
        key = (program.to_string(), dtype, _index(device))
        if self._handles.get(key):
            return
        from .build import build_program

        with self._lock:
            try:
                runtime = self._runtime(device)
                module = build_program(program, dtype, self._target_for(device))
            except BuildError:
                raise
            except Exception as error:  # noqa: BLE001 - e.g. no toolchain: the same outcome
                raise BuildError(f"{type(error).__name__}: {error}") from error
            self._modules[key] = module
            self._handles[key] = module.info
            runtime.register_program(key[0], DTYPE_CODES[dtype], key[2], module.info)

    def prepare_many(self, items, device: torch.device, workers: int | None = None) -> dict:
        """Build many (program, dtype) pairs in parallel processes, then load them; the failures."""
        from .build import RUNTIME_SOURCE, build_in_subprocess

        pairs = list(dict.fromkeys((program.to_string(), dtype) for program, dtype in items))
        target = self._target_for(device)
        cpus = os.cpu_count() or 2
        workers = max(1, min(workers or max(1, cpus // 2), len(pairs) + 1))
        jobs = [(RUNTIME_SOURCE, torch.float32)] + pairs
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            texts, dtypes = zip(*jobs)
            errors = list(pool.map(build_in_subprocess, texts, dtypes, [target] * len(jobs),
                                   [max(1, cpus // workers)] * len(jobs)))
        failed = {pair: BuildError(error) for pair, error in zip(pairs, errors[1:]) if error is not None}
        for text, dtype in pairs:
            if (text, dtype) not in failed:
                try:
                    self.prepare(Program.parse(text), dtype, device)
                except BuildError as error:
                    failed[(text, dtype)] = error
        return failed

    def _runtime(self, device: torch.device):
        from .build import build_runtime

        if self._runtime_module is None:
            runtime = build_runtime(self._target_for(device))
            self._flags = runtime.GROUP_NORM_ROUNDS_STATS if group_norm_rounds_stats(device) else 0
            runtime.set_fallback(self.call, self._flags)
            runtime.set_grad_fallback(self.backward)
            if hasattr(runtime, "register_autograd"):  # the CUDA build
                _register_autograd(runtime)
            self._runtime_module = runtime
        return self._runtime_module

    def set_plan_items(self, items: int) -> None:
        """Tuning only (bench/epilogue_breakdown.py): the 16-byte chunks a thread of row-local
        programs' apply kernels; 0 restores the default plan."""
        shift, mask = self._runtime_module.PLAN_ITEMS_SHIFT, self._runtime_module.PLAN_ITEMS_MASK
        self._flags = (self._flags & ~mask) | ((items << shift) & mask)
        self._runtime_module.set_fallback(self.call, self._flags)

    def _handle(self, program: str, t: torch.Tensor) -> int:
        """The module handle for ``program`` on ``t``'s dtype and device (0: no kernels)."""
        handle = self._handles.get((program, t.dtype, t.get_device()))
        return self._resolve(program, t.dtype, t.device) if handle is None else handle

    def _resolve(self, program: str, dtype: torch.dtype, device: torch.device) -> int:
        """Handle of a key seen for the first time: build as a last resort; 0 if that fails."""
        key = (program, dtype, _index(device))
        try:
            self.prepare(Program.parse(program), dtype, device)
        except BuildError as error:
            self._warn_once(program, f"fxfuse: no CUDA kernels for {program!r} ({dtype}); using the "
                            f"reference implementation.\n{error}")
            self._handles[key] = 0
        return self._handles[key]

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- calling -----------------------------------------------------------------------------------

    def call(self, program: str, x, weight, bias, params, out=None, save_gemm: bool = False):
        """``(out, batch_stats, gemm)`` of the fused op; ``out`` (tests) is a buffer to write into."""
        handle = self._handle(program, x)
        runtime = self._runtime_module
        if handle and runtime is not None:
            result = runtime.run(handle, x, weight, bias, params, self._flags, out, save_gemm)
            if result is not None:
                return result
        return reference.op_forward(Program.parse(program), x, weight, bias, list(params), save_gemm)

    def backward(self, program: str, grad, gemm, params):
        """``fxfuse::epilogue_backward``: ``(dgemm, sums)`` by the program module's backward kernel,
        or by the reference where the kernel does not cover the call."""
        result = self.backward_kernel(program, grad, gemm, params)
        if result is not None:
            return result
        return reference.epilogue_backward(Program.parse(program), grad, gemm, list(params))

    def backward_kernel(self, program: str, grad, gemm, params):
        """``(dgemm, sums)`` from the backward kernel; None where it does not cover the call."""
        handle = self._handle(program, gemm)
        if not handle or self._runtime_module is None:
            return None
        return self._runtime_module.run_grad(handle, grad, gemm, list(params), self._flags)

    def covers(self, program: str, x, weight, bias, params) -> bool:
        """Whether ``call`` would run the kernels (tests): it does run them once."""
        handle = self._handle(program, x)
        return bool(handle) and self._runtime_module.run(handle, x, weight, bias, params, self._flags, None) is not None


def _register_autograd(runtime) -> None:
    """Let the runtime serve the op's autograd key in C++ (no Python per call of a compiled
    graph); without it (an older or newer torch lacking the pieces) the Python kernel stays."""
    from .. import op

    try:
        registered = runtime.register_autograd(op.autograd_implementation())
    except Exception as error:  # noqa: BLE001 - only a per-call cost is at stake
        registered, reason = False, f"{type(error).__name__}: {error}"
    else:
        reason = "the runtime cannot pass a dispatch key set to Python"
    if not registered:
        warnings.warn(f"fxfuse: the op's autograd layer stays in Python ({reason})", RuntimeWarning)


def group_norm_rounds_stats(device: torch.device) -> bool:
    """Whether eager's group_norm of a bfloat16 input on ``device`` normalises with its mean and
    1/std rounded to bfloat16 (torch's CUDA kernel did up to 2.11) rather than kept in float32.

    The kernels must round where eager rounds: in a bf16 chain one flipped ulp after the norm can
    grow past 1e-2 (S04). Asked of eager itself once, on an input where the two differ."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 3 + 1).to(device=device, dtype=torch.bfloat16)
    eps = float(torch.tensor(1e-5, dtype=torch.bfloat16))
    y = torch.nn.functional.group_norm(x, 8, eps=1e-5).float()
    xf = x.float().view(64, 8, 32)
    var, mean = torch.var_mean(xf, dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)

    def distance(mean, rstd):
        z = ((xf - mean) * rstd).view(64, 256).to(torch.bfloat16).float()
        return (z - y).abs().sum().item()

    def bf16(t):
        return t.to(torch.bfloat16).float()

    return distance(bf16(mean), bf16(rstd)) < distance(mean, rstd)


def _index(device: torch.device) -> int:
    return -1 if device.index is None else device.index
