"""Operands of the output's shape: a residual added to the GEMM's output, a gate multiplying it.

``x + proj(h)`` (then a norm), ``proj(h) * gate`` and the like fuse into one op that reads the
operand as a parameter of kind "full" and returns its gradient; outputs, input and parameter
gradients equal eager's (on CUDA the row kernels read them; tests/gpu/test_operands_cuda.py).
Operands that would broadcast the output, or that are computed from the chain itself, still stop
the chain. A chain value the graph also reads elsewhere — a pre-norm block's residual sum, read by
the norm and by the next block — is returned by the op too (a ``keep()`` stage).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.cuda import codegen, gemm_codegen
from fxfuse.ir import Program
from support import check_against_eager, compile_fxfuse

B, T, K, N = 2, 8, 24, 32


class BertOutput(nn.Module):
    """transformers' BertOutput: Linear, dropout, + the residual, LayerNorm."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.dense = nn.Linear(K, N)
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(N)

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class Gated(nn.Module):
    """A gate of the output's shape: silu(proj(x)) * gate, then a per-column scale."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False)
        self.scale = nn.Parameter(torch.randn(N))

    def forward(self, x, gate):
        return F.silu(self.proj(x)) * gate * self.scale


class ResidualTwice(nn.Module):
    """The residual read twice, on both sides of an activation."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x, r):
        return torch.tanh(r + self.proj(x)) - r


def three_d():
    return [torch.randn(B, T, K), torch.randn(B, T, N)]


def x_alone():
    return [torch.randn(B, T, K)]


def two_d():
    return [torch.randn(B * T, K), torch.randn(B * T, N)]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("inputs", [three_d, two_d], ids=["3d", "2d"])
def test_a_residual_add_then_layer_norm_fuses_in_full(inputs, train):
    report = check_against_eager(BertOutput, inputs, train=train, grads=train)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert row.program.endswith("|| full col col") and "layer_norm" in row.program


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gate_of_the_outputs_shape_fuses_with_its_gradient(dtype):
    report = check_against_eager(Gated, three_d, dtype=dtype, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and "full" in row.program.split("||")[1]


class PositionEmbedding(nn.Module):
    """A (T, N) learned position embedding (or a (1, T, N) one) added after the projection, then
    LayerNorm: an operand broadcast along the batch, its gradient summed over it."""

    def __init__(self, batch_dim: bool = False):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.pos = nn.Parameter(torch.randn(*((1,) if batch_dim else ()), T, N))
        self.norm = nn.LayerNorm(N)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.proj(x) + self.pos))


@pytest.mark.parametrize("batch_dim", [False, True], ids=["T_N", "1_T_N"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_an_operand_broadcast_along_the_batch_fuses_with_its_summed_gradient(batch_dim, train):
    report = check_against_eager(lambda: PositionEmbedding(batch_dim), x_alone, train=train, grads=train)
    (row,) = report.rows
    assert row.status == "fused" and row.program.endswith("|| full col col")


def test_an_operand_broadcast_along_the_features_of_a_row_still_stops_the_chain():
    """(B, 1, N) against (B, T, N) is a per-sample row, not read at each row's own position."""
    class PerSample(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x, s):
            return torch.relu(self.proj(x)) * s

    (row,) = check_against_eager(PerSample, lambda: [torch.randn(B, T, K), torch.randn(B, 1, N)]).rows
    assert row.status == "partial" and "not a per-column vector" in row.reason


def test_a_residual_read_twice_is_one_operand():
    report = check_against_eager(ResidualTwice, three_d, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.program.split("||")[1].split() == ["full"]


class PerRow(nn.Module):
    """One value per row: a per-row scale inside the chain, and after a row reduction an (M, 1)
    tensor combined with the reduced value."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x, scale, shift):
        return (torch.sigmoid(F.gelu(self.proj(x)) * scale).sum(-1, keepdim=True) - shift) * scale


def per_row(dtype=torch.float32, lead=(B, T)):
    return lambda: [torch.randn(*lead, K), torch.rand(*lead, 1) + 0.5, torch.randn(*lead, 1)]


@pytest.mark.parametrize("lead", [(B, T), (B * T,)], ids=["3d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_operands_of_one_value_per_row_fuse_before_and_after_a_row_reduction(dtype, lead):
    report = check_against_eager(PerRow, per_row(dtype, lead), dtype=dtype, grads=True)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert row.program.split("||")[1].split() == ["row", "row"]
    assert "sum(keepdim=True)" in row.program


class BroadcastBack(nn.Module):
    """A row reduction's one value a row meets a per-column vector: ``mean(relu(y)) * w + b`` is a
    row of N again (then a sigmoid)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.w, self.b = nn.Parameter(torch.randn(N)), nn.Parameter(torch.randn(N))

    def forward(self, x):
        return torch.sigmoid(torch.relu(self.proj(x)).mean(-1, keepdim=True) * self.w + self.b)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_reduced_value_broadcast_back_against_columns_fuses_with_its_gradients(dtype, train):
    report = check_against_eager(BroadcastBack, x_alone, dtype=dtype, train=train, grads=train)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert "mean(keepdim=True)" in row.program and row.program.split("||")[1].split() == ["col", "col"]


def test_after_a_reduction_broadcast_back_a_second_reduction_ends_the_chain():
    class Twice(BroadcastBack):
        def forward(self, x):
            return (self.proj(x).sum(-1, keepdim=True) * self.w).amax(-1)

    report = check_against_eager(Twice, x_alone)
    (row,) = report.rows
    assert row.status == "partial" and row.reason == "max after a row reduction"


class PerSample(nn.Module):
    """A (B, 1, 1) scale against (B, T, N): one value a sample (timm's drop-path mask)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x, mask):
        return torch.relu(self.proj(x)) * mask + 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_per_sample_operand_is_one_value_per_row_expanded(dtype):
    report = check_against_eager(PerSample, lambda: [torch.randn(B, T, K), torch.rand(B, 1, 1)], dtype=dtype,
                                 grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.program.endswith("|| row"), row


def test_a_per_sample_operand_of_a_chain_whose_rows_a_view_regrouped_stops_it():
    """The op's rows are x's (B * T) where the chain's value was viewed (B, T, N): a (B, 1, 1)
    operand cannot be expanded to them."""
    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x, mask):
            return torch.relu(self.proj(x.view(-1, K)).view(B, T, N)) * mask

    report = check_against_eager(Viewed, lambda: [torch.randn(B, T, K), torch.rand(B, 1, 1)])
    (row,) = report.rows
    assert row.status == "partial" and "of shape (2, 1, 1)" in row.reason


class DropPathBlock(nn.Module):
    """timm's Mlp and DropPath around a residual: ``x + drop_path(fc2(gelu(fc1(h))))``, where the
    mask is ``y.new_empty((B, 1, 1)).bernoulli_(keep) / keep`` (``sampled``) or, to compare with
    eager, a given per-sample tensor built through ``y.new_ones`` / ``new_zeros``."""

    def __init__(self, sampled: bool):
        super().__init__()
        self.fc1, self.fc2, self.sampled, self.keep = nn.Linear(K, N), nn.Linear(N, N), sampled, 0.75

    def forward(self, x, h, given):
        y = self.fc2(F.gelu(self.fc1(h)))
        shape = (y.shape[0],) + (1,) * (y.ndim - 1)
        if self.sampled:
            mask = y.new_empty(shape).bernoulli_(self.keep).div_(self.keep)
        else:
            mask = y.new_ones(shape) * given + y.new_zeros(shape, dtype=torch.float32)
        return x + y * mask


def drop_path_inputs():
    return [torch.randn(B, T, N), torch.randn(B, T, K), torch.rand(B, 1, 1)]


def test_a_drop_path_mask_reads_only_the_shape_of_the_value_it_drops():
    """new_ones / new_zeros read the value's dtype and device, not its values: fc2's chain goes on
    through the per-sample mask and the residual, gradients equal eager's."""
    report = check_against_eager(lambda: DropPathBlock(sampled=False), drop_path_inputs, grads=True)
    fc2 = report.rows[-1]
    assert fc2.status == "fused", fc2.reason
    assert fc2.program.endswith("|| row full"), fc2.program


def test_a_sampled_drop_path_mask_fuses_and_drops_whole_samples():
    torch.manual_seed(0)
    model = DropPathBlock(sampled=True).train()
    x, h, _ = drop_path_inputs()
    h = h.repeat(8, 1, 1)
    x = x.repeat(8, 1, 1)
    fxfuse.reset_report()
    out = compile_fxfuse(model)(x, h, None)
    fc2 = fxfuse.last_report().rows[-1]
    assert fc2.status == "fused" and fc2.program.endswith("|| row full"), fc2
    with torch.no_grad():
        y = model.fc2(F.gelu(model.fc1(h)))
    kept = torch.isclose(out, x + y / model.keep, atol=1e-5).all(dim=(1, 2))
    dropped = torch.isclose(out, x, atol=1e-6).all(dim=(1, 2))
    assert bool((kept | dropped).all()) and bool(kept.any()) and bool(dropped.any())


def test_an_operand_that_would_broadcast_the_output_stops_the_chain():
    class Broadcasting(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x, r):
            return torch.relu(self.proj(x) + r)  # r: (2, B, T, N) against (B, T, N)

    report = check_against_eager(Broadcasting, lambda: [torch.randn(B, T, K), torch.randn(2, B, T, N)])
    (row,) = report.rows
    assert row.status != "fused" and f"of shape (2, {B}, {T}, {N}) would broadcast the output" in row.reason


def test_an_operand_computed_from_the_chain_stops_it():
    class FromChain(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x):
            y = self.proj(x)
            return torch.relu(y) + y.flip(-1)

    report = check_against_eager(FromChain, x_alone)
    assert any("computed from the chain" in (r.reason or "") or r.status != "fused" for r in report.rows)


def test_a_program_with_a_full_operand_round_trips_and_runs_on_both_gpu_back_ends():
    """The row kernels read a full operand at each element's position, the in-GEMM epilogue loads
    its subtile beside the accumulator's; no generated backward sums its gradient (a tensor of the
    output's shape)."""
    text = "linear(bias=True) | pointwise(x + p0) | layer_norm(eps=1e-05, weight=p1, bias=p2) || full col col"
    program = Program.parse(text)
    assert program.to_string() == text and program.params == ("full", "col", "col")
    assert codegen.unsupported_reason(program) is None
    assert "r.template full_chunk<0>(i, p0v);" in codegen.generate(program, torch.bfloat16, "ns", "entry")["program.cuh"]
    assert not codegen.has_generated_backward(program)
    gated = Program.parse("linear(bias=False) | pointwise(silu(x) * p0) || full")
    assert gemm_codegen.unsupported_reason(gated, torch.bfloat16) is None
    assert gemm_codegen.unsupported_reason(program, torch.bfloat16) is None  # the operand, then the norm over the row


def test_compiled_residual_block_in_a_loop_of_layers():
    """Two blocks in a row: each GEMM's chain takes its own residual (the previous block's output)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(N, N), nn.Linear(N, N)
            self.na, self.nb = nn.LayerNorm(N), nn.LayerNorm(N)

        def forward(self, x):
            x = self.na(self.a(x) + x)
            return self.nb(self.b(x) + x)

    torch.manual_seed(0)
    model = Two()
    x = torch.randn(B, T, N)
    fxfuse.reset_report()
    out = compile_fxfuse(model)(x)
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    assert [r.status for r in fxfuse.last_report().rows] == ["fused", "fused"]


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)): two GEMMs whose values meet in one multiply."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(K, N, bias=False), nn.Linear(K, N, bias=False)
        self.down_proj = nn.Linear(N, K, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_gated_mlp_is_one_op_running_both_gemms(train, dtype):
    """silu(gate(x)) * up(x): the up projection is a GEMM on the same x that only the multiply
    reads, so the gate's op runs it too (its weight a "gemm" parameter); the report gives both
    GEMMs the op's row, and gradients reach both weights and x."""
    report = check_against_eager(SwiGLU, x_alone, dtype=dtype, train=train, grads=train)
    gate, up, down = report.rows
    assert gate.status == "fused" and gate.program.split(" || ")[1] == "gemm" and "* p0" in gate.program
    assert up.status == "fused" and up.program == gate.program and up.chain[1] == f"second GEMM of {gate.gemm}'s op"
    assert down.status == "not_fused"


class UpFirstSwiGLU(nn.Module):
    """The same MLP written with the up projection first: up(x) * silu(gate(x))."""

    def __init__(self):
        super().__init__()
        self.up_proj, self.gate_proj = nn.Linear(K, N, bias=False), nn.Linear(K, N, bias=False)
        self.down_proj = nn.Linear(N, K, bias=False)

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * F.silu(self.gate_proj(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_gated_mlp_with_the_up_projection_first_is_one_op_too(train, dtype):
    """The later GEMM (the gate) is the op's second GEMM, and the silu applied to it (read only by
    the multiply) is computed on its output inside the op, rounded where eager rounds."""
    report = check_against_eager(UpFirstSwiGLU, x_alone, dtype=dtype, train=train,
                                 grads=train)
    up, gate, down = report.rows
    assert up.status == "fused" and up.fused == ["linear", "silu", "mul"] and up.program.endswith("|| gemm")
    assert "x * " in up.program and "silu(p0)" in up.program
    assert gate.status == "fused" and gate.chain[1] == f"second GEMM of {up.gemm}'s op"
    assert down.status == "not_fused"


def test_a_gated_mlp_under_autocast_casts_both_weights_as_autocast_does():
    report = check_against_eager(SwiGLU, x_alone, autocast=torch.bfloat16, train=True,
                                 grads=True)
    gate, up, _ = report.rows
    assert gate.status == up.status == "fused" and gate.program.endswith("|| gemm")


class BiasedGeGLU(nn.Module):
    """T5-style gated GELU with biases on both projections, then a scale."""

    def __init__(self):
        super().__init__()
        self.wi_0, self.wi_1 = nn.Linear(K, N), nn.Linear(K, N)

    def forward(self, x):
        return F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_second_gemm_with_a_bias_adds_it_as_a_column_parameter_rounded_as_its_output(dtype):
    report = check_against_eager(BiasedGeGLU, x_alone, dtype=dtype, train=True, grads=True)
    gate, up = report.rows
    assert gate.status == up.status == "fused" and gate.program.endswith("|| gemm col")
    assert ("bf16(p0 + p1)" in gate.program) == (dtype == torch.bfloat16)


def test_a_second_gemm_read_elsewhere_too_is_an_operand_of_the_output_shape():
    """An up projection whose value the graph also returns is computed once, in the graph, and read
    by the gate's op as an operand."""

    class Twice(SwiGLU):
        def forward(self, x):
            up = self.up_proj(x)
            return F.silu(self.gate_proj(x)) * up, up

    report = check_against_eager(Twice, x_alone, grads=True)
    up, gate = report.rows  # graph order: the up projection runs first here
    assert gate.status == "fused" and gate.program.endswith("|| full")
    assert up.status == "not_fused"


class OneGemmGLU(nn.Module):
    """The one-GEMM spelling of a gated MLP: one projection to 2N features split in halves."""

    def __init__(self, spelling: str = "chunk", bias: bool = False):
        super().__init__()
        self.proj, self.spelling = nn.Linear(K, 2 * N, bias=bias), spelling

    def forward(self, x):
        y = self.proj(x)
        if self.spelling == "chunk":
            a, b = y.chunk(2, dim=-1)
        elif self.spelling == "torch.chunk":
            a, b = torch.chunk(y, 2, -1)
        elif self.spelling == "split":
            a, b = y.split(N, dim=-1)
        else:
            a, b = torch.split(y, [N, N], dim=-1)
        return F.silu(a) * b


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("spelling", ["chunk", "torch.chunk", "split", "split_sizes"])
def test_a_gated_mlp_of_one_gemm_split_in_halves_is_the_same_op(spelling, bias):
    """Each half is the GEMM of x with half of the weight's rows (and of the bias): the one GEMM
    becomes two on views of the weight, and they fuse as a gated pair; the weight's gradient is
    eager's."""
    report = check_against_eager(lambda: OneGemmGLU(spelling, bias), x_alone, grads=True)
    gate, up = report.rows
    assert gate.status == up.status == "fused"
    assert gate.program.split(" || ")[1] == ("gemm col" if bias else "gemm")


class GLUOfOneGemm(nn.Module):
    """A GLU of one projection: its first half times the sigmoid of its second."""

    def __init__(self, spelling: str, bias: bool):
        super().__init__()
        self.proj, self.spelling, self.glu = nn.Linear(K, 2 * N, bias=bias), spelling, nn.GLU()

    def forward(self, x):
        return self.glu(self.proj(x)) if self.spelling == "nn.GLU" else F.glu(self.proj(x), dim=-1)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("spelling", ["F.glu", "nn.GLU"])
def test_a_glu_of_one_gemm_is_the_gated_pair_of_its_halves(spelling, bias):
    """F.glu(proj(x)) is the split in halves with a sigmoid gate on the second: the one GEMM
    becomes two on views of the weight, fused as a gated pair; the weight's gradient is eager's."""
    report = check_against_eager(lambda: GLUOfOneGemm(spelling, bias), x_alone, grads=True)
    up, gate = report.rows
    assert up.status == gate.status == "fused"
    assert up.program.startswith(f"linear(bias={bias}) | pointwise(x * sigmoid(p0")
    assert up.program.split(" || ")[1] == ("gemm col" if bias else "gemm")


def test_a_split_into_unequal_parts_stays_one_gemm():
    class Unequal(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, 2 * N)

        def forward(self, x):
            a, b = self.proj(x).split([N - 8, N + 8], dim=-1)
            return a.relu(), b

    report = check_against_eager(Unequal, x_alone, grads=True)
    (row,) = report.rows
    assert row.status == "not_fused" and "split" in row.reason


class Conv1DBlock(nn.Module):
    """GPT-2's MLP spelling: x.view(-1, K), addmm with a (K, N) weight, .view(B, T, N), gelu_new
    written out, and a residual of the viewed shape."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(K, N) / K**0.5)
        self.bias = nn.Parameter(torch.randn(N))

    def forward(self, x, residual):
        h = torch.addmm(self.bias, x.view(-1, K), self.weight).view(B, T, N)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return h + residual


def test_views_that_regroup_rows_stay_in_the_chain():
    report = check_against_eager(Conv1DBlock, three_d, grads=True)
    (row,) = report.rows
    assert row.status == "fused" and row.fused[:2] == ["addmm", f"view({B}, {T}, {N})"] and row.fused[-1] == "add"
    assert row.program.endswith("|| full")  # the residual, of the viewed shape


def test_on_the_gpu_a_weight_stored_k_by_n_builds_no_gemm_module(monkeypatch):
    """No GEMM configuration reads a (K, N) weight (GPT-2's Conv1D): its chain asks for its row
    module and the selection of row path against Inductor, never for a GEMM module's minutes of
    CUTLASS; a Linear's chain asks for both. (The GPU back end stood in for: the chains count as
    CUDA chains, nothing builds, and the build and the selection record what they are asked.)"""
    from fxfuse import backend, cuda

    asked, selected = [], []
    monkeypatch.setattr(backend, "_on_cuda", lambda chain: chain.fusion is not None)
    monkeypatch.setattr(cuda, "prepare_many", lambda items, workers=None, gemm_items=(): asked.append(gemm_items) or {})
    monkeypatch.setattr(cuda, "select", lambda *args: selected.append(args[7]))  # weight_is_kn; None: the row path

    class LinearBlock(Conv1DBlock):
        def forward(self, x, residual):
            return F.gelu(F.linear(x, self.weight.t(), self.bias), approximate="tanh") + residual

    for block, gemm_modules, weight_is_kn in ((Conv1DBlock, 0, True), (LinearBlock, 1, False)):
        asked.clear(), selected.clear(), fxfuse.reset_report()
        model = block().requires_grad_(False)  # inference: the GEMM module may serve the calls
        inputs = three_d()
        torch.testing.assert_close(compile_fxfuse(model)(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)
        assert [len(items) for items in asked] == [gemm_modules] and selected == [weight_is_kn]
        (row,) = fxfuse.last_report().rows
        assert row.status == "fused"
        assert ("reads a weight stored (K, N)" in row.path) == weight_is_kn  # the report says why


def test_a_view_into_attention_heads_ends_the_chain_in_full_and_another_feature_view_stops_it():
    """Attention reads a projection's heads as the next GEMM would read its rows: the chain before
    the view is complete. A view that merges the rows into the features stops the chain."""
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x):
            return torch.relu(self.proj(x)).view(B, T, 4, N // 4).transpose(1, 2)

    class Flattened(Heads):
        def forward(self, x):
            return torch.relu(self.proj(x)).view(B, T * N) * 2.0

    (row,) = check_against_eager(Heads, x_alone).rows
    assert row.status == "fused" and row.program.endswith("pointwise(relu(x))")
    (row,) = check_against_eager(Flattened, x_alone).rows
    assert row.status == "partial" and "changes the feature dim" in row.reason


def test_a_split_of_the_features_says_so():
    """GPT-2's c_attn: one GEMM split into q, k and v along the features (no gated product reads
    the halves)."""
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, 3 * N)

        def forward(self, x):
            q, k, v = self.proj(x).split(N, dim=2)
            return q * 2.0, k, v

    (row,) = check_against_eager(QKV, x_alone).rows
    assert row.status == "not_fused"
    assert row.reason == f"split({N}, 2) splits the features into separate values (as attention's q, k and v are): the chain ends before it"


def test_an_in_place_op_after_a_view_of_the_value_still_shows_through_the_view():
    """``v = y.view(...)`` then ``y.relu_()``: v aliases y, so the in-place op may not be moved
    into a fused chain that v does not see."""

    class ViewThenInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x):
            y = self.proj(x)
            v = y.view(-1, N)
            y.relu_()
            return v * 2.0

    check_against_eager(ViewThenInPlace, x_alone, train=False)


class PreNormBlock(nn.Module):
    """GPT-2's and ViT's spelling: h = x + proj(a) is read by the next LayerNorm and by the next
    residual add."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.ln = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N)

    def forward(self, a, x):
        h = x + self.proj(a)
        return h + F.gelu(self.fc(self.ln(h)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("inputs", [three_d, two_d], ids=["3d", "2d"])
def test_a_residual_sum_read_twice_is_returned_too_and_the_norm_fuses(inputs, train, dtype):
    report = check_against_eager(PreNormBlock, inputs, dtype=dtype, train=train, grads=train)
    first, second = report.rows
    assert first.status == "fused" and first.fused == ["linear", "add", "layer_norm(1e-05)"]
    assert " | keep() | layer_norm(" in first.program
    assert second.status == "fused" and second.fused == ["linear", "gelu", "add"]  # the kept sum, an operand


def test_the_op_returns_the_kept_value_and_differentiates_through_both_outputs():
    program = Program.parse("linear(bias=True) | pointwise(x + p0) | keep() | pointwise(tanh(x) * p1) || full col")
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in [(5, 4), (6, 4), (6,)])
    residual = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    out, _, _, kept = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, [residual, scale], True)
    h = F.linear(x, w, b) + residual
    torch.testing.assert_close(kept, h)
    torch.testing.assert_close(out, torch.tanh(h) * scale)

    def both(x, w, b, residual, scale):
        out, _, _, kept = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, [residual, scale], True)
        return out, kept

    assert torch.autograd.gradcheck(both, (x, w, b, residual, scale))
    torch.library.opcheck(torch.ops.fxfuse.linear_epilogue.default,
                          (program.to_string(), x, w, b, [residual, scale], False))


def test_a_program_that_keeps_a_value_stores_it_from_the_row_kernels_only():
    program = Program.parse("linear(bias=True) | pointwise(x + p0) | keep() | layer_norm(eps=1e-05) || full")
    assert program.keeps and program.kept_dtype(torch.bfloat16) == torch.bfloat16
    assert codegen.unsupported_reason(program) is None
    assert "r.store_kept();" in codegen.generate(program, torch.bfloat16, "ns", "entry")["program.cuh"]
    assert not codegen.has_generated_backward(program)
    assert "stages are not in the in-GEMM epilogue" in gemm_codegen.unsupported_reason(program, torch.bfloat16)
