"""The pass that finishes a norm or softmax over the row inside the GEMM (csrc/row_statistics.cuh's
normalize_rows_body, the body of the in-GEMM back end's normalize_rows kernel), run by the host
emulator (every thread a fiber, barriers checked) on the partials and stored values the GEMM's
epilogue writes (fxg::RowStatistics, mirrored here per (row, 64-column subtile)), against torch.

LayerNorm, RMSNorm, softmax, log_softmax and F.normalize; rows of one subtile, of a short last subtile, and of
more subtiles than the block has threads; NaN and infinities where eager puts them; float32 values
(held to 1e-4) and bfloat16 ones stored as float16 deviations (held to the rule's 1e-2).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from fxfuse.cuda.build import CSRC, find_cuda_home

SUBTILE = 64  # fxg::RowStatistics' (gemm_codegen.ROW_STATISTICS_SUBTILE)
KINDS = {"layer_norm": 0, "rms_norm": 1, "softmax": 2, "log_softmax": 3, "normalize": 4}  # fx::RowStatistic

SOURCE = r"""
#define FX_EMULATE
#include <cstdio>
#include <stdexcept>
#include <vector>
#include "row_statistics.cuh"

struct Args { const float* weight; const float* bias; };
struct After {  // the stages after the map: none here (the generator's are the GEMM modules' tests)
  using Arguments = Args;
  struct Scalars {};
  static Scalars scalars(const Args&) { return {}; }
  static float apply(const Args&, const Scalars&, int64_t, float x) { return x; }
};
struct Affine {
  static float weight(const Args& a, int64_t n) { return a.weight ? a.weight[n] : 1.f; }
  static float bias(const Args& a, int64_t n) { return a.bias ? a.bias[n] : 0.f; }
};

template <class Out, class D, int Kind>
int run(const float* partials, void* out, long long m, long long n, float eps, const float* w, const float* b) {
  const Args args{w, b};
  std::vector<fx::Moments> parts(fx::kRowNormThreads);
  try {
    fx::emulate_launch(m, fx::kRowNormThreads, 2 * fx::row_subtiles<64>(n) * sizeof(float),
                       [&](const fx::Thread& t, float* dyn, float*) {
                         fx::normalize_rows_body<Affine, After, Out, D, Kind, 64>(
                             t, static_cast<Out*>(out), partials, m, n, eps, args, dyn, parts.data());
                       });
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  return 0;
}

template <class Out, class D>
int dispatch(int kind, const float* p, void* out, long long m, long long n, float eps, const float* w, const float* b) {
  switch (kind) {
    case 0: return run<Out, D, fx::kRowLayerNorm>(p, out, m, n, eps, w, b);
    case 1: return run<Out, Out, fx::kRowRmsNorm>(p, out, m, n, eps, w, b);
    case 2: return run<Out, D, fx::kRowSoftmax>(p, out, m, n, eps, w, b);
    case 3: return run<Out, D, fx::kRowLogSoftmax>(p, out, m, n, eps, w, b);
    case 4: return run<Out, Out, fx::kRowNormalize>(p, out, m, n, eps, w, b);
  }
  return 2;
}

extern "C" int fx_normalize_rows(int kind, int bf16, const float* partials, void* out, long long m, long long n,
                                 float eps, const float* weight, const float* bias) {
  return bf16 ? dispatch<__nv_bfloat16, __half>(kind, partials, out, m, n, eps, weight, bias)
              : dispatch<float, float>(kind, partials, out, m, n, eps, weight, bias);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    home = find_cuda_home(need_nvcc=False)
    compiler = shutil.which("g++") or shutil.which("c++")
    if home is None or compiler is None:
        pytest.skip("needs a host C++ compiler and CUDA's headers (cuda_bf16.h)")
    directory = tmp_path_factory.mktemp("row_statistics")
    (directory / "harness.cpp").write_text(SOURCE)
    subprocess.run([compiler, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", f"-I{CSRC}",
                    f"-I{home}/include", str(directory / "harness.cpp"), "-o", str(directory / "harness.so")],
                   check=True, capture_output=True, text=True)
    library = ctypes.CDLL(str(directory / "harness.so"))
    library.fx_normalize_rows.restype = ctypes.c_int
    library.fx_normalize_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_longlong, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p,
                                          ctypes.c_void_p]
    return library


def epilogue(x: torch.Tensor, kind: str, stored: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What fxg::RowStatistics writes for the float32 values x: the partials [parts][M][subtiles]
    and the stored values (a LayerNorm's standardized deviations in each subtile, a softmax's
    values less the subtile's max, an RMSNorm's values), in ``stored``."""
    m, n = x.shape
    firsts, seconds, values = [], [], []
    for start in range(0, n, SUBTILE):
        v = x[:, start:start + SUBTILE]
        if kind == "layer_norm":
            mean = v.mean(1, keepdim=True)
            m2 = ((v - mean) ** 2).sum(1, keepdim=True)
            standardizer = torch.where(m2 > 0, torch.rsqrt(m2 / v.shape[1]), torch.zeros_like(m2))
            firsts.append(mean), seconds.append(m2), values.append((v - mean) * standardizer)
        elif kind in ("rms_norm", "normalize"):
            firsts.append((v * v).sum(1, keepdim=True)), values.append(v)
        else:
            top = v.amax(1, keepdim=True)  # NaN-propagating, as the epilogue's
            shift = torch.where(top.isfinite(), top, torch.zeros_like(top))
            firsts.append(top), seconds.append(torch.exp(v - shift).sum(1, keepdim=True)), values.append(v - shift)
    parts = [torch.cat(firsts, 1)] + ([torch.cat(seconds, 1)] if seconds else [])
    return torch.stack(parts).contiguous(), torch.cat(values, 1).to(stored).contiguous()


def normalize(lib, x: torch.Tensor, kind: str, weight=None, bias=None, eps=1e-5, bf16=False) -> torch.Tensor:
    stored_dtype = torch.bfloat16 if kind in ("rms_norm", "normalize") else torch.float16
    partials, stored = epilogue(x, kind, stored_dtype if bf16 else torch.float32)
    out = stored.clone()  # the pass maps the stored values in place
    code = lib.fx_normalize_rows(KINDS[kind], int(bf16), partials.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                 eps, None if weight is None else weight.data_ptr(),
                                 None if bias is None else bias.data_ptr())
    assert code == 0, "the emulated pass failed (stderr says why)"
    return out.view(torch.bfloat16) if bf16 else out


def eager(x: torch.Tensor, kind: str, weight=None, bias=None, eps=1e-5) -> torch.Tensor:
    if kind == "layer_norm":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if kind == "rms_norm":
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    if kind == "normalize":
        return F.normalize(x, 2.0, -1, eps)
    return F.softmax(x, -1) if kind == "softmax" else F.log_softmax(x, -1)


def affine(kind: str, n: int, generator) -> tuple:
    if kind == "layer_norm":
        return torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    return (torch.randn(n, generator=generator), None) if kind == "rms_norm" else (None, None)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("m,n", [(5, 64), (4, 200), (3, 4096), (2, 20000)])
def test_the_pass_maps_each_row_as_eager(lib, kind, m, n):
    """One subtile, a short last one (200 = 3 x 64 + 8), many, and more subtiles than threads
    (20000: 313, each thread merging two), rows of mean far from zero for the LayerNorm."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g) * 3 + (40.0 if kind == "layer_norm" else 0.0)
    weight, bias = affine(kind, n, g)
    got = normalize(lib, x, kind, weight, bias)
    torch.testing.assert_close(got, eager(x, kind, weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bfloat16_rows_from_float16_deviations_are_within_the_rule(lib, kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1000, generator=g) * 4 + (100.0 if kind == "layer_norm" else 0.0)
    weight, bias = affine(kind, 1000, g)
    got = normalize(lib, x, kind, weight, bias, bf16=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), eager(x, kind, weight, bias), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_nan_and_infinities_land_where_eager_puts_them(lib, kind):
    """Row 0: a NaN; row 1: +inf; row 2: -inf in two subtiles; row 3: a whole subtile of -inf;
    row 4: all -inf; row 5: finite."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 200, generator=g)
    x[0, 7] = math.nan
    x[1, 150] = math.inf
    x[2, 3], x[2, 130] = -math.inf, -math.inf
    x[3, 64:128] = -math.inf
    x[4, :] = -math.inf
    got, want = normalize(lib, x, kind), eager(x, kind)
    assert torch.equal(got.isnan(), want.isnan()), (got.isnan().nonzero(), want.isnan().nonzero())
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
