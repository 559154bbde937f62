"""Training on CUDA through fused chains: the training example's steps equal eager's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_mlp import compare  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_ten_sgd_steps_match_eager_losses_weights_and_running_statistics():
    eager_losses, fused_losses, eager, fused = compare(steps=10, device="cuda", optimizer="sgd")
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)
    for (name, a), (_, b) in zip(eager.state_dict().items(), fused.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"state {name}")
    assert int(fused.blocks[1].norm.num_batches_tracked) == 10


def test_the_adamw_loss_curve_matches_eager():
    eager_losses, fused_losses, _, _ = compare(steps=30, device="cuda")
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)
