"""How ``bench.py`` samples and reports, without a GPU: after a warm-up of all variants, each variant
alone for a while, in blocks, the order rotated every pass (a variant sampled right after another
runs in the state that one left on the card: BENCHMARKS.md section 17; the card's clocks swing for
seconds after a heavy load starts: section 28)."""

from __future__ import annotations

import pytest

from bench.bench import TABLE_HEADERS, format_report, in_blocks, merge, table_rows
from fxfuse.cuda.timing import WARM_UP_RUNS


def test_each_variant_is_sampled_in_blocks_at_every_position_once():
    calls = []

    def sample(fn, _inputs, _i):
        calls.append(fn())
        return 1.0

    fns = {name: (lambda name=name: name) for name in ("gemm", "eager", "inductor", "fxfuse")}
    samples, errors = in_blocks(sample, fns, [], rounds=8, settle_s=0.0)
    assert errors == {} and all(len(v) == 8 for v in samples.values())
    # first the warm-up: every variant in turn, untimed (these take no time: its runs, not its seconds)
    warm_up = WARM_UP_RUNS
    assert calls[:warm_up] == list(fns) * (WARM_UP_RUNS // len(fns))
    # then a pass per variant; every block: one untimed settling call, then rounds / passes = 2 samples
    blocks = [calls[i:i + 3] for i in range(warm_up, len(calls), 3)]
    assert all(len(set(block)) == 1 for block in blocks)
    order = [block[0] for block in blocks]
    assert order == ["gemm", "eager", "inductor", "fxfuse", "eager", "inductor", "fxfuse", "gemm",
                     "inductor", "fxfuse", "gemm", "eager", "fxfuse", "gemm", "eager", "inductor"]
    assert all(a != b for a, b in zip(order, order[1:]))  # no variant runs two blocks in a row


def test_a_variant_that_raises_is_dropped_with_its_error():
    def sample(fn, _inputs, _i):
        return fn()

    def broken():
        raise RuntimeError("no kernel")

    samples, errors = in_blocks(sample, {"gemm": lambda: 1.0, "fxfuse": broken}, [], rounds=4, settle_s=0.0)
    assert samples["gemm"] == [1.0] * 4 and samples["fxfuse"] == [] and "no kernel" in errors["fxfuse"]


def test_a_row_fxfuse_left_to_inductor_is_marked_as_the_same_graph_timed_twice():
    def row(paths, left):
        timing = {f"{kind}_ms": 1.0 for kind in ("gpu", "pipelined", "latency")}
        return {"id": "S26", "variants": {"gemm": timing, "eager": timing, "inductor": timing, "fxfuse": timing},
                "fxfuse_paths": paths, "fxfuse_left_to_inductor": left, "check": {}}

    fused, left = table_rows({"rows": [row(["in-GEMM epilogue"], []), row([], ["Inductor is faster"])]})
    assert not any(cell.endswith("=") for cell in fused)
    assert [cell for cell in left if cell.endswith("=")] == ["1.00="] * 3  # fx/ind: gpu, pipelined, latency


def test_an_inductor_max_autotune_time_from_the_profiler_is_marked_in_its_ratio():
    timing = {f"{kind}_ms": 1.0 for kind in ("gpu", "pipelined", "latency")}
    variants = {"gemm": timing, "eager": timing, "inductor": timing, "fxfuse": {**timing, "gpu_method": "cuda_graph"}}
    replayed, summed = ({"id": "S08", "variants": {**variants, "inductor_max": {**timing, "gpu_method": method}},
                         "fxfuse_paths": ["in-GEMM epilogue"], "check": {}} for method in ("cuda_graph", "profiler"))
    fx_max = TABLE_HEADERS.index("fx/max\ngpu")
    assert [cells[fx_max] for cells in table_rows({"rows": [replayed, summed]})] == ["1.00", "1.00*"]


def _run(date: str, rows: list[str], device: str = "NVIDIA H200") -> dict:
    timing = {f"{kind}_ms": 1.0 for kind in ("gpu", "pipelined", "latency")}
    env = {"date": date, "device": device, "torch": "2.11", "cuda": "13.0", "dtype": "bf16"}
    return {"env": env, "config": {}, "rows": [
        {"id": r, "description": r, "variants": {"gemm": timing, "inductor": timing, "fxfuse": timing}, "check": {}}
        for r in rows]}


def test_runs_of_parts_of_the_suite_merge_into_one_table_on_one_card():
    merged = merge([_run("2026-11-26T06:00", ["S01", "S02"]), _run("2026-11-26T06:09", ["S26"])])
    assert [r["id"] for r in merged["rows"]] == ["S01", "S02", "S26"]
    assert "merged from 2 runs" in format_report(merged)
    with pytest.raises(ValueError, match="device"):
        merge([_run("2026-11-26T06:00", ["S01"]), _run("2026-11-26T06:09", ["S26"], device="NVIDIA H100")])


def test_the_ncu_summary_gives_a_kernels_rate_from_its_duration():
    """2 M N K flops over ncu's duration: 1024 x 8192 x 8192 in 171.8 us is 800 TFLOP/s, in the
    units ncu writes (newer versions: "ns", with thousands separators); a unit it does not know is
    said, not guessed."""
    from bench.ncu_summary import tflops

    flops = 2.0 * 1024 * 8192 * 8192
    assert tflops("171.80 usecond", flops) == "800 TFLOP/s"
    assert tflops("0.1718 msecond", flops) == "800 TFLOP/s"
    assert tflops("171,800 ns", flops) == "800 TFLOP/s"
    assert tflops("171.8 cycle", flops).startswith("? TFLOP/s")


def test_the_sass_count_tells_each_functions_branch_regions_shuffles_and_transcendentals():
    """bench/epilogue_sass.py counts cuobjdump's SASS per function: predicated instructions by their
    opcode, prefetches apart from other cache controls, nothing before the first function."""
    from bench.epilogue_sass import sass_counts

    sass = """
        code for sm_90a
                Function : _ZN3fxg13finalize_rowsE
        /*0000*/                   BSSY B0, 0x90 ;
        /*0010*/               @P0 MUFU.EX2 R1, R2 ;
        /*0020*/                   SHFL.BFLY PT, R3, R4, 0x1, 0x1f ;
                Function : _ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalE
        /*0000*/                   CCTL.IVALL ;
        /*0010*/                   CCTL.E.PF1 [R162] ;
        /*0020*/              @!P2 LDG.E.U16.CONSTANT R5, desc[UR4][R6.64] ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        /*0040*/                   STL [R1], R2 ;
    """
    finalize, gemm = sass_counts(sass)
    assert (finalize["instructions"], finalize["branch regions"], finalize["MUFU"], finalize["shuffles"]) == (3, 1, 1, 1)
    assert (gemm["instructions"], gemm["prefetches"], gemm["global loads"], gemm["barriers"], gemm["local memory"]) == (
        5, 1, 1, 1, 1)


def test_a_kernel_list_for_the_gemm_sweep_reads_tile_cluster_and_schedule():
    """bench/gemm_configs.py --kernels: "TMxTN[xTK]/CMxCN[/pingpong]", comma-separated; K is 64
    unless given (the tile's K for 16-bit elements)."""
    from bench.gemm_configs import parse_kernels
    from fxfuse.cuda.gemm_codegen import Kernel

    assert parse_kernels("256x128/2x1, 128x128/2x1/pingpong,128x256x32/1x2") == (
        Kernel(256, 128, cluster_m=2), Kernel(128, 128, cluster_m=2, pingpong=True),
        Kernel(128, 256, 32, cluster_n=2))


def test_the_suite_prebuild_names_each_programs_gemm_module_with_its_parameters_dtypes():
    """bench/prebuild_suite.py builds the modules the tests and the benchmark compile: a row module
    per (program, dtype) and an in-GEMM module per (program, dtype, parameter dtypes), for the rows
    of the chain's calls (the kernels a module carries follow them)."""
    import torch

    from bench.prebuild_suite import DTYPES, suite_programs
    from examples import suite

    pairs, gemms = suite_programs(suite.select(["S07", "S26"]), ["small"], [DTYPES["bf16"]], device="cpu")
    assert {(program, dtype) for program, dtype, _, _ in gemms} == pairs
    assert {rows for *_, rows in gemms} == {8}  # the small size's rows
    by_text = {program.to_string(): params for program, _, params, _ in gemms}
    assert len(by_text) == 3  # S07's chain; S26's SwiGLU chain and its down projection with the residual
    assert all(params == (torch.bfloat16,) * len(params) for params in by_text.values())
    assert any("batch_norm" in text and len(params) == 3 for text, params in by_text.items())


def test_the_suite_prebuild_gives_a_program_one_gemm_module_with_the_kernels_of_all_its_calls(tmp_path):
    """tests/gpu/prebuild.py --suite builds what bench/prebuild_suite.py traced, in processes of
    their own (written to a file and read back as they were): one GEMM module a (program, dtype,
    parameter dtypes), with the kernels for the calls of every size and of the decode tests'
    batches (a test process that needs fewer of them loads it: build.covering_kernels)."""
    import torch

    from bench.prebuild_suite import DTYPES, build_jobs, read_traced, suite_programs, write_traced
    from examples import suite
    from fxfuse.cuda import gemm_codegen

    rows = suite.select(["S01"])
    pairs, gemms = suite_programs(rows, ["small"], [DTYPES["bf16"]], device="cpu")
    _, decode = suite_programs(rows, ["full"], [DTYPES["bf16"]], device="cpu", batches=[16, 64])
    assert {calls for *_, calls in decode} == {16, 64}
    write_traced(tmp_path / "small.json", pairs, gemms)
    write_traced(tmp_path / "decode.json", set(), decode)
    assert read_traced(tmp_path / "small.json") == (pairs, gemms)
    jobs = build_jobs(pairs, gemms | read_traced(tmp_path / "decode.json")[1])
    (gemm,) = [job for job in jobs if job.param_dtypes is not None]
    assert gemm.dtype == torch.bfloat16
    assert gemm.kernels == (gemm_codegen.FEW_ROWS_KERNELS[0], gemm_codegen.FEW_ROWS_KERNELS[2])  # 8 and 16 rows; 64
    assert {(job.program, job.dtype) for job in jobs if job.param_dtypes is None} >= {
        (program.to_string(), dtype) for program, dtype in pairs}


def _report(dtype: str, rows: dict) -> dict:
    """A bench.py report of rows {id: (gemm, inductor, fxfuse) GPU = pipelined ms, fused?}."""
    def variant(ms):
        return {"gpu_ms": ms, "pipelined_ms": ms}

    return {"config": {"dtype": dtype}, "rows": [
        {"id": row, "input_shapes": [[1024, 8192]], "fxfuse_paths": ["in-GEMM"] if fused else [],
         "fxfuse_left_to_inductor": [] if fused else ["S"],
         "variants": {"gemm": variant(g), "inductor": variant(i), "fxfuse": variant(f)}}
        for row, (g, i, f, fused) in rows.items()]}


def test_each_target_is_checked_on_its_rows_under_both_timings():
    from bench.targets import check

    lines = check(_report("bf16", {"S01": (1.0, 1.05, 1.02, True), "S07": (1.0, 1.2, 1.1, True),
                                   "S11": (1.0, 1.1, 1.12, False)}))
    got = {(ln["row"], ln["target"].split(" ")[0]): ln["met"] for ln in lines}
    assert got[("S01", "pointwise")] is True  # 1.02 <= 1.03 of the bare GEMM
    assert got[("S07", "BatchNorm-train,")] is False  # 1.2 / 1.1 = 1.09: not 1.10x faster
    assert got[("S11", "BatchNorm-train,")] is False  # left to Inductor: not faster either
    assert got[("S11", "default")] is True  # but then the model is Inductor's graph: not slower
    assert got[("S07", "default")] is True and got[("S01", "default")] is True


def test_the_decode_target_covers_the_decode_rows_at_sixteen_rows():
    from bench.targets import check

    report = _report("bf16", {"S23-S01-M16": (1.0, 1.0, 1.04, True), "S23-S01-M1": (1.0, 1.0, 1.2, True)})
    report["rows"][0]["variants"]["fxfuse"]["pipelined_ms"] = 1.8  # host-bound: the target names GPU time
    decode = [(ln["row"], ln["gpu"], ln["pipelined"], ln["met"]) for ln in check(report)
              if ln["target"].startswith("decode")]
    assert decode == [("S23-S01-M16", 1.04, None, True)]  # M = 1 is held to the default policy alone


def test_a_tf32_run_is_held_to_the_tf32_target_alone():
    from bench.targets import check

    lines = check(_report("tf32", {"S01": (1.0, 1.1, 1.06, True)}))
    assert [(ln["target"], ln["met"]) for ln in lines] == [("TF32 rows <= 1.05x bare GEMM", False)]


def test_the_rule_model_finds_that_rounding_once_from_the_accumulator_never_breaks_the_rule():
    """bench/rule_model.py on S04 at 16 rows: the in-GEMM numerics (the chain on the exact GEMM
    output, rounded once) break the rule nowhere, where eager on a GEMM whose split-K slices were
    added in bf16 breaks it against eager on the exact GEMM output rounded once."""
    import torch

    from bench.rule_model import rule_counts

    counts = rule_counts("S04", batch=16, draws=2, dtype=torch.bfloat16)
    assert counts["in-GEMM"] == 0
    assert counts["eager, split-K added in the dtype"] > 0


def _ncu_rows(launches: list[tuple[str, float, float]]) -> list[str]:
    """An ncu ``--csv --page details`` file's rows: each launch's duration (ns) and SM clock (Hz)."""
    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = [header]
    for i, (name, ns, hz) in enumerate(launches):
        rows.append(f'"{i}","{name}","Duration","ns","{ns:,.0f}"')
        rows.append(f'"{i}","{name}","SM Frequency","hz","{hz:,.2f}"')
    return rows


def test_the_ncu_summary_pairs_each_profiled_path_with_its_kernels():
    """gemm_configs.py --profile prints "ROW profiled: PATH" in launch order; a path is the GEMM
    that starts it and the passes after it (the row path's apply kernel, a finalize), so its time is
    their sum and its cycles are the GEMM's duration times its clock."""
    from bench.ncu_summary import path_table, paths, read_launches

    lines = ["S05      profiled: F.linear", "S05      profiled: row",
             "S05      profiled: cooperative 128x256x64 cluster 2x1, raster heuristic",
             *_ncu_rows([("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", 170_000, 1.6e9),
                         ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", 171_000, 1.6e9),
                         ("void fx::apply_kernel<4, 1, 1>(FxArgs)", 13_000, 1.9e9),
                         ("void cutlass::device_kernel<GemmUniversal<...>>(Params)", 184_000, 1.5e9),
                         ("void fxg::finalize_rows<cutlass::bfloat16_t>(float const*)", 3_000, 1.9e9)])]
    table = path_table(paths(lines, read_launches(lines)))
    assert [(r["path"][:11], r["kernels"], r["us"], r["/ F.linear"]) for r in table] == [
        ("F.linear", 1, 170.0, 1.0), ("row", 2, 184.0, 1.082), ("cooperative", 2, 187.0, 1.1)]
    assert [r["GEMM kcycles"] for r in table] == [272.0, 273.6, 276.0]


def test_the_ncu_summary_makes_no_table_of_launches_it_cannot_pair():
    """One path more than the GEMMs that start paths: the file is not what the labels say."""
    from bench.ncu_summary import paths, read_launches

    lines = ["S01      profiled: F.linear", "S01      profiled: row",
             *_ncu_rows([("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", 170_000, 1.6e9)])]
    assert paths(lines, read_launches(lines)) is None
