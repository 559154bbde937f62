"""The device functions (csrc/epilogue_ops.cuh), compiled as host C++, against torch on CPU.

Checks the formulas themselves, NaN/Inf behaviour above all, on special values and random data.
The same harness runs on the GPU in test_device_functions.py (CUDA's math library there).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

import harness
from fxfuse.cuda import build
from fxfuse.cuda.build import CSRC, Target, find_cuda_home

# Inputs where torch's CPU kernel differs from its CUDA kernel (which the device functions follow)
CPU_DIFFERS = {
    # CPU's vectorised gelu gives NaN at inf and overflows near FLT_MAX; CUDA computes
    # x * 0.5 * (1 + erf(x / sqrt 2)) = x there
    "gelu": lambda a: a.abs() > 1e38,
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    home = find_cuda_home(need_nvcc=False)
    if home is None or not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("needs a host C++ compiler and CUDA's headers (cuda_bf16.h)")
    return harness.build_host(tmp_path_factory.mktemp("harness"), f"{home}/include")


@pytest.mark.parametrize("case", list(harness.cases()), ids=lambda c: f"{c[1].name}{list(c[2])}")
def test_device_function_matches_torch(lib, case):
    index, row, attrs = case
    a, b = harness.inputs("cpu")
    got = harness.evaluate(lib, index, a, b, attrs)
    want = harness.reference(row, a, b, attrs)
    if row.name in CPU_DIFFERS:
        keep = ~CPU_DIFFERS[row.name](a)
        got, want, a, b = got[keep], want[keep], a[keep], b[keep]
    harness.assert_matches(got, want, {"a": a, "b": b}, f"{row.name}{attrs}", rtol=2e-6)


# Gradients where torch's CPU backward kernels differ from their CUDA ones (which the _bwd functions
# follow; tests/gpu/test_cuda_device_functions.py checks those everywhere): the vectorised CPU
# kernels give NaN for a NaN operand where CUDA's comparisons pass the gradient (or zero) on, and
# evaluate gelu's derivatives by other formulas in their tails
CPU_GRAD_DIFFERS = {
    "gelu": lambda a: a.abs() > 5.0,
    "gelu_tanh": lambda a: a.abs() > 4.0,
    "hardtanh": torch.isnan,
    "hardswish": torch.isnan,
    "elu": torch.isnan,
    "selu": torch.isnan,
    "celu": torch.isnan,
    "hardshrink": torch.isnan,  # (the CPU kernel gives 0 for a NaN operand, CUDA's the gradient)
    "softshrink": torch.isnan,
    # the derivative reads the output, g * (y + 1): where expm1 is -1 less half an ulp, torch's
    # vectorised CPU expm1 gives -1 (an infinite g then gives NaN) and libm's -0.99999994
    "expm1": lambda a: a < -15.0,
}


@pytest.mark.parametrize("case", list(harness.grad_cases()), ids=lambda c: f"{c[1].name}-{c[2]}{list(c[3])}")
def test_device_derivative_matches_autograd(lib, case):
    """Each ``_bwd`` device function equals eager's autograd through the row's torch function,
    NaN and infinities (in the operands and the incoming gradient) included."""
    index, row, k, attrs = case
    a, b = harness.inputs("cpu")
    g = harness.grad_inputs("cpu")
    got = harness.evaluate_grad(lib, index, k, g, a, b, attrs)
    want = harness.reference_grad(row, k, g, a, b, attrs)
    if row.name in CPU_GRAD_DIFFERS:
        keep = ~CPU_GRAD_DIFFERS[row.name](a)
        got, want, a, b, g = got[keep], want[keep], a[keep], b[keep], g[keep]
    harness.assert_matches(got, want, {"a": a, "b": b, "g": g}, f"{row.name}{attrs} operand {k}", rtol=2e-6)


BRANCH = re.compile(r"\s*(@!?%p\d+\s+)?bra(\.uni)?\s")  # a PTX branch, taken or conditional

# Activations whose in-GEMM build (the correctness rule's math) compiles to straight-line PTX
STRAIGHT_LINE = {"relu": "fx_relu(x)", "leaky_relu": "fx_leaky_relu(x, 0.1f)", "gelu_tanh": "fx_gelu_tanh(x)",
                 "silu": "fx_silu(x)", "sigmoid": "fx_sigmoid(x)", "tanh": "fx_tanh(x)", "mish": "fx_mish(x)",
                 "clamp": "fx_clamp(x, -1.f, 1.f)", "hardswish": "fx_hardswish(x)", "elu": "fx_elu(x, 1.f)",
                 "selu": "fx_selu(x)", "celu": "fx_celu(x, 0.5f)", "expm1": "fx_expm1(x)"}


@pytest.mark.parametrize("name", list(STRAIGHT_LINE))
def test_an_in_gemm_activation_computes_every_value_without_a_branch(name, tmp_path):
    """In the GEMM's epilogue a thread applies the chain to many accumulators at once. A branch
    around a value's work (an early return past the exponential) puts each value in a block of its
    own, and nvcc then runs their exponentials one after another instead of overlapping them:
    S17's Mish compiled to 32 such branches a subtile. Both sides are computed and selected."""
    home = find_cuda_home(need_nvcc=True)
    if home is None:
        pytest.skip("needs nvcc")
    source = tmp_path / "probe.cu"
    source.write_text(f'#include "epilogue_ops.cuh"\n__global__ void probe(float* out, const float* in) {{\n'
                      f'  const float x = in[threadIdx.x];\n  out[threadIdx.x] = {STRAIGHT_LINE[name]};\n}}\n')
    ptx = tmp_path / "probe.ptx"
    # a GEMM module's own flags (the rule's math; CUTLASS's include is an empty directory: the probe reads none)
    flags = build._compiler_flags(Target("cuda", "sm_90a", ()), tmp_path)["extra_cuda_cflags"]
    subprocess.run([f"{home}/bin/nvcc", *flags, "-arch=sm_90a", f"-I{CSRC}", "-ptx", str(source), "-o", str(ptx)],
                   check=True)
    branches = [line.strip() for line in ptx.read_text().splitlines() if BRANCH.match(line)]
    assert not branches, f"{name}: {branches}"
