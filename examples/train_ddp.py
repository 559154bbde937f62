"""Data-parallel training with fxfuse: DDP or FSDP2, checked against one process of eager.

    torchrun --nproc-per-node 2 examples/train_ddp.py [--wrapper ddp|fsdp] [--model mlp|S08|S20|...]
             [--size small|full] [--steps 5] [--batch 16] [--autocast] [--compiler fxfuse|inductor|eager]
    python examples/train_ddp.py --spawn 2 ...          # no torchrun: two CPU processes over gloo

Every rank builds the same model from one seed, wraps it (``DistributedDataParallel``, or FSDP2's
``fully_shard`` on every block and the root), compiles it with ``torch.compile(...,
backend="fxfuse")`` and trains on its shard of each global batch. Rank 0 then trains the same
model in one process, in eager, on the same batches (``reference``) and prints both loss curves,
the largest parameter and buffer differences, and fxfuse's coverage report of the compiled graphs.

What the wrappers change for fxfuse: DDP's graph splitting (Dynamo's DDPOptimizer, on by default)
cuts the forward graph at gradient-bucket boundaries and compiles each piece with the backend, so a
chain fuses when its GEMM and epilogue fall in one piece; FSDP2 runs its all-gather hooks outside
the graph (Dynamo skips FSDP hooks), and the blocks are traced with the gathered parameters as plain
tensors. Either way the fused op sees ordinary tensors. BatchNorm uses each rank's own batch
statistics, as in eager; DDP broadcasts rank 0's running statistics before each forward, FSDP2
leaves each rank its own. SyncBatchNorm is left to Inductor: its cross-rank statistics are a
collective inside the norm, which a per-GEMM kernel does not perform.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn as nn

from examples.train_mlp import MLP

WRAPPERS = ("ddp", "fsdp")
COMPILERS = ("fxfuse", "inductor", "eager")


@dataclass(frozen=True)
class Job:
    """What each rank trains, and how."""

    model: str = "mlp"  # "mlp" (examples/train_mlp.py) or a suite row id ("S08")
    size: str = "small"  # the suite row's size; for the MLP, "small" (512 features) or "full" (4096)
    wrapper: str = "ddp"
    compiler: str = "fxfuse"
    steps: int = 5
    batch: int = 16  # global batch: each of the ranks trains on its equal share
    autocast: bool = False  # bf16 autocast around the forward (CUDA)
    sync_batch_norm: bool = False  # BatchNorm layers converted to SyncBatchNorm (CUDA, DDP)
    policy: str = "always"  # fxfuse's policy option
    lr: float = 1e-2
    bucket_mb: float = 1.0  # DDP's gradient buckets: small, so that its graph splitting cuts even a small model

    def options(self, device: torch.device) -> dict[str, Any]:
        """fxfuse's options: the CPU reference kernels are allowed where the ranks run on the CPU."""
        return {"policy": self.policy, **({"allow_cpu": True} if device.type == "cpu" else {})}


def build_model(job: Job, device: torch.device) -> nn.Module:
    """The job's model from seed 0, in training mode (every rank and the reference build the same)."""
    torch.manual_seed(0)
    if job.model == "mlp":
        features = {"small": 512, "full": 4096}[job.size]
        model = MLP(features=features, inputs=features if job.size == "full" else 32)
    else:
        from examples.suite import build

        model, _ = build(job.model, size=job.size)
    model = model.to(device).train()
    if job.sync_batch_norm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def input_shape(job: Job) -> tuple[int, ...]:
    """One sample's input shape."""
    if job.model == "mlp":
        return (4096,) if job.size == "full" else (32,)
    from examples.suite import make_inputs

    return tuple(make_inputs(job.model, size=job.size)[0].shape[1:])


def global_batch(job: Job, step: int, output_shape: torch.Size, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch (inputs, regression targets), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(job.batch, *input_shape(job), generator=g)
    y = torch.randn(job.batch, *output_shape[1:], generator=g)
    return x.to(device), y.to(device)


def output_shape(job: Job) -> torch.Size:
    """One batch's output shape (the model run on the meta device)."""
    with torch.device("meta"):
        model = build_model(replace(job, sync_batch_norm=False), torch.device("meta"))
        return model(torch.empty(job.batch, *input_shape(job))).shape


def wrap(model: nn.Module, job: Job, device: torch.device) -> nn.Module:
    if job.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=job.bucket_mb)
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", []):
        fully_shard(block)
    return fully_shard(model)


def compile_model(model: nn.Module, job: Job, device: torch.device):
    if job.compiler == "eager":
        return model
    if job.compiler == "inductor":
        return torch.compile(model)
    try:
        torch._dynamo.lookup_backend("fxfuse")
        backend: Any = "fxfuse"
    except Exception:  # a checkout on PYTHONPATH: the entry point that registers the name is missing
        from fxfuse.backend import fxfuse_backend as backend
    return torch.compile(model, backend=backend, options=job.options(device))


def loss_of(model, x: torch.Tensor, y: torch.Tensor, job: Job) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=job.autocast):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, whole (FSDP2's shards gathered: a collective, every rank calls it)."""
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "module", model)  # DDP's wrapped module
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()
            for name, t in inner.state_dict().items()}


def train_rank(job: Job, device: torch.device) -> dict[str, Any]:
    """This rank's part of the job (the process group is up): the global loss of every step, and on
    every rank the final state and what fxfuse fused."""
    import fxfuse

    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap(build_model(job, device), job, device)
    fxfuse.reset_report()
    compiled = compile_model(model, job, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
    shape, losses = output_shape(job), []
    for step in range(job.steps):
        x, y = global_batch(job, step, shape, device)
        loss = loss_of(compiled, x.chunk(world)[rank], y.chunk(world)[rank], job)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    report = fxfuse.last_report()
    return {"job": asdict(job), "world": world, "losses": losses, "state": full_state(model),
            "fused": sum(r.status == "fused" for r in report.rows), "graphs": len({r.graph for r in report.rows}),
            "rows": [(r.status, r.reason) for r in report.rows], "report": str(report)}


def reference(job: Job, world: int, device: torch.device) -> dict[str, Any]:
    """The job in one process, in eager, as ``world`` ranks would run it: each step's loss is the
    mean of the shards' losses, each shard's forward sees only its shard (BatchNorm's batch
    statistics per rank), and the running statistics follow rank 0's shard (DDP broadcasts rank 0's
    before every forward; FSDP2 keeps each rank's own, and rank 0's are compared). With
    SyncBatchNorm the statistics are over the whole batch, which one forward of it computes."""
    model = build_model(replace(job, sync_batch_norm=False), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
    shape, losses = output_shape(job), []
    for step in range(job.steps):
        x, y = global_batch(job, step, shape, device)
        optimizer.zero_grad(set_to_none=True)
        if job.sync_batch_norm:
            loss = loss_of(model, x, y, job)
            loss.backward()
        else:
            loss = 0.0
            for r in reversed(range(world)):  # rank 0 last: its running statistics stay
                kept = {n: b.clone() for n, b in model.named_buffers()} if r else {}
                shard = loss_of(model, x.chunk(world)[r], y.chunk(world)[r], job) / world
                shard.backward()
                loss = loss + shard.detach()
                with torch.no_grad():
                    for n, b in model.named_buffers():
                        if n in kept:
                            b.copy_(kept[n])
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "state": {n: t.detach().float().cpu() for n, t in model.state_dict().items()}}


def differences(result: dict[str, Any], expected: dict[str, Any]) -> dict[str, float]:
    """The largest |difference| of the losses and of every state entry."""
    out = {"losses": max(abs(a - b) for a, b in zip(result["losses"], expected["losses"]))}
    for name, want in expected["state"].items():
        out[name] = (result["state"][name] - want).abs().max().item() if want.numel() else 0.0
    return out


def _spawned(rank: int, world: int, init: str, job: Job, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(train_rank(job, torch.device("cpu")), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def run_spawned(job: Job, world: int = 2, attempts: int = 2) -> list[dict[str, Any]]:
    """The job on ``world`` CPU processes (gloo), without torchrun: every rank's result.

    A rank killed by a signal (gloo's C++ threads have aborted a rank on a loaded machine, with no
    Python error) runs the whole job again, up to ``attempts`` times; a Python error in a rank is
    raised at once."""
    import torch.multiprocessing as mp

    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{Path(tmp) / 'rendezvous'}"
            try:
                mp.spawn(_spawned, args=(world, init, job, tmp), nprocs=world)
            except mp.ProcessExitedException as killed:
                if attempt == attempts or killed.signal_name is None:
                    raise
                print(f"run_spawned: {killed}; running the job again", file=sys.stderr)
                continue
            return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    raise AssertionError("unreachable")


def _print(result: dict[str, Any], expected: dict[str, Any]) -> None:
    print(f"{result['world']} ranks, {result['job']['wrapper']}, {result['job']['compiler']}: "
          f"{result['fused']} chains fused over {result['graphs']} compiled graphs")
    print(f"{'step':>5} {'eager, 1 process':>18} {result['job']['compiler'] + ', ranks':>16}")
    for i, (a, b) in enumerate(zip(expected["losses"], result["losses"])):
        print(f"{i:>5} {a:>18.6f} {b:>16.6f}")
    diffs = differences(result, expected)
    print(f"largest |difference|: losses {diffs.pop('losses'):.2e}, parameters and buffers "
          f"{max(diffs.values()):.2e} ({max(diffs, key=diffs.get)})")
    print(result["report"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--wrapper", default="ddp", choices=WRAPPERS)
    parser.add_argument("--compiler", default="fxfuse", choices=COMPILERS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--sync-batch-norm", action="store_true")
    parser.add_argument("--spawn", type=int, default=0, help="run this many CPU processes (gloo) instead of torchrun's")
    parser.add_argument("--save", default=None, help="torch.save rank 0's result here")
    args = parser.parse_args()
    job = Job(args.model, args.size, args.wrapper, args.compiler, args.steps, args.batch, args.autocast,
              args.sync_batch_norm)
    if args.spawn:
        result = run_spawned(job, args.spawn)[0]
        device = torch.device("cpu")
    else:  # under torchrun
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            result = train_rank(job, device)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    if args.save:
        torch.save(result, args.save)
    _print(result, reference(job, result["world"], device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
