"""Every accepted spelling fuses into one op and computes what eager computes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse

from support import check_against_eager

N, K, M = 32, 16, 8


class Chain(nn.Module):
    """A Linear(K, N) followed by ``epilogue(self, y)``; holds parameters of every broadcast shape."""

    def __init__(self, epilogue, bias: bool = True, gemm=None):
        super().__init__()
        self.linear = nn.Linear(K, N, bias=bias)
        self.weight = nn.Parameter(torch.randn(N, K) / K**0.5)
        self.weight_kn = nn.Parameter(torch.randn(K, N) / K**0.5)  # stored (K, N), as GPT-2's Conv1D
        self.vector = nn.Parameter(torch.randn(N))
        self.row = nn.Parameter(torch.randn(1, N))
        self.one = nn.Parameter(torch.randn(1))
        self.scalar = nn.Parameter(torch.randn(()))
        self.norm_weight = nn.Parameter(torch.rand(N) + 0.5)
        self.norm_bias = nn.Parameter(torch.randn(N))
        self.register_buffer("running_mean", torch.randn(N))
        self.register_buffer("running_var", torch.rand(N) + 0.5)
        self.epilogue, self.gemm = epilogue, gemm

    def forward(self, x):
        y = self.gemm(self, x) if self.gemm else self.linear(x)
        return self.epilogue(self, y)


def _inputs(shape=(M, K)):
    return lambda: [torch.randn(*shape)]


# (id, epilogue(m, y), substring the program must contain)
POINTWISE = [
    ("mul-scalar", lambda m, y: y * 2.0, "x * 2.0"),
    ("scalar-mul", lambda m, y: 2.0 * y, "2.0 * x"),
    ("add-scalar", lambda m, y: y + 1.5, "x + 1.5"),
    ("scalar-sub", lambda m, y: 1.5 - y, "1.5 - x"),
    ("sub-scalar", lambda m, y: y - 2.0, "x - 2.0"),
    ("div-scalar", lambda m, y: y / 10.0, "x / 10.0"),
    ("scalar-div", lambda m, y: 1.0 / (y * y + 1.0), "1.0 / "),
    ("int-scalar", lambda m, y: y * 3, "x * 3.0"),
    ("mul-vector", lambda m, y: y * m.vector, "x * p0"),
    ("add-row", lambda m, y: y + m.row, "x + p0"),
    ("sub-one", lambda m, y: y - m.one, "x - p0"),
    ("div-0d", lambda m, y: y / m.scalar, "x / p0"),
    ("x-plus-x", lambda m, y: y + y, "x + x"),
    ("x-minus-x", lambda m, y: y - y, "x - x"),
    ("used-twice", lambda m, y: torch.sigmoid(y) * 2.0 + y, "(sigmoid(x) * 2.0) + x"),
    ("silu-spelled", lambda m, y: y * torch.sigmoid(y), "x * sigmoid(x)"),
    ("silu-spelled-rev", lambda m, y: torch.sigmoid(y) * y, "sigmoid(x) * x"),
    ("torch-add", lambda m, y: torch.add(y, m.vector), "x + p0"),
    ("torch-add-alpha", lambda m, y: torch.add(y, m.vector, alpha=0.5), "x + (p0 * 0.5)"),
    ("torch-mul", lambda m, y: torch.mul(y, 0.5), "x * 0.5"),
    ("torch-div", lambda m, y: torch.div(y, 4.0), "x / 4.0"),
    ("torch-sub", lambda m, y: torch.sub(y, m.row), "x - p0"),
    ("neg", lambda m, y: -y, "-x"),
    ("pow", lambda m, y: y**2, "x ** 2.0"),
    ("rsqrt", lambda m, y: torch.rsqrt(y * y + 1.0), "** -0.5"),
    ("sqrt-method", lambda m, y: (y * y + 0.5).sqrt(), "** 0.5"),
    ("square", lambda m, y: torch.square(y), "x ** 2.0"),
    ("reciprocal", lambda m, y: (y * y + 1.0).reciprocal(), "** -1.0"),
    ("type_as", lambda m, y: torch.relu(y).type_as(m.vector) * 2.0, "relu(x) * 2.0"),
    ("flatten-of-rows", lambda m, y: torch.flatten(torch.relu(y), 1) * 2.0, "relu(x) * 2.0"),
    ("relu", lambda m, y: torch.relu(y), "relu(x)"),
    ("F-relu", lambda m, y: F.relu(y), "relu(x)"),
    ("relu-method", lambda m, y: y.relu(), "relu(x)"),
    ("relu-inplace", lambda m, y: F.relu(y, inplace=True), "relu(x)"),
    ("relu_-method", lambda m, y: y.relu_(), "relu(x)"),
    ("nn-ReLU-inplace", lambda m, y: nn.ReLU(inplace=True)(y), "relu(x)"),
    ("mul_-inplace", lambda m, y: y.mul_(2.0).add_(1.0), "(x * 2.0) + 1.0"),
    ("iadd", lambda m, y: _iadd(y, m.vector), "x + p0"),
    ("leaky_relu", lambda m, y: F.leaky_relu(y, 0.2), "leaky_relu(x, 0.2)"),
    ("nn-LeakyReLU", lambda m, y: nn.LeakyReLU(0.1)(y), "leaky_relu(x, 0.1)"),
    ("leaky_relu-inplace", lambda m, y: F.leaky_relu(y, 0.3, inplace=True), "leaky_relu(x, 0.3)"),
    ("rrelu-not-training", lambda m, y: F.rrelu(y, 0.1, 0.3), "leaky_relu(x, 0.2)"),  # the mean slope
    ("torch-rrelu-defaults", lambda m, y: torch.rrelu(y), "leaky_relu(x, 0.2291"),
    ("prelu-one-weight", lambda m, y: F.prelu(y, m.one), "prelu(x, p0)"),
    ("prelu-a-weight-a-feature", lambda m, y: torch.prelu(y * 2.0, m.vector), "prelu(x * 2.0, p0)"),
    ("gelu", lambda m, y: F.gelu(y), "gelu(x)"),
    ("gelu-tanh", lambda m, y: F.gelu(y, approximate="tanh"), "gelu_tanh(x)"),
    ("silu", lambda m, y: F.silu(y), "silu(x)"),
    ("nn-SiLU", lambda m, y: nn.SiLU()(y), "silu(x)"),
    ("sigmoid", lambda m, y: torch.sigmoid(y), "sigmoid(x)"),
    ("sigmoid-method", lambda m, y: y.sigmoid(), "sigmoid(x)"),
    ("tanh", lambda m, y: torch.tanh(y), "tanh(x)"),
    ("tanh-method", lambda m, y: y.tanh(), "tanh(x)"),
    ("mish", lambda m, y: F.mish(y), "mish(x)"),
    ("hardtanh", lambda m, y: F.hardtanh(y, -2.0, 2.0), "hardtanh(x, -2.0, 2.0)"),
    ("nn-Hardtanh", lambda m, y: nn.Hardtanh(-0.5, 0.5)(y), "hardtanh(x, -0.5, 0.5)"),
    ("relu6", lambda m, y: F.relu6(y * 4.0), "hardtanh(x * 4.0, 0.0, 6.0)"),
    ("clamp", lambda m, y: torch.clamp(y, -1, 1), "clamp(x, -1.0, 1.0)"),
    ("clamp-method", lambda m, y: y.clamp(min=-0.5), "clamp_min(x, -0.5)"),
    ("clamp_min", lambda m, y: torch.clamp_min(y, 0.1), "clamp_min(x, 0.1)"),
    ("clamp_max", lambda m, y: y.clamp_max(0.1), "clamp_max(x, 0.1)"),
    ("max-0d", lambda m, y: torch.max(y, m.scalar), "maximum(x, p0)"),
    ("min-0d", lambda m, y: torch.min(y, m.scalar), "minimum(x, p0)"),
    ("hardswish", lambda m, y: F.hardswish(y), "hardswish(x)"),
    ("hardsigmoid", lambda m, y: F.hardsigmoid(y), "hardsigmoid(x)"),
    ("elu", lambda m, y: F.elu(y, alpha=0.7), "elu(x, 0.7)"),
    ("selu", lambda m, y: F.selu(y), "selu(x)"),
    ("softplus", lambda m, y: F.softplus(y, beta=2.0, threshold=10.0), "softplus(x, 2.0, 10.0)"),
    ("abs", lambda m, y: torch.abs(y), "abs(x)"),
    ("neg-method", lambda m, y: y.neg(), "-x"),
    ("exp", lambda m, y: torch.exp(y * 0.1), "exp(x * 0.1)"),
    ("expm1", lambda m, y: torch.expm1(y), "expm1(x)"),
    ("log", lambda m, y: torch.log(y.abs() + 0.5), "log(abs(x) + 0.5)"),
    ("log-method-inplace", lambda m, y: (y * y + 0.5).log_(), "log("),
    ("log1p", lambda m, y: y.abs().log1p(), "log1p(abs(x))"),
    ("erf", lambda m, y: torch.erf(y), "erf(x)"),
    ("special-erf", lambda m, y: torch.special.erf(y), "erf(x)"),
    ("special-expit", lambda m, y: torch.special.expit(y) * y, "sigmoid(x) * x"),
    ("special-expm1-log1p", lambda m, y: torch.special.log1p(torch.special.expm1(y.abs())), "log1p(expm1(abs(x)))"),
    ("gelu-written-with-erf", lambda m, y: y * 0.5 * (1.0 + torch.erf(y / math.sqrt(2.0))), "erf(x / 1.414"),
    ("logsigmoid", lambda m, y: F.logsigmoid(y), "log_sigmoid(x)"),
    ("nn-LogSigmoid", lambda m, y: nn.LogSigmoid()(y), "log_sigmoid(x)"),
    ("sign", lambda m, y: torch.sign(y), "sign(x)"),
    ("floor", lambda m, y: torch.floor(y * 4.0), "floor(x * 4.0)"),
    ("ceil-method", lambda m, y: (y * 4.0).ceil(), "ceil(x * 4.0)"),
    ("round", lambda m, y: torch.round(y * 4.0), "round(x * 4.0)"),
    ("trunc", lambda m, y: torch.trunc(y * 4.0), "trunc(x * 4.0)"),
    ("celu", lambda m, y: F.celu(y, alpha=0.5), "celu(x, 0.5)"),
    ("nn-CELU-inplace", lambda m, y: nn.CELU(2.0, inplace=True)(y), "celu(x, 2.0)"),
    ("threshold", lambda m, y: F.threshold(y, 0.1, 2.0), "threshold(x, 0.1, 2.0)"),
    ("nn-Threshold", lambda m, y: nn.Threshold(-0.2, 0.0)(y), "threshold(x, -0.2, 0.0)"),
    ("hardshrink", lambda m, y: F.hardshrink(y, 0.3), "hardshrink(x, 0.3)"),
    ("nn-Hardshrink", lambda m, y: nn.Hardshrink()(y), "hardshrink(x, 0.5)"),
    ("softshrink", lambda m, y: F.softshrink(y, 0.3), "softshrink(x, 0.3)"),
    ("softsign", lambda m, y: F.softsign(y), "x / (abs(x) + 1.0)"),
    ("tanhshrink", lambda m, y: nn.Tanhshrink()(y), "x - tanh(x)"),
    ("alpha-dropout-eval", lambda m, y: F.alpha_dropout(y, p=0.2, training=False).relu(), "relu(x)"),
    ("feature-alpha-dropout-eval", lambda m, y: F.feature_alpha_dropout(y, p=0.2).relu(), "relu(x)"),
    ("dropout-p0", lambda m, y: F.dropout(y, p=0.0).relu(), "relu(x)"),
    ("dropout-eval", lambda m, y: F.dropout(y, p=0.5, training=False).relu(), "relu(x)"),
]


def _iadd(y, v):
    y += v
    return y


NORMS = [
    ("group_norm", lambda m, y: F.group_norm(y, 4, m.norm_weight, m.norm_bias), "group_norm(eps=1e-05, groups=4"),
    ("nn-GroupNorm", lambda m, y: nn.GroupNorm(8, N, affine=False)(y), "groups=8)"),
    ("layer_norm", lambda m, y: F.layer_norm(y, (N,), m.norm_weight, m.norm_bias), "layer_norm("),
    ("layer_norm-no-affine", lambda m, y: F.layer_norm(y, (N,), eps=1e-3), "layer_norm(eps=0.001)"),
    ("rms_norm", lambda m, y: F.rms_norm(y, (N,), m.norm_weight, 1e-6), "rms_norm(eps=1e-06, weight=p0)"),
    ("rms_norm-eps-None", lambda m, y: F.rms_norm(y, (N,)), "rms_norm(eps=1.1920928955078125e-07)"),
    ("batch_norm-train", lambda m, y: F.batch_norm(y, m.running_mean, m.running_var, m.norm_weight,
                                                   m.norm_bias, training=True, momentum=0.2), "training=True"),
    ("batch_norm-train-no-stats", lambda m, y: F.batch_norm(y, None, None, training=True), "training=True"),
    ("batch_norm-eval", lambda m, y: F.batch_norm(y, m.running_mean, m.running_var, m.norm_weight,
                                                  m.norm_bias, training=False), "running_mean=p"),
]

REDUCTIONS = [
    ("sum-keepdim", lambda m, y: y.sum(dim=1, keepdim=True), "sum(keepdim=True)"),
    ("sum", lambda m, y: torch.sum(y, -1), "sum(keepdim=False)"),
    ("sum-dim-list", lambda m, y: y.sum([1]), "sum(keepdim=False)"),
    ("mean", lambda m, y: y.mean(1, keepdim=True), "mean(keepdim=True)"),
    ("amax", lambda m, y: torch.amax(y, dim=1), "max(keepdim=False)"),
    ("amin", lambda m, y: y.amin(-1, keepdim=True), "min(keepdim=True)"),
    ("max-values", lambda m, y: torch.max(y, dim=1).values, "max(keepdim=False, ties='first')"),
    ("vector_norm", lambda m, y: torch.linalg.vector_norm(y, dim=-1, keepdim=True), "vector_norm(keepdim=True)"),
    ("normalize", lambda m, y: F.normalize(y, dim=-1), "normalize(eps=1e-12)"),
    ("var", lambda m, y: y.var(-1), "var(keepdim=False, correction=1.0)"),
    ("var-biased", lambda m, y: torch.var(y, -1, unbiased=False, keepdim=True), "var(keepdim=True, correction=0.0)"),
    ("std-correction", lambda m, y: y.std(dim=1, correction=0, keepdim=True) + 1.0, "std(keepdim=True, correction=0.0)"),
    ("std", lambda m, y: torch.std(y, -1) * 0.5, "std(keepdim=False, correction=1.0)"),
    ("normalize-default-dim", lambda m, y: F.normalize(y * m.vector, eps=1e-6) * 2.0, "normalize(eps=1e-06)"),
    ("norm-method", lambda m, y: y.norm(dim=1), "vector_norm(keepdim=False)"),
    ("torch-norm-p2", lambda m, y: torch.norm(y, p=2, dim=[-1], keepdim=True) * 0.5, "vector_norm(keepdim=True)"),
    ("max-index0", lambda m, y: y.max(1, keepdim=True)[0], "max(keepdim=True, ties='first')"),
    ("min-values", lambda m, y: torch.min(y, 1).values, "min(keepdim=False, ties='first')"),
    ("logsumexp", lambda m, y: torch.logsumexp(y, dim=1, keepdim=True), "logsumexp(keepdim=True)"),
    ("softmax", lambda m, y: F.softmax(y, dim=1), "softmax()"),
    ("softmax-method", lambda m, y: y.softmax(-1), "softmax()"),
    ("nn-Softmax", lambda m, y: nn.Softmax(dim=1)(y), "softmax()"),
    ("log_softmax", lambda m, y: F.log_softmax(y, dim=-1), "log_softmax()"),
    ("softmin", lambda m, y: F.softmin(y, dim=1), "pointwise(-x) | softmax()"),
    ("softmax-of-a-keepdim-mean", lambda m, y: torch.softmax(F.dropout(y, 0.2, False).mean(1, keepdim=True), dim=1),
     "mean(keepdim=True) | pointwise(softmax_of_one(x))"),  # KernelBench's Matmul_Dropout_Mean_Softmax
    ("log_softmax-of-a-keepdim-max", lambda m, y: F.log_softmax(y.amax(-1, keepdim=True), -1) * 2.0,
     "max(keepdim=True) | pointwise(log_softmax_of_one(x) * 2.0)"),
    ("nn-Softmin", lambda m, y: nn.Softmin(dim=-1)(y * 2.0), "pointwise(-(x * 2.0)) | softmax()"),
    ("pointwise-after-reduction", lambda m, y: torch.logsumexp(y, 1, keepdim=True) * m.one - 1.0,
     "logsumexp(keepdim=True) | pointwise((x * p0) - 1.0)"),
    # reductions over the size-1 dim a keepdim reduction left reduce one value each: the value
    ("reductions-in-a-row", lambda m, y: torch.logsumexp(torch.logsumexp(torch.mean(torch.max(
        torch.sum(y, 1, keepdim=True), 1, keepdim=True)[0], 1, keepdim=True), 1, keepdim=True), 1, keepdim=True),
     "linear(bias=True) | sum(keepdim=True)"),
    ("size-1-reduction-drops-the-dim", lambda m, y: (y.amax(1, keepdim=True) * 2.0).sum(1),
     "max(keepdim=False) | pointwise(x * 2.0)"),
]

# pooling along the features (KernelBench): the rows viewed as one channel, pooled, viewed back
POOLINGS = [
    ("max_pool1d-sum-scale", lambda m, y: F.max_pool1d(y.unsqueeze(1), 2).squeeze(1).sum(1) * 0.5,
     "max_pool(kernel=2, stride=2) | sum(keepdim=False) | pointwise(x * 0.5)"),
    ("AvgPool1d-gelu-max", lambda m, y: torch.max(F.gelu(nn.AvgPool1d(4)(y.unsqueeze(1)).squeeze(1)) * 2.0, 1).values,
     "avg_pool(kernel=4, stride=4) | pointwise(gelu(x) * 2.0) | max(keepdim=False, ties='first')"),
    ("MaxPool1d-overlapping", lambda m, y: nn.MaxPool1d(3, stride=2)(torch.sigmoid(y).unsqueeze(1)).squeeze(1) - 0.5,
     "max_pool(kernel=3, stride=2) | pointwise(x - 0.5)"),
    ("avg_pool1d-keywords", lambda m, y: F.avg_pool1d(y.unsqueeze(dim=1), kernel_size=(5,), stride=(3,)).squeeze(dim=1),
     "avg_pool(kernel=5, stride=3)"),
    ("indexed-in-and-out", lambda m, y: F.max_pool1d(y[:, None], 4)[:, 0] + 1.0, "max_pool(kernel=4, stride=4) | pointwise(x + 1.0)"),
    ("viewed-in-flattened-out", lambda m, y: F.avg_pool1d(y.view(y.size(0), 1, -1), 4, 2).flatten(1).relu(),
     "avg_pool(kernel=4, stride=2) | pointwise(relu(x))"),
    ("after-a-training-batch-norm", lambda m, y: F.max_pool1d(F.batch_norm(
        y, m.running_mean, m.running_var, m.norm_weight, m.norm_bias, training=True).unsqueeze(1), 4, 2).squeeze(1),
     "training=True) | max_pool(kernel=4, stride=2)"),
    ("adaptive-where-the-size-divides-the-row", lambda m, y: nn.AdaptiveMaxPool1d(N // 4)(y.unsqueeze(1)).squeeze(1)
     .amax(1), "max_pool(kernel=4, stride=4) | max(keepdim=False)"),
    ("ceil_mode-where-windows-fit", lambda m, y: F.avg_pool1d(y.unsqueeze(1), 4, ceil_mode=True).squeeze(1),
     "avg_pool(kernel=4, stride=4)"),
    ("row-operand-after-the-reduction", lambda m, y: F.max_pool1d(y.unsqueeze(1), 2).squeeze(1).mean(1, keepdim=True)
     * m.linear.bias[:M].reshape(M, 1), "max_pool(kernel=2, stride=2) | mean(keepdim=True) | pointwise(x * p0)"),
]

GEMMS = [
    ("F.linear", lambda m, x: F.linear(x, m.weight, m.vector), "linear(bias=True)"),
    ("F.linear-no-bias", lambda m, x: F.linear(x, m.weight), "linear(bias=False)"),
    ("addmm", lambda m, x: torch.addmm(m.vector, x, m.weight.t()), "linear(bias=True)"),
    ("addmm-conv1d", lambda m, x: torch.addmm(m.vector, x, m.weight_kn), "linear(bias=True)"),
    ("matmul-T", lambda m, x: torch.matmul(x, m.weight.T), "linear(bias=False)"),
    ("matmul-T-plus-b", lambda m, x: torch.matmul(x, m.weight.T) + m.vector, "linear(bias=True)"),
    ("at-t", lambda m, x: x @ m.weight.t() + m.vector, "linear(bias=True)"),
    ("at-transpose", lambda m, x: x @ m.weight.transpose(0, 1), "linear(bias=False)"),
    ("mm", lambda m, x: torch.mm(x, m.weight.t()), "linear(bias=False)"),
    ("bias-free-linear-plus-vector", lambda m, x: m.unbiased(x) + m.vector, "linear(bias=True)"),
]


def _check(epilogue, fragment, gemm=None, inputs=_inputs(), dtype=torch.float32):
    def make():
        model = Chain(epilogue, gemm=gemm)
        model.unbiased = nn.Linear(K, N, bias=False)
        return model

    report = check_against_eager(make, inputs, dtype=dtype)
    (row,) = report.rows
    assert row.status == "fused", row
    assert fragment in row.program, row.program
    return row


@pytest.mark.parametrize("name,epilogue,fragment", POINTWISE, ids=[c[0] for c in POINTWISE])
def test_pointwise_spelling_fuses_and_matches_eager(name, epilogue, fragment):
    _check(epilogue, fragment)


WITH_GRADIENTS = ["expm1", "log", "log1p", "erf", "gelu-written-with-erf", "logsigmoid", "floor", "celu", "threshold",
                  "hardshrink", "softshrink", "softsign", "tanhshrink", "rrelu-not-training", "prelu-one-weight",
                  "prelu-a-weight-a-feature", "reciprocal", "special-expm1-log1p"]


@pytest.mark.parametrize("name,epilogue,fragment", [c for c in POINTWISE if c[0] in WITH_GRADIENTS], ids=WITH_GRADIENTS)
def test_functions_have_eagers_gradients(name, epilogue, fragment):
    """Each function's derivative: the input's and every parameter's gradient as eager's (a
    step's is zero)."""
    def make():
        model = Chain(epilogue)
        model.unbiased = nn.Linear(K, N, bias=False)
        return model

    report = check_against_eager(make, lambda: [torch.randn(M, K, requires_grad=True)], grads=True)
    assert report.rows[0].status == "fused" and fragment in report.rows[0].program


def test_a_softmax_over_the_one_value_a_keepdim_reduction_left_is_1_or_nan_with_eagers_gradients():
    def with_infinite_rows():
        x = torch.rand(M, K)
        x[1], x[4] = float("inf"), -float("inf")
        return [x.requires_grad_()]

    def make():
        model = Chain(lambda m, y: torch.softmax(y.sum(1, keepdim=True), 1) * 2.0)
        with torch.no_grad():
            model.linear.weight.abs_()  # rows +inf and -inf where x is, so their sums too
        return model

    report = check_against_eager(make, with_infinite_rows, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and "sum(keepdim=True) | pointwise(softmax_of_one(x) * 2.0)" in row.program, row


def test_rrelu_in_training_draws_a_slope_an_element_and_ends_the_chain():
    rows = fxfuse.report(Chain(lambda m, y: F.rrelu(y, training=True)), *_inputs()(), allow_cpu=True).rows
    assert rows[0].status == "not_fused" and rows[0].reason == "rrelu in training (a random slope an element)"


def test_prelu_of_a_value_with_channels_in_dim_1_ends_the_chain():
    """torch's PReLU weighs dim 1, which is not the features of a 3-D value; one weight is fine."""
    rows = fxfuse.report(Chain(lambda m, y: F.prelu(y, m.vector[:4])), torch.randn(2, 4, K), allow_cpu=True).rows
    assert rows[0].status == "not_fused"
    assert rows[0].reason == "prelu with a weight per channel of dim 1 of a 3-D value (not its features)"
    _check(lambda m, y: F.prelu(y, m.one), "prelu(x, p0)", inputs=_inputs((2, 4, K)))


class BiasFree(nn.Module):
    """``epilogue(y)`` of a bias-free Linear: a zero input row makes a zero (constant) GEMM row."""

    def __init__(self, epilogue):
        super().__init__()
        self.linear = nn.Linear(K, N, bias=False)
        self.epilogue = epilogue

    def forward(self, x):
        return self.epilogue(self.linear(x))


def _with_zero_and_tiny_rows():
    x = torch.randn(M, K)
    x[2] = 0.0
    x[5] *= 1e-5
    return [x.requires_grad_()]


# where eager masks a gradient: the norm's on a row of zeros, std's on a constant row, normalize's
# through the norm on rows of zeros and rows under eps
ROW_STATISTICS = [
    ("vector_norm", lambda y: torch.linalg.vector_norm(y, dim=-1, keepdim=True) * 2.0),
    ("var", lambda y: torch.var(y, -1, keepdim=True) * 2.0),
    ("std", lambda y: torch.std(y, -1) * 2.0),
    ("normalize", lambda y: F.normalize(y, dim=-1) * 3.0),
    ("normalize-eps-1e-3", lambda y: F.normalize(y, dim=-1, eps=1e-3) * 3.0),
]


@pytest.mark.parametrize("name,epilogue", ROW_STATISTICS, ids=[c[0] for c in ROW_STATISTICS])
def test_row_statistics_have_eagers_gradients_on_zero_and_tiny_rows(name, epilogue):
    report = check_against_eager(lambda: BiasFree(epilogue), _with_zero_and_tiny_rows, grads=True)
    assert report.rows[0].status == "fused"


@pytest.mark.parametrize("name,epilogue,fragment", [
    ("p=3", lambda y: y.norm(p=3, dim=-1), "p=3"),
    ("normalize p=1", lambda y: F.normalize(y, p=1.0, dim=-1), "normalize with p=1.0"),
    ("var over every dim", lambda y: torch.var(y, False), "var over every dim"),
    ("every dim", lambda y: y.norm(), "every dim"),
    ("after a reduction", lambda y: y.sum(-1, keepdim=True).norm(dim=-1), "vector_norm after a row reduction"),
], ids=["p=3", "normalize-p=1", "var-every-dim", "every-dim", "after-a-reduction"])
def test_norms_that_are_not_the_rows_euclidean_norm_end_the_chain(name, epilogue, fragment):
    report = check_against_eager(lambda: Chain(lambda m, y: epilogue(y)), _inputs())
    assert fragment in report.rows[0].reason


LP_NORMS = [
    ("norm-p1", lambda m, y: y.norm(p=1, dim=-1), "linear(bias=True) | pointwise(abs(x)) | sum(keepdim=False)"),
    ("vector_norm-ord1", lambda m, y: torch.linalg.vector_norm(y, 1, dim=-1, keepdim=True) * 0.5,
     "pointwise(abs(x)) | sum(keepdim=True) | pointwise(x * 0.5)"),
    ("vector_norm-inf", lambda m, y: torch.linalg.vector_norm(y, float("inf"), dim=1), "pointwise(abs(x)) | max(keepdim=False)"),
    ("torch-norm-minus-inf", lambda m, y: torch.norm(y, p=-math.inf, dim=[-1], keepdim=True),
     "pointwise(abs(x)) | min(keepdim=True)"),
]


@pytest.mark.parametrize("name,epilogue,fragment", LP_NORMS, ids=[c[0] for c in LP_NORMS])
def test_norms_of_order_1_and_infinity_are_reductions_of_the_magnitudes(name, epilogue, fragment):
    """sum, amax or amin of |y|, with eager's values and gradients: columns 2 and 5 tie for the
    largest magnitude with opposite signs, and the infinity norm's gradient splits between them."""
    def make():
        model = Chain(epilogue)
        with torch.no_grad():
            model.linear.weight[2], model.linear.weight[5] = 4.0, -4.0
            model.linear.bias[2], model.linear.bias[5] = 4.0, -4.0
        return model

    report = check_against_eager(make, lambda: [torch.rand(M, K)], grads=True)
    (row,) = report.rows
    assert row.status == "fused" and fragment in row.program, row


def test_under_autocast_a_norm_of_order_infinity_of_a_bfloat16_row_stays_the_norm():
    """Autocast picks each op's dtype: the norm's and those of the reductions of |y| need not agree
    (on CUDA the norm computes in float32), so the rewrite is not made and the report says why."""
    report = check_against_eager(lambda: Chain(lambda m, y: torch.linalg.vector_norm(y, float("inf"), dim=-1)),
                                 _inputs(), autocast=torch.bfloat16)
    (row,) = report.rows
    assert row.status == "not_fused" and "p=inf of a 16-bit value under autocast" in row.reason


@pytest.mark.parametrize("name,epilogue,fragment", NORMS, ids=[c[0] for c in NORMS])
def test_norm_spelling_fuses_and_matches_eager(name, epilogue, fragment):
    _check(epilogue, fragment)


@pytest.mark.parametrize("name,epilogue,fragment", REDUCTIONS, ids=[c[0] for c in REDUCTIONS])
def test_reduction_spelling_fuses_and_matches_eager(name, epilogue, fragment):
    _check(epilogue, fragment)


@pytest.mark.parametrize("name,epilogue,fragment", POOLINGS, ids=[c[0] for c in POOLINGS])
def test_pooling_along_the_features_fuses_with_what_follows_and_has_eagers_gradients(name, epilogue, fragment):
    """The row narrows to the pooled width; pointwise ops, a reduction and a per-row operand after
    it join the op, and the gradients (through the windows, overlapping or not) are eager's."""
    model = lambda: Chain(epilogue)
    report = check_against_eager(model, _inputs(), grads=True)
    (row,) = report.rows
    assert row.status == "fused" and fragment in row.program, row
    assert any("pool1d(" in op for op in row.fused)  # the report names the user's pooling


# max and min where two columns tie in every row: amax/amin split the gradient between them,
# max(dim)/min(dim) give it to the first (the index they return)
TIES = [
    ("amax", lambda m, y: torch.amax(y, 1), "max(keepdim=False)", 1.0),
    ("max-values", lambda m, y: torch.max(y, 1).values, "max(keepdim=False, ties='first')", 1.0),
    ("amin", lambda m, y: y.amin(-1, keepdim=True), "min(keepdim=True)", -1.0),
    ("min-index0", lambda m, y: y.min(1, keepdim=True)[0] * 2.0, "min(keepdim=True, ties='first')", -1.0),
]


@pytest.mark.parametrize("name,epilogue,fragment,sign", TIES, ids=[c[0] for c in TIES])
def test_max_and_min_give_tied_elements_eager_gradients(name, epilogue, fragment, sign):
    def make():
        model = Chain(epilogue)
        with torch.no_grad():  # columns 2 and 5: equal, and the row's extreme for inputs in [0, 1)
            model.linear.weight[2] = model.linear.weight[5] = sign * 4.0
            model.linear.bias[2] = model.linear.bias[5] = sign * 4.0
        return model

    report = check_against_eager(make, lambda: [torch.rand(M, K)], grads=True)
    (row,) = report.rows
    assert row.status == "fused" and fragment in row.program, row


@pytest.mark.parametrize("name,gemm,fragment", GEMMS, ids=[c[0] for c in GEMMS])
def test_gemm_spelling_fuses_with_its_epilogue(name, gemm, fragment):
    _check(lambda m, y: torch.relu(y), fragment, gemm=gemm)


def test_a_weight_stored_k_by_n_gets_its_gradient():
    """GPT-2's Conv1D: the fused op reads W.t(); W's gradient flows back through the view."""
    report = check_against_eager(lambda: Chain(lambda m, y: F.gelu(y), gemm=GEMMS[3][1]), _inputs(), grads=True)
    assert report.rows[0].status == "fused"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_chain_matches_eager(dtype):
    _check(lambda m, y: F.gelu(F.group_norm(y * 2.0, 4)) + m.vector, "group_norm", dtype=dtype)


# a bfloat16 chain that goes on in float32, as eager's does after an explicit cast
WIDENINGS = [
    ("float-then-softmax", lambda m, y: F.gelu(y).float().softmax(-1), "pointwise(bf16(gelu(x))) | float32() | softmax()"),
    ("to-float32-then-layer_norm", lambda m, y: F.layer_norm(y.to(torch.float32), (N,)), "float32() | layer_norm("),
    ("to-dtype-kwarg", lambda m, y: y.to(dtype=torch.float32) * 0.5 + y.sigmoid(), "pointwise((x * 0.5) + bf16(sigmoid(x))) | float32()"),
    # and back: the cast is a rounding point, the weight multiply rounds again, the output is bf16
    ("norm-then-cast-back", lambda m, y: m.vector.to(torch.bfloat16) * F.layer_norm(y.float(), (N,)).to(torch.bfloat16),
     "float32() | layer_norm(eps=1e-05) | pointwise(bf16(p0 * bf16(x))) | narrow()"),
    ("cast-back-then-pointwise", lambda m, y: (y.float().exp() * 0.5).to(torch.bfloat16).relu(),
     "narrow()"),
]


@pytest.mark.parametrize("name,epilogue,fragment", WIDENINGS, ids=[c[0] for c in WIDENINGS])
def test_a_cast_to_float32_widens_a_bfloat16_chain(name, epilogue, fragment):
    _check(epilogue, fragment, dtype=torch.bfloat16)


def test_three_dimensional_input_fuses_feature_ops():
    row = _check(lambda m, y: F.silu(F.layer_norm(y, (N,))).softmax(-1), "layer_norm",
                 inputs=_inputs((2, 3, K)))
    assert row.program.endswith("softmax()")


def test_nan_and_inf_propagate_as_in_eager():
    def inputs():
        x = torch.randn(M, K)
        x[0, 0], x[1, 3], x[2, 5] = float("nan"), float("inf"), -float("inf")
        return [x]

    _check(lambda m, y: torch.clamp(F.relu(y) - y, -1, 1) * torch.sigmoid(y), "clamp", inputs=inputs)
    _check(lambda m, y: F.softmax(y, 1), "softmax", inputs=inputs)


def test_detach_is_the_value_itself_where_autograd_records_nothing():
    """KernelBench's ``x.clone().detach()`` fuses in inference; with a backward recorded it would
    cut the gradient, so it stops the chain there."""
    def epilogue(m, y):
        return torch.relu(y.clone().detach()) * 2.0

    report = check_against_eager(lambda: Chain(epilogue), _inputs(), train=False)
    assert report.rows[0].status == "fused" and report.rows[0].fused[-2:] == ["relu", "mul(2.0)"]
    def training(m, y):  # the gradient reaches the GEMM through the add only
        return torch.relu(y.clone().detach()) * 2.0 + y

    report = check_against_eager(lambda: Chain(training), _inputs(), grads=True)
    (row,) = report.rows
    assert row.status != "fused" and row.chain[-1] == "detach"  # growth stopped at the detach


def test_reductions_over_the_size_one_dim_a_reduction_left_are_the_value_with_gradients():
    """KernelBench's reductions in a row: after sum(keepdim=True) each further reduction over that
    dim reduces one value per row; 3-D inputs, gradients to x, W and b."""
    def epilogue(m, y):
        s = torch.sum(y, -1, keepdim=True)
        s = torch.max(s, -1, keepdim=True)[0]
        return torch.logsumexp(torch.mean(s, -1, keepdim=True), -1) * 2.0

    report = check_against_eager(lambda: Chain(epilogue), _inputs((2, 3, K)), grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.program == "linear(bias=True) | sum(keepdim=False) | pointwise(x * 2.0)"
