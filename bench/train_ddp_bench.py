"""Data-parallel training step time and peak memory: eager, Inductor and fxfuse under DDP and FSDP2.

    torchrun --standalone --nproc-per-node 2 bench/train_ddp_bench.py [--models mlp,S08,S20]
             [--wrappers ddp,fsdp] [--steps 30] [--dtype autocast|fp32] [--json out.json]

Each rank trains on its own batch of the model's suite size (the MLP example at 4096 features,
8192 rows; S08 at 32768 x 1024 -> 4096; S20 at 8 x 512 x 4096), so the global batch grows with the
ranks. One step is forward, backward (with the wrapper's gradient all-reduce or reduce-scatter)
and AdamW (DDP's default 25 MiB gradient buckets). Every variant is compiled and run ``--warmup`` steps, then the variants take turns
for ``--rounds`` rounds of ``--steps`` steps back to back between CUDA events; the median of the
slowest rank's mean step time and the largest peak of memory a step allocates beyond what is held before it
(gradients, activations, the optimizer's temporaries; not the parameters and optimizer state,
the same for every variant) on any rank are reported. fxfuse runs its default policy; its
coverage report per model goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from tabulate import tabulate

from examples.train_ddp import COMPILERS, Job, build_model, compile_model, input_shape, loss_of, output_shape, wrap

ROW_BATCH = {"mlp": 8192, "S08": 32768, "S20": 8}  # one rank's batch: the suite size


class Variant:
    """One compiler's copy of the model on this rank, compiled and warmed up, with its own inputs."""

    def __init__(self, job: Job, device: torch.device, warmup: int):
        import fxfuse

        world, rank = dist.get_world_size(), dist.get_rank()
        self.job, self.model = job, wrap(build_model(job, device), job, device)
        fxfuse.reset_report()
        self.compiled = compile_model(self.model, job, device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        g = torch.Generator(device).manual_seed(rank)
        per_rank = job.batch // world
        self.x = torch.randn(per_rank, *input_shape(job), device=device, generator=g)
        self.y = torch.randn(per_rank, *output_shape(replace(job, batch=per_rank))[1:], device=device, generator=g)
        for _ in range(warmup):
            self.step()
        self.report = fxfuse.last_report() if job.compiler == "fxfuse" else None
        self.samples: list[float] = []
        self.peak_mib = 0.0

    def step(self) -> None:
        loss = loss_of(self.compiled, self.x, self.y, self.job)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def time(self, steps: int) -> None:
        """``steps`` steps back to back; the slowest rank's ms per step and the largest peak."""
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            self.step()
        end.record()
        end.synchronize()
        stats = torch.tensor([start.elapsed_time(end) / steps, (torch.cuda.max_memory_allocated() - held) / 2**20],
                             device=self.x.device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        self.samples.append(stats[0].item())
        self.peak_mib = max(self.peak_mib, stats[1].item())


def measure(jobs: dict[str, Job], device: torch.device, warmup: int, steps: int, rounds: int) -> dict[str, Any]:
    """Every compiler's variant of one model, timed in ``rounds`` rounds taken in turn (the
    variants live side by side, so that no variant gets the quieter minutes): median ms, peak."""
    torch._dynamo.reset()
    variants = {name: Variant(job, device, warmup) for name, job in jobs.items()}
    for _ in range(rounds):
        for variant in variants.values():
            variant.time(steps)
    out = {name: {"ms": statistics.median(v.samples), "peak_mib": v.peak_mib} for name, v in variants.items()}
    for name, v in variants.items():
        if v.report is not None:
            out[name]["report"] = str(v.report)
    del variants
    gc.collect()
    torch.cuda.empty_cache()
    return out


def format_table(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"{env['date']}  {env['world']} x {env['device']}  torch {env['torch']}  {env['dtype']}  "
             f"fxfuse policy {env['policy']}  (ms per training step, slowest rank; step peak MiB above held memory, largest rank)", ""]
    table = []
    for r in report["rows"]:
        v = r["variants"]
        ms = {c: v[c]["ms"] if c in v else None for c in COMPILERS}
        table.append([r["model"], r["wrapper"], *(f"{ms[c]:.2f}" if ms[c] else "err" for c in ("eager", "inductor", "fxfuse")),
                      f"{ms['inductor'] / ms['fxfuse']:.2f}" if ms["inductor"] and ms["fxfuse"] else "-",
                      *(f"{v[c]['peak_mib']:.0f}" if c in v else "err" for c in ("eager", "inductor", "fxfuse"))])
    headers = ["model", "wrapper", "eager\nms", "inductor\nms", "fxfuse\nms", "inductor /\nfxfuse",
               "eager\npeak", "inductor\npeak", "fxfuse\npeak"]
    lines.append(tabulate(table, headers=headers))
    lines.append("inductor / fxfuse: > 1 means fxfuse's step is faster")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,S08,S20")
    parser.add_argument("--wrappers", default="ddp,fsdp")
    parser.add_argument("--compilers", default="eager,inductor,fxfuse")
    parser.add_argument("--dtype", default="autocast", choices=("autocast", "fp32"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    report: dict[str, Any] = {"env": {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
        "world": world, "torch": torch.__version__, "dtype": args.dtype, "policy": "fastest"}, "rows": []}
    for model in args.models.split(","):
        for wrapper in args.wrappers.split(","):
            jobs = {compiler: Job(model=model, size="full", wrapper=wrapper, compiler=compiler,
                                  batch=ROW_BATCH[model] * world, autocast=args.dtype == "autocast",
                                  policy="fastest", bucket_mb=25)
                    for compiler in args.compilers.split(",")}
            if rank == 0:
                print(f"[train_ddp_bench] {model} {wrapper}", file=sys.stderr, flush=True)
            row = {"model": model, "wrapper": wrapper, "variants": measure(jobs, device, args.warmup, args.steps, args.rounds)}
            report["rows"].append(row)
            if rank == 0 and "fxfuse" in row["variants"]:
                print(f"fxfuse's report, {model} {wrapper}:\n{row['variants']['fxfuse']['report']}", file=sys.stderr)
    if rank == 0:
        print(format_table(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
