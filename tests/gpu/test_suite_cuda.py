"""Every suite model on CUDA: fused in full, equal to eager, at small and full size, every dtype."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxfuse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support, test_suite

from examples import suite  # noqa: E402
from support import check_against_eager  # noqa: E402
from test_suite import BASE_ROWS, EXPECTED_FUSED, assert_fused_in_full  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FULL_SIZE_ROWS = ["S01", "S02", "S03", "S04", "S05", "S08", "S11", "S16", "S20", "S21"]


def _check(row, size, dtype, batch=None, draws=5, grads=False):
    mod = suite.load(row)
    dims = mod.SIZES[size]

    def inputs():
        return mod.get_inputs(size) if batch is None else [torch.rand(batch, dims["in_features"])]

    report = check_against_eager(
        lambda: mod.Model(*mod.get_init_inputs(size)), inputs, dtype=dtype, device="cuda",
        train=not row.eval_mode, draws=draws, grads=grads,
    )
    assert [r.fused for r in report.rows] == EXPECTED_FUSED[row.id] or size != "small"
    assert all(r.status == "fused" for r in report.rows if r.fused), report
    assert sum(bool(r.fused) for r in report.rows) == sum(bool(f) for f in EXPECTED_FUSED[row.id])
    return report


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("row", BASE_ROWS, ids=[r.id for r in BASE_ROWS])
def test_suite_model_on_cuda_small(row, dtype):
    _check(row, "small", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("row_id", FULL_SIZE_ROWS)
def test_suite_model_on_cuda_full_size(row_id, dtype):
    _check(suite.get_row(row_id), "full", dtype, draws=2)


DECODE_ROWS = ["S01", "S02", "S04", "S10"]  # also built by prebuild.py --suite
DECODE_BATCHES = [16, 1, 24, 64]  # the swapped GEMM's 16-, 32- and 64-wide tiles over the rows


@pytest.mark.parametrize("batch", DECODE_BATCHES)
@pytest.mark.parametrize("row_id", DECODE_ROWS)
def test_decode_shapes_on_cuda(row_id, batch):
    _check(suite.get_row(row_id), "full", torch.bfloat16, batch=batch, draws=2)


SYMBOLIC_BATCH_ROW = "S10"  # at the full size, in bf16: also built by prebuild.py --suite


def test_a_graph_with_a_symbolic_batch_fuses_on_cuda_and_serves_every_later_size():
    """Dynamo compiles the first batch size as a static graph and the second as one with a
    symbolic batch. The chains of both fuse (the selection times the second at the size it was
    traced with, without guarding on it), and the second serves every later size without
    compiling again, a bucket no compile timed timed on its first call; every output keeps the
    correctness rule against eager and a float64 run."""
    import copy

    from fxfuse.accuracy import rule_breaks

    mod = suite.load(suite.get_row(SYMBOLIC_BATCH_ROW))
    torch.manual_seed(0)
    eager = mod.Model(*mod.get_init_inputs("full")).to("cuda", torch.bfloat16).eval()
    exact = copy.deepcopy(eager).double()
    compiled = torch.compile(copy.deepcopy(eager), backend="fxfuse", options={"policy": "always"})  # fxfuse's paths
    fxfuse.reset_report()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for batch in (1024, 300, 3000, 40):
            x = torch.rand(batch, mod.SIZES["full"]["in_features"], device="cuda", dtype=torch.bfloat16)
            out = compiled(x)
            assert not rule_breaks(out, eager(x), exact(x.double()), 1e-2).any(), batch
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert [r.status for r in fxfuse.last_report().rows] == ["fused", "fused"]


def test_tf32_is_honoured_like_eager(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)  # this test's alone
    _check(suite.get_row("S01"), "small", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", BASE_ROWS, ids=[r.id for r in BASE_ROWS])
def test_gradients_on_cuda(row, dtype):
    """Input and parameter gradients of every suite model equal eager's (1e-4 of the gradient's
    scale in float32, 1e-2 in bfloat16), and BatchNorm statistics after each step."""
    _check(row, "small", dtype, grads=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("row", BASE_ROWS, ids=[r.id for r in BASE_ROWS])
def test_autocast_on_cuda(row, dtype):
    """autocast(bfloat16 or float16) over the float32 model: outputs, dtypes, BatchNorm statistics
    and gradients as eager's (1e-2); every chain fused in full, widened to float32 at the op
    autocast runs in float32 (norms, softmax, logsumexp, sum) or a float32 parameter promotes."""
    mod = suite.load(row)
    report = check_against_eager(
        lambda: mod.Model(*mod.get_init_inputs("small")), lambda: mod.get_inputs("small"),
        device="cuda", train=not row.eval_mode, grads=True, autocast=dtype,
    )
    assert_fused_in_full(report, row)


@pytest.mark.parametrize("train", [True, False], ids=["train", "inference"])
@pytest.mark.parametrize("row_id", ["S01", "S03", "S04"])
def test_cuda_graphs_mode_runs_the_fused_ops(row_id, train, monkeypatch):
    """mode="reduce-overhead" (Inductor's CUDA graphs) captures the fused op like any other kernel,
    and every graph, one that updates BatchNorm's running statistics too: outputs, gradients and
    BatchNorm statistics as eager's, step after step. (torch.compile takes a mode or options, so
    the policy that fuses every chain comes from the environment.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FXFUSE_POLICY", "always")
    counters.clear()
    mod = suite.load(suite.get_row(row_id))
    report = check_against_eager(
        lambda: mod.Model(*mod.get_init_inputs("small")), lambda: mod.get_inputs("small"),
        dtype=torch.bfloat16, device="cuda", train=train, grads=train, mode="reduce-overhead",
    )
    assert [r.fused for r in report.rows] == EXPECTED_FUSED[row_id]
    assert counters["inductor"]["cudagraph_skips"] == 0
