"""The per-call path: program module lookup, the runtime's GEMM + epilogue call, the fallback.

An Engine owns the modules built for one kind of target (the GPU, or the host emulator in tests).
Every prepared program is registered with the runtime module, whose C++ kernel serves the op's
CUDA calls without Python. ``call`` is the path for everything else (and the tests'): it builds a
program on first use as a last resort, and runs the reference when the kernels do not cover a call
(the runtime returns None: an unsupported shape, a training BatchNorm on one row, ...) or when a
program could not be built.

Two paths run a program on the GPU: the row path (the GEMM on cuBLAS, then the program module's
pass over its output) and, where a GEMM module was built (Hopper, bf16/fp16 or TF32, the in-GEMM
epilogue of gemm_codegen.py), one CUTLASS kernel per call in one of several configurations.
``select`` times them once per (program, dtype, parameter dtypes, N, K, bucket of M) when a graph
compiles (a bucket no compile timed, as a graph with a symbolic batch meets them, on its first call:
``measure_call``), tells the runtime which to route such calls to, and keeps the measurement on disk
beside the builds, so a warm compile measures nothing. Asked to, it times one more candidate beside them
(beside the row path alone, for a program without a GEMM module): the chain as Inductor compiles
it on its own (cuBLAS, then its generated kernels), so that the backend can leave the chain to
Inductor where Inductor is faster on this card at this shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from .. import reference
from ..ir import Program, Rotary
from .errors import BuildError
from .timing import time_candidates

if TYPE_CHECKING:
    from .build import Target

# fxfuse.cuda.build (code generator, toolchain) is imported on first use: importing fxfuse on a
# machine without a GPU only registers the kernel.

Key = tuple  # (program string, dtype, device index)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # FxDtype, csrc/fx_abi.h
ROW_PATH = "row"  # the name of the cuBLAS + row-pass path in selections
INDUCTOR = "Inductor"  # the name of the chain as Inductor compiles it, where a selection timed it
# How much faster than Inductor's kernels fxfuse's fastest path must measure for the chain to stay
# fused: the selection times the chain alone, where in the model Inductor may fuse the chain's
# neighbours too (S25's gelu_new chain won by 0.4 % alone and ran 1.06x Inductor's graph, H100)
INDUCTOR_MARGIN = 0.03
# How long each finalist runs alone before its samples (Engine._measure's final): a CUTLASS kernel
# draws more power than cuBLAS's and, run alone this long, settles on lower clocks; in blocks of
# 20 ms it ran on the clocks the candidates before it left (BENCHMARKS.md section 32)
FINAL_SETTLE_S = 0.3
# How candidates are timed, in the selections' disk key (keyed on the modules, not on this file):
# selections timed another way (round-robin; blocks without the warm-up; no final) are measured again
TIMING_METHOD = ("blocks after a warm-up; a final of the in-GEMM winner, the row path and Inductor, "
                 f"each alone {FINAL_SETTLE_S} s")


@dataclass(frozen=True)
class Selection:
    """The measured paths of one program at one shape: ``times_us`` per path name (the row path,
    each GEMM configuration that covers the shape, and Inductor's kernels where asked), and
    fxfuse's fastest, ``path``; ``config`` is its GEMM configuration (-1: the row path);
    ``timing``: how the times were taken (``GRAPH_TIMING`` or ``LAUNCH_TIMING``)."""

    path: str
    config: int
    times_us: dict[str, float]
    timing: str
    # where an in-GEMM configuration won the screen (``times_us``): it, the row path and
    # Inductor's kernels timed again, each alone for FINAL_SETTLE_S before its samples; ``path``
    # is the faster of fxfuse's two finalists
    final_us: dict[str, float] = field(default_factory=dict)

    @property
    def deciding_us(self) -> dict[str, float]:
        """The times the path was chosen by: the final's where there was one, else the screen's."""
        return {**self.times_us, **self.final_us}

    def inductor_is_faster(self) -> bool | None:
        """Whether Inductor's kernels beat fxfuse's fastest path, or come within INDUCTOR_MARGIN of
        it (None: Inductor was not timed)."""
        times = self.deciding_us
        if INDUCTOR not in times:
            return None
        return times[INDUCTOR] < times[self.path] * (1 + INDUCTOR_MARGIN)

    def why_inductor(self) -> str:
        """Why the chain goes to Inductor, where ``inductor_is_faster``: Inductor measured faster,
        or fxfuse's fastest path won by less than the margin."""
        fastest, inductor = self.deciding_us[self.path], self.deciding_us[INDUCTOR]
        if inductor <= fastest:
            return "Inductor is faster at this shape"
        return (f"fxfuse's fastest is {inductor / fastest - 1:.1%} faster than Inductor at this shape, "
                f"under the {INDUCTOR_MARGIN:.0%} margin")

    def describe(self) -> str:
        """The path taken and the measured times, fastest first: the row pass, Inductor, and each
        GEMM kernel at its fastest tile order (a module's configurations are six tile orders of each
        kernel of its menu, twice for a gated module)."""
        fastest: dict[str, tuple[str, float]] = {}
        for name, t in self.times_us.items():
            kernel = name.rsplit(", ", 1)[0]  # "<kernel>, <tile order>"; "row" and "Inductor" are their own
            if kernel not in fastest or t < fastest[kernel][1]:
                fastest[kernel] = (name, t)
        times = ", ".join(f"{name} {t:.1f} us" for name, t in sorted(fastest.values(), key=lambda nt: nt[1]))
        orders = " (each kernel at its fastest tile order)" if len(fastest) < len(self.times_us) else ""
        where = "in-GEMM epilogue" if self.config >= 0 else "cuBLAS + row pass"
        final = ""
        if self.final_us:
            alone = ", ".join(f"{name} {t:.1f} us" for name, t in sorted(self.final_us.items(), key=lambda nt: nt[1]))
            final = f"; then each alone for {FINAL_SETTLE_S} s: {alone}"
        return f"{where} ({self.path}); measured ({self.timing}){orders}: {times}{final}"


class Engine:
    def __init__(self, target_for: Callable[[torch.device], Target]) -> None:
        self._target_for = target_for
        self._handles: dict[Key, int] = {}  # 0: no kernels for this key, use the reference
        self._modules: dict[Key, object] = {}  # ProgramModules: keep the libraries loaded
        self._gemms: dict[tuple, object] = {}  # (key, param dtypes) -> GemmModule, None if it failed
        self._replaced: list = []  # modules that a module for more calls took the place of
        self._gemm_errors: dict[tuple, str] = {}
        self.selections: dict[tuple, Selection] = {}  # (key, param dtypes, n, k, bucket, (K, N) weight, no module)
        self._timed_at_call: set[tuple] = set()  # selections' keys timed at a call, on a module as held
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

    def prepare_gemm(self, program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...],
                     device: torch.device, served: frozenset = frozenset()):
        """The GEMM module of ``program`` (built or loaded from the cache, and registered with the
        runtime), or None where there is none (not Hopper, no CUTLASS, a program the in-GEMM path
        does not take, a failed build: the row path serves, and ``gemm_error`` says why), with the
        kernels for the calls it ``served`` (gemm_codegen.rows_served; empty: any). A module held
        without them is built again with the kernels for its calls and these, and registered in its
        place (where that build fails, the held one serves), and the routes the selection chose on
        it are set again by the configurations' names."""
        key = (program.to_string(), dtype, _index(device))
        gkey = (key, tuple(param_dtypes))
        held = self._gemms.get(gkey)
        kernels = self._kernels_to_build(gkey, program, served)
        if kernels is None:
            return held
        from .build import build_gemm

        self.prepare(program, dtype, device)  # the row path: the fallback of every call
        try:
            module = build_gemm(program, dtype, tuple(param_dtypes), self._target_for(device), kernels=kernels)
        except BuildError as error:
            module, self._gemm_errors[gkey] = None, str(error)
        except Exception as error:  # noqa: BLE001 - e.g. no toolchain: the same outcome
            module, self._gemm_errors[gkey] = None, f"{type(error).__name__}: {error}"
        with self._lock:
            if module is None:
                self._gemms.setdefault(gkey, None)
                return self._gemms[gkey]
            self._gemms[gkey] = module
            self._runtime_module.register_gemm(key[0], DTYPE_CODES[dtype], key[2], module.info)
            if held is not None:
                self._replaced.append(held)  # keep its library loaded
                self._route_again(gkey, dtype, module)
        return module

    def _kernels_to_build(self, gkey: tuple, program: Program, served: frozenset) -> tuple | None:
        """The kernels of the module ``gkey`` needs for calls of ``served`` (empty: any): None where
        the module held serves them (or its build failed); where a module held for other calls
        must be built again, the kernels for its calls and these."""
        from . import gemm_codegen

        held = self._gemms.get(gkey)
        served = served or gemm_codegen.ANY_ROWS
        kernels = gemm_codegen.menu(program, served)
        if gkey in self._gemms and (held is None or gkey in self._gemm_errors or set(kernels) <= set(held.kernels)):
            return None
        return kernels if held is None else gemm_codegen.menu(program, served | {k.rows for k in held.kernels})

    def _route_again(self, gkey: tuple, dtype: torch.dtype, module) -> None:
        """The selections made on the module that ``module`` replaced for ``gkey``, routed to the
        same paths by name (its configurations' indices may differ)."""
        key, names = gkey[0], list(module.config_names)
        for skey, selection in list(self.selections.items()):
            if skey[:2] != gkey or selection.config < 0:
                continue
            # the first of a name: the configuration of a kernel without tile orders that runs
            config = names.index(selection.path) if selection.path in names else -1
            n, k, bucket = skey[2:5]
            rows = 2 ** bucket  # a row count of the bucket (the runtime's bucket_of: ceil(log2 m))
            self._runtime_module.choose(key[0], DTYPE_CODES[dtype], key[2], rows, n, k, config)
            self.selections[skey] = replace(selection, config=config)

    def gemm_error(self, program: Program, dtype: torch.dtype, param_dtypes, device: torch.device,
                   weight_is_kn: bool = False) -> str | None:
        """Why the calls have no GEMM module (None: they have one, or none was asked for): the
        in-GEMM path does not take them now (``not_taken_reason``), or the module's build failed."""
        return (not_taken_reason(program, dtype, weight_is_kn)
                or self._gemm_errors.get(((program.to_string(), dtype, _index(device)), tuple(param_dtypes))))

    def prepare_many(self, items, device: torch.device, workers: int | None = None, gemm_items=()) -> dict:
        """Build many (program, dtype) pairs, and the GEMM modules of ``gemm_items`` ((program,
        dtype, param dtypes, rows) items: ``rows`` the calls' rows, None for any, as
        ``prepare_gemm``'s), in parallel processes, then load them; the failures of the pairs (a
        GEMM module that fails leaves its program on the row path)."""
        from .build import RUNTIME_SOURCE, build_many, gemm_target_reason

        pairs = list(dict.fromkeys((program.to_string(), dtype) for program, dtype in items))
        target = self._target_for(device)
        gemms = gemm_modules_served(gemm_items) if gemm_target_reason(target) is None else {}
        menus = {}  # the modules to build: one held for other calls, with the kernels for its calls and these
        for (text, dtype, params), served in gemms.items():
            kernels = self._kernels_to_build(((text, dtype, _index(device)), params), Program.parse(text), served)
            if kernels is not None:
                menus[(text, dtype, params)] = kernels
        built = build_many(module_jobs(pairs, menus.items()), target, workers)
        failed = {(job.program, job.dtype): BuildError(error) for job, error in built.items()
                  if error is not None and job.param_dtypes is None and job.program != RUNTIME_SOURCE}
        for job, error in built.items():
            if error is not None and job.param_dtypes is not None:  # not built again below: minutes, to fail alike
                gkey = ((job.program, job.dtype, _index(device)), job.param_dtypes)
                with self._lock:
                    self._gemm_errors[gkey] = error
                    self._gemms.setdefault(gkey, None)
        for text, dtype in pairs:
            if (text, dtype) not in failed:
                try:
                    self.prepare(Program.parse(text), dtype, device)
                except BuildError as error:
                    failed[(text, dtype)] = error
        for (text, dtype, param_dtypes), served in gemms.items():
            if (text, dtype) not in failed:
                self.prepare_gemm(Program.parse(text), dtype, param_dtypes, device, served)
        return failed

    # -- selection -----------------------------------------------------------------------------

    def select(self, program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...],
               shape: tuple[int, int, int], device: torch.device, has_bias: bool,
               param_shapes: tuple[tuple[int, ...], ...] | None = None,
               against_inductor: bool = False, weight_is_kn: bool = False,
               operands: tuple | None = None, build: bool = True) -> Selection | None:
        """Time the row path and each GEMM configuration on an (m, n, k) problem (or take the
        measurement cached on disk), route (bucket of m, n, k) to the fastest, and return the
        selection; None where the calls have no GEMM module to take (``_timed_module``) and Inductor
        is not to be timed (the row path serves: there is nothing to choose). The problem's data is ``operands``, (x,
        weight, bias, params) as the model computes them, where given (the closest the selection
        gets to the model: S26's chains ran at other speeds in the model than timed alone on random
        data, BENCHMARKS.md section 15), else random data.
        ``against_inductor``: Inductor's kernels for the chain are timed too (in the same rounds);
        ``weight_is_kn``: the calls' weight is a (K, N) tensor read transposed (GPT-2's Conv1D),
        which the GEMM configurations do not read (their B is the (N, K) weight): the row path and
        Inductor are timed with that layout, and no module is built for it. ``build``: a module
        without the kernels for these rows is built again with them (at compile time), or timed as
        it is held (at a call).
        """
        if build:  # the runtime and the row module: every call's fallback, timed where no GEMM module is
            self.prepare(program, dtype, device)
        module = self._timed_module(program, dtype, param_dtypes, device, shape[0], weight_is_kn, build)
        if module is None and not against_inductor:
            return None
        m, n, k = shape
        runtime = self._runtime_module
        bucket = runtime.bucket_of(m)
        key = (program.to_string(), dtype, _index(device))
        skey = (key, tuple(param_dtypes), n, k, bucket, weight_is_kn, module is None)
        selection = self.selections.get(skey)
        if build and skey in self._timed_at_call:  # the module may have grown for these rows since
            selection = None
        if selection is not None and (selection.inductor_is_faster() is not None or not against_inductor):
            return selection
        timed = module if module is not None else self._modules[key]  # the row module: its key
        disk = _selection_file(timed.key + (" kn" if weight_is_kn else ""), shape, bucket, device)
        selection = read_measurement(disk, Selection)
        if selection is None or (against_inductor and selection.inductor_is_faster() is None):
            selection = self._measure(program, dtype, param_dtypes, shape, device, has_bias, module, param_shapes,
                                      against_inductor, weight_is_kn, operands)
            write_measurement(disk, selection)
        if module is not None:
            runtime.choose(key[0], DTYPE_CODES[dtype], key[2], m, n, k, selection.config)
        self.selections[skey] = selection
        if build:
            self._timed_at_call.discard(skey)
        else:
            self._timed_at_call.add(skey)
        return selection

    def _timed_module(self, program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...],
                      device: torch.device, rows: int, weight_is_kn: bool, build: bool):
        """The GEMM module whose configurations the selection times for calls of ``rows`` rows:
        built with the kernels for them where ``build``, else as held. None where the calls cannot
        take the in-GEMM path now (``not_taken_reason``): a module would be minutes of CUTLASS for
        no call."""
        from . import gemm_codegen

        if not_taken_reason(program, dtype, weight_is_kn) is not None:
            return None
        if build:
            return self.prepare_gemm(program, dtype, param_dtypes, device, gemm_codegen.rows_served(rows))
        return self._gemms.get(((program.to_string(), dtype, _index(device)), tuple(param_dtypes)))

    def _measure(self, program, dtype, param_dtypes, shape, device, has_bias, module, param_shapes,
                 against_inductor: bool, weight_is_kn: bool, operands: tuple | None) -> Selection:
        from . import gemm_codegen

        m, n, k = shape
        handle = self._handles[(program.to_string(), dtype, _index(device))]
        if operands is not None:
            x, weight, bias, params = operands
            x, params = x.reshape(m, k), list(params)
        else:
            x, weight, bias, params = random_operands(program, dtype, param_dtypes, shape, device, has_bias,
                                                      param_shapes, weight_is_kn)
        weight = weight.t() if weight_is_kn else weight
        runtime = self._runtime_module
        candidates = {ROW_PATH: -1}
        if module is not None:
            timed = gemm_codegen.timed_for(module.kernels, m)
            for config, name in enumerate(module.config_names):
                # a kernel without tile orders (a swapped one) bears one name at every schedule,
                # and covers calls at its first only
                if module.kernel_of(config) in timed:
                    candidates.setdefault(name, config)
        gemm_info = module.info if module is not None else 0
        calls = {}
        for name, config in candidates.items():
            if config < 0 or module.supports(m, n, k, config):
                calls[name] = (lambda config=config: runtime.run(handle, x, weight, bias, params, self._flags,
                                                                 False, gemm_info, config))
        with torch.no_grad():
            calls = self._agreeing(program, calls)
            if against_inductor:
                try:
                    # first: the candidate at the turn of the blocks' order runs two blocks in a
                    # row (blocked_medians), and that should not be the one the chain's fate turns on
                    calls = {INDUCTOR: inductor_chain(program, x, weight, bias, params), **calls}
                except Exception as error:  # noqa: BLE001 - the policy's rules decide without it
                    self._warn_once(f"inductor {program.to_string()}",
                                    f"fxfuse: Inductor's kernels for a chain could not be timed "
                                    f"({type(error).__name__}: {error}); the policy's rules decide")
            times, timing = time_candidates(calls)
            path = min(candidates.keys() & times.keys(), key=times.get)
            final = {}
            if candidates[path] >= 0:  # an in-GEMM configuration won: again against the cuBLAS paths
                finalists = [name for name in (INDUCTOR, ROW_PATH, path) if name in times]
                final, _ = time_candidates({name: calls[name] for name in finalists}, settle_s=FINAL_SETTLE_S,
                                           warm_up_s=0.0)
                path = min((ROW_PATH, path) if ROW_PATH in final else (path,), key=final.get)
        return Selection(path, candidates[path], times, timing, final)

    def _agreeing(self, program: Program, calls: dict[str, Callable[[], tuple | None]]) -> dict:
        """``calls`` without the GEMM configurations whose output disagrees with the row pass's on
        the measurement's inputs (``disagreement``), each left out with a warning: a kernel fault
        on this device and shape is never timed, so never chosen."""
        if len(calls) < 2:  # the row pass alone
            return calls
        expected = calls[ROW_PATH]()
        if expected is None:  # nothing to hold the configurations to
            return calls
        agreeing, errors = {}, {}
        for name, call in calls.items():
            result = call() if name != ROW_PATH else expected
            error = "no output" if result is None else disagreement(result[0], expected[0])
            if error is None:
                agreeing[name] = call
            else:
                errors[name] = error
        if errors:
            first = next(iter(errors))
            self._warn_once(f"disagrees {program.to_string()} {sorted(errors)}",
                            f"fxfuse: {len(errors)} in-GEMM configurations of {program.to_string()} disagree with "
                            f"the row pass (the first, {first!r}: {errors[first]}); the selection leaves them out")
        return agreeing

    def _runtime(self, device: torch.device):
        from .build import build_runtime

        if self._runtime_module is None:
            runtime = build_runtime(self._target_for(device))
            self._flags = runtime.GROUP_NORM_ROUNDS_STATS if group_norm_rounds_stats(device) else 0
            runtime.set_fallback(self.call, self._flags)
            runtime.set_grad_fallback(self.backward)
            runtime.set_measure(self.measure_call)
            if hasattr(runtime, "register_autograd"):  # the CUDA build
                _register_autograd(runtime)
            self._runtime_module = runtime
        return self._runtime_module

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

    def measure_call(self, program: str, x, weight, bias, params) -> None:
        """The runtime's call for a GEMM module's call in a bucket of M no selection has timed: a
        graph Dynamo traced with a symbolic batch serves every size with the routes measured at
        its traced size. Times the row path and the held module's configurations on this call's
        operands, once (no build; the measurement kept on disk), and routes the bucket. While a
        CUDA graph is captured nothing can be timed: the call takes the row path and a later one
        measures. Raises nothing: where the measurement fails, the bucket takes the row path."""
        k = x.shape[-1]
        m, n = x.numel() // k, weight.shape[0]
        try:
            if _capturing(x.device):
                return
            selection = self.select(Program.parse(program), x.dtype, tuple(p.dtype for p in params), (m, n, k),
                                    x.device, bias is not None, tuple(tuple(p.shape) for p in params),
                                    operands=(x, weight, bias, params), build=False)
        except Exception as error:  # noqa: BLE001 - the user's call goes on, on the row path
            selection = None
            self._warn_once(f"measure {program}", f"fxfuse: calls of {program} at {m} rows could not be timed "
                            f"({type(error).__name__}: {error}); they take the row path")
        if selection is None:  # routed all the same (select routes what it times), so that the
            # bucket's later calls do not come here again
            self._runtime_module.choose(program, DTYPE_CODES[x.dtype], _index(x.device), m, n, k, -1)

    # -- calling -----------------------------------------------------------------------------------

    def call(self, program: str, x, weight, bias, params, save_gemm: bool = False, gemm=None, config: int = -1):
        """``(out, batch_stats, gemm, kept)`` of the fused op: from the kernels, or from the reference
        where they do not cover the call."""
        result = self.forward_kernels(program, x, weight, bias, params, save_gemm, gemm, config)
        if result is not None:
            return result
        return reference.op_forward(Program.parse(program), x, weight, bias, list(params), save_gemm)

    def forward_kernels(self, program: str, x, weight, bias, params, save_gemm: bool = False, gemm=None,
                        config: int = -1):
        """The op's outputs from the program's kernels; None where they do not cover the call.
        ``gemm`` and ``config`` run one configuration of a GEMM module where it covers the call
        (the selection times each)."""
        handle = self._handle(program, x)
        runtime = self._runtime_module
        if not handle or runtime is None:
            return None
        return runtime.run(handle, x, weight, bias, params, self._flags, save_gemm,
                           gemm.info if gemm is not None else 0, config)

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


def random_operands(program: Program, dtype, param_dtypes, shape, device, has_bias: bool, param_shapes,
                    weight_is_kn: bool) -> tuple:
    """(x, weight, bias, params) of an (m, n, k) problem, drawn at random (seeded): a weight of
    the scale nn.Linear's initialisation gives, stored (K, N) where ``weight_is_kn``."""
    m, n, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    weight = torch.randn(*((k, n) if weight_is_kn else (n, k)), device=device, dtype=dtype, generator=g) * k ** -0.5
    bias = torch.randn(n, device=device, dtype=dtype, generator=g) if has_bias else None
    head_dim = next((s.head_dim for s in program.stages if isinstance(s, Rotary)), 1)
    kind_shapes = {"col": (n,), "full": (m, n), "row": (m, 1), "gemm": (n, k), "head": (m, head_dim)}  # scalars: ()
    shapes = param_shapes or tuple(kind_shapes.get(kind, ()) for kind in program.params)
    params = [torch.randn(s, device=device, dtype=d, generator=g) * k ** -0.5 if kind == "gemm"
              else torch.rand(s, device=device, dtype=d, generator=g) + 0.5
              for s, d, kind in zip(shapes, param_dtypes, program.params)]
    return x, weight, bias, params


def inductor_chain(program: Program, x, weight, bias, params) -> Callable[[], torch.Tensor]:
    """A call of the chain on these inputs as Inductor compiles it on its own: the eager
    reference traced to a graph and compiled by Inductor (its cuBLAS GEMM, then the kernels it
    generates for the epilogue), what the chain costs when fxfuse leaves it to Inductor.

    It is compiled and run outside the tracing and compile contexts of the graph being compiled
    (the backend measures while Dynamo compiles the user's frame): inside them Inductor would take
    that frame's fake mode and shape environment and leave symbols without sources in its guards."""
    from torch._guards import compile_context, tracing
    from torch._inductor import compile as inductor_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [x, weight, *([bias] if bias is not None else []), *params]

    def chain(x, weight, *rest):
        b, ps = (rest[0], rest[1:]) if bias is not None else (None, rest)
        return reference.op_forward(program, x, weight, b, list(ps), False)[0]

    def isolated(fn):
        with tracing(None), compile_context(None):
            return fn()

    compiled = isolated(lambda: inductor_compile(make_fx(chain)(*inputs), inputs))
    return lambda: isolated(lambda: compiled(*inputs))


# How far a GEMM configuration's output may lie from the row pass's, of the row pass's largest
# magnitude: the two round differently (the epilogue once, from float32; the row pass where eager
# does), a few 16-bit ulps apart, which an exponential after them (a softmax of values near 10)
# turns into 2 %; a kernel fault (a wrong index, an element not written) is far past it
AGREEMENT = 5e-2


def disagreement(out: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Where ``out`` (a GEMM configuration's output) and ``expected`` (the row pass's, on the same
    inputs) differ by more than AGREEMENT of the row pass's largest finite magnitude, or in
    their NaN or infinite positions: what differs (None where they agree). The selection leaves
    such a configuration out, so that a kernel fault on this device and shape is never chosen."""
    if out.shape != expected.shape:
        return f"shape {tuple(out.shape)} against {tuple(expected.shape)}"
    out, expected = out.float(), expected.float()
    finite = expected.isfinite()
    scale = expected[finite].abs().max().item() if finite.any() else 1.0
    close = torch.isclose(out, expected, rtol=0.0, atol=AGREEMENT * (scale or 1.0), equal_nan=True)
    if bool(close.all()):
        return None
    where = (~close).nonzero()[0].tolist()
    return (f"{int((~close).sum())} elements, the first at {tuple(where)}: {out[tuple(where)].item():.4g} "
            f"against {expected[tuple(where)].item():.4g}")


KN_WEIGHT_REASON = "no in-GEMM kernel reads a weight stored (K, N)"


def never_taken_reason(program: Program, dtype: torch.dtype, weight_is_kn: bool = False) -> str | None:
    """Why calls of ``program`` on ``dtype`` inputs can never take a GEMM module, whatever the
    process's settings (None: they can, settings allowing): a weight stored (K, N), which no
    configuration reads, or no module can be generated (``gemm_codegen.build_reason``). What a
    trace for builds elsewhere (the backend's GEMM items, the prebuild's) may decide."""
    from . import gemm_codegen

    return KN_WEIGHT_REASON if weight_is_kn else gemm_codegen.build_reason(program, dtype)


def not_taken_reason(program: Program, dtype: torch.dtype, weight_is_kn: bool = False) -> str | None:
    """Why calls of ``program`` on ``dtype`` inputs cannot take a GEMM module now, whatever is
    built (None: they can): they never can (``never_taken_reason``), or the process's settings
    keep them off (``gemm_codegen.setting_reason``: a float32 GEMM while torch does not allow TF32;
    the runtime then runs cuBLAS and the row pass whatever a route says)."""
    from . import gemm_codegen

    return never_taken_reason(program, dtype, weight_is_kn) or gemm_codegen.setting_reason(dtype)


def module_jobs(pairs, gemms) -> list:
    """The builds prepare_many runs (build.BuildJob): the runtime, the GEMM modules of ``gemms``
    (((program text, dtype, param dtypes), kernels) items), and the program module of each
    (program text, dtype) of ``pairs``."""
    from .build import RUNTIME_SOURCE, BuildJob

    return ([BuildJob(RUNTIME_SOURCE, torch.float32)] + [BuildJob(*item, kernels) for item, kernels in gemms]
            + [BuildJob(text, dtype) for text, dtype in pairs])


def gemm_modules_served(gemm_items) -> dict[tuple, frozenset]:
    """The GEMM modules ``gemm_items`` ((program, dtype, param dtypes, rows) as prepare_many's)
    ask for, as (program text, dtype, param dtypes) -> the calls each serves (rows_served): one a
    program, for the calls of all its items; none where the in-GEMM path does not take it."""
    from . import gemm_codegen

    gemms: dict[tuple, frozenset] = {}
    for program, dtype, params, rows in gemm_items:
        if not_taken_reason(program, dtype) is None:
            item = (program.to_string(), dtype, tuple(params))
            gemms[item] = gemms.get(item, frozenset()) | gemm_codegen.rows_served(rows)
    return gemms


def _selection_file(module_key: str, shape, bucket: int, device: torch.device):
    from .build import cache_root

    name = torch.cuda.get_device_name(device)
    text = f"{module_key}\n{shape[1]} {shape[2]} {bucket}\n{name}\n{torch.__version__}\n{TIMING_METHOD}"
    return cache_root() / "selections" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def read_measurement(path, kind: type):
    """The measurement (a dataclass of type ``kind``) stored at ``path``; None where it is absent,
    unreadable or of another form (an older one: measured again)."""
    try:
        return kind(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_measurement(path, measurement) -> None:
    """Store a measurement (a dataclass) at ``path``, atomically; an unwritable cache costs a
    measurement next time, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(measurement)))
        os.replace(tmp, path)
    except OSError:
        pass


def _index(device: torch.device) -> int:
    return -1 if device.index is None else device.index


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (nothing can be timed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
