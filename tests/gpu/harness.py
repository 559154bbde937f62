"""A harness that evaluates every device function of csrc/epilogue_ops.cuh elementwise.

The same source builds as host C++ (g++, CPU tests) and as CUDA (nvcc, GPU tests), exporting
``fx_harness(which, a, b, y, n, attr0, attr1, stream)``: y[i] = f_which(a[i][, b[i]], attrs...), and
``fx_harness_grad(which, k, g, a, b, y, ...)``: y[i] = operand k's gradient of f_which (its ``_bwd``
device function, given the output's gradient g[i]).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import torch

from fxfuse.cuda.build import CSRC
from fxfuse.vocabulary import POINTWISE

FUNCTIONS = list(POINTWISE.values())

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 1e-45, 1.0, -1.0, 2.5, -2.5, 3.0, -3.0,
           6.0, -6.0, 19.9, 20.1, 25.0, -25.0, 88.0, 89.0, -88.0, -104.0, 1e4, -1e4, 3.0e38, -3.0e38]


def source() -> str:
    cases, grad_cases = [], []
    for i, row in enumerate(FUNCTIONS):
        operands = ["a", "b"][: row.operands]
        attrs = ["a0", "a1"][: len(row.attrs)]
        cases.append(f"    case {i}: return {row.device_fn}({', '.join(operands + attrs)});")
        for k, bwd in enumerate(row.device_backward):
            args = ", ".join(["g", *operands, "y", *attrs])
            grad_cases.append(f"    case {2 * i + k}: return {bwd}({args});")
    return "\n".join(
        [
            '#include "epilogue_ops.cuh"',
            "#if defined(__CUDACC__)",
            "#include <cuda_runtime.h>",
            "#endif",
            "",
            "FX_FN float fx_harness_apply(int which, float a, float b, float a0, float a1) {",
            "  (void)b; (void)a0; (void)a1;",
            "  switch (which) {",
            *cases,
            "  }",
            "  return NAN;",
            "}",
            "",
            "// operand k's gradient of function `which` from the output's gradient g",
            "FX_FN float fx_harness_grad_apply(int which, int k, float g, float a, float b, float a0, float a1) {",
            "  (void)b; (void)a0; (void)a1;",
            "  const float y = fx_harness_apply(which, a, b, a0, a1);",
            "  (void)y;",
            "  switch (2 * which + k) {",
            *grad_cases,
            "  }",
            "  return NAN;",
            "}",
            "",
            "#if defined(__CUDACC__)",
            "__global__ void fx_harness_grad_kernel(int which, int k, const float* g, const float* a, const float* b,",
            "                                       float* y, long long n, float a0, float a1) {",
            "  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;",
            "  if (i < n) y[i] = fx_harness_grad_apply(which, k, g[i], a[i], b[i], a0, a1);",
            "}",
            'extern "C" int fx_harness_grad(int which, int k, const float* g, const float* a, const float* b, float* y,',
            "                               long long n, float a0, float a1, void* stream) {",
            "  if (n > 0) fx_harness_grad_kernel<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(",
            "      which, k, g, a, b, y, n, a0, a1);",
            "  return (int)cudaGetLastError();",
            "}",
            "#else",
            'extern "C" int fx_harness_grad(int which, int k, const float* g, const float* a, const float* b, float* y,',
            "                               long long n, float a0, float a1, void*) {",
            "  for (long long i = 0; i < n; ++i) y[i] = fx_harness_grad_apply(which, k, g[i], a[i], b[i], a0, a1);",
            "  return 0;",
            "}",
            "#endif",
            "",
            "#if defined(__CUDACC__)",
            "__global__ void fx_harness_kernel(int which, const float* a, const float* b, float* y, long long n,",
            "                                  float a0, float a1) {",
            "  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;",
            "  if (i < n) y[i] = fx_harness_apply(which, a[i], b[i], a0, a1);",
            "}",
            'extern "C" int fx_harness(int which, const float* a, const float* b, float* y, long long n,',
            "                          float a0, float a1, void* stream) {",
            "  if (n > 0) fx_harness_kernel<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(",
            "      which, a, b, y, n, a0, a1);",
            "  return (int)cudaGetLastError();",
            "}",
            "#else",
            'extern "C" int fx_harness(int which, const float* a, const float* b, float* y, long long n,',
            "                          float a0, float a1, void*) {",
            "  for (long long i = 0; i < n; ++i) y[i] = fx_harness_apply(which, a[i], b[i], a0, a1);",
            "  return 0;",
            "}",
            "#endif",
            "",
        ]
    )


def build_host(directory: Path, cuda_include: str) -> ctypes.CDLL:
    """Compile the harness with the host C++ compiler (no FMA contraction, no fast math)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no host C++ compiler")
    src = directory / "harness.cpp"
    src.write_text(source())
    lib = directory / "harness.so"
    subprocess.run(
        [compiler, "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", f"-I{CSRC}",
         f"-I{cuda_include}", str(src), "-o", str(lib)],
        check=True, capture_output=True, text=True,
    )
    return _bind(ctypes.CDLL(str(lib)))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.fx_harness.restype = ctypes.c_int
    lib.fx_harness.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_longlong, ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
    lib.fx_harness_grad.restype = ctypes.c_int
    lib.fx_harness_grad.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float, ctypes.c_float,
                                    ctypes.c_void_p]
    return lib


def evaluate_grad(lib: ctypes.CDLL, index: int, k: int, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  attrs: tuple, stream=None):
    """Operand ``k``'s gradient of function ``index`` at (a, b) given the output's gradient g."""
    y = torch.empty_like(a)
    attrs = list(attrs) + [0.0] * (2 - len(attrs))
    code = lib.fx_harness_grad(index, k, g.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel(),
                               attrs[0], attrs[1], stream)
    assert code == 0, f"harness error {code}"
    return y


def reference_grad(row, k: int, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, attrs: tuple) -> torch.Tensor:
    """Operand ``k``'s gradient by eager's autograd through the row's reference function."""
    operands = [t.detach().clone().requires_grad_(i == k) for i, t in enumerate([a, b][: row.operands])]
    with torch.enable_grad():
        out = row.reference(*operands, *attrs)
        (grad,) = torch.autograd.grad(out, [operands[k]], g)
    return grad.float()


def evaluate(lib: ctypes.CDLL, index: int, a: torch.Tensor, b: torch.Tensor, attrs: tuple, stream=None):
    y = torch.empty_like(a)
    attrs = list(attrs) + [0.0] * (2 - len(attrs))
    code = lib.fx_harness(index, a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel(), attrs[0], attrs[1], stream)
    assert code == 0, f"harness error {code}"
    return y


def inputs(device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Operand pairs: every special value against every other (NaN/Inf on either side), plus
    random values of several scales."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor(SPECIAL, dtype=torch.float32)
    a_sp = special.repeat_interleave(len(SPECIAL))
    b_sp = special.repeat(len(SPECIAL))
    rand = torch.cat([torch.randn(4096, generator=g) * s for s in (0.1, 1.0, 4.0, 30.0)])
    b_rand = torch.cat([torch.randn(4096, generator=g) * s for s in (0.1, 1.0, 4.0, 30.0)])
    a = torch.cat([a_sp, rand]).contiguous()
    b = torch.cat([b_sp, b_rand]).contiguous()
    return a.to(device), b.to(device)


ATTRS = {
    "leaky_relu": [(0.1,), (0.01,)],
    "clamp": [(-2.0, 2.0), (-1.0, 1.0), (0.5, -0.5)],
    "hardtanh": [(-2.0, 2.0), (0.0, 6.0)],
    "clamp_min": [(0.0,), (-1.5,)],
    "clamp_max": [(0.0,), (6.0,)],
    "elu": [(1.0,), (0.3,)],
    "softplus": [(1.0, 20.0), (2.0, 3.0), (0.5, 10.0)],
    "celu": [(1.0,), (0.3,), (2.5,)],
    "threshold": [(0.1, 20.0), (-1.0, 0.0)],
    "hardshrink": [(0.5,), (0.0,)],
    "softshrink": [(0.5,), (2.0,)],
}


def cases():
    """(index, row, attrs) for every function and attribute set."""
    for i, row in enumerate(FUNCTIONS):
        for attrs in ATTRS.get(row.name, [()]):
            assert len(attrs) == len(row.attrs), row.name
            yield i, row, attrs


def grad_cases():
    """(index, row, operand, attrs) for every function, operand and attribute set."""
    for i, row, attrs in cases():
        for k in range(row.operands):
            yield i, row, k, attrs


def grad_inputs(device: str, seed: int = 1) -> torch.Tensor:
    """Output gradients for harness.inputs: random, with NaN and infinities among them."""
    a, _ = inputs("cpu", seed)
    g = torch.randn(a.shape, generator=torch.Generator().manual_seed(seed))
    g[::97] = math.nan
    g[1::89] = math.inf
    g[2::83] = -math.inf
    return g.to(device)


def reference(row, a: torch.Tensor, b: torch.Tensor, attrs: tuple) -> torch.Tensor:
    operands = [a, b][: row.operands]
    return row.reference(*operands, *attrs).float()


def assert_matches(got: torch.Tensor, want: torch.Tensor, where: dict, what: str, rtol: float) -> None:
    """NaN exactly where torch has NaN (``where`` names the inputs to print at a mismatch), the
    other values within ``rtol`` (atol 1e-6)."""
    bad = torch.isnan(got) != torch.isnan(want)
    if bad.any():
        at = " ".join(f"{k}={v[bad][:6].tolist()}" for k, v in where.items())
        raise AssertionError(f"{what}: NaN mismatch at {at}: got {got[bad][:6].tolist()}, torch {want[bad][:6].tolist()}")
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=rtol, atol=1e-6, msg=lambda m: f"{what}: {m}")
