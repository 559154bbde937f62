"""How ``bench.py`` samples, without a GPU: each variant alone for a while, in blocks, the order
reversed every pass; and ``--apart``, Inductor and fxfuse timed in processes of their own, merged
into one table whose fxfuse times are scaled by the two processes' GEMM times."""

from __future__ import annotations

from bench.bench import format_report, in_blocks, merge_apart


def test_each_variant_is_sampled_in_blocks_the_order_reversed_every_pass():
    calls = []

    def sample(fn, _inputs, _i):
        calls.append(fn())
        return 1.0

    fns = {"inductor": lambda: "inductor", "fxfuse": lambda: "fxfuse"}
    samples, errors = in_blocks(sample, fns, [], rounds=8, passes=4, settle_s=0.0)
    assert errors == {} and {n: len(v) for n, v in samples.items()} == {"inductor": 8, "fxfuse": 8}
    # every block: one untimed settling call, then rounds / passes = 2 samples, of one variant
    blocks = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert all(len(set(block)) == 1 for block in blocks)
    assert [block[0] for block in blocks] == ["inductor", "fxfuse", "fxfuse", "inductor"] * 2


def test_a_variant_that_raises_is_dropped_with_its_error():
    def sample(fn, _inputs, _i):
        return fn()

    def broken():
        raise RuntimeError("no kernel")

    samples, errors = in_blocks(sample, {"gemm": lambda: 1.0, "fxfuse": broken}, [], rounds=4, settle_s=0.0)
    assert samples["gemm"] == [1.0] * 4 and samples["fxfuse"] == [] and "no kernel" in errors["fxfuse"]

ENV = {"date": "2026-11-26", "device": "NVIDIA H200", "torch": "2.11", "cuda": "13.0", "dtype": "bf16"}


def _report(compiler: str, gemm_ms: float, compiled_ms: float) -> dict:
    timing = {f"{kind}_ms": compiled_ms for kind in ("gpu", "pipelined", "latency")}
    return {"env": ENV, "config": {"compilers": [compiler]}, "rows": [{
        "id": "S26", "description": "Llama MLP",
        "variants": {"gemm": {f"{kind}_ms": gemm_ms for kind in ("gpu", "pipelined", "latency")},
                     "eager": {"gpu_ms": 3.6}, compiler: {**timing, "peak_mib": 236.0}},
        "check": {compiler: {"ok": True}},
        "fxfuse_paths": ["in-GEMM epilogue (gated)"] if compiler == "fxfuse" else [],
        "cpu_us": {"gemm": 60.0, "eager": 100.0, compiler: 130.0},
    }]}


def test_fxfuse_times_keep_their_ratio_to_their_own_processes_gemm():
    merged = merge_apart(_report("inductor", 3.40, 3.30), _report("fxfuse", 3.50, 3.36))
    (row,) = merged["rows"]
    fx = row["variants"]["fxfuse"]
    assert abs(fx["gpu_ms"] - 3.36 * 3.40 / 3.50) < 1e-12 and fx["gpu_ms_own"] == 3.36
    assert abs(fx["gpu_ms"] / row["variants"]["gemm"]["gpu_ms"] - 3.36 / 3.50) < 1e-12
    assert row["variants"]["inductor"]["gpu_ms"] == 3.30
    assert row["check"] == {"inductor": {"ok": True}, "fxfuse": {"ok": True}}
    assert row["fxfuse_paths"] == ["in-GEMM epilogue (gated)"]
    assert row["cpu_us"] == {"gemm": 60.0, "eager": 100.0, "inductor": 130.0, "fxfuse": 130.0}


def test_the_merged_table_says_how_it_was_measured():
    text = format_report(merge_apart(_report("inductor", 3.40, 3.30), _report("fxfuse", 3.50, 3.36)))
    assert "timed in processes of their own" in text
    s26 = next(line for line in text.splitlines() if line.startswith("S26"))
    assert "0.96" in s26.split() and "yes" in s26.split()  # fx/GEMM, fxfuse's check
