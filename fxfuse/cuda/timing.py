"""How fxfuse times GPU candidates: CUDA-graph replays sampled in blocks after a warm-up.

A big GEMM runs at the card's power limit, and its clocks follow the power drawn over the last
tens of milliseconds: a candidate timed right after another runs in the state that one left, and a
card that sat idle starts on boosted clocks. So every measurement (the selection of a chain's path,
the whole-graph check, the benchmarks) runs all its candidates untimed first (``warm_up``), then
each alone for a while before its samples (``blocked_medians``), the order reversed every pass
(BENCHMARKS.md sections 17, 28 and 32).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

GRAPH_TIMING = "CUDA-graph replay"  # how a selection timed its candidates (Selection.timing)
LAUNCH_TIMING = "back-to-back launches"  # where a candidate could not be captured
CALLS_PER_SAMPLE = 10  # calls of a candidate in one timing sample
WARM_UP_S = 2.0  # untimed load before a measurement's first sample (warm_up)
WARM_UP_RUNS = 1000  # at most this many runs in the warm-up (of microsecond candidates: a fraction of a second)
# A run (a sample's CUDA-graph replay) at least this long keeps the card at its power limit, and a
# block of it settles for its whole settling time; shorter runs, which do not heat the card, settle
# for ten runs' time (blocked_medians)
HEAVY_RUN_S = 1e-3


def warm_up(runs: list[Callable[[], object]], seconds: float = WARM_UP_S, most: int = WARM_UP_RUNS) -> None:
    """Run ``runs`` in turn, untimed, for ``seconds`` or ``most`` runs in all, whichever ends first.

    A card that sat idle (a compile's builds and tracing, a benchmark's setup) starts a heavy load
    on boosted clocks; about 0.7 s in, its power limiter pulls them down, and they swing with a
    period of about a second for seconds more. Over the 42 rows of about 200 µs that bench.py
    timed in sections 18, 19, 24 and 28 of BENCHMARKS.md (16 blocks of 0.21 s each), the fourth
    block ran 7.5 % slower than the same graph's median on average and up to 26 %, whichever graph
    it was (Inductor's own, where fxfuse had fused nothing), the ninth 5.5 % and the fourteenth
    2.8 %; the others within 2.5 %. Samples taken after the warm-up see the card as a user's
    steady load does. Candidates of microseconds (decode sizes, tests), which do not heat the
    card, end at ``most`` runs, long before ``seconds``."""
    if seconds <= 0 or not runs:
        return
    until = time.perf_counter() + seconds
    for i in range(most):
        runs[i % len(runs)]()
        if time.perf_counter() >= until:
            return


def blocked_medians(calls: dict[str, Callable[[], object]], time_once: Callable[[Callable], float],
                    samples_per_block: int = 4, passes: int = 2, settle_s: float = 0.05,
                    warm_up_s: float = WARM_UP_S) -> dict[str, float]:
    """The median of each call's timings, taken in blocks after ``warm_up_s`` of all of them
    untimed (``warm_up``): one candidate at a time runs untimed
    for ``settle_s`` (at least once; a run shorter than HEAVY_RUN_S at most ten times as long as
    its first untimed run took), then is timed ``samples_per_block`` times; the candidates in
    order, then in reverse order, ``passes`` passes in all.

    A big GEMM runs at the card's power limit, and a candidate timed right after another runs in
    the state that one left. Round-robin samples (every candidate once a round) timed S26's fused
    graph at 0.89x Inductor's where each run alone for a while, as in a user's process, measured
    1.11x, and 1.10x with the card idle between samples (BENCHMARKS.md section 17). Reversing the
    order every pass gives each candidate the same mean position, so that a card whose clocks
    drift as it heats slows all of them alike; the candidate at each turn runs two blocks in a row,
    its second deeper into its own state. A selection times up to some fifty candidates, so
    each settles for 0.05 s by default; its final and the whole-graph check, two or three, settle
    longer. A short run (microseconds: decode sizes, tests), which does not heat the card, settles
    for ten runs' time, so that the selections of a model's small chains stay quick. A heavy one
    settles for all of ``settle_s``: capped at ten runs, a 2 ms replay of a big GEMM settled for
    20 ms, on the clocks the candidate before it left, and the whole-graph check read S01's fused
    graph 6 % faster than Inductor's where bench.py, each graph alone for 0.2 s, read it 6 %
    slower (BENCHMARKS.md section 32)."""
    warm_up([lambda call=call: time_once(call) for call in calls.values()], warm_up_s)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for p in range(passes):
        for name in order if p % 2 == 0 else reversed(order):
            started = time.perf_counter()
            time_once(calls[name])
            run_s = time.perf_counter() - started
            settled_at = started + (settle_s if run_s >= HEAVY_RUN_S else min(settle_s, 10 * run_s))
            while time.perf_counter() < settled_at:
                time_once(calls[name])
            samples[name] += [time_once(calls[name]) for _ in range(samples_per_block)]
    return {name: statistics.median(values) for name, values in samples.items()}


def time_candidates(calls: dict[str, Callable[[], object]], settle_s: float = 0.05,
                    passes: int = 2, warm_up_s: float = WARM_UP_S) -> tuple[dict[str, float], str]:
    """Median GPU time per call of each candidate, and how it was taken: from replays of a CUDA
    graph of ``CALLS_PER_SAMPLE`` calls each, as the benchmark measures a compiled model's GPU
    time (launches between CUDA events read the same within 2 % on S26, during the compile and
    after it: BENCHMARKS.md section 15). A candidate that cannot be captured is timed by
    launches, and so are all the others."""
    try:
        graphs = captured(calls, CALLS_PER_SAMPLE)
    except Exception:  # noqa: BLE001 - uncapturable (a host sync, an allocation that cannot be pooled)
        torch.cuda.synchronize()
        return blocked_medians(calls, time_us, passes=passes, settle_s=settle_s, warm_up_s=warm_up_s), LAUNCH_TIMING
    replays = {name: graph.replay for name, graph in graphs.items()}
    times = blocked_medians(replays, lambda replay: time_us(replay, 1) / CALLS_PER_SAMPLE, passes=passes,
                            settle_s=settle_s, warm_up_s=warm_up_s)
    del graphs, replays  # their shared memory pool goes back to the allocator's cache
    return times, GRAPH_TIMING


def captured(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, torch.cuda.CUDAGraph]:
    """One CUDA graph of ``repeats`` calls per candidate, warmed up and captured on a side stream.
    The graphs share one memory pool: they are replayed one at a time on one stream, and none
    keeps an output, so the candidates together hold one candidate's intermediates."""
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # first calls build caches (workspaces, interleaved weights)
        for call in calls.values():
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = {}
    for name, call in calls.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            for _ in range(repeats):
                call()
        graph.replay()  # the first replay uploads the graph
        graphs[name] = graph
    return graphs


def time_us(call, calls: int = CALLS_PER_SAMPLE) -> float:
    """GPU time per call of ``calls`` back-to-back calls, microseconds (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls
