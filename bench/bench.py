"""Time fxfuse against the bare GEMM, eager PyTorch and Inductor on the public suite (SUITE.md).

    python bench/bench.py [--rows S01,S02,S23] [--dtype bf16|fp16|fp32|tf32|autocast]
                          [--json out.json] [--png out.png] [--repeats N]
    python bench/bench.py --merge part1.json part2.json ... [--json all.json]

For every row, in one process, four variants of the model at its benchmark size on CUDA:

* ``gemm``: the model's GEMMs alone (its ``nn.Linear`` layers chained through ``F.linear``, or
  ``x @ W.T`` for S15), the floor that fusion is measured against;
* ``eager``: the model itself;
* ``inductor``: ``torch.compile(model)``;
* ``fxfuse``: ``torch.compile(model, backend="fxfuse")``;
* ``inductor_max`` (with ``--max-autotune``): ``torch.compile(model, mode="max-autotune")``.

The fxfuse report's GPU path of each fused chain (the in-GEMM configuration or the row pass its
shape measured fastest on, and the times measured) is printed under the table.

Each is timed three ways, because each answers a different question:

* ``gpu``: device time per call, from replays of a CUDA graph of 20 calls (launch gaps removed),
  or, where capture fails, the profiler's sum of kernel durations (marked ``*``);
* ``pipelined``: 50 calls issued back to back between CUDA events, per call (what a busy
  inference loop sees: device time plus whatever CPU overhead the GPU cannot hide);
* ``latency``: one call between ``torch.cuda.synchronize()`` calls on a host clock (what a single
  request sees; CPU-bound at decode shapes).

Graph replays, pipelined, latency and CPU-cost samples are taken in blocks: each variant runs alone
for a while, then is sampled, the order rotated by one every pass (``in_blocks``), so that no
variant is timed in the state another left on the card and slow drift of a shared host or of the
GPU's clocks lands on all of them alike.

Plus peak memory per call, the per-call CPU cost of each variant on a tiny (8 x 64 -> 64) version of
the model (and of Dynamo alone, ``backend="eager"``), and a check of fxfuse's output against eager.

Inputs are ``torch.rand`` draws made up front, rotated among ``N_INPUT_SETS`` sets so that repeated
calls do not just re-read the cache. Everything runs under ``torch.no_grad()``; models are in
training mode (BatchNorm on batch statistics) unless the row is an eval row. Compilation happens in
the warm-up, never inside a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.suite import SuiteRow, build, make_inputs, select
from fxfuse.accuracy import rule_breaks

Fn = Callable[..., Any]
Inputs = Sequence[torch.Tensor]

VARIANTS = ("gemm", "eager", "inductor", "fxfuse")
MAX_AUTOTUNE = "inductor_max"  # the optional variant: Inductor's max-autotune mode
CPU_VARIANTS = ("gemm", "eager", "dynamo", "inductor", "fxfuse")
N_INPUT_SETS = 4
GRAPH_CALLS = 20  # calls captured in one CUDA graph
PIPELINE_CALLS = 50  # calls issued back to back
WARMUP_CALLS = 3
CPU_WARMUP_CALLS = 20
TINY_SIZE = "tiny"  # the examples' 8 x 64 -> 64 size, for per-call CPU cost


@dataclass(frozen=True)
class DtypeSpec:
    """How a ``--dtype`` choice is realised, and the tolerance its results are checked at."""

    param_dtype: torch.dtype
    tf32: bool = False
    autocast: torch.dtype | None = None
    tol: float = 1e-2


DTYPES: dict[str, DtypeSpec] = {
    "bf16": DtypeSpec(torch.bfloat16),
    "fp16": DtypeSpec(torch.float16),
    "fp32": DtypeSpec(torch.float32, tol=1e-4),  # TF32 off: true fp32 GEMMs
    "tf32": DtypeSpec(torch.float32, tf32=True),
    "autocast": DtypeSpec(torch.float32, autocast=torch.bfloat16),  # autocast(bf16) over fp32
}


@dataclass(frozen=True)
class Config:
    """Knobs shared by every measurement of one run."""

    dtype: str = "bf16"
    repeats: int = 20  # samples behind each gpu / pipelined median
    latency_calls: int = 100
    cpu_calls: int = 500  # samples behind each CPU-cost median
    max_autotune: bool = False  # also time Inductor's max-autotune mode


# --------------------------------------------------------------------------------------------
# Variants


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a weight stored (K, N), applied as addmm(b, x, W)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _gemm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Linear):
        return F.linear(x, module.weight, module.bias)
    return torch.addmm(module.bias, x.reshape(-1, x.shape[-1]), module.weight)


def gemm_callable(model: nn.Module, example: Inputs | None = None) -> Fn:
    """The model's GEMMs alone, on the same shapes.

    Chaining the ``nn.Linear`` layers through ``F.linear`` gives each GEMM its real input shape
    (S19's and S22's second GEMM reads the first one's output) without any epilogue op; a model
    with no Linear (S15) multiplies by its ``weight`` Parameter as the model spells it. Where the
    Linears do not chain (S26's gate and up projections read the same x; S27 takes two inputs), or
    the GEMMs are GPT-2's Conv1D (S25: addmm with a (K, N) weight), each GEMM's input is recorded
    from one eager call on ``example`` and the GEMMs replay on those tensors.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    gemms = [m for m in model.modules() if isinstance(m, nn.Linear) or _is_conv1d(m)]
    chains = len(gemms) == len(linears) and all(a.out_features == b.in_features for a, b in zip(linears, linears[1:]))
    if linears and (example is None or (chains and len(example) == 1)):

        def gemm(x: torch.Tensor) -> torch.Tensor:
            for lin in linears:
                x = F.linear(x, lin.weight, lin.bias)
            return x

        return gemm
    if gemms and example is not None:
        seen: list[tuple[nn.Module, torch.Tensor]] = []
        hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].detach().clone())))
                 for m in gemms]
        try:
            with torch.no_grad():
                model(*example)
        finally:
            for h in hooks:
                h.remove()
        return lambda *_: [_gemm(m, x) for m, x in seen]
    weight = model.get_parameter("weight")
    return lambda x: x @ weight.T


def fxfuse_backend_arg() -> str | Fn:
    """``"fxfuse"``, as users spell it; the backend function itself where the entry point that
    registers the name is missing (a checkout on PYTHONPATH rather than ``pip install``)."""
    try:
        torch._dynamo.lookup_backend("fxfuse")
        return "fxfuse"
    except Exception:
        from fxfuse.backend import fxfuse_backend as backend

        return backend


def compile_fxfuse(model: nn.Module) -> Fn:
    return torch.compile(model, backend=fxfuse_backend_arg())


def make_variants(model: nn.Module, spec: DtypeSpec, names: Sequence[str], example: Inputs | None = None) -> dict[str, Fn]:
    """Callables for ``names``; compiled variants get their own copy of the model.

    Copies are taken before any call, so all variants start from the same parameters and
    BatchNorm statistics; separate modules also keep each backend's Dynamo cache entries apart.
    Compilation itself is lazy (first call, i.e. the warm-up).
    """
    factories: dict[str, Callable[[], Fn]] = {
        "gemm": lambda: gemm_callable(model, example),
        "eager": lambda: model,
        "dynamo": lambda: torch.compile(copy.deepcopy(model), backend="eager"),
        "inductor": lambda: torch.compile(copy.deepcopy(model)),
        "fxfuse": lambda: compile_fxfuse(copy.deepcopy(model)),
        MAX_AUTOTUNE: lambda: torch.compile(copy.deepcopy(model), mode="max-autotune"),
    }
    out: dict[str, Fn] = {}
    for name in names:
        try:
            out[name] = with_autocast(factories[name](), spec)
        except Exception as e:  # e.g. fxfuse not importable: record it, keep the other variants
            out[name] = _failing(e)
    return out


def with_autocast(fn: Fn, spec: DtypeSpec) -> Fn:
    """``fn`` under autocast when the dtype asks for it (cache off: the calls may be captured)."""
    if spec.autocast is None:
        return fn

    def call(*args: torch.Tensor) -> Any:
        with torch.autocast("cuda", dtype=spec.autocast, cache_enabled=False):
            return fn(*args)

    return call


def _failing(err: Exception) -> Fn:
    def call(*args: torch.Tensor) -> Any:
        raise err

    return call


# --------------------------------------------------------------------------------------------
# Timers. Each returns samples in milliseconds per call; the caller takes the median.


def _call(fn: Fn, input_sets: Sequence[Inputs], i: int) -> Any:
    return fn(*input_sets[i % len(input_sets)])


def warm_up(fn: Fn, input_sets: Sequence[Inputs], calls: int = WARMUP_CALLS) -> None:
    """Compile and settle ``fn`` on a side stream, as CUDA graph capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            _call(fn, input_sets, i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _event_ms(body: Callable[[], None]) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture(fn: Fn, input_sets: Sequence[Inputs]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``GRAPH_CALLS`` calls of ``fn`` (warmed up already); raises if uncapturable.

    Each captured call reads one of the pre-drawn input sets directly, so no copies into static
    buffers are needed before a replay.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(GRAPH_CALLS):
            _call(fn, input_sets, i)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    return graph


def graph_sample(replay: Fn, _input_sets: Sequence[Inputs], _round: int) -> float:
    """GPU ms per call of one replay of a captured graph, between CUDA events."""
    return _event_ms(replay) / GRAPH_CALLS


def time_kernels(fn: Fn, input_sets: Sequence[Inputs], repeats: int) -> list[float]:
    """Fallback for uncapturable variants: the profiler's summed kernel time per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    samples = []
    for _ in range(max(1, min(repeats, 3))):  # each profiler session is slow to start
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the profiler warns about its cycles on every session
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(GRAPH_CALLS):
                    _call(fn, input_sets, i)
                torch.cuda.synchronize()
            events = prof.events()
        us = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA)
        samples.append(us / 1e3 / GRAPH_CALLS)
    return samples


def pipelined_sample(fn: Fn, input_sets: Sequence[Inputs], _round: int) -> float:
    """Per-call ms of ``PIPELINE_CALLS`` calls issued back to back, between CUDA events."""

    def body() -> None:
        for i in range(PIPELINE_CALLS):
            _call(fn, input_sets, i)

    torch.cuda.synchronize()
    return _event_ms(body) / PIPELINE_CALLS


def latency_sample(fn: Fn, input_sets: Sequence[Inputs], round_: int) -> float:
    """Wall ms of one call between synchronizations, on the host clock."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _call(fn, input_sets, round_)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def cpu_sample(fn: Fn, input_sets: Sequence[Inputs], round_: int) -> float:
    """Host us of one call that only enqueues its kernels (the GPU queue starts empty)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _call(fn, input_sets, round_)
    return (time.perf_counter() - t0) * 1e6


Sampler = Callable[[Fn, Sequence[Inputs], int], float]


def in_blocks(
    sample: Sampler, fns: dict[str, Fn], input_sets: Sequence[Inputs], rounds: int, passes: int | None = None,
    settle_s: float = 0.2,
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``rounds`` samples of every variant, taken in blocks: one variant at a time runs untimed
    for ``settle_s``, then is sampled ``rounds / passes`` times; the order rotated by one every
    pass, ``passes`` passes in all (by default one per variant).

    A variant sampled right after another runs in the state that one left: a big GEMM runs at the
    card's power limit, and round-robin samples timed S26 at 0.89x Inductor's where each variant
    run alone measured 1.11x (BENCHMARKS.md section 17). Rotating the order puts every variant
    at every position once (with a pass per variant), so slow drift of the host (other tenants,
    clocks, Inductor's compile workers) falls on all variants alike, and no variant runs two blocks
    in a row, deeper into its own state than the others (with more than two variants). At decode
    shapes, where a call is CPU-bound, that drift was as large as the differences measured.
    Before the first block all variants run in turn, untimed, for ``WARM_UP_S``
    (``fxfuse.cuda.timing.warm_up``): the card's power limiter swings its clocks for seconds after a heavy
    load starts, and without the warm-up the fourth block, always fxfuse's first, ran 7.5 % slow
    on average. Python's GC is off meanwhile, as in timeit. A variant that raises is dropped; its
    error is returned.
    """
    from fxfuse.cuda.timing import warm_up

    names = list(fns)
    passes = passes or max(1, len(names))
    samples: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    per_block = max(1, -(-rounds // passes))
    gc_enabled = gc.isenabled()
    gc.disable()

    def untimed(fn: Fn) -> None:
        with contextlib.suppress(Exception):  # a failing variant is dropped in its block, with its error
            sample(fn, input_sets, 0)

    try:
        warm_up([lambda fn=fns[n]: untimed(fn) for n in names])
        for p in range(passes):
            k = p % len(names) if names else 0
            for n in names[k:] + names[:k]:
                if n in errors:
                    continue
                try:
                    settled_at = time.perf_counter() + settle_s
                    sample(fns[n], input_sets, 0)
                    while time.perf_counter() < settled_at:
                        sample(fns[n], input_sets, 0)
                    for _ in range(min(per_block, rounds - len(samples[n]))):
                        samples[n].append(sample(fns[n], input_sets, len(samples[n])))
                except Exception as e:
                    traceback.print_exc(file=sys.stderr)
                    errors[n] = _error(e)
    finally:
        if gc_enabled:
            gc.enable()
    return samples, errors


def peak_mib(fn: Fn, inputs: Inputs) -> float:
    """Memory one call allocates at its peak (output included) beyond what was held before it."""
    fn(*inputs)  # one-time allocations on this stream (e.g. cuBLAS's workspace) are not per call
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


# --------------------------------------------------------------------------------------------
# One row


def _median(samples: list[float] | None) -> float | None:
    return statistics.median(samples) if samples else None


def _error(e: BaseException) -> str:
    """One line for the table's error list; the full traceback goes to stderr."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def prepare(
    fn: Fn, input_sets: Sequence[Inputs], cfg: Config
) -> tuple[dict[str, Any], torch.cuda.CUDAGraph | None]:
    """Warm-up (compilation), peak memory and a CUDA graph of one variant.

    Where capture fails, the GPU time comes from the profiler instead, right away. A failure of
    the variant itself (say, the backend cannot compile the row) is recorded rather than raised,
    so that the other variants and rows still get measured.
    """
    res: dict[str, Any] = {"error": None}
    try:
        warm_up(fn, input_sets)
        res["peak_mib"] = peak_mib(fn, input_sets[0])
        try:
            graph = capture(fn, input_sets)
            res["gpu_method"] = "cuda_graph"
            return res, graph
        except Exception as e:
            res["graph_error"] = _error(e)
            torch.cuda.synchronize()
            res["gpu_samples"] = time_kernels(fn, input_sets, cfg.repeats)
            res["gpu_method"] = "profiler"
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        res["error"] = _error(e)
    return res, None


def check(fn: Fn, ref: Fn, truth: Fn, input_sets: Sequence[Inputs], tol: float) -> dict[str, Any]:
    """Does ``fn`` obey the correctness rule on every input set: each value within atol = rtol =
    ``tol`` of ``ref``'s (eager), or no further from ``truth``'s (the model in float64) than
    eager's is, with NaN where eager has NaN? ``max_abs_err`` is against eager."""
    ok, worst = True, 0.0
    for inputs in input_sets:
        try:
            outs, expecteds = _tensors(fn(*inputs)), _tensors(ref(*inputs))
            exacts = _tensors(truth(*[t.double() if t.is_floating_point() else t for t in inputs]))
        except Exception as e:
            return {"ok": False, "error": _error(e)}
        for out, expected, exact in zip(outs, expecteds, exacts):
            if out.shape != expected.shape:
                return {"ok": False, "error": f"shape {tuple(out.shape)} != {tuple(expected.shape)}"}
            worst = max(worst, (out.double() - expected.double()).abs().nan_to_num(0.0).max().item())
            ok = ok and not rule_breaks(out, expected, exact, tol).any()
    return {"ok": ok, "max_abs_err": worst}


def _tensors(value) -> list[torch.Tensor]:
    """A model's output as a list of tensors (S27 returns two)."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _release() -> None:
    """Drop compiled code and cached blocks so that rows do not see each other's state.

    Resetting Dynamo also matters for correctness of the timings: the S23 rows reuse S01's model
    class at other shapes, and without a reset Dynamo would recompile them with dynamic shapes.
    """
    torch._dynamo.reset()
    _release_memory()


def _release_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _sample_into(
    variants: dict[str, dict[str, Any]],
    kind: str,
    sample: Sampler,
    fns: dict[str, Fn],
    input_sets: Sequence[Inputs],
    rounds: int,
) -> None:
    """Interleaved samples of ``kind`` for ``fns`` into ``variants``; failures become errors."""
    samples, errors = in_blocks(sample, fns, input_sets, rounds)
    for name, values in samples.items():
        if values:
            variants[name][f"{kind}_samples"] = values
    for name, err in errors.items():
        variants[name]["error"] = err


def measure_row(row: SuiteRow, spec: DtypeSpec, cfg: Config) -> dict[str, Any]:
    """The four variants of ``row`` at its benchmark size, and fxfuse's correctness."""
    _release()
    torch.manual_seed(0)
    model, first = build(row, device="cuda", dtype=spec.param_dtype)
    input_sets = [first] + [
        make_inputs(row, device="cuda", dtype=spec.param_dtype) for _ in range(N_INPUT_SETS - 1)
    ]
    fns = make_variants(model, spec, VARIANTS + ((MAX_AUTOTUNE,) if cfg.max_autotune else ()), first)
    import fxfuse

    fxfuse.reset_report()
    prepared = {name: prepare(fn, input_sets, cfg) for name, fn in fns.items()}
    paths = [r.path for r in fxfuse.last_report().rows if r.status != "not_fused" and r.path]
    left = [r.reason for r in fxfuse.last_report().rows if r.status == "not_fused" and r.reason]
    variants = {name: res for name, (res, _) in prepared.items()}
    replays = {name: graph.replay for name, (_, graph) in prepared.items() if graph is not None}
    _sample_into(variants, "gpu", graph_sample, replays, input_sets, cfg.repeats)
    del prepared, replays  # frees the graphs' memory pools
    _release_memory()

    for kind, sample, rounds in (
        ("pipelined", pipelined_sample, cfg.repeats),
        ("latency", latency_sample, cfg.latency_calls),
    ):
        ready = {name: fn for name, fn in fns.items() if not variants[name]["error"]}
        _sample_into(variants, kind, sample, ready, input_sets, rounds)
    for v in variants.values():
        for kind in ("gpu", "pipelined", "latency"):
            v[f"{kind}_ms"] = _median(v.get(f"{kind}_samples"))
    with torch.no_grad():
        exact = copy.deepcopy(model).double()
    result = {
        "input_shapes": [list(t.shape) for t in first],
        "variants": variants,
        "fxfuse_paths": paths,
        "fxfuse_left_to_inductor": left,
        "check": {
            name: check(fns[name], fns["eager"], exact, input_sets, spec.tol)
            for name in ("inductor", "fxfuse")
        },
    }
    del fns, model, input_sets, first
    _release()
    return result


def measure_cpu(row: SuiteRow, spec: DtypeSpec, cfg: Config) -> dict[str, float | str]:
    """Per-call host cost (us) of each variant, and of Dynamo alone, on the row's tiny model."""
    _release()
    torch.manual_seed(0)
    model, inputs = build(row, size=TINY_SIZE, device="cuda", dtype=spec.param_dtype)
    fns = make_variants(model, spec, CPU_VARIANTS, inputs)
    errors: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(CPU_WARMUP_CALLS):
                fn(*inputs)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            errors[name] = _error(e)
    ready = {name: fn for name, fn in fns.items() if name not in errors}
    samples, late_errors = in_blocks(cpu_sample, ready, [inputs], cfg.cpu_calls)
    errors.update(late_errors)
    del fns, ready, model, inputs
    _release()
    return {name: errors.get(name) or _median(samples.get(name)) for name in CPU_VARIANTS}


# --------------------------------------------------------------------------------------------
# Whole run


@contextlib.contextmanager
def tf32_allowed(enabled: bool) -> Iterator[None]:
    """torch's TF32 setting for float32 GEMMs set to ``enabled`` inside the block, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def environment(dtype: str) -> dict[str, str]:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "dtype": dtype,
        "fxfuse_backend": _describe_backend(),
    }


def _describe_backend() -> str:
    try:
        arg = fxfuse_backend_arg()
    except Exception as e:
        return f"unavailable ({_error(e)})"
    return (
        '"fxfuse"'
        if arg == "fxfuse"
        else "fxfuse.backend.fxfuse_backend (entry point not installed)"
    )


def run(
    rows: list[str] | None = None,
    dtype: str = "bf16",
    repeats: int = 20,
    *,
    latency_calls: int = 100,
    cpu_calls: int = 500,
    max_autotune: bool = False,
    json_path: str | Path | None = None,
    png_path: str | Path | None = None,
    show: bool = True,
) -> dict[str, Any]:
    """Benchmark suite ``rows`` (ids such as "S01"; "S23" means all decode rows; None: all).

    Returns ``{"env": {...}, "config": {...}, "rows": [...]}`` with every sample; prints the
    tables when ``show`` (each row's to stderr as it finishes, all of them at the end); writes
    JSON (rewritten after each row) and a bar chart when paths are given.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench.run needs a CUDA GPU")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    spec, cfg = DTYPES[dtype], Config(dtype, repeats, latency_calls, cpu_calls, max_autotune)
    report: dict[str, Any] = {"env": environment(dtype), "config": asdict(cfg), "rows": []}
    cpu_cache: dict[str, dict[str, float | str]] = {}  # S23 rows share their base row's tiny model
    with torch.no_grad(), tf32_allowed(spec.tf32):
        for row in select(rows):
            print(f"[bench] {row.id}: {row.description}", file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"id": row.id, "description": row.description, "size": row.size}
            try:
                entry.update(measure_row(row, spec, cfg))
                if row.module not in cpu_cache:
                    cpu_cache[row.module] = measure_cpu(row, spec, cfg)
                entry["cpu_us"] = cpu_cache[row.module]
            except Exception as e:  # e.g. out of memory: report the row, go on with the rest
                traceback.print_exc(file=sys.stderr)
                entry["error"] = _error(e)
                _release()
            report["rows"].append(entry)
            # each row as it finishes: a run cut short by a time limit keeps the rows it timed
            if show:
                print(format_report({**report, "rows": [entry]}), file=sys.stderr, flush=True)
            if json_path:
                Path(json_path).write_text(json.dumps(report, indent=1))
    if show:
        print(format_report(report))
    if png_path:
        plot(report, png_path)
    return report


# --------------------------------------------------------------------------------------------
# Output


def variant_ms(v: dict[str, Any] | None, kind: str) -> float | None:
    """A variant's time per call of one timing ("gpu", "pipelined", "latency"), None if it failed."""
    return None if v is None or v.get("error") else v.get(f"{kind}_ms")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _correct(entry: dict[str, Any]) -> str:
    """fxfuse's check under the correctness rule; on a failure, also Inductor's."""
    checks = entry.get("check", {})
    c = checks.get("fxfuse", {})
    if "ok" not in c:
        return "-"
    if c.get("error"):
        return "ERR"
    if c["ok"]:
        return "yes"
    ind = checks.get("inductor", {})
    return f"NO {c['max_abs_err']:.1e} (ind {'ok' if ind.get('ok') else 'NO'})"


def _profiled_mark(variant: dict[str, Any] | None) -> str:
    """``*`` where a variant's GPU time is the profiler's kernel sum, not CUDA-graph replay."""
    return "*" if variant and variant.get("gpu_method") == "profiler" else ""


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """The ratio table: GPU ms per variant, then fxfuse/GEMM, inductor/GEMM, fxfuse/inductor for
    each of the three timings, then peak memory and correctness."""
    out = []
    for e in report["rows"]:
        v = e.get("variants", {})
        gemm, eager, ind, fx = (v.get(n) for n in VARIANTS)
        line = [e["id"], _fmt(variant_ms(gemm, "gpu")), _fmt(variant_ms(eager, "gpu")), _fmt(variant_ms(ind, "gpu"))]
        line.append(_fmt(variant_ms(fx, "gpu")) + _profiled_mark(fx))
        same_graph = "=" if fused_nothing(e) else ""
        for kind in ("gpu", "pipelined", "latency"):
            g, i, f = variant_ms(gemm, kind), variant_ms(ind, kind), variant_ms(fx, kind)
            line += [_ratio(f, g), _ratio(i, g), _ratio(f, i) + same_graph]
        # max-autotune's own CUDA graphs cannot be captured inside the benchmark's: its GPU time
        # is then the profiler's kernel sum (no launch gaps), marked as fxfuse's is
        max_mode = v.get(MAX_AUTOTUNE)
        line.append(_ratio(variant_ms(fx, "gpu"), variant_ms(max_mode, "gpu")) + _profiled_mark(max_mode))
        line += [_fmt((fx or {}).get("peak_mib"), ".1f"), _fmt((ind or {}).get("peak_mib"), ".1f")]
        line.append("ERR" if e.get("error") else _correct(e))
        out.append(line)
    return out


def fused_nothing(entry: dict[str, Any]) -> bool:
    """fxfuse left every chain of the row to Inductor: its compiled model is Inductor's compile
    of the same graph, and the two columns time one program twice."""
    return not entry.get("fxfuse_paths") and bool(entry.get("fxfuse_left_to_inductor"))


TABLE_HEADERS = [
    "row", "GEMM\nms", "eager\nms", "inductor\nms", "fxfuse\nms",
    "fx/GEMM\ngpu", "ind/GEMM\ngpu", "fx/ind\ngpu",
    "fx/GEMM\npipe", "ind/GEMM\npipe", "fx/ind\npipe",
    "fx/GEMM\nlat", "ind/GEMM\nlat", "fx/ind\nlat", "fx/max\ngpu",
    "MiB\nfxfuse", "MiB\ninductor", "correct?",
]  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    """Header line, the ratio table, the CPU-cost table and any errors, as text."""
    from tabulate import tabulate

    env = report["env"]
    head = (
        f"{env['date']}  {env['device']}  torch {env['torch']}  CUDA {env['cuda']}"
        f"  dtype {env['dtype']}"
    )
    if env.get("fxfuse_backend", '"fxfuse"') != '"fxfuse"':
        head += f"\nfxfuse backend: {env['fxfuse_backend']}"
    if env.get("parts"):
        head += f"\nmerged from {len(env['parts'])} runs on this card, started {', '.join(env['parts'])}"
    parts = [head, "", tabulate(table_rows(report), headers=TABLE_HEADERS, disable_numparse=True)]
    parts.append(
        "ms: GPU time per call (CUDA graph replay; * = profiler kernel sum);"
        " ratios < 1: fxfuse faster; fx/max: against Inductor max-autotune (--max-autotune; * = its time a"
        " profiler kernel sum);"
        " fx/ind =: fxfuse fused nothing, both columns time Inductor's graph (the ratio is noise)"
    )
    paths = [f"  {e['id']}: {p}" for e in report["rows"] for p in e.get("fxfuse_paths", [])]
    if paths:
        parts += ["", "fxfuse GPU paths (what each fused chain's shape measured fastest on):", *paths]
    left = [f"  {e['id']}: {r}" for e in report["rows"] for r in e.get("fxfuse_left_to_inductor", [])]
    if left:
        parts += ["", "chains fxfuse left to Inductor, and why:", *left]
    cpu_rows = [
        [e["id"]] + [_fmt(e.get("cpu_us", {}).get(n), ".1f") for n in CPU_VARIANTS]
        for e in report["rows"]
    ]
    cpu_headers = ["row", "F.linear", "eager", "dynamo\n(eager)", "inductor", "fxfuse"]
    parts += [
        "",
        "CPU us per call, tiny model (8 x 64 -> 64):",
        tabulate(cpu_rows, headers=cpu_headers, disable_numparse=True),
    ]
    errors = list(_errors(report))
    if errors:
        parts += ["", "errors:"] + [f"  {line}" for line in errors]
    return "\n".join(parts)


def _errors(report: dict[str, Any]) -> Iterator[str]:
    for e in report["rows"]:
        if e.get("error"):
            yield f"{e['id']}: {e['error']}"
        for name, v in e.get("variants", {}).items():
            if v.get("error"):
                yield f"{e['id']} {name}: {v['error']}"
            elif v.get("graph_error"):
                yield f"{e['id']} {name}: not capturable ({v['graph_error']})"
        for name, c in e.get("check", {}).items():
            if c.get("error") and not e["variants"].get(name, {}).get("error"):
                yield f"{e['id']} {name} check: {c['error']}"
        for name, c in e.get("cpu_us", {}).items():
            if isinstance(c, str):
                yield f"{e['id']} cpu {name}: {c}"


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Bar chart of GPU time over the bare GEMM per row; silently skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ids = [e["id"] for e in report["rows"]]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(ids)), 4.5))
    width = 0.27
    for k, name in enumerate(("eager", "inductor", "fxfuse")):
        ratios = []
        for e in report["rows"]:
            v = e.get("variants", {})
            g, x = variant_ms(v.get("gemm"), "gpu"), variant_ms(v.get(name), "gpu")
            ratios.append(x / g if x and g else 0.0)
        ax.bar([i + (k - 1) * width for i in range(len(ids))], ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ids)), ids, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GPU time / bare GEMM")
    env = report["env"]
    ax.set_title(f"{env['device']}, {env['dtype']}, torch {env['torch']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report of the rows of several runs of this script (a suite timed in parts, each in a
    command of its own), in their order. The runs must share device, torch version and dtype: only
    ratios measured on one card are comparable."""
    if not reports:
        raise ValueError("no reports to merge")
    env = reports[0]["env"]
    for other in reports[1:]:
        mismatched = [key for key in ("device", "torch", "dtype") if other["env"].get(key) != env.get(key)]
        if mismatched:
            raise ValueError(f"reports differ in {', '.join(mismatched)}: {other['env']} against {env}")
    return {"env": {**env, "parts": [r["env"]["date"] for r in reports]}, "config": reports[0]["config"],
            "rows": [row for r in reports for row in r["rows"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", help="comma-separated row ids, e.g. S01,S02,S23 (default: all)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="default: bf16")
    p.add_argument("--repeats", type=int, default=20, help="samples per gpu/pipelined median")
    p.add_argument("--latency-calls", type=int, default=100, help="samples per latency median")
    p.add_argument("--cpu-calls", type=int, default=500, help="samples per CPU-cost median")
    p.add_argument("--max-autotune", action="store_true", help="also time Inductor's max-autotune mode")
    p.add_argument("--json", help="write every raw number here")
    p.add_argument("--png", help="write a bar chart here (needs matplotlib)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print (and with --json write) the rows of "
                   "several runs' --json files as one report, timing nothing")
    args = p.parse_args(argv)
    if args.merge:
        report = merge([json.loads(Path(f).read_text()) for f in args.merge])
        print(format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    rows = [r for r in args.rows.split(",") if r.strip()] if args.rows else None
    run(
        rows,
        args.dtype,
        args.repeats,
        latency_calls=args.latency_calls,
        cpu_calls=args.cpu_calls,
        max_autotune=args.max_autotune,
        json_path=args.json,
        png_path=args.png,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
