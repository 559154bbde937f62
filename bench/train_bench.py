"""Training cost: forward + backward (and the whole AdamW step beside it) of suite models under
eager, Inductor and fxfuse.

    python bench/train_bench.py [--rows S01,S02,S03,S04,S08,S19,S20,train_mlp]
                                [--dtype fp32|autocast|bf16] [--json out.json] [--repeats N]
                                [--policy fastest|always] [--mode reduce-overhead]

For every row, in one process: each variant's model (its own copy, in training mode) runs
``STEP_CALLS`` forward + backward passes back to back between CUDA events (parameter gradients set
to None before each pass, a fixed random output gradient), median over ``--repeats`` rounds taken
in blocks over the variants (bench.in_blocks); then the same with ``optimizer.step()`` (AdamW) after each backward,
for context (the optimizer is the same work for every variant). Peak memory is what one forward +
backward allocates at its peak beyond what was held before it. ``autocast`` runs the fp32 model
under ``torch.autocast("cuda", dtype=torch.bfloat16)``; ``bf16`` converts the model.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn as nn
from tabulate import tabulate

from bench.bench import fxfuse_backend_arg, in_blocks
from examples.suite import build, make_inputs
from examples.train_mlp import MLP

ROWS = ("S01", "S02", "S03", "S04", "S08", "S19", "S20", "train_mlp")
VARIANTS = ("eager", "inductor", "fxfuse")
STEP_CALLS = 10
DTYPES = ("fp32", "autocast", "bf16")


@dataclass(frozen=True)
class Compile:
    """How the compiled variants are compiled: fxfuse's policy option (its default, or "always")
    and torch.compile's mode (None, or "reduce-overhead": Inductor's CUDA graphs, for both)."""

    policy: str = "fastest"
    mode: str | None = None


def model_and_inputs(row: str, dtype: str) -> tuple[nn.Module, Callable[[], list[torch.Tensor]]]:
    """The row's model on CUDA in training mode, and a maker of fresh inputs."""
    param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if row == "train_mlp":  # the training example at a size that fills the GPU a little
        model = MLP(features=4096, inputs=4096).cuda().to(param_dtype).train()
        return model, lambda: [torch.rand(8192, 4096, device="cuda", dtype=param_dtype)]
    model, _ = build(row, device="cuda", dtype=param_dtype)
    return model.train(), lambda: make_inputs(row, device="cuda", dtype=param_dtype)


def variant(model: nn.Module, name: str, how: Compile = Compile()) -> tuple[nn.Module, Callable]:
    """The variant's own copy of the model, and what to call it through."""
    copied = copy.deepcopy(model)
    if name == "eager":
        return copied, copied
    if name == "inductor":
        return copied, torch.compile(copied, mode=how.mode)
    from torch._inductor import list_mode_options  # torch.compile takes a mode or options: the mode's

    options = {"policy": how.policy, **(list_mode_options(how.mode) if how.mode else {})}
    return copied, torch.compile(copied, backend=fxfuse_backend_arg(), options=options)


class Step:
    """Forward + backward of one variant, optionally with an AdamW step."""

    def __init__(self, module: nn.Module, compiled: Callable, dtype: str, inputs: list[torch.Tensor]):
        self.module, self.compiled, self.dtype = module, compiled, dtype
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6)
        self.grad_out = None

    def forward_backward(self) -> None:
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graphs (else a no-op)
        for p in self.params:
            p.grad = None
        for t in self.inputs:
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.dtype == "autocast"):
            out = self.compiled(*self.inputs)
        if self.grad_out is None:
            self.grad_out = torch.randn_like(out)
        out.backward(self.grad_out)

    def full_step(self) -> None:
        self.forward_backward()
        self.optimizer.step()


def _event_ms(body: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def sampler(method: str):
    def sample(step: Step, _inputs, _round: int) -> float:
        call = getattr(step, method)
        return _event_ms(lambda: [call() for _ in range(STEP_CALLS)]) / STEP_CALLS

    return sample


def peak_mib(step: Step) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step.forward_backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(row: str, dtype: str, repeats: int, how: Compile = Compile()) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, fresh = model_and_inputs(row, dtype)
    inputs = fresh()
    steps = {name: Step(*variant(model, name, how), dtype, [t.clone() for t in inputs]) for name in VARIANTS}
    for step in steps.values():  # compile, settle, first optimizer state
        for _ in range(3):
            step.full_step()
    result: dict[str, Any] = {"row": row, "variants": {name: {} for name in VARIANTS}}
    for name, step in steps.items():
        result["variants"][name]["peak_mib"] = peak_mib(step)
    for kind, method in (("fwd_bwd", "forward_backward"), ("step", "full_step")):
        samples, errors = in_blocks(sampler(method), steps, [], repeats)
        for name in VARIANTS:
            entry = result["variants"][name]
            entry[f"{kind}_ms"] = statistics.median(samples[name]) if samples.get(name) else None
            if name in errors:
                entry["error"] = errors[name]
    del steps, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def format_table(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"{env['date']}  {env['device']}  torch {env['torch']}  dtype {env['dtype']}  "
             f"fxfuse policy {env.get('policy', 'always')}  mode {env.get('mode', 'default')}  (ms per step; MiB)", ""]
    table = []
    for r in report["rows"]:
        v = r["variants"]
        fb = {n: v[n].get("fwd_bwd_ms") for n in VARIANTS}
        best = min((x for x in (fb["eager"], fb["inductor"]) if x is not None), default=None)
        table.append([
            r["row"], *(f"{fb[n]:.3f}" if fb[n] else "err" for n in VARIANTS),
            f"{best / fb['fxfuse']:.2f}" if fb["fxfuse"] and best else "-",
            *(f"{v[n].get('step_ms'):.3f}" if v[n].get("step_ms") else "err" for n in VARIANTS),
            *(f"{v[n]['peak_mib']:.0f}" for n in VARIANTS),
        ])
    headers = ["row", "eager\nfwd+bwd", "inductor\nfwd+bwd", "fxfuse\nfwd+bwd", "speed-up\nvs best",
               "eager\n+AdamW", "inductor\n+AdamW", "fxfuse\n+AdamW", "eager\npeak", "inductor\npeak", "fxfuse\npeak"]
    lines.append(tabulate(table, headers=headers))
    lines.append("speed-up: the faster of eager and Inductor over fxfuse, forward + backward (> 1: fxfuse faster)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--dtype", default="autocast", choices=DTYPES)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--policy", default="fastest", choices=("fastest", "always"))
    parser.add_argument("--mode", default=None, choices=("reduce-overhead",))
    args = parser.parse_args()
    how = Compile(args.policy, args.mode)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {
        "env": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "dtype": args.dtype, "policy": args.policy,
                "mode": args.mode or "default"},
        "rows": [],
    }
    for row in args.rows.split(","):
        print(f"[train_bench] {row} {args.dtype}", file=sys.stderr, flush=True)
        report["rows"].append(measure(row, args.dtype, args.repeats, how))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
