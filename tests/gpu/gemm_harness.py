"""What the in-GEMM tests share: drawing a problem, the float64 truth, the correctness rule, and
running one configuration of a GEMM module into a poisoned buffer."""

from __future__ import annotations

import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse import reference
from fxfuse.cuda.build import cuda_target, gemm_target_reason
from fxfuse.cuda.gemm_codegen import SCHEDULES, canonical
from fxfuse.ir import Program
from programs import make_params
from selected import parameters, selected
from support import assert_under_rule as rule

DEVICE = "cuda"
TOL = 1e-2


def param_dtypes(program: Program, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """A widening chain's parameters are float32 (they promote it, as under autocast)."""
    return tuple(torch.float32 if program.widens else dtype for _ in program.params)


def build_modules(cases: dict[str, tuple[Program, torch.dtype]]) -> dict:
    """The GEMM module of each named (program, dtype), built in parallel (skips without a Hopper
    GPU, nvcc or CUTLASS)."""
    if not fxcuda.available():
        pytest.skip("no CUDA toolchain (nvcc + ninja)")
    reason = gemm_target_reason(cuda_target(torch.device(DEVICE)))
    if reason is not None:
        pytest.skip(reason)
    items = [(program, dtype) for program, dtype in cases.values()]
    gemms = [(program, dtype, param_dtypes(program, dtype)) for program, dtype in cases.values()]
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 cases: TF32 modules
    try:  # modules for calls of any rows: every kernel of the menu, the swapped ones included
        assert not fxcuda.prepare_many(items, gemm_items=[(*gemm, None) for gemm in gemms])
        device = torch.device(DEVICE, torch.cuda.current_device())
        built = {}
        for name, (program, dtype, params) in zip(cases, gemms):
            module = fxcuda.engine.prepare_gemm(program, dtype, params, device)
            assert module is not None, fxcuda.engine.gemm_error(program, dtype, params, device)
            built[name] = module
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return built


def build_menu_modules(programs: dict[str, Program], dtype: torch.dtype, menu: tuple) -> dict:
    """The GEMM module of each named program with the kernels of ``menu`` (not the production
    menu), built in parallel worker processes (build.build_in_subprocess, as prepare_many's), then
    loaded from the cache (skips as build_modules)."""
    import concurrent.futures
    import multiprocessing

    from fxfuse.cuda import build

    build_modules({})
    target = cuda_target(torch.device(DEVICE))
    texts = [program.to_string() for program in programs.values()]
    params = [param_dtypes(program, dtype) for program in programs.values()]
    n = len(texts)
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = list(pool.map(build.build_in_subprocess, texts, [dtype] * n, [target] * n, [2] * n, params,
                               [menu] * n))
    assert not any(errors), [error for error in errors if error]
    return {name: build.build_gemm(program, dtype, param_dtypes(program, dtype), target, kernels=menu)
            for name, program in programs.items()}


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


