"""Policy "fastest": a chain goes to Inductor where Inductor measured faster (fxfuse/policy.py)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxfuse.canonicalize import canonicalize
from fxfuse import expr as E
from fxfuse.expr import X, call
from fxfuse.ir import Gemm, Norm, Pointwise, Program, Reduce, Widen
from fxfuse.match import match_all
from fxfuse.policy import LARGE_ELEMENTS, inductor_is_faster
from support import compile_fxfuse

GROUP_NORM = Program(Gemm(True), (Norm("group", 1e-5, groups=8, weight=0, bias=1),), ("col", "col"))
POINTWISE = Program(Gemm(True), (Pointwise(call("relu", X)),), ())
SOFTMAX = Program(Gemm(True), (Reduce("softmax"),), ())


def gemm_output(rows: int, n: int, device: str = "cuda", training: bool = False,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(rows, n, device=device, dtype=dtype, requires_grad=training)


def test_large_norm_chains_on_cuda_go_to_inductor_with_a_reason():
    reason = inductor_is_faster(GROUP_NORM, gemm_output(1024, 8192), after_selection=True)
    assert reason is not None and "Inductor is faster" in reason and "policy='always'" in reason


@pytest.mark.parametrize("program", [POINTWISE, SOFTMAX], ids=["pointwise", "softmax"])
def test_pointwise_and_reduction_chains_stay_fused(program):
    assert inductor_is_faster(program, gemm_output(1024, 8192), after_selection=True) is None


WIDENED_POINTWISE = Program(Gemm(False), (Pointwise(call("relu", X + E.param(0))), Widen()), ("col",))
WIDENED_SOFTMAX = Program(Gemm(True), (Pointwise(call("gelu", X)), Widen(), Reduce("softmax")))


def test_large_widened_pointwise_chains_on_cuda_go_to_inductor_small_ones_stay():
    reason = inductor_is_faster(WIDENED_POINTWISE, gemm_output(1024, 8192), after_selection=True)
    assert reason is not None and "widen to float32" in reason
    assert inductor_is_faster(WIDENED_POINTWISE, gemm_output(16, 8192), after_selection=True) is None


def test_a_widened_chain_ending_in_a_row_map_stays_fused():
    assert inductor_is_faster(WIDENED_SOFTMAX, gemm_output(1024, 8192), after_selection=True) is None


RESIDUAL_ADD = Program(Gemm(False), (Pointwise(X + E.param(0)),), ("full",))


def test_large_chains_reading_a_residual_go_to_inductor_small_ones_stay():
    reason = inductor_is_faster(RESIDUAL_ADD, gemm_output(1024, 8192), after_selection=True)
    assert reason is not None and "operand of the output's shape" in reason
    assert inductor_is_faster(RESIDUAL_ADD, gemm_output(16, 8192), after_selection=True) is None
    assert inductor_is_faster(RESIDUAL_ADD, gemm_output(1024, 8192, device="cpu"), after_selection=True) is None


ROTARY = Program.parse("linear(bias=False) | rotary(head_dim=128, cos=p0, sin=p1) || head head")


def test_large_rotary_chains_in_training_go_to_inductor_small_ones_stay():
    """In training, where no selection times the chain: its row pass measured 1.05x Inductor's."""
    reason = inductor_is_faster(ROTARY, gemm_output(8192, 4096, training=True))
    assert reason is not None and reason.startswith("Inductor is faster: rotary embeddings")
    assert inductor_is_faster(ROTARY, gemm_output(16, 4096, training=True)) is None


POOLING_SUM = Program.parse("linear(bias=True) | max_pool(kernel=2, stride=2) | sum(keepdim=False)")


def test_large_pooling_chains_not_yet_timed_on_a_gpu_go_to_inductor_and_say_so():
    reason = inductor_is_faster(POOLING_SUM, gemm_output(1024, 8192), after_selection=True)
    assert reason is not None and reason.startswith("left to Inductor: poolings along the features")
    assert "have not been timed against Inductor on a GPU yet" in reason
    assert inductor_is_faster(POOLING_SUM, gemm_output(16, 8192), after_selection=True) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("program", [GROUP_NORM, RESIDUAL_ADD, WIDENED_POINTWISE, POOLING_SUM, ROTARY, SOFTMAX],
                         ids=["norm", "residual", "widened", "pooling", "rotary", "softmax"])
def test_outside_training_every_cuda_chain_is_kept_for_the_selection_to_time_against_inductor(program, dtype):
    """No rule decides before the selection has timed the chain's paths beside Inductor's kernels
    at its shape (the row pass alone where the in-GEMM path does not take it); asked again without
    that measurement, the rules decide; in training (no measurement) they decide at once."""
    out = gemm_output(8192, 4096, dtype=dtype)
    assert inductor_is_faster(program, out) is None
    if program is not SOFTMAX:
        assert inductor_is_faster(program, out, after_selection=True) is not None
        assert inductor_is_faster(program, gemm_output(8192, 4096, dtype=dtype, training=True)) is not None


S04_GROUPS = Program(Gemm(True), (Norm("group", 1e-5, groups=256, weight=0, bias=1),), ("col", "col"))
S06_GROUPS = Program(Gemm(True), (Norm("group", 1e-5, groups=16, weight=0, bias=1),), ("col", "col"))
LAYER_NORM = Program(Gemm(True), (Norm("layer", 1e-5, weight=0, bias=1),), ("col", "col"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_training_a_large_group_norm_chain_of_small_groups_stays_fused(dtype):
    """Its forward and generated backward together beat Inductor's; inference still goes to
    Inductor, and so do larger groups and layer norms in training."""
    assert inductor_is_faster(S04_GROUPS, gemm_output(1024, 8192, training=True, dtype=dtype)) is None
    assert inductor_is_faster(S04_GROUPS, gemm_output(1024, 8192, dtype=dtype), after_selection=True) is not None
    assert inductor_is_faster(S06_GROUPS, gemm_output(1024, 8192, training=True, dtype=dtype)) is not None
    assert inductor_is_faster(LAYER_NORM, gemm_output(1024, 8192, training=True, dtype=dtype)) is not None


def test_in_training_without_the_generated_backward_group_norms_go_to_inductor(monkeypatch):
    monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", "0")
    assert inductor_is_faster(S04_GROUPS, gemm_output(1024, 8192, training=True)) is not None


def test_small_norm_chains_stay_fused():
    assert inductor_is_faster(GROUP_NORM, gemm_output(16, 8192), after_selection=True) is None
    assert LARGE_ELEMENTS > 16 * 8192


class _SwishThen(torch.nn.Module):
    """Linear, x·sigmoid(x), then ``tail``: under bf16 autocast a float32 vector promotes."""

    def __init__(self, tail):
        super().__init__()
        self.linear, self.scale, self.tail = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.rand(8)), tail

    def forward(self, x):
        y = self.linear(x)
        return self.tail(y * torch.sigmoid(y), self.scale)


def _chain_under_autocast(tail):
    found = []

    def collect(gm, example_inputs, **kwargs):
        found.extend(match_all(gm.graph, canonicalize(gm.graph), allow_cpu=True))
        return gm.forward

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(_SwishThen(tail), backend=collect)(torch.randn(4, 8))
    (chain,) = found
    return chain


def test_a_chain_widened_by_a_float32_parameter_fuses_in_full():
    chain = _chain_under_autocast(lambda v, scale: v * scale)  # bf16 * float32 parameter: float32
    assert chain.status == "fused" and chain.program.widens and not chain.stops_at_wider_dtype
    assert inductor_is_faster(chain.program, gemm_output(1024, 8), after_selection=True) is None


def test_a_chain_cut_by_a_dtype_it_cannot_widen_to_goes_to_inductor_with_the_cut_named():
    chain = _chain_under_autocast(lambda v, scale: v * scale.double())  # float64: no fused kernel
    assert chain.status == "partial" and chain.stops_at_wider_dtype
    reason = inductor_is_faster(chain.program, gemm_output(1024, 8), chain.reason)
    assert "Inductor is faster" in reason and "computes in torch.float64" in reason
    assert inductor_is_faster(chain.program, gemm_output(1024, 8, device="cpu"), chain.reason) is None


def test_a_chain_cut_by_an_unfusable_op_is_not_a_dtype_cut():
    chain = _chain_under_autocast(lambda v, scale: torch.cumsum(v, -1))
    assert chain.status == "partial" and not chain.stops_at_wider_dtype


def test_the_cpu_reference_path_is_never_redirected():
    assert inductor_is_faster(GROUP_NORM, gemm_output(1024, 8192, device="cpu"), after_selection=True) is None


def test_an_unknown_policy_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.raises(Exception, match="policy must be one of"):
        compile_fxfuse(model, policy="sometimes")(torch.randn(2, 8))


def _residual_chain(selection) -> "Chain":
    from fxfuse.match import Chain, Decision, Fusion

    gemm = gemm_output(8192, 4096, dtype=torch.bfloat16)
    return Chain(gemm=gemm, status="fused", chain=["linear", "add"], fused=["linear", "add"], reason=None,
                 fusion=Fusion(RESIDUAL_ADD, nodes=[gemm], x=gemm, weight=gemm, bias=None, params=[]),
                 dtype=torch.bfloat16, decision=Decision(selection.describe(), selection) if selection else None)


def test_where_the_selection_timed_inductor_its_measurement_decides():
    """Timed at the chain's shape on this card, Inductor's kernels either lost (the chain stays
    fused, whatever the rules say of its kind) or won (the chain goes to Inductor, the report
    saying by how much)."""
    from fxfuse.backend import _unfused_if_slower
    from fxfuse.cuda.engine import INDUCTOR, Selection
    from fxfuse.cuda.timing import GRAPH_TIMING

    won = Selection("row", -1, {"row": 100.0, INDUCTOR: 110.0}, GRAPH_TIMING)
    near = _unfused_if_slower(_residual_chain(Selection("row", -1, {"row": 100.0, INDUCTOR: 101.0}, GRAPH_TIMING)),
                              after_selection=True)
    assert near.status == "not_fused"  # a win under the margin goes to Inductor, and says so
    assert "fxfuse's fastest is 1.0% faster than Inductor at this shape, under the 3% margin" in near.reason
    assert _unfused_if_slower(_residual_chain(won), after_selection=True).status == "fused"
    lost = Selection("cooperative", 0, {"row": 120.0, "cooperative": 105.0, INDUCTOR: 100.0}, GRAPH_TIMING)
    left = _unfused_if_slower(_residual_chain(lost), after_selection=True)
    assert left.status == "not_fused" and left.program is None
    assert "Inductor is faster at this shape" in left.reason and "Inductor 100.0 us" in left.reason


def test_without_an_inductor_timing_the_rules_decide_after_the_selection():
    from fxfuse.backend import _unfused_if_slower
    from fxfuse.cuda.engine import Selection
    from fxfuse.cuda.timing import GRAPH_TIMING

    untimed = Selection("cooperative", 0, {"row": 120.0, "cooperative": 105.0}, GRAPH_TIMING)
    left = _unfused_if_slower(_residual_chain(untimed), after_selection=True)
    assert left.status == "not_fused" and "operand of the output's shape" in left.reason
    assert "measured path: in-GEMM epilogue (cooperative)" in left.reason
