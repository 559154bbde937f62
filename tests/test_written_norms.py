"""Norms written out op by op — transformers' LlamaRMSNorm and T5LayerNorm, the LayerNorms models
write themselves (ConvNeXt's), CLIP's and ALIGN's embeddings over their Euclidean norm — are
recognised as the RMS norm, layer norm or L2 normalization they compute and fuse like
``torch.rms_norm`` / ``F.layer_norm`` / ``F.normalize``; outputs and gradients equal eager's. A
written-out norm whose inner values something else reads is left as written."""

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


class WrittenNormalization(nn.Module):
    """A projection without bias (CLIP's, ALIGN's), the embedding over its Euclidean norm, then a
    scale: the division is ``F.normalize`` (eps = 0 without a clamp)."""

    SPELLINGS = {
        "align-norm-method": lambda e: e / e.norm(p=2, dim=-1, keepdim=True),
        "clip-pow-sum-pow": lambda e: e / torch.pow(torch.sum(torch.pow(e, 2), dim=-1, keepdim=True), 0.5),
        "linalg-vector-norm": lambda e: e / torch.linalg.vector_norm(e, dim=-1, keepdim=True),
        "square-sum-sqrt": lambda e: e / (e * e).sum(-1, keepdim=True).sqrt(),
        "norm-clamp-min": lambda e: e / e.norm(dim=-1, keepdim=True).clamp(min=1e-6),
        "torch-norm-clamp_min": lambda e: e / torch.norm(e, 2, -1, True).clamp_min(1e-6),
    }
    EPS = {"norm-clamp-min": 1e-06, "torch-norm-clamp_min": 1e-06}

    def __init__(self, spelling: str = "align-norm-method"):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False)
        self.spelling = spelling

    def forward(self, x):
        return self.SPELLINGS[self.spelling](self.proj(x)) * 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", list(WrittenNormalization.SPELLINGS))
def test_a_row_over_its_written_euclidean_norm_fuses_as_normalize(spelling, dtype):
    report = check_against_eager(lambda: WrittenNormalization(spelling), lambda: [torch.randn(2, 5, K)],
                                 dtype=dtype, grads=True)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    eps = WrittenNormalization.EPS.get(spelling, 0.0)
    assert row.program.startswith(f"linear(bias=False) | normalize(eps={eps}) | pointwise("), row.program


def test_a_zero_row_over_its_norm_is_nan_where_eagers_is():
    """0 / 0 on a row of zeros, as eager's quotient (and F.normalize at eps = 0): NaN there, the
    other rows unchanged; the gradients carry eager's Inf and NaN (g / 0; none through the norm)."""

    def zero_second_row():
        x = torch.randn(3, K)
        x[1] = 0.0
        return [x]

    report = check_against_eager(WrittenNormalization, zero_second_row, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and "normalize(eps=0.0)" in row.program


@pytest.mark.parametrize("read_too", ["norm", "square"])
def test_a_written_norm_read_elsewhere_or_over_another_row_stays_written(read_too):
    class NormToo(WrittenNormalization):
        def forward(self, x):
            e = self.proj(x)
            if read_too == "norm":
                n = e.norm(p=2, dim=-1, keepdim=True)
                return e / n + n
            square = e * e
            return e / square.sum(-1, keepdim=True).sqrt() + square

    report = check_against_eager(NormToo, lambda: [torch.randn(4, K)], grads=True)
    assert all("normalize" not in (row.program or "") for row in report.rows)


def test_a_norm_over_another_dim_or_an_upper_clamp_is_not_a_normalization():
    class Other(WrittenNormalization):
        def forward(self, x):
            e = self.proj(x)
            return e / e.norm(dim=0, keepdim=True) + e / e.norm(dim=-1, keepdim=True).clamp(1e-6, 10.0)

    report = check_against_eager(Other, lambda: [torch.randn(4, K)], grads=True)
    assert all("normalize" not in (row.program or "") for row in report.rows)


class WrittenSoftmax(nn.Module):
    """A classifier head's softmax written out with its max shift, then a scale."""

    SPELLINGS = {
        "max-index0": lambda y: torch.exp(y - y.max(dim=-1, keepdim=True)[0]),
        "max-values": lambda y: torch.exp(y - torch.max(y, -1, keepdim=True).values),
        "amax-method-exp": lambda y: (y - y.amax(-1, keepdim=True)).exp(),
    }

    def __init__(self, spelling: str = "max-index0"):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.spelling = spelling

    def forward(self, x):
        e = self.SPELLINGS[self.spelling](self.proj(x))
        return e / e.sum(dim=-1, keepdim=True) * 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", list(WrittenSoftmax.SPELLINGS))
def test_a_softmax_written_out_with_its_max_shift_fuses_as_softmax(spelling, dtype):
    report = check_against_eager(lambda: WrittenSoftmax(spelling), lambda: [torch.randn(2, 5, K)], dtype=dtype,
                                 grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.program.startswith("linear(bias=True) | softmax() | pointwise("), row


def test_a_row_of_infinities_is_nan_where_the_written_softmax_is():
    """inf - inf in the shift: NaN, as torch.softmax gives for a row holding +inf."""
    def infinite_second_row():
        x = torch.randn(3, K)
        x[1] = float("inf")
        return [x]

    assert WrittenSoftmax()(*infinite_second_row())[1].isnan().all()
    report = check_against_eager(WrittenSoftmax, infinite_second_row)
    assert report.rows[0].program.startswith("linear(bias=True) | softmax()")


def test_a_written_softmax_without_the_shift_or_with_its_max_read_elsewhere_stays_written():
    class Other(WrittenSoftmax):
        def forward(self, x):
            y = self.proj(x)
            unshifted = torch.exp(y) / torch.exp(y).sum(-1, keepdim=True)  # overflows where softmax does not
            peak = y.amax(-1, keepdim=True)
            e = torch.exp(y - peak)
            return unshifted + e / e.sum(-1, keepdim=True) + peak

    report = check_against_eager(Other, lambda: [torch.randn(4, K)])
    assert all("softmax" not in (row.program or "") for row in report.rows)
