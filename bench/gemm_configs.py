"""Every path of the in-GEMM back end against cuBLAS, per program and shape (Hopper GPU).

    python bench/gemm_configs.py [--rows S01,S10] [--dtype bf16|fp16] [--shape M,N,K] [--kernels wide]

For each program: ``F.linear`` (cuBLAS, with the bias: the floor), the row path (cuBLAS + the
program module's pass) and each configuration of the program's GEMM module, as GPU time per call
from CUDA-graph replays of 20 calls, inputs rotated over 4 sets, all paths timed in blocks after a
warm-up (``time_paths``). ``identity`` is the bare GEMM through CUTLASS (no epilogue but the
store): the "bare GEMM first" comparison. Programs are the suite's pointwise and group-norm rows
as fxfuse matches them (tests/gpu/programs.py
spells them; S08 is meant for its own shape, 32768,4096,1024; S20 and S21 for 4096,4096,4096; S26gate and S26dual for
8192,11008,4096 and S26down for 8192,4096,11008). A program with a second GEMM (S26dual) is
measured against both GEMMs' ``F.linear``.

``--kernels wide`` builds the modules with ``wide_menu()`` instead of the production menu
(gemm_codegen.menu): how the menu is chosen; ``--kernels 256x128/2x1,128x128/2x1/pingpong``
builds the kernels listed (``/pdl``: the kernel, and those after it, launched as programmatic
dependents: csrc/gemm_launch.cuh). Each configuration's output is checked against the row path's as the
selection checks it (``!`` marks one that ``engine.disagreement`` finds off, which the selection
would leave out), and the name of the kernel cuBLAS runs for ``F.linear`` is printed with it.

``--profile`` times nothing: it runs ``F.linear``, the row path and each kernel of the menu once
(at its first tile order) between cudaProfilerStart and Stop, after a warm-up, for ncu::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --csv --page details python3 bench/gemm_configs.py --rows identity,S05 --profile > ncu.csv
    python3 bench/ncu_summary.py ncu.csv --flops M,N,K

(the launches in the order the script prints them; build the modules first, outside ncu).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

import torch
import torch.nn.functional as F

GRAPH_CALLS = 20
SETS = 4


def wide_menu() -> tuple:
    """Candidate kernels beyond the production menu: the cooperative tiles of 128 accumulators a
    thread (128x256, 256x128) under several clusters, 128x128, and ping-pong over 64 and 128 rows."""
    from fxfuse.cuda.gemm_codegen import Kernel

    return (Kernel(128, 256, cluster_m=2), Kernel(128, 256, cluster_n=2), Kernel(128, 256),
            Kernel(128, 256, cluster_m=4), Kernel(256, 128, cluster_m=2), Kernel(256, 128, cluster_n=2),
            Kernel(128, 128, cluster_m=2, pingpong=True), Kernel(128, 128, cluster_n=2),
            Kernel(64, 256, pingpong=True), Kernel(64, 256, cluster_m=2, pingpong=True))


def parse_kernels(text: str) -> tuple:
    """Kernels from "TMxTN[xTK]/CMxCN[/pingpong][/pdl][/swapped]" separated by commas (TK: for
    16-bit elements; pdl: launched as programmatic dependents; swapped: the few-rows kernel,
    fxg::Swapped, cluster 1x1)."""
    from fxfuse.cuda.gemm_codegen import Kernel

    kernels = []
    for item in text.split(","):
        tile, cluster, *schedule = item.strip().split("/")
        tm, tn, *tk = (int(v) for v in tile.split("x"))
        cm, cn = (int(v) for v in cluster.split("x"))
        if not set(schedule) <= {"pingpong", "pdl", "swapped"}:
            raise ValueError(f"{item}: a kernel's options are pingpong, pdl and swapped")
        kernels.append(Kernel(tm, tn, *(tk or [64]), cluster_m=cm, cluster_n=cn, pingpong="pingpong" in schedule,
                              pdl="pdl" in schedule, swapped="swapped" in schedule))
    return tuple(kernels)


def profile_once(name: str, paths: list) -> None:
    """Each (label, fn) of ``paths`` once between cudaProfilerStart and Stop (ncu's
    ``--profile-from-start off``), after two warm-up calls, in the order printed."""
    for _, fn in paths:
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    for label, fn in paths:
        print(f"{name:8s} profiled: {label}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def cublas_kernel(fn) -> str:
    """The name of the GEMM kernel ``fn`` launches (the torch profiler's longest CUDA kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return max(events, key=lambda e: e.device_time_total).key if events else "?"


def programs() -> dict:
    import dataclasses

    from fxfuse import expr as E
    from fxfuse.ir import Gemm, Norm, Pointwise, Program
    from fxfuse.vocabulary import call
    from programs import PROGRAMS

    def groups(name: str, count: int) -> Program:  # the suite's group counts (tests use small ones)
        program = PROGRAMS[name]
        stages = tuple(dataclasses.replace(s, groups=count) if isinstance(s, Norm) else s for s in program.stages)
        return Program(program.gemm, stages, program.params)

    X = E.X
    return {
        "identity": Program(Gemm(True), ()),
        "S01": PROGRAMS["s01_scale_leaky"],
        "S09": Program(Gemm(False), (Pointwise(call("relu", E.add(X, E.param(0)))),), ("col",)),
        "S10": PROGRAMS["s10_div_gelu"],
        "S12": Program(Gemm(True), (Pointwise(call("mish", call("mish", X))),)),
        "S13": PROGRAMS["s13_sub_mul_relu"],
        "S05": PROGRAMS["s05_logsumexp_chain"],
        "S15": PROGRAMS["s15_div_sum_mul"],
        "S14": PROGRAMS["s14_silu_div_clamp_tanh"],
        "S02": groups("s02_group_leaky_double", 512),
        "S04": groups("s04_group_silu_vec_silu", 256),
        "S17": groups("s17_vec_hardtanh_mish_group", 256),
        "S11": PROGRAMS["s11_gelu_softmax"],  # (row, subtile) statistics in the epilogue, then a pass a row
        "S20": PROGRAMS["s20_layer_silu"],
        "S21": PROGRAMS["s21_rms_silu"],
        "S08": Program(Gemm(True), (Pointwise(E.add(E.mul(call("sigmoid", X), X), E.param(0))),
                                    Norm("group", 1e-5, groups=64, weight=1, bias=2)), ("col", "col", "col")),
        # S26 (Llama's MLP): the gate chain reads the up projection's output, the down chain the residual
        "S26gate": Program(Gemm(False), (Pointwise(E.mul(call("silu", X), E.param(0))),), ("full",)),
        "S26down": Program(Gemm(False), (Pointwise(E.add(X, E.param(0))),), ("full",)),
        # the same gate chain with the up projection as its second GEMM: both GEMMs in one op
        "S26dual": Program(Gemm(False), (Pointwise(E.mul(call("silu", X), E.param(0))),), ("gemm",)),
    }


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``--shape``'s value: shapes separated by ';', each its sizes separated by ','."""
    return [tuple(int(v) for v in shape.split(",")) for shape in text.split(";")]


def problem(prog, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> tuple:
    """One input set (x, w, b, params) of ``prog`` at (m, n, k): uniform x, a weight scaled by
    1/sqrt(k), the program's parameters as the GPU tests draw them."""
    from programs import make_params

    g = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=g).to(device, dtype)
    w = (torch.rand(n, k, generator=g) * 2 - 1).div(k ** 0.5).to(device, dtype)
    b = torch.rand(n, generator=g).to(device, dtype)
    return x, w, b, make_params(prog, n, dtype=dtype, device=device, generator=g, lead=(m,), k=k)


def time_paths(paths: dict, repeats: int) -> dict[str, float]:
    """GPU time per call (us) of each path ``fn(i)`` (i: the input set), from replays of a CUDA graph
    of GRAPH_CALLS calls rotating over the sets, timed as the selection times its candidates:
    after a warm-up of all of them, in blocks, the order reversed every pass
    (``timing.blocked_medians``). Timed one after another, the path timed first ran on the clocks
    of a card that had been idle (BENCHMARKS.md section 28)."""
    from fxfuse.cuda.timing import blocked_medians, captured, time_us

    def rotating(fn):
        count = itertools.count()
        return lambda: fn(next(count) % SETS)

    graphs = captured({name: rotating(fn) for name, fn in paths.items()}, GRAPH_CALLS)
    replays = {name: graph.replay for name, graph in graphs.items()}
    passes = 4
    return blocked_medians(replays, lambda replay: time_us(replay, 1) / GRAPH_CALLS,
                           samples_per_block=max(1, repeats // passes), passes=passes, settle_s=0.1)


def main(argv=None) -> int:
    import fxfuse.cuda as fxcuda
    from fxfuse.cuda.engine import disagreement

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None, help="comma-separated program names (default: all)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--shape", default="1024,8192,8192", help="M,N,K (several: separated by ';')")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="run each path once for ncu instead of timing")
    p.add_argument("--kernels", default="menu",
                   help="menu (the production one), wide (wide_menu(): the candidates it is chosen from) or a list "
                        "of kernels, e.g. 256x128/2x1,128x128/2x1/pingpong")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    chosen = programs()
    if args.rows:
        chosen = {k: v for k, v in chosen.items() if k in args.rows.split(",")}
    shapes = parse_shapes(args.shape)
    from fxfuse.cuda import build

    production = args.kernels == "menu"
    candidates = () if production else wide_menu() if args.kernels == "wide" else parse_kernels(args.kernels)
    failed = fxcuda.prepare_many([(prog, dtype) for prog in chosen.values()], gemm_items=[
        (prog, dtype, (dtype,) * len(prog.params), None) for prog in chosen.values() if production])
    assert not failed, failed
    device = torch.device("cuda", torch.cuda.current_device())
    modules = {}  # name -> the modules whose configurations are timed
    for name, prog in chosen.items():
        params = (dtype,) * len(prog.params)
        if production:
            modules[name] = [fxcuda.engine.prepare_gemm(prog, dtype, params, device)]
            continue
        import multiprocessing

        # one module a kernel (one that fails to build costs itself), built in worker processes (a
        # process builds one module at a time), then loaded here from the cache
        target = build.cuda_target(device)
        jobs = [(prog.to_string(), dtype, target, 2, params, (kernel,)) for kernel in candidates]
        with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
            errors = pool.starmap(build.build_in_subprocess, jobs)
        for kernel, error in zip(candidates, errors):
            if error:
                print(f"{name}: {kernel} does not build: {error[-400:]}", flush=True)
        modules[name] = [build.build_gemm(prog, dtype, params, target, kernels=(kernel,))
                         for kernel, error in zip(candidates, errors) if not error]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.dtype}  us per call (CUDA graph)")
    with torch.no_grad():
        for m, n, k in shapes:
            for name, prog in chosen.items():
                text = prog.to_string()
                sets = [problem(prog, m, n, k, dtype, device, seed) for seed in range(SETS)]
                seconds = prog.second_gemms  # a gated pair's floor: both GEMMs
                paths = {"F.linear": lambda i: [F.linear(sets[i][0], sets[i][1], sets[i][2])] + [
                    F.linear(sets[i][0], sets[i][3][j]) for j in seconds]}
                if not seconds:
                    print(f"{name:8s} {m}x{n}x{k}  cuBLAS runs {cublas_kernel(lambda: F.linear(*sets[0][:3]))}")

                def run(i, config=-1, gemm=None):
                    x, w, b, params = sets[i]
                    return fxcuda.engine.call(text, x, w, b if prog.gemm.bias else None, params, gemm=gemm,
                                              config=config)[0]

                if args.profile:
                    profile_once(name, [("F.linear", lambda: F.linear(*sets[0][:3])), ("row", lambda: run(0))] + [
                        (module.config_names[c], lambda c=c, g=module: run(0, c, g)) for module in modules[name]
                        for c in range(0, len(module.config_names), 6) if module.supports(m, n, k, c)])
                    continue
                paths["row"] = run
                expected = run(0)
                wrong = set()
                for module in modules[name]:
                    for config, cname in enumerate(module.config_names):
                        if module.supports(m, n, k, config):
                            paths[cname] = lambda i, c=config, g=module: run(i, c, g)
                            if disagreement(run(0, config, module), expected) is not None:
                                wrong.add(cname)
                times = time_paths(paths, args.repeats)
                base = times["F.linear"]
                cells = "  ".join(f"{key}{'!' if key in wrong else ''} {t:.1f} ({t / base:.3f})"
                                  for key, t in sorted(times.items(), key=lambda kv: kv[1]))
                print(f"{name:8s} {m}x{n}x{k}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
