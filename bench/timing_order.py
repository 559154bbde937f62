"""Does the order in which two compiled models are timed change which one is faster?

A big bf16 GEMM on the H100/H200 runs at the card's power limit, and the clocks follow the power
drawn over the last milliseconds: a model timed right after a model that draws more power starts on
lowered clocks. The backend's measurements (the chains' selection, the whole-graph check) and
``bench.py`` took their samples round-robin over the candidates (now in blocks, after a warm-up);
this script times a suite row's fxfuse and Inductor compiles several ways and logs the SM clock and
power during every sample (``nvidia-smi``), to see which way of timing favours one of them:

* interleaved — one sample of each in turn (what the backend and bench.py do);
* blocks — each model alone for a while (warm-up samples, then timed ones), in the order A B B A …,
  as a user's process runs one model;
* interleaved with idle — round-robin with the card left idle between samples;
* blocks over rotated inputs — blocks again, each captured call reading the next of four input
  sets (as bench.py's graphs do), so that no call finds its input in L2 from the call before; the
  backend's selection and whole-graph check time one input set, bench.py four, and the two have
  disagreed by 5-10 % on the in-GEMM rows (BENCHMARKS.md section 28);
* sustained — each model alone for ``--sustained`` seconds untimed, then its timed samples: the
  card's state under a user's steady load, past the power limiter's first swings.

    python bench/timing_order.py --row S26 [--sustained 3]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.suite import build, make_inputs
from fxfuse.cuda.timing import CALLS_PER_SAMPLE, captured, time_us

Sample = tuple[str, str, float, float, float]  # method, model, start, end (epoch s), us per call


def interleaved(replays: dict, rounds: int, idle_s: float = 0.0) -> list[Sample]:
    samples = []
    for _ in range(rounds):
        for name, replay in replays.items():
            if idle_s:
                time.sleep(idle_s)
            start = time.time()
            us = time_us(replay, 1) / CALLS_PER_SAMPLE
            samples.append(("interleaved with idle" if idle_s else "interleaved", name, start, time.time(), us))
    return samples


def blocks(replays: dict, order: str, warm_up: int, timed: int, method: str = "blocks") -> list[Sample]:
    names = list(replays)
    samples = []
    for letter in order:
        name = names[ord(letter) - ord("A")]
        for _ in range(warm_up):
            time_us(replays[name], 1)
        for _ in range(timed):
            start = time.time()
            us = time_us(replays[name], 1) / CALLS_PER_SAMPLE
            samples.append((method, name, start, time.time(), us))
    return samples


def sustained(replays: dict, seconds: float, timed: int, method: str = "sustained") -> list[Sample]:
    """Each model alone: ``seconds`` of untimed replays, then ``timed`` samples."""
    samples = []
    for name, replay in replays.items():
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            time_us(replay, 1)
        for _ in range(timed):
            start = time.time()
            us = time_us(replay, 1) / CALLS_PER_SAMPLE
            samples.append((method, name, start, time.time(), us))
    return samples


def read_smi(path: Path) -> list[tuple[float, float, float, float]]:
    """(epoch s, SM MHz, W, deg C) rows of nvidia-smi's log."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            stamp, clock, power, temp = [f.strip() for f in line.split(",")]
            t = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(clock.split()[0]), float(power.split()[0]), float(temp)))
        except ValueError:
            continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", default="S26")
    parser.add_argument("--blocks", default="ABBAABBA", help="the order of the blocks (A: fxfuse, B: Inductor)")
    parser.add_argument("--sustained", type=float, default=3.0, help="seconds of untimed load before a sustained block")
    parser.add_argument("--csv", help="write every sample (with the clock and power during it) here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, inputs = build(args.row, device="cuda", dtype=torch.bfloat16)
    input_sets = [inputs] + [make_inputs(args.row, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    models = {"fxfuse": torch.compile(copy.deepcopy(model), backend="fxfuse"),
              "inductor": torch.compile(copy.deepcopy(model))}
    with torch.no_grad():
        for compiled in models.values():
            compiled(*inputs)
        graphs = captured({name: (lambda c=c: c(*inputs)) for name, c in models.items()}, CALLS_PER_SAMPLE)

        def rotating(compiled):
            calls = itertools.count()
            return lambda: compiled(*input_sets[next(calls) % len(input_sets)])

        rotated = captured({name: rotating(c) for name, c in models.items()}, CALLS_PER_SAMPLE)
    replays = {name: g.replay for name, g in graphs.items()}
    rotated_replays = {name: g.replay for name, g in rotated.items()}
    log = Path(tempfile.mkdtemp()) / "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "20"], stdout=log.open("w"), stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        samples = interleaved(replays, rounds=20)
        samples += blocks(replays, args.blocks, warm_up=6, timed=6)
        samples += interleaved(replays, rounds=12, idle_s=0.15)
        samples += interleaved(replays, rounds=20)
        samples += blocks(rotated_replays, args.blocks, warm_up=6, timed=6, method="blocks over rotated inputs")
        samples += sustained(replays, args.sustained, timed=12)
        samples += sustained(rotated_replays, args.sustained, timed=12, method="sustained over rotated inputs")
    finally:
        time.sleep(0.5)
        smi.terminate()
        smi.wait()
    smi_rows = read_smi(log)

    def during(start: float, end: float) -> tuple[float, float]:
        inside = [(c, p) for t, c, p, _ in smi_rows if start - 0.02 <= t <= end + 0.02]
        if not inside:
            return float("nan"), float("nan")
        return statistics.mean(c for c, _ in inside), statistics.mean(p for _, p in inside)

    print(f"{args.row}: {torch.cuda.get_device_name()}, torch {torch.__version__}; us per call (median), "
          "mean SM MHz and W during the samples")
    methods = list(dict.fromkeys(m for m, *_ in samples))
    lines = []
    for method in methods:
        medians = {}
        for name in replays:
            mine = [s for s in samples if s[0] == method and s[1] == name]
            medians[name] = statistics.median(s[4] for s in mine)
            state = [during(s[2], s[3]) for s in mine]
            clocks = [c for c, _ in state if c == c]
            watts = [p for _, p in state if p == p]
            print(f"  {method:22s} {name:9s} {medians[name]:8.1f} us  "
                  f"{statistics.mean(clocks) if clocks else float('nan'):6.0f} MHz  "
                  f"{statistics.mean(watts) if watts else float('nan'):5.0f} W  ({len(mine)} samples)")
        print(f"  {method:22s} fxfuse / Inductor = {medians['fxfuse'] / medians['inductor']:.3f}")
    if args.csv:
        for method, name, start, end, us in samples:
            clock, watts = during(start, end)
            lines.append(f"{method},{name},{start:.3f},{end:.3f},{us:.1f},{clock:.0f},{watts:.0f}")
        Path(args.csv).write_text("method,model,start,end,us_per_call,sm_mhz,watts\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
