"""Training through fused chains: fused blocks feeding each other, SGD and AdamW steps equal to
eager's on the CPU reference and on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import fxfuse  # noqa: E402
from train_mlp import MLP, compare  # noqa: E402


def test_blocks_whose_fused_output_feeds_the_next_gemm_all_fuse():
    report = fxfuse.report(MLP().train(), torch.randn(8, 32), allow_cpu=True, policy="always")
    assert [r.status for r in report.rows if r.fused] == ["fused"] * 3
    norms = [r.fused[1].split("(")[0] for r in report.rows if r.fused]
    assert norms == ["group_norm", "batch_norm", "layer_norm"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_ten_sgd_steps_match_eager_losses_weights_and_running_statistics(device):
    eager_losses, fused_losses, eager, fused = compare(steps=10, device=device, optimizer="sgd")
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)
    for (name, a), (_, b) in zip(eager.state_dict().items(), fused.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"state {name}")
    assert int(fused.blocks[1].norm.num_batches_tracked) == 10


@pytest.mark.parametrize("device", DEVICES)
def test_the_adamw_loss_curve_matches_eager(device):
    """AdamW divides by the gradient's own scale, so the bias before the training BatchNorm (its
    gradient is zero up to rounding) takes rounding-sized gradients to full steps in both runs;
    the loss, which that bias cannot change, is the comparison."""
    eager_losses, fused_losses, _, _ = compare(steps=30, device=device)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row_id", ["S01", "S10", "S13", "S14"])
def test_the_generated_backward_path_matches_eager(monkeypatch, row_id, dtype):
    """With FXFUSE_GENERATED_BACKWARD=1 a pointwise chain's backward graph calls
    fxfuse::epilogue_backward (dY and the column sums for db in one op) and its gradients still
    equal eager's."""
    import fxfuse.op
    from examples import suite
    from support import check_against_eager

    monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", "1")
    # the flag is read when the backward is traced: a cached compiled graph keeps its old backward
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    calls = []
    original = torch.ops.fxfuse.epilogue_backward.default
    monkeypatch.setattr(fxfuse.op, "epilogue_backward", lambda *a: calls.append(a[0]) or original(*a))
    mod = suite.load(suite.get_row(row_id))
    check_against_eager(lambda: mod.Model(*mod.get_init_inputs("small")), lambda: mod.get_inputs("small"),
                        dtype=dtype, grads=True, draws=2)
    assert calls, "the backward did not go through fxfuse::epilogue_backward"
