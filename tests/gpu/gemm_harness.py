"""What the in-GEMM tests share: drawing a problem, the float64 truth, the correctness rule, and
running one configuration of a GEMM module into a poisoned buffer."""

from __future__ import annotations

import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse import reference
from fxfuse.cuda import build, gemm_codegen
from fxfuse.cuda.build import BuildJob, cuda_target, gemm_target_reason
from fxfuse.cuda.engine import module_jobs, not_taken_reason
from fxfuse.cuda.gemm_codegen import FEW_ROWS_KERNELS, KERNELS, SCHEDULES, Kernel, canonical, swaps
from fxfuse.ir import Program
from programs import make_params
from selected import parameters, selected
from support import assert_under_rule as rule

DEVICE = "cuda"
TOL = 1e-2


def param_dtypes(program: Program, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """A widening chain's parameters are float32 (they promote it, as under autocast)."""
    return tuple(torch.float32 if program.widens else dtype for _ in program.params)


def checking_menu(program: Program, turn: int) -> tuple[Kernel, ...]:
    """The kernels of a module built only to check that its kernels compute ``program``: one of the
    production menu's for many rows and, where the program swaps, one of those for few rows, each
    the ``turn``-th in turn. Programs given turns in order check every kernel on programs of every
    stage, at a fraction of the builds of every kernel for every program (those were 287 CUTLASS
    kernels, the GPU tests' prebuild more than ten minutes of a 64-core host)."""
    many = (KERNELS[turn % len(KERNELS)],)
    return many + ((FEW_ROWS_KERNELS[turn % len(FEW_ROWS_KERNELS)],) if swaps(program) else ())


def on_checking_menus(cases: dict, every_kernel: set) -> dict:
    """``cases`` ((name, dtype) -> (program, dtype)), those outside ``every_kernel`` (which keep
    the production menu) on a checking_menu each, turns in order."""
    return {key: case if key in every_kernel else (*case, checking_menu(case[0], turn))
            for turn, (key, case) in enumerate(cases.items())}


def gemm_jobs(cases: dict) -> list[BuildJob]:
    """The builds of the GEMM modules of ``cases`` (name -> (program, dtype) for the production
    menu's, or (program, dtype, kernels)), of their programs' row modules (their fallback) and of
    the runtime, as prepare_many's (engine.module_jobs)."""
    pairs = [(program.to_string(), dtype) for program, dtype, *_ in cases.values()]
    gemms = [((program.to_string(), dtype, param_dtypes(program, dtype)), menu[0] if menu else gemm_codegen.menu(program))
             for program, dtype, *menu in cases.values() if not_taken_reason(program, dtype) is None]
    return module_jobs(pairs, gemms)


def build_modules(cases: dict) -> dict:
    """The GEMM module of each named case (gemm_jobs), built in parallel: the production menu's
    as a compile prepares it (the engine holds it, so the selection's tests run on it), or one of
    the kernels given (skips without a Hopper GPU, nvcc or CUTLASS)."""
    if not fxcuda.available():
        pytest.skip("no CUDA toolchain (nvcc + ninja)")
    device = torch.device(DEVICE, torch.cuda.current_device())
    target = cuda_target(device)
    reason = gemm_target_reason(target)
    if reason is not None:
        pytest.skip(reason)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 cases: TF32 modules
    try:
        errors = build.build_many(gemm_jobs(cases), target)
        assert not any(errors.values()), [error for error in errors.values() if error]
        assert not fxcuda.prepare_many([(program, dtype) for program, dtype, *_ in cases.values()])  # loads
        built = {}
        for name, (program, dtype, *menu) in cases.items():
            params = param_dtypes(program, dtype)
            if menu:
                built[name] = build.build_gemm(program, dtype, params, target, kernels=menu[0])
            else:
                built[name] = fxcuda.engine.prepare_gemm(program, dtype, params, device)
                assert built[name] is not None, fxcuda.engine.gemm_error(program, dtype, params, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return built


class Modules(dict):
    """A test file's GEMM modules by (name, dtype): those its selected tests name (their ``name``
    and ``dtype`` parameters) are built at once, in parallel; any other on first use. So
    ``pytest -k s05`` builds S05's module, not every module of the file."""

    def __init__(self, request: pytest.FixtureRequest, cases: dict[tuple, tuple[Program, torch.dtype]]):
        super().__init__(build_modules({key: cases[key] for key in selected_cases(request, cases)}))
        self.cases = cases

    def __missing__(self, key: tuple):
        self.update(build_modules({key: self.cases[key]}))
        return self[key]


def selected_cases(request: pytest.FixtureRequest, cases: dict) -> list[tuple]:
    """The keys of ``cases`` the run's selected tests of the requesting file name: (name, dtype),
    the dtype bfloat16 where a test has no dtype parameter."""

    def named(item, key) -> bool:
        params = parameters(item)
        return key == (params.get("name"), params.get("dtype", torch.bfloat16))

    return selected(request, cases, named)


def draw(program: Program, dtype: torch.dtype, m: int, n: int, k: int, seed: int, batch: tuple = ()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if program.gemm.bias else None
    params = make_params(program, n, dtype=torch.float32 if program.widens else dtype, generator=g, device=DEVICE,
                         lead=(*batch, m), k=k)
    return x, w, b, params


def truth(program: Program, x, w, b, params) -> torch.Tensor:
    """The program in float64 without rounding points: what every result approximates."""
    exact = canonical(program)
    return reference.op_forward(exact, x.double(), w.double(), None if b is None else b.double(),
                                [p.double() for p in params], False)[0]


def truth_statistics(program: Program, x, w, b, params) -> torch.Tensor:
    """A training BatchNorm program's batch statistics, as the op returns them beside its output,
    in float64."""
    return reference.op_forward(program, x.double(), w.double(), None if b is None else b.double(),
                                [p.double() for p in params], False)[1]


def assert_under_rule(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """The correctness rule at the low-precision tolerance (tests/support.py)."""
    rule(out, eager, exact, TOL)


def assert_every_kernel_computes(module, program: Program, dtype: torch.dtype, m: int, n: int, k: int,
                                 seeds: int) -> None:
    """One configuration of each kernel, on ``seeds`` draws of an (m, n, k) problem, obeys the rule."""
    for seed in range(seeds):
        x, w, b, params = draw(program, dtype, m, n, k, seed)
        eager = reference.op_forward(program, x, w, b, params, False)[0]
        exact = truth(program, x, w, b, params)
        for config in kernels(module):
            assert_under_rule(run_config(module, program, x, w, b, params, config), eager, exact)


def kernels(module) -> range:
    """One configuration of each kernel (the first schedule of each): schedules only reorder tiles."""
    return range(0, len(module.config_names), SCHEDULES)


def names_of(module, kernels: tuple, configs=None) -> set[str]:
    """The names of the module's configurations (of ``configs``, default all) whose kernel is one
    of ``kernels``."""
    configs = range(len(module.config_names)) if configs is None else configs
    return {module.config_names[c] for c in configs if module.kernel_of(c) in kernels}


def every_schedule(module, m: int, n: int, k: int) -> list[int]:
    """Every configuration of the module, each kernel at each tile order, but a swapped kernel's
    (fxg::Swapped: one CTA a tile, no tile orders) past its first: those are checked not to cover
    an (m, n, k) call."""
    assert len(module.config_names) == len(module.kernels) * SCHEDULES
    configs = []
    for config in range(len(module.config_names)):
        if module.kernel_of(config).swapped and config % SCHEDULES:
            assert not module.supports(m, n, k, config)
            assert module.config_names[config].endswith("one CTA a tile")
        else:
            configs.append(config)
    return configs


def run_config(module, program, x, w, b, params, config: int) -> torch.Tensor:
    """Configuration ``config`` of the module's output (it must cover the call)."""
    return run_config_outputs(module, program, x, w, b, params, config)[0]


def run_config_outputs(module, program, x, w, b, params, config: int) -> tuple:
    """Configuration ``config`` of the module's op outputs ``(out, batch_stats, gemm, kept)``."""
    n = w.shape[0]
    m = x.numel() // x.shape[-1]
    assert module.supports(m, n, x.shape[-1], config)
    result = fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params, gemm=module, config=config)
    assert result is not None, "the call did not take the in-GEMM path"
    return result


