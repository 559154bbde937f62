"""Attention's rotary embedding joins the q and k projections' chains (patterns/rotary.py).

transformers' ``q * cos + rotate_half(q) * sin`` of ``proj(h).view(B, T, H, D).transpose(1, 2)``
is rewritten to a rotation of the projection's rows; the chain holds a ``rotary`` stage and ends,
fused in full, at the view into heads that attention reads. Outputs and gradients are eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.ir import Gemm, Program, Rotary
from fxfuse.reference import epilogue
from fxfuse.patterns.rotary import recognise, rotary_embedding
from support import captured, check_against_eager

B, T, HEADS, D = 2, 8, 4, 16


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def tables(batch: int = 1, dtype=torch.float32):
    """Llama's cos and sin: (batch, T, D) from the positions' angles."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.arange(T).float()[:, None] * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1).expand(batch, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """transformers' Llama attention, cut to what the rotation touches: q, k and v projections,
    the rotation of q and k (in the operand orders ``swapped`` picks), causal SDPA, o_proj."""

    def __init__(self, bias: bool = False, swapped: bool = False, batch_tables: int = 1, two_d: bool = False):
        super().__init__()
        hidden = HEADS * D
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden, bias=bias) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.swapped, self.two_d = swapped, two_d
        cos, sin = tables(batch_tables)
        self.register_buffer("cos", cos[0] if two_d else cos)
        self.register_buffer("sin", sin[0] if two_d else sin)

    def rotate(self, x, cos, sin):
        if self.swapped:
            return rotate_half(x) * sin + cos * x
        return x * cos + rotate_half(x) * sin

    def forward(self, h):
        shape = (*h.shape[:-1], -1, D)
        q = self.q_proj(h).view(shape).transpose(1, 2)
        k = self.k_proj(h).view(shape).transpose(1, 2)
        v = self.v_proj(h).view(shape).transpose(1, 2)
        cos = self.cos if self.two_d else self.cos.unsqueeze(1)
        sin = self.sin if self.two_d else self.sin.unsqueeze(1)
        q, k = self.rotate(q, cos.to(q.dtype), sin.to(q.dtype)), self.rotate(k, cos.to(k.dtype), sin.to(k.dtype))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(h.shape))


def _inputs():
    return [torch.randn(B, T, HEADS * D)]


def _rotated_chains(report):
    return [r for r in report.rows if "rotary(" in (r.program or "")]


@pytest.mark.parametrize("variant", [dict(), dict(bias=True), dict(swapped=True), dict(batch_tables=B),
                                     dict(two_d=True)],
                         ids=["llama", "qwen2_bias", "operands_swapped", "tables_per_sample", "tables_2d"])
def test_q_and_k_fuse_with_their_rotation_and_compute_eagers_values_and_gradients(variant):
    report = check_against_eager(lambda: Attention(**variant), _inputs, train=True, grads=True)
    rotated = _rotated_chains(report)
    assert len(rotated) == 2 and all(r.status == "fused" for r in rotated)
    assert all(f"rotary(head_dim={D}, cos=p0, sin=p1)" in r.program and r.program.endswith("|| head head")
               for r in rotated)
    assert sum(r.status == "fused" for r in report.rows) == 2  # v_proj and o_proj: nothing after them


def test_in_bfloat16_the_rotation_rounds_as_eagers_three_ops():
    report = check_against_eager(lambda: Attention(), _inputs, dtype=torch.bfloat16, train=False)
    assert len(_rotated_chains(report)) == 2


def test_the_rewritten_graph_computes_eagers_values_bit_for_bit():
    """``rotary_embedding`` runs eager's ops in eager's order: a graph left to Inductor (or the
    reference) computes what the model did."""
    torch.manual_seed(0)
    model = Attention().eval()
    h = _inputs()[0]
    gm, inputs = captured(model, h)  # (the parameters lifted to inputs)
    assert recognise(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    with torch.no_grad():
        assert torch.equal(gm(*inputs)[0], model(h))


def test_the_reference_stage_is_rotate_half_per_head_with_table_rows_repeating():
    """Output row r reads table row r mod P: a (T, D) table serves every sample."""
    torch.manual_seed(1)
    program = Program(Gemm(False), (Rotary(D, 0, 1),), ("head", "head"))
    y = torch.randn(B, T, HEADS * D).to(torch.bfloat16)
    cos, sin = tables(1, torch.bfloat16)
    out, _ = epilogue(program, y, [cos[0], sin[0]])
    heads = y.view(B, T, HEADS, D).transpose(1, 2)
    eager = heads * cos.unsqueeze(1) + rotate_half(heads) * sin.unsqueeze(1)
    assert torch.equal(out, eager.transpose(1, 2).reshape(B, T, HEADS * D))
    assert torch.equal(rotary_embedding(y, cos, sin), out)


def test_the_stage_prints_and_parses():
    program = Program(Gemm(True), (Rotary(64, 1, 0),), ("head", "head"))
    assert program.to_string() == "linear(bias=True) | rotary(head_dim=64, cos=p1, sin=p0) || head head"
    assert Program.parse(program.to_string()) == program
    assert program.constant_params == {0, 1}  # the tables get no gradient


class LearnedTables(Attention):
    """Tables that are parameters: their gradient is not the chain's to give."""

    def __init__(self):
        super().__init__()
        self.cos, self.sin = (nn.Parameter(t.clone()) for t in tables())


class ReadTwice(Attention):
    """q's heads are also returned before the rotation."""

    def forward(self, h):
        q = self.q_proj(h).view(*h.shape[:-1], -1, D).transpose(1, 2)
        return self.rotate(q, self.cos.unsqueeze(1), self.sin.unsqueeze(1)), q


@pytest.mark.parametrize("model", [LearnedTables, ReadTwice], ids=["learned_tables", "heads_read_twice"])
def test_a_rotation_the_chain_cannot_hold_is_left_as_the_model_wrote_it(model):
    gm, _ = captured(model().eval(), *_inputs())
    assert recognise(gm.graph) == 0
    report = check_against_eager(model, _inputs, train=True, grads=True, draws=2)
    assert not _rotated_chains(report)


def test_the_example_model_fuses_q_and_k_with_their_rotation():
    """examples/llama_attention_rope.py (what the benchmark times at full size), at its small size."""
    from examples.suite import build, make_inputs, select

    (row,) = select(["llama_attention_rope"])
    report = check_against_eager(lambda: build(row, "small")[0], lambda: make_inputs(row, "small"), train=False)
    assert [r.status for r in _rotated_chains(report)] == ["fused", "fused"]
