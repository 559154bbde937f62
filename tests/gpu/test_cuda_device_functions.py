"""The device functions on the GPU (CUDA's math library) against torch's CUDA kernels: NaN/Inf
behaviour exactly, values to a couple of float32 ulps."""

from __future__ import annotations

import ctypes

import pytest
import torch

import harness
from fxfuse.cuda import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from torch.utils import cpp_extension

    target = build.cuda_target()
    directory = tmp_path_factory.mktemp("cuda_harness")
    (directory / "harness.cu").write_text(harness.source())
    build._use_cuda_home(target)
    path = cpp_extension.load(
        name="fxfuse_cuda_harness",
        sources=[str(directory / "harness.cu")],
        extra_include_paths=[str(build.CSRC)],
        extra_cuda_cflags=["-O3", "--fmad=false", *target.nvcc_flags],
        build_directory=str(directory),
        is_python_module=False,
        with_cuda=True,
    )
    return harness._bind(ctypes.CDLL(path))


@pytest.mark.parametrize("case", list(harness.cases()), ids=lambda c: f"{c[1].name}{list(c[2])}")
def test_device_function_matches_torch_cuda(lib, case):
    index, row, attrs = case
    a, b = harness.inputs("cuda")
    got = harness.evaluate(lib, index, a, b, attrs, stream=torch.cuda.current_stream().cuda_stream)
    want = harness.reference(row, a, b, attrs)
    torch.cuda.synchronize()
    harness.assert_matches(got, want, {"a": a, "b": b}, f"{row.name}{attrs}", rtol=4e-6)


@pytest.mark.parametrize("case", list(harness.grad_cases()), ids=lambda c: f"{c[1].name}-{c[2]}{list(c[3])}")
def test_device_derivative_matches_autograd_cuda(lib, case):
    """Each ``_bwd`` device function against eager's CUDA autograd: NaN/Inf exactly (operands and
    incoming gradients), values to a couple of float32 ulps."""
    index, row, k, attrs = case
    a, b = harness.inputs("cuda")
    g = harness.grad_inputs("cuda")
    got = harness.evaluate_grad(lib, index, k, g, a, b, attrs, stream=torch.cuda.current_stream().cuda_stream)
    want = harness.reference_grad(row, k, g, a, b, attrs)
    torch.cuda.synchronize()
    harness.assert_matches(got, want, {"a": a, "b": b, "g": g}, f"{row.name}{attrs} operand {k}", rtol=4e-6)
