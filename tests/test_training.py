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
@pytest.mark.parametrize("row_id", ["S01", "S10", "S13", "S14", "S22"])
def test_the_generated_backward_path_matches_eager(monkeypatch, row_id, dtype):
    """With FXFUSE_GENERATED_BACKWARD=1 the backward graph of a pointwise chain, or of S22's
    BatchNorm in eval mode (a frozen BatchNorm being fine-tuned), calls fxfuse::epilogue_backward
    (dY and the column sums for db and the parameters in one op) and its gradients still equal
    eager's; the running statistics get none."""
    import fxfuse.reference
    from examples import suite
    from support import check_against_eager

    monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", "1")
    calls = []  # the op's CPU kernel, called by each backward
    original = fxfuse.reference.epilogue_backward
    monkeypatch.setattr(fxfuse.reference, "epilogue_backward", lambda *a: calls.append(1) or original(*a))
    row = suite.get_row(row_id)
    mod = suite.load(row)
    check_against_eager(lambda: mod.Model(*mod.get_init_inputs("small")), lambda: mod.get_inputs("small"),
                        dtype=dtype, grads=True, draws=2, train=not row.eval_mode)
    assert calls, "the backward did not go through fxfuse::epilogue_backward"


def test_torch_compile_caches_key_on_the_backward_fxfuse_traces(monkeypatch):
    """The same graph compiled again after FXFUSE_GENERATED_BACKWARD changed (or after fxfuse's
    code changed) runs the backward the setting asks for, not one from torch's compile caches:
    with it, each backward calls fxfuse::epilogue_backward (on CPU, the reference's kernel)."""
    from examples import suite
    from support import compile_fxfuse

    import fxfuse.reference

    calls = []
    original = fxfuse.reference.epilogue_backward
    monkeypatch.setattr(fxfuse.reference, "epilogue_backward", lambda *a: calls.append(1) or original(*a))
    mod = suite.load(suite.get_row("S01"))
    model = mod.Model(*mod.get_init_inputs("small")).train()
    (x,) = mod.get_inputs("small")
    counts = []
    for setting in ("1", "0", "1", "0"):
        monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", setting)
        torch._dynamo.reset()
        calls.clear()
        compile_fxfuse(model)(x.clone().requires_grad_()).sum().backward()
        counts.append(len(calls))
    assert counts == [1, 0, 1, 0], counts
