"""The CUDA kernels of fxfuse::linear_epilogue against the reference (needs a CUDA device).

Every program of programs.py in float32 (TF32 off, atol = rtol = 1e-4) and the suite's low-precision
ones in bfloat16/float16 (1e-2), over 5 random draws, against fxfuse.reference.forward on the same
CUDA inputs (and float32 against the CPU reference too). Outputs are written into NaN-filled
buffers so every element must be written, and each call asserts the kernels ran (no fallback).
"""

from __future__ import annotations

import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse import expr as E
from fxfuse import reference
from fxfuse.cuda import codegen
from fxfuse.ir import Gemm, Norm, Program, row_split
from programs import (LOW_PRECISION, PROGRAMS, REDUCTION_EDGES, S04_TRACED_BF16, ZERO_ROW_NORMS, X,
                      assert_backward_close, dtypes_of, fits, grad_cases, make_params, p, poison, pw, reduction_edges,
                      rows_of_zeros)
from selected import selected

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SHAPES = [(7, 1000, 300), (1, 1000, 64), (16, 8192, 64), (33, 256, 32), (5, 3, 16)]
DRAWS = 5


def all_builds():
    pairs = [(PROGRAMS[name], dtype) for name, dtype, *_ in (c.values for c in cases())]
    pairs += [(PROGRAMS[n], d) for n in WIDE for d in (torch.float32, torch.bfloat16)]
    pairs += [(PROGRAMS["minus_and_negation"], torch.float16)]
    pairs += [(program, dtype) for _, dtype, _, program in small_group_cases()]
    pairs += [(PROGRAMS[name], dtype) for name, dtype, *_ in grad_cases(GRAD_SHAPES)]
    pairs += [(PROGRAMS[n], d) for n in GRADIENT_PROGRAMS for d in (torch.float32, torch.bfloat16)]
    pairs += [(PROGRAMS[n], torch.float32) for n in dict.fromkeys(REDUCTION_EDGES + ZERO_ROW_NORMS)]
    pairs += [(PROGRAMS[n], d) for n, _ in ROTARY_LAYOUTS for d in dtypes_of(n)]
    return pairs


def selected_builds(request) -> list:
    """The pairs of all_builds() whose programs the run's selected tests of this file name in their
    ids (small_group_cases' with their test): built at once, in parallel; any other builds on first
    use. minus_and_negation is left to build on its first call (a test of that)."""
    names = {id(program): name for name, program in PROGRAMS.items()}

    def named(item, pair) -> bool:
        program = pair[0]
        if program is PROGRAMS["minus_and_negation"]:
            return False
        return ("small_groups" if id(program) not in names else names[id(program)]) in item.nodeid

    return selected(request, all_builds(), named)


@pytest.fixture(scope="module", autouse=True)
def cuda_setup(request):
    if not fxcuda.available():
        pytest.skip("no CUDA toolchain (nvcc + ninja)")
    failed = fxcuda.prepare_many(selected_builds(request))
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def op(program_text, x, w, b, params, save_gemm=False):
    return torch.ops.fxfuse.linear_epilogue(program_text, x, w, b, params, save_gemm)


def inputs(program, dtype, m, n, k, seed, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    shape = {"transposed": (k, m), "3d": (3, m, k)}.get(layout, (m, k))
    x = torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)
    if layout == "transposed":
        x = x.t()  # a non-contiguous view
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device=DEVICE, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=DEVICE, dtype=dtype) if program.gemm.bias else None
    params = make_params(program, n, dtype=dtype, generator=g, device=DEVICE, lead=tuple(x.shape[:-1]), k=k)
    return x, w, b, params


def check(program, dtype, x, w, b, params, cpu_too=False):
    """The kernels and the registered op against the reference."""
    text = program.to_string()
    ref_out, ref_stats, _, ref_kept = reference.op_forward(program, x, w, b, params, False)
    result = fxcuda.engine.forward_kernels(text, x, w, b, params)
    assert result is not None, "the kernels do not cover the call"
    out, stats, _, kept = result
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(kept, ref_kept, rtol=tol, atol=tol, equal_nan=True)
    if ref_stats.numel():
        torch.testing.assert_close(stats, ref_stats, rtol=tol, atol=tol, equal_nan=True)
    op_out, op_stats, *_ = op(text, x, w, b, params)  # the dispatcher path
    assert op_out.shape == ref_out.shape and op_out.dtype == ref_out.dtype and op_out.is_cuda
    torch.testing.assert_close(op_out, ref_out, rtol=tol, atol=tol, equal_nan=True)
    assert op_stats.shape == ref_stats.shape
    if cpu_too and not program.second_gemms:
        # The CPU reference's epilogue on the GPU's GEMM output (an identity GEMM is exact): the
        # GEMMs themselves differ in summation order, which ill-conditioned chains (pow, exp of
        # large values) amplify past 1e-4. (A second GEMM reads x, which the identity GEMM does
        # not see: those programs are checked against the reference on the GPU only.)
        y = torch.nn.functional.linear(x, w, b).reshape(-1, w.shape[0]).cpu()
        eye = torch.eye(w.shape[0], dtype=y.dtype)
        zero = torch.zeros(w.shape[0], dtype=y.dtype) if b is not None else None
        cpu_out, cpu_stats = reference.forward(program, y, eye, zero, [p.cpu() for p in params])
        cpu_out = cpu_out.reshape(ref_out.shape)
        torch.testing.assert_close(out.cpu(), cpu_out, rtol=tol, atol=tol, equal_nan=True)
        if cpu_stats.numel():
            torch.testing.assert_close(stats.cpu(), cpu_stats, rtol=tol, atol=tol, equal_nan=True)


def cases():
    for name, program in PROGRAMS.items():
        dtypes = dtypes_of(name)
        for dtype in dtypes:
            for m, n, k in SHAPES:
                if fits(program, n) and not (program.batch_norm_training and m < 2):
                    yield pytest.param(name, dtype, m, n, k, id=f"{name}-{str(dtype)[6:]}-{m}x{k}x{n}")


@pytest.mark.parametrize("name,dtype,m,n,k", list(cases()))
def test_kernels_match_reference(name, dtype, m, n, k):
    program = PROGRAMS[name]
    fxcuda.prepare(program, dtype)
    for seed in range(DRAWS):
        check(program, dtype, *inputs(program, dtype, m, n, k, seed), cpu_too=dtype == torch.float32 and seed == 0)


WIDE = ["s16_sigmoid_sum", "s04_group_silu_vec_silu", "s11_gelu_softmax", "s21_rms_silu", "s03_batch_train_gelu_relu",
        "group_odd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", WIDE)
def test_wide_rows(name, dtype):
    """N = 32768 with M = 128 (S16's shape); 32765 for the odd group sizes."""
    program = PROGRAMS[name]
    n = 32765 if name == "group_odd" else 32768
    for seed in range(2):
        check(program, dtype, *inputs(program, dtype, 128, n, 64, seed))


@pytest.mark.parametrize("layout", ["transposed", "3d"])
@pytest.mark.parametrize("name", ["s02_group_leaky_double", "s20_layer_silu", "reduce_logsumexp_drop", "reduce_sum_keep"])
def test_input_layouts(name, layout):
    program = PROGRAMS[name]
    for seed in range(DRAWS):
        args = inputs(program, torch.float32, 7, 1000, 300, seed, layout)
        if layout == "3d" and any(getattr(s, "kind", None) == "group" for s in program.stages):
            # group_norm of a 3-D value normalises dim 1: the matcher never fuses it, and a direct
            # call raises eager's error rather than computing a feature norm.
            with pytest.raises(RuntimeError, match="divisible by num_groups"):
                op(program.to_string(), *args)
            continue
        check(program, torch.float32, *args)


@pytest.mark.parametrize(
    "name",
    ["s02_group_leaky_double", "s20_layer_silu", "s21_rms_silu", "s11_gelu_softmax", "log_softmax_then_pointwise",
     "reduce_max_drop", "reduce_min_keep", "reduce_logsumexp_keep", "s03_batch_train_gelu_relu", "s22_batch_eval_relu",
     "group_odd", "vocabulary_1", "vocabulary_2"],
)
def test_nan_inf_propagate(name):
    program = PROGRAMS[name]
    x, w, b, params = inputs(program, torch.float32, 6, 1000, 8, 2)
    poison(x, w, b)
    check(program, torch.float32, x, w, b, params)


def test_batch_norm_one_row_raises_like_eager():
    program = PROGRAMS["s03_batch_train_gelu_relu"]
    x, w, b, params = inputs(program, torch.float32, 1, 64, 8, 0)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        op(program.to_string(), x, w, b, params)


def test_batch_stats_equal_var_mean_and_are_deterministic():
    program = PROGRAMS["s07_vec_batch_train"]
    x, w, b, params = inputs(program, torch.float32, 4097, 1000, 64, 3)
    out1, stats1, *_ = op(program.to_string(), x, w, b, params)
    out2, stats2, *_ = op(program.to_string(), x, w, b, params)
    assert torch.equal(out1, out2) and torch.equal(stats1, stats2)  # fixed reduction order
    pre = torch.nn.functional.linear(x, w, b) * params[0]
    var, mean = torch.var_mean(pre, dim=0, correction=1)
    torch.testing.assert_close(stats1, torch.stack([mean, var]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["s01_scale_leaky", "s04_group_silu_vec_silu", "s03_batch_train_gelu_relu",
                                  "reduce_logsumexp_keep", "s18_batch_train_scalar_silu"])
def test_opcheck(name):
    program = PROGRAMS[name]
    x, w, b, params = inputs(program, torch.float32, 8, 256, 64, 0)
    for save_gemm in (True, False):
        torch.library.opcheck(torch.ops.fxfuse.linear_epilogue.default, (program.to_string(), x, w, b, params, save_gemm))


@pytest.mark.parametrize("name", ["s04_group_silu_vec_silu", "s03_batch_train_gelu_relu", "s16_sigmoid_sum"])
def test_cuda_graph_capture_and_replay(name):
    """No host sync, current stream, caching allocator: the op captures into a CUDA graph."""
    program = PROGRAMS[name]
    text = program.to_string()
    x, w, b, params = inputs(program, torch.bfloat16, 64, 4096, 256, 0)
    fxcuda.prepare(program, torch.bfloat16)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            op(text, static_x, w, b, params)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_stats, *_ = op(text, static_x, w, b, params)
    for seed in range(3):
        new_x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 10)).to(x)
        static_x.copy_(new_x)
        graph.replay()
        ref_out, ref_stats = reference.forward(program, new_x, w, b, params)
        torch.testing.assert_close(static_out, ref_out, rtol=1e-2, atol=1e-2)
        if ref_stats.numel():
            torch.testing.assert_close(static_stats, ref_stats, rtol=1e-2, atol=1e-2)


def test_autocast_gemm_runs_in_the_input_dtype():
    """Inside the kernel the GEMM is not re-autocast: the output dtype is x's, as the fake says."""
    program = PROGRAMS["s01_scale_leaky"]
    x, w, b, params = inputs(program, torch.float32, 8, 256, 64, 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, *_ = op(program.to_string(), x, w, b, params)
    assert out.dtype == torch.float32


def test_the_dispatcher_runs_the_runtime_kernel():
    """Once a program is prepared, the op's CUDA dispatch key holds the runtime's C++ kernel (no
    Python per call) and gives the same result as the engine."""
    program = PROGRAMS["s01_scale_leaky"]
    fxcuda.prepare(program, torch.float32)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fxfuse::linear_epilogue", "CUDA")
    x, w, b, params = inputs(program, torch.float32, 8, 256, 64, 0)
    direct, *_ = fxcuda.engine.call(program.to_string(), x, w, b, params)
    dispatched, *_ = op(program.to_string(), x, w, b, params)
    assert torch.equal(direct, dispatched)


def test_unprepared_program_builds_on_first_call():
    program = PROGRAMS["minus_and_negation"]
    x, w, b, params = inputs(program, torch.float16, 4, 128, 32, 0)
    check(program, torch.float16, x, w, b, params)


def test_a_chain_without_an_in_gemm_kernel_is_timed_against_inductor_when_asked():
    """A row reduction has no in-GEMM kernel: the selection times the row path against Inductor's
    kernels for the chain (the default policy asks), and routes nothing (None) where not asked."""
    program = PROGRAMS["reduce_sum_keep"]
    selection = fxcuda.select(program, torch.float32, (torch.float32,), (512, 1024, 256), True,
                              against_inductor=True)
    assert selection.path == "row" and selection.config == -1 and set(selection.times_us) == {"row", "Inductor"}
    assert "cuBLAS + row pass (row); measured (" in selection.describe()
    assert fxcuda.select(program, torch.float32, (torch.float32,), (512, 1024, 256), True) is None


def test_by_default_a_row_reduction_chain_goes_where_it_measured_faster():
    """S15's kind of chain (a sum over the row, pointwise after it) at the default policy: the
    report gives the row pass's and Inductor's measured times whichever way the chain went."""
    import fxfuse

    class RowSum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(512, 2048, bias=False)

        def forward(self, h):
            return (self.proj(h) / 2.0).sum(-1, keepdim=True) * 1.5

    torch.manual_seed(2)
    model = RowSum().to(DEVICE, torch.bfloat16)
    h = torch.randn(1024, 512, device=DEVICE, dtype=torch.bfloat16)
    fxfuse.reset_report()
    torch._dynamo.reset()
    with torch.no_grad():
        out, eager = torch.compile(model, backend="fxfuse")(h), model(h)
    (row,) = fxfuse.last_report().rows
    said = row.path if row.status == "fused" else row.reason
    assert "measured (" in said and "row " in said and "Inductor " in said
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2 * eager.abs().max().item())


ROTARY_LAYOUTS = [("rotary_heads", 4096), ("rotary_between_pointwise", 8192), ("rotary_heads_of_24", 4800),
                  ("rotary_heads_of_24", 24)]


@pytest.mark.parametrize("name,n", ROTARY_LAYOUTS, ids=[f"{name}-{n}" for name, n in ROTARY_LAYOUTS])
def test_a_rotary_embedding_pairs_its_columns_by_lanes_or_through_shared_memory(name, n):
    """Heads of 16 and 64 (whole chunks a head: the partner one lane shuffle away) and of 24 (the
    partner through the row's scratch), over (3, 9) rows reading a table of 9 rows."""
    program = PROGRAMS[name]
    for dtype in dtypes_of(name):
        fxcuda.prepare(program, dtype)
        for seed in range(2):
            check(program, dtype, *inputs(program, dtype, 9, n, 32, seed, layout="3d"))


def test_an_operand_broadcast_along_the_rows_is_expanded_for_the_kernels():
    """A (T, N) residual of a (3, T, K) x (a position embedding): the runtime hands the kernels the
    (3, T, N) expansion, contiguous; each row reads its own position's values."""
    program = PROGRAMS["full_residual_layer"]
    for dtype in (torch.float32, torch.bfloat16):
        fxcuda.prepare(program, dtype)
        x, w, b, (residual, *cols) = inputs(program, dtype, 9, 4096, 32, 0, layout="3d")
        check(program, dtype, x, w, b, [residual[0], *cols])


def test_q_and_k_projections_run_their_rotary_embedding_in_the_row_kernel():
    """transformers' Llama attention in bfloat16 on the GPU: q_proj and k_proj fuse with their
    rotation (cos and sin of (1, T, D), read once a row), and the kernels' result is eager's."""
    import fxfuse

    class Attention(torch.nn.Module):
        def __init__(self, heads=16, d=128):
            super().__init__()
            self.d, hidden = d, heads * d
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(3))
            angles = torch.arange(256).float()[:, None] / (10000 ** (torch.arange(0, d, 2).float() / d))[None]
            emb = torch.cat((angles, angles), dim=-1)[None]
            self.register_buffer("cos", emb.cos())
            self.register_buffer("sin", emb.sin())

        def forward(self, h):
            shape = (*h.shape[:-1], -1, self.d)
            q, k, v = (p(h).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            cos, sin = self.cos.unsqueeze(1).to(h.dtype), self.sin.unsqueeze(1).to(h.dtype)

            def rotate(x):
                half = x.shape[-1] // 2
                return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

            return torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)

    torch.manual_seed(3)
    model = Attention().to(DEVICE, torch.bfloat16).eval()
    h = torch.randn(4, 256, 16 * 128, device=DEVICE, dtype=torch.bfloat16)
    fxfuse.reset_report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="fxfuse", options={"policy": "always"})(h)
        eager = model(h)
    rotated = [r for r in fxfuse.last_report().rows if "rotary(" in (r.program or "")]
    assert len(rotated) == 2 and all(r.status == "fused" and "row" in (r.path or "") for r in rotated), rotated
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_comparisons_and_where_run_in_the_kernels_with_eagers_values_and_gradients(dtype, train):
    """tests/test_comparisons.py's models on the GPU: where, masks against numbers and per-column
    thresholds, masked_fill and the method form fuse in full and their outputs (a NaN row
    included) and gradients are eager's; the unpicked infinite branch leaves no NaN."""
    import test_comparisons as cases
    from support import check_against_eager

    models = [cases.WhereLeaky, cases.MaskMultiplied, cases.WhereMethod]
    if dtype == torch.float32 or not train:  # exp(20 y)' carries 20x the bf16 rounding of y, eager's too
        models.append(cases.WhereOfTwoBranches)
    for model in models:
        report = check_against_eager(model, cases._inputs, dtype=dtype, train=train, grads=train, device=DEVICE)
        (row,) = report.rows
        assert row.status == "fused" and row.path, (model.__name__, row)  # a GPU path, not the reference


def small_group_cases():
    """(group size, dtype, N, program): group norms of up to 32 values in whole 16-byte chunks over
    4096 columns, and S04's (bf16 groups of 32 over 8192 columns) alone and followed by a
    per-column vector (S04's shape of program)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for size in (4, 8, 16, 32):
            if size * dtype.itemsize % 16 == 0:
                yield size, dtype, 4096, _group_norm_program(4096 // size)
    yield 32, torch.bfloat16, 8192, _group_norm_program(256)
    yield 32, torch.bfloat16, 8192, _group_norm_program(256, pw(E.mul(X, p(2))))


def _group_norm_program(groups: int, *after) -> Program:
    norm = Norm("group", 1e-5, groups=groups, weight=0, bias=1)
    return Program(Gemm(True), (norm, *after), ("col", "col") + ("col",) * len(after))


def _small_group_id(size, dtype, n, program) -> str:
    return f"{size}-{str(dtype)[6:]}-{n}" + ("-then-a-vector" if len(program.stages) > 1 else "")


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("group_size,dtype,n,program",
                         [pytest.param(*c, id=_small_group_id(*c)) for c in small_group_cases()])
def test_group_norm_of_small_groups_is_eager_bit_for_bit(group_size, dtype, n, program, rows):
    """Groups of up to 32 values take eager's own Welford tree: the statistics, and so the output,
    are eager's to the bit at any number of rows (in a bf16 chain one flipped statistic can grow
    past 1e-2: S04), also where a pointwise stage follows the norm (here a vector of ones)."""
    for seed in range(DRAWS):
        x, w, b, params = inputs(program, dtype, rows, n, 256, seed)
        x = x * 3 + 1  # an offset mean: the statistics' last bits matter
        params = [*params[:2], *(torch.ones_like(v) for v in params[2:])]
        out, *_ = op(program.to_string(), x, w, b, params)
        y = torch.nn.functional.linear(x, w, b)
        expected = torch.nn.functional.group_norm(y, n // group_size, params[0], params[1], 1e-5)
        assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()


@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_the_row_path_is_eagers_chain_bit_for_bit(rows):
    """The row path's GEMM is ``F.linear``'s call (cuBLAS, the bias in its epilogue) and its kernel
    rounds where eager rounds to eager's bits, on S04 as a bf16 model traces it, at full width and
    depth (a group norm, two sigmoids, three products): the op's saved GEMM output and its output
    are eager's to the bit, at decode and batch sizes alike. A kernel that rounds as eager does but
    lands one op a few ulps off sees the ops after it carry that past the correctness rule."""
    program = S04_TRACED_BF16
    for seed in range(2):
        x, w, b, params = inputs(program, torch.bfloat16, rows, 8192, 8192, seed)
        out, _, gemm, _ = op(program.to_string(), x, w, b, params, save_gemm=True)
        assert torch.equal(gemm, torch.nn.functional.linear(x, w, b))
        expected = reference.op_forward(program, x, w, b, params, False)[0]
        assert torch.equal(out, expected), f"{int((out != expected).sum())} of {out.numel()} elements differ"


def test_autograd_key_runs_in_cpp_and_records_gradients():
    """The runtime serves AutogradCUDA in C++ (a compiled graph's calls need no gradient and run
    no Python); a call that records a backward node still gets the registered backward."""
    program = PROGRAMS["s04_group_silu_vec_silu"]
    fxcuda.prepare(program, torch.float32)
    table = torch._C._dispatch_dump_table("fxfuse::linear_epilogue")
    assert any("AutogradCUDA" in line and "runtime.cpp" in line for line in table.splitlines()), table
    x, w, b, params = inputs(program, torch.float32, 8, 256, 64, 0)
    with torch.no_grad():
        out, *_ = op(program.to_string(), x, w, b, params)
    assert out.grad_fn is None
    for save_gemm in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, *params)]
        out, *_ = op(program.to_string(), *leaves[:3], leaves[3:], save_gemm)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad_out)
        expected_leaves = [t.clone().requires_grad_() for t in (x, w, b, *params)]
        expected_out, _ = reference.forward(program, *expected_leaves[:3], expected_leaves[3:])
        expected = torch.autograd.grad(expected_out, expected_leaves, grad_out)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# -- the generated backward of pointwise and row programs -------------------------------------------------

GRAD_SHAPES = [(7, 1000), (1, 8192), (33, 256), (5, 3), (4096, 1024)]
GRAD_CASES = [pytest.param(*c, id=f"{c[0]}-{str(c[1])[6:]}-{c[2]}x{c[3]}") for c in grad_cases(GRAD_SHAPES)]


@pytest.mark.parametrize("name,dtype,m,n", GRAD_CASES)
def test_backward_kernel_matches_reference(name, dtype, m, n):
    """fxfuse::epilogue_backward through the dispatcher (the runtime's C++ kernel) against the
    reference's autograd on the same CUDA tensors: dY and the column sums of dY and of each
    parameter's gradient."""
    program = PROGRAMS[name]
    text = program.to_string()
    for seed in range(DRAWS):
        g = torch.Generator().manual_seed(seed)
        y = (torch.randn(m, n, generator=g) * 2).to(DEVICE, dtype)
        grad = torch.randn(program.output_shape((m,), n), generator=g).to(DEVICE, program.output_dtype(dtype))
        pdtype = dtype if name in LOW_PRECISION else torch.float32
        params = make_params(program, n, dtype=pdtype, device=DEVICE, generator=g)
        assert fxcuda.engine.backward_kernel(text, grad, y, params) is not None, "the backward kernel did not run"
        got = torch.ops.fxfuse.epilogue_backward(text, grad, y, params)
        tol = TOL[dtype]
        assert_backward_close(program, got, reference.epilogue_backward(program, grad, y, params), tol,
                              col_atol=tol * m ** 0.5, scalar_atol=tol * (m * n) ** 0.5)


def backward_on_device(program, y, grad, params):
    """fxfuse::epilogue_backward through the dispatcher against the reference's autograd on the
    same CUDA tensors (torch's own CUDA kernels), float32."""
    text = program.to_string()
    y, grad = y.to(DEVICE), grad.to(DEVICE)
    params = [p.to(DEVICE) for p in params]
    assert fxcuda.engine.backward_kernel(text, grad, y, params) is not None, "the backward kernel did not run"
    got = torch.ops.fxfuse.epilogue_backward(text, grad, y, params)
    m = y.numel() // y.shape[-1]
    assert_backward_close(program, got, reference.epilogue_backward(program, grad, y, params), 1e-4,
                          col_atol=1e-4 * m, scalar_atol=1e-4 * y.numel())


@pytest.mark.parametrize("name", REDUCTION_EDGES)
def test_reduction_backward_kernel_at_ties_nan_and_inf(name):
    """Rows of small integers, where max and min tie, and rows holding NaN, +inf, -inf, only -inf
    or only zeros: the gradients are eager's on the device, NaN where eager's are."""
    backward_on_device(PROGRAMS[name], *reduction_edges(PROGRAMS[name]))


@pytest.mark.parametrize("name", ZERO_ROW_NORMS)
def test_rows_of_zeros_take_eagers_gradient_whatever_reaches_the_norm(name):
    """A row of zeros: eager's CUDA norm backward masks the row by a product (a finite gradient
    gives 0, an infinite or NaN one NaN; F.normalize at eps 0 gives NaN), std's by a fill."""
    backward_on_device(PROGRAMS[name], *rows_of_zeros(PROGRAMS[name]))


GRADIENT_PROGRAMS = ["s01_scale_leaky", "s14_silu_div_clamp_tanh", "scalar_param_pow", "vocabulary_2",
                     "s04_group_silu_vec_silu", "s20_layer_silu", "s21_rms_silu", "widen_s08_silu_vec_group",
                     "widen_s20_layer_silu", "s05_logsumexp_chain", "s11_gelu_softmax", "s15_div_sum_mul",
                     "widen_s11_gelu_softmax", "reduce_max_first_drop", "reduce_min_keep", "s05_traced_bf16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", GRADIENT_PROGRAMS)
def test_fused_op_gradients_equal_eager(name, dtype, monkeypatch):
    """The fused op's backward (generated kernel, then the GEMMs) against eager autograd through
    the reference: x, weight, bias and every parameter."""
    monkeypatch.setenv("FXFUSE_GENERATED_BACKWARD", "1")
    program = PROGRAMS[name]
    text = program.to_string()
    n = 1024 if row_split(program) else 1000  # 1024: whole 16-byte chunks a group
    x, w, b, params = inputs(program, dtype, 64, n, 96, 0)
    leaves = [t.detach().requires_grad_() for t in (x, w, b, *params) if t is not None]
    out, *_ = torch.ops.fxfuse.linear_epilogue(text, *leaves[:2], leaves[2] if b is not None else None,
                                               leaves[3 if b is not None else 2:], True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.detach().requires_grad_() for t in leaves]
    ref_out, _ = reference.forward(program, *ref_leaves[:2], ref_leaves[2] if b is not None else None,
                                   ref_leaves[3 if b is not None else 2:])
    want = torch.autograd.grad(ref_out, ref_leaves, grad)
    tol = TOL[dtype]
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.shape == e.shape
        scale = e.float().norm().item() / max(1, e.numel()) ** 0.5 + 1e-6
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol * scale * 10)


def test_backward_opcheck_and_cuda_graph():
    program = PROGRAMS["s14_silu_div_clamp_tanh"]
    text = program.to_string()
    fxcuda.prepare(program, torch.bfloat16)
    y = torch.randn(64, 4096, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn_like(y)
    torch.library.opcheck(torch.ops.fxfuse.epilogue_backward.default, (text, grad, y, []))
    static_grad = grad.clone()
    torch.ops.fxfuse.epilogue_backward(text, static_grad, y, [])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_dy, static_sums = torch.ops.fxfuse.epilogue_backward(text, static_grad, y, [])
    for seed in range(2):
        static_grad.copy_(torch.randn(grad.shape, generator=torch.Generator().manual_seed(seed)).to(grad))
        graph.replay()
        ref_dy, ref_sums = reference.epilogue_backward(program, static_grad, y, [])
        torch.testing.assert_close(static_dy.float(), ref_dy.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(static_sums, ref_sums, rtol=1e-2, atol=0.1)
