"""Norms written out op by op — transformers' LlamaRMSNorm and T5LayerNorm, the LayerNorms models
write themselves (ConvNeXt's) — are recognised as the RMS or layer norm they compute and fuse like
``torch.rms_norm`` / ``F.layer_norm``; outputs and gradients equal eager's. A written-out norm whose
inner values something else reads is left as written."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from support import check_against_eager

K, N = 24, 32


class LlamaStyle(nn.Module):
    """Linear, then LlamaRMSNorm's body: to(float32), pow(2).mean(-1, keepdim), rsqrt, weight."""

    def __init__(self, square="pow"):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.weight = nn.Parameter(torch.rand(N) + 0.5)
        self.square = square

    def forward(self, x):
        h = self.proj(x)
        dtype = h.dtype
        v = h.to(torch.float32)
        squared = v.pow(2) if self.square == "pow" else v * v
        v = v * torch.rsqrt(squared.mean(-1, keepdim=True) + 1e-6)
        return self.weight * v.to(dtype)


class T5Style(nn.Module):
    """T5LayerNorm's body: the variance from h.to(float32), then h * rsqrt(...) (h promotes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.weight = nn.Parameter(torch.rand(N) + 0.5)

    def forward(self, x):
        h = self.proj(x)
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


def inputs():
    return [torch.randn(2, 8, K)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [LlamaStyle, lambda: LlamaStyle("mul"), T5Style], ids=["llama", "llama_mul", "t5"])
def test_a_written_out_rms_norm_fuses_as_rms_norm(model, dtype):
    """The whole block fuses; in bfloat16 the norm computes in float32 and the cast back to
    bfloat16 before the weight is a rounding point (``narrow()``): the output is bfloat16."""
    report = check_against_eager(model, inputs, dtype=dtype, grads=True)
    (row,) = report.rows
    assert row.status == "fused", report
    assert "rms_norm(eps=1e-06)" in row.program and "rsqrt" not in " ".join(row.fused)
    assert ("narrow()" in row.program) == (dtype == torch.bfloat16)


def test_a_written_norm_whose_variance_is_read_elsewhere_stays_written():
    class VarianceToo(LlamaStyle):
        def forward(self, x):
            v = self.proj(x)
            variance = v.pow(2).mean(-1, keepdim=True)
            return v * torch.rsqrt(variance + 1e-6) + variance

    report = check_against_eager(VarianceToo, inputs, grads=True)
    (row,) = report.rows
    assert "rms_norm" not in (row.program or "")


@pytest.mark.parametrize("model", [LlamaStyle, T5Style], ids=["llama", "t5"])
def test_under_bf16_autocast_the_float32_weight_multiply_fuses_too(model):
    """An fp32 model under bf16 autocast: the GEMM is bf16, the norm float32, Llama's cast back to
    bf16 a rounding point inside the float32 weight multiply; the output is float32, as eager's."""
    report = check_against_eager(model, inputs, autocast=torch.bfloat16, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.program.startswith("linear(bias=True) | float32() | rms_norm(")


class InstanceNormOfRows(nn.Module):
    """KernelBench's spelling: an instance norm of the GEMM's rows viewed as (B, 1, 1, N) (one
    channel, so Dynamo keeps it in the graph), viewed back, then a residual-style tail."""

    def __init__(self, affine: bool = False):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.norm = nn.InstanceNorm2d(1, eps=1e-4, affine=affine)

    def forward(self, x, y):
        h = self.norm(self.proj(x).unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
        return (h + y) * y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_instance_norm_of_rows_viewed_as_images_fuses_as_layer_norm(dtype):
    report = check_against_eager(InstanceNormOfRows, lambda: [torch.randn(6, K), torch.randn(6, N)], dtype=dtype,
                                 grads=True)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert "layer_norm(eps=0.0001)" in row.program and row.program.endswith("|| full")


def test_an_affine_instance_norm_stays_as_written():
    """Its weight is per channel (one value here), not per feature: not the layer norm's."""
    report = check_against_eager(lambda: InstanceNormOfRows(affine=True),
                                 lambda: [torch.randn(6, K), torch.randn(6, N)], grads=True)
    (row,) = report.rows
    assert row.status != "fused" and "layer_norm" not in (row.program or "")


class WrittenLayerNorm(nn.Module):
    """Linear, then a LayerNorm written out — the mean, the biased variance, the centred row over
    its square root — then the weight, the bias and a GELU."""

    SPELLINGS = {
        "pow-div-sqrt": lambda h, u: (h - u) / torch.sqrt((h - u).pow(2).mean(-1, keepdim=True) + 1e-6),
        "square-rsqrt": lambda h, u: (h - u) * torch.rsqrt(((h - u) * (h - u)).mean(-1, keepdim=True) + 1e-5),
        "var-pow-half": lambda h, u: (h - u) / (h.var(-1, keepdim=True, unbiased=False) + 1e-5) ** 0.5,
        "var-correction-0-sqrt-method": lambda h, u: (h - u) / (torch.var(h, -1, keepdim=True, correction=0) + 1e-5).sqrt(),
    }

    def __init__(self, spelling: str = "pow-div-sqrt", centred_once: bool = False):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.weight = nn.Parameter(torch.rand(N) + 0.5)
        self.bias = nn.Parameter(torch.randn(N))
        self.spelling, self.centred_once = spelling, centred_once

    def forward(self, x):
        h = self.proj(x)
        u = h.mean(-1, keepdim=True)
        if self.centred_once:  # one centred value, read by the variance and the division
            c = h - u
            y = c / torch.sqrt((c ** 2).mean(-1, keepdim=True) + 1e-6)
        else:
            y = self.SPELLINGS[self.spelling](h, u)
        return torch.nn.functional.gelu(self.weight * y + self.bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [*(lambda s=s: WrittenLayerNorm(s) for s in WrittenLayerNorm.SPELLINGS),
                                   lambda: WrittenLayerNorm(centred_once=True)],
                         ids=[*WrittenLayerNorm.SPELLINGS, "centred-once"])
def test_a_written_out_layer_norm_fuses_as_layer_norm(model, dtype):
    """In bfloat16 the written norm rounds after every op, the fused one computes in float32 and
    rounds once: the correctness rule's float64 truth judges it."""
    report = check_against_eager(model, lambda: [torch.randn(6, K)], dtype=dtype, grads=True)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert "| layer_norm(eps=" in row.program and "gelu(" in row.program and row.program.endswith("|| col col")


def test_a_written_layer_norm_whose_mean_is_read_elsewhere_stays_written():
    class MeanToo(WrittenLayerNorm):
        def forward(self, x):
            h = self.proj(x)
            u = h.mean(-1, keepdim=True)
            return (h - u) / torch.sqrt((h - u).pow(2).mean(-1, keepdim=True) + 1e-6) + u

    report = check_against_eager(MeanToo, lambda: [torch.randn(6, K)], grads=True)
    (row,) = report.rows
    assert "layer_norm" not in (row.program or "")


def test_an_unbiased_variance_is_not_a_layer_norm():
    class Unbiased(WrittenLayerNorm):
        def forward(self, x):
            h = self.proj(x)
            return (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True) + 1e-6)

    report = check_against_eager(Unbiased, lambda: [torch.randn(6, K)], grads=True)
    (row,) = report.rows
    assert "layer_norm" not in (row.program or "")
