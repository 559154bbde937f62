"""Policy "fastest": a chain goes to Inductor where Inductor measured faster (fxfuse/policy.py)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxfuse.ir import Gemm, Norm, Pointwise, Program, Reduce
from fxfuse.expr import X, call
from fxfuse.policy import NORM_ELEMENTS_TO_INDUCTOR, inductor_is_faster
from support import compile_fxfuse

GROUP_NORM = Program(Gemm(True), (Norm("group", 1e-5, groups=8, weight=0, bias=1),), ("col", "col"))
POINTWISE = Program(Gemm(True), (Pointwise(call("relu", X)),), ())
SOFTMAX = Program(Gemm(True), (Reduce("softmax"),), ())


def gemm_output(rows: int, n: int, device: str = "cuda") -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(rows, n, device=device)


def test_large_norm_chains_on_cuda_go_to_inductor_with_a_reason():
    reason = inductor_is_faster(GROUP_NORM, gemm_output(1024, 8192))
    assert reason is not None and "Inductor is faster" in reason and "policy='always'" in reason


@pytest.mark.parametrize("program", [POINTWISE, SOFTMAX], ids=["pointwise", "softmax"])
def test_pointwise_and_reduction_chains_stay_fused(program):
    assert inductor_is_faster(program, gemm_output(1024, 8192)) is None


def test_small_norm_chains_stay_fused():
    assert inductor_is_faster(GROUP_NORM, gemm_output(16, 8192)) is None
    assert NORM_ELEMENTS_TO_INDUCTOR > 16 * 8192


def test_the_cpu_reference_path_is_never_redirected():
    assert inductor_is_faster(GROUP_NORM, gemm_output(1024, 8192, device="cpu")) is None


def test_an_unknown_policy_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.raises(Exception, match="policy must be one of"):
        compile_fxfuse(model, policy="sometimes")(torch.randn(2, 8))
