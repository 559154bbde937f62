"""Data-parallel training through fxfuse on two GPUs of one host: ``torchrun --nproc-per-node 2
examples/train_ddp.py`` (NCCL) under DDP and FSDP2, float32 and bf16 autocast; rank 0's losses,
parameters and running statistics against one eager process on GPU 0 running the same shards,
and the chains fused on the CUDA kernels. Skipped without two GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.train_ddp import Job, reference  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

FUSED = {"mlp": 3, "S08": 1, "S20": 1}


def torchrun(job: Job, tmp_path: Path) -> dict:
    """Rank 0's result of the job on two GPUs."""
    saved = tmp_path / "rank0.pt"
    flags = [f"--model={job.model}", f"--size={job.size}", f"--wrapper={job.wrapper}", f"--steps={job.steps}",
             f"--batch={job.batch}", f"--save={saved}"]
    flags += ["--autocast"] * job.autocast + ["--sync-batch-norm"] * job.sync_batch_norm
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "train_ddp.py"), *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return torch.load(saved)


def assert_like_eager(result: dict, job: Job, tol: float) -> None:
    expected = reference(job, world=2, device=torch.device("cuda", 0))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=tol, atol=tol)
    for name, want in expected["state"].items():
        torch.testing.assert_close(result["state"][name], want, rtol=tol, atol=tol, msg=f"state {name}")


CASES = [
    Job(model="mlp", wrapper="ddp"),
    Job(model="mlp", wrapper="fsdp"),
    Job(model="S08", wrapper="ddp"),
    Job(model="S20", wrapper="fsdp"),
    Job(model="mlp", wrapper="ddp", autocast=True),
    Job(model="mlp", wrapper="fsdp", autocast=True),
]


@pytest.mark.parametrize("job", CASES, ids=lambda j: f"{j.wrapper}-{j.model}-{'autocast' if j.autocast else 'fp32'}")
def test_two_gpus_train_like_one_eager_process_with_every_chain_fused(job, tmp_path):
    result = torchrun(job, tmp_path)
    assert result["fused"] == FUSED[job.model], result["report"]
    # float32: TF32 off, as torch's default; autocast: bf16 GEMMs, the low-precision tolerance
    assert_like_eager(result, job, tol=1e-2 if job.autocast else 1e-4)


def test_sync_batch_norm_is_left_to_inductor_and_trains_on_whole_batch_statistics(tmp_path):
    """SyncBatchNorm's statistics are a collective across the ranks inside the norm: its chain is
    not fused (the report says why), the other blocks still are, and training equals one eager
    process normalising the whole batch."""
    job = Job(model="mlp", wrapper="ddp", sync_batch_norm=True)
    result = torchrun(job, tmp_path)
    assert result["fused"] == 2, result["report"]
    assert_like_eager(result, job, tol=1e-4)
