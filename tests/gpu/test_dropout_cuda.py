"""Training-mode dropout on CUDA: the row kernels draw the reference's mask bit for bit, and a
compiled model's dropout (seed drawn by Inductor's lowering of torch.randint) keeps 1 - p of the
elements scaled by 1 / (1 - p), drops the same ones in the backward, draws a new mask each call
(CUDA graph replays included) and is reproducible under ``torch.manual_seed``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support, test_dropout

import fxfuse  # noqa: E402
import fxfuse.cuda as fxcuda  # noqa: E402
from fxfuse import masks, reference  # noqa: E402
from programs import PROGRAMS, make_params  # noqa: E402
from support import compile_fxfuse  # noqa: E402
from test_dropout import K, N, ROWS, BertOutput, DenseDropout, _zero_fraction_bound  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = [("dropout_residual_layer", torch.float32), ("dropout_residual_layer", torch.bfloat16),
         ("gelu_dropout", torch.float32), ("gelu_dropout", torch.bfloat16), ("dropout_traced_bf16", torch.bfloat16)]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not fxcuda.available():
        pytest.skip("no CUDA toolchain (nvcc + ninja)")
    failed = fxcuda.prepare_many([(PROGRAMS[name], dtype) for name, dtype in CASES])
    assert not failed, failed


@pytest.mark.parametrize("m,n,k", [(7, 1000, 300), (3, 11008, 64), (64, 4096, 32)])
@pytest.mark.parametrize("name,dtype", CASES)
def test_the_kernels_draw_the_reference_mask(name, dtype, m, n, k):
    program = PROGRAMS[name]
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype) if program.gemm.bias else None
    params = [p.to("cuda") if p.dtype == torch.int64 else p.to("cuda", dtype)
              for p in make_params(program, n, generator=g, lead=(m,))]
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    expected, _ = reference.forward(program, x, w, b, params)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert torch.equal(out == 0, expected == 0)  # the same elements dropped
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_block_keeps_one_minus_p_scaled_and_the_backward_drops_the_same(dtype):
    torch.manual_seed(0)
    model = DenseDropout(0.5).to("cuda", dtype).train()
    x = torch.randn(ROWS, K, device="cuda", dtype=dtype, requires_grad=True)
    fxfuse.reset_report()
    out = compile_fxfuse(model)(x)
    assert [r.status for r in fxfuse.last_report().rows] == ["fused"]
    dropped = out == 0
    assert abs(dropped.float().mean().item() - 0.5) < _zero_fraction_bound(0.5, dropped.numel())
    y = model.dense(x).detach()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[~dropped].float(), (y[~dropped].float() * masks.scale(0.5)), rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    out.backward(grad)
    kept = (~dropped).to(dtype)
    x_ref = x.detach().clone().requires_grad_()
    (model.dense(x_ref) * kept * masks.scale(0.5)).backward(grad)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)


def test_new_masks_every_call_and_manual_seed_reproduces_them():
    model = BertOutput(0.1).cuda().train()
    compiled = compile_fxfuse(model)
    h, x = torch.randn(4, 16, K, device="cuda"), torch.randn(4, 16, N, device="cuda")
    torch.manual_seed(3)
    first, second = compiled(h, x), compiled(h, x)
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    assert torch.equal(compiled(h, x), first)


def test_cuda_graph_replays_draw_new_masks():
    torch._dynamo.reset()
    model = DenseDropout(0.5).cuda().train()
    compiled = torch.compile(model, backend="fxfuse", mode="reduce-overhead")
    x = torch.randn(ROWS, K, device="cuda")
    with torch.no_grad():
        masks_seen = [(compiled(x) == 0).clone() for _ in range(4)]
    assert [r.status for r in fxfuse.last_report().rows] == ["fused"]
    assert not torch.equal(masks_seen[-1], masks_seen[-2])
