"""Data-parallel training through fxfuse on the CPU: two processes over gloo, each wrapping the
model in DDP or FSDP2 and compiling it with fxfuse (the CPU reference kernels), train a few SGD
steps; losses, parameters and BatchNorm running statistics equal one eager process that runs the
same shards (examples/train_ddp.py's ``reference``), and the chains are fused in the compiled
graphs. The same on two GPUs with torchrun: tests/gpu/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.train_ddp import Job, differences, reference, run_spawned

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# model -> chains fused on every rank: the MLP's GroupNorm, BatchNorm and LayerNorm blocks; S08's
# GroupNorm chain; S03's training-mode BatchNorm chain.
FUSED = {"mlp": 3, "S08": 1, "S03": 1}
CASES = [("ddp", "mlp"), ("fsdp", "mlp"), ("ddp", "S03"), ("fsdp", "S08")]


@pytest.mark.parametrize("wrapper,model", CASES, ids=[f"{w}-{m}" for w, m in CASES])
def test_two_ranks_train_like_one_eager_process_with_every_chain_fused(wrapper, model):
    job = Job(model=model, wrapper=wrapper, steps=4, batch=16)
    ranks = run_spawned(job, world=2)
    expected = reference(job, world=2, device=torch.device("cpu"))

    for result in ranks:
        assert result["fused"] == FUSED[model], result["report"]
        assert {reason for status, reason in result["rows"] if status != "fused"} <= {"no epilogue op after the GEMM"}
    if (wrapper, model) == ("ddp", "mlp"):  # DDP's graph splitting at its 1 MiB buckets (a block's
        assert ranks[0]["graphs"] >= 3     # weights each) compiled every block's chain in its own graph
    rank0 = ranks[0]
    torch.testing.assert_close(torch.tensor(rank0["losses"]), torch.tensor(expected["losses"]), rtol=1e-4, atol=1e-4)
    for name, want in expected["state"].items():
        torch.testing.assert_close(rank0["state"][name], want, rtol=1e-4, atol=1e-4, msg=f"state {name}")
    for name, param in rank0["state"].items():  # the replicas (or the gathered shards) agree
        if "running" not in name and "num_batches" not in name:
            torch.testing.assert_close(ranks[1]["state"][name], param, rtol=0, atol=0, msg=f"rank 1 {name}")
    assert max(differences(rank0, expected).values()) < 1e-4


def test_batch_norm_uses_each_ranks_own_batch_statistics():
    """A training BatchNorm under DDP normalises each rank's shard by that shard's statistics, as
    eager DDP does: one eager process running the whole batch at once does not match it."""
    job = Job(model="S03", wrapper="ddp", steps=2, batch=16)
    rank0 = run_spawned(job, world=2)[0]
    per_rank = reference(job, world=2, device=torch.device("cpu"))
    whole_batch = reference(job, world=1, device=torch.device("cpu"))
    torch.testing.assert_close(torch.tensor(rank0["losses"]), torch.tensor(per_rank["losses"]), rtol=1e-4, atol=1e-4)
    assert abs(rank0["losses"][1] - whole_batch["losses"][1]) > 1e-3
