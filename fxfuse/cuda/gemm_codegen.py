"""Program -> CUDA sources of one GEMM module (the in-GEMM back end: csrc/gemm_epilogue.cuh and the
stage headers it includes).

The program's epilogue becomes a CUTLASS epilogue visitor tree over typed stages: the accumulator
(``fxg::Acc``), the bias and column parameters (``fxg::Col``), operands of the output's shape
(``fxg::Full``: a residual, a gate, loaded by TMA ahead of their subtile), scalar parameters
(``fxg::Scalar``) and one ``fxg::Pointwise`` node whose functor is the program's pointwise stages
composed into one expression, printed by the same printer as the row kernels' (``print_expr``,
the device functions of csrc/epilogue_ops.cuh). The numerics are the correctness rule's, not
eager's rounding: the expression runs in float32 on the float32 accumulator (the bias added
there), the rounding points a bfloat16/float16 chain carries are dropped, and the result is
rounded once, at the store. A norm of fixed statistics (an eval-mode batch norm: running mean and
variance, weight and bias per column) is one more pointwise stage of that expression.

A program that reduces each row to one value (sum, mean, max, min, logsumexp; scalars after it)
ends its tree in an ``fxg::RowReduce`` node: the kernel stores no D but per (row, N-tile)
partials, and ``fxg::finalize_rows`` combines them and runs the stages after the reduction
(``RowFinalize``, printed as a group norm's ``Post`` is) into the (M,) or (M, 1) output.

A training batch norm's tree ends in an ``fxg::ColumnMoments`` node: the kernel stores the norm's
input (D, as its standardized deviation in each 16-row strip) and per (strip, column) moments of it,
``fxg::finalize_columns`` merges them into the batch statistics and a scale per column (with the
norm's weight and bias: ``Affine``) and ``fxg::normalize_columns`` normalises D in place with each
strip's scale and shift and runs the stages after the norm (``After``).

A norm or row map over the whole row (LayerNorm, RMSNorm, softmax, log_softmax, F.normalize:
wider than any tile) ends its tree in an ``fxg::RowStatistics`` node: the kernel stores the map's input (as the
statistic needs it: a LayerNorm's standardized deviation in each 64-column subtile, a softmax's
value less the subtile's max) and per (row, subtile) partials, and ``fxg::normalize_rows``, a
block a row, merges them and maps the row in place, then the norm's weight and bias (``Affine``)
and the stages after the map (``After``).

A program with a second GEMM (a gated MLP: ``silu(x @ Wg.T) * (x @ Wu.T)``) gets two trees in its
module, measured against each other by the selection: ``Prog`` reads the second GEMM's output
(computed by cuBLAS in the runtime) as an operand of the output's shape; ``GatedProg`` is one GEMM
over the two weights interleaved in blocks of 32 rows, its tree an ``fxg::Gated`` node that
combines each gate column with the matching up column (the expression, with the up value as its
"gemm" parameter) and stores the (M, N) output; the runtime keeps the interleaved weight per pair.

A module is built per (program, dtype, parameter dtypes): the tree's leaves read each parameter in
its own type. One unit per kernel of the menu the module is generated with (``menu``: ``KERNELS``,
and for pointwise and in-tile group norm trees the swapped kernel for few rows; declared as
``fxg::Menu``), so that ninja compiles them in parallel. The tree is a template over the GEMM's
Frame, so the swapped kernel (out^T = weight . x^T) instantiates the same tree with transposed
leaves and ``fxg::SwappedGroupNorm`` (``fxg::GroupNormFor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .. import expr as E
from ..ir import Norm, Pointwise, Program, Reduce, Widen
from ..vocabulary import ROUNDING
from ..patterns.norms import FAMILY as NORMS
from ..patterns.reductions import FAMILY as REDUCTIONS
from .codegen import OUT_KINDS, PARAM_KINDS, UnsupportedProgram
from .printer import UnsupportedExpression, float_literal, print_expr

GEMM_CODEGEN_VERSION = "10"


@dataclass(frozen=True)
class Kernel:
    """One GEMM kernel of a module's menu (csrc/gemm_epilogue.cuh's fxg::Config): the CTA tile (its
    K for 16-bit elements; 32-bit ones take half), the cluster, the schedule, and whether it and
    the kernels after it are launched as programmatic dependents (``pdl``: each may start while the
    kernel before it drains; csrc/gemm_launch.cuh). Each runs under the tile orders of
    fxg::kSchedules, chosen at launch. A ``swapped`` kernel (fxg::Swapped, for few rows) computes
    out^T = weight . x^T: its tile_m runs along the output's columns, its tile_n along x's rows;
    one CTA a tile, no cluster, no tile orders."""

    tile_m: int
    tile_n: int
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    pingpong: bool = False
    pdl: bool = False
    swapped: bool = False

    @property
    def rows(self) -> str:
        """The calls it is built for (``rows_served``): a swapped kernel those of up to its tile's
        width of rows (and more than the next narrower one's), the others many rows."""
        return f"up to {self.tile_n} rows" if self.swapped else MANY

    @property
    def cpp(self) -> str:
        if self.swapped:
            return f"fxg::Swapped<{self.tile_m}, {self.tile_n}, {self.tile_k}>"
        pdl = ", true" if self.pdl else ""  # the default keeps the other kernels' text, and so module keys
        return (f"fxg::Config<{self.tile_m}, {self.tile_n}, {self.tile_k}, {self.cluster_m}, {self.cluster_n}, "
                f"{'true' if self.pingpong else 'false'}{pdl}>")


SCHEDULES = 6  # fxg::kNumSchedules: a kernel's configurations in a module (its tile orders)

# The kernels every GEMM module compiles, one unit each, chosen by `bench/gemm_configs.py --kernels
# wide` (BENCHMARKS.md sections 9 and 24). The cooperative 256x128 and 128x256 tiles with a 2x1
# cluster come nearest cuBLAS at K = 8192 (1.05x; the first at M = 1024, the second at M = 4096);
# ping-pong, which overlaps one warp group's epilogue with the other's mainloop, beats cuBLAS at
# K = 1024 (0.96x); 128x128 with a 1x2 cluster serves shapes with few large tiles (S16).
KERNELS = (Kernel(128, 256, cluster_m=2), Kernel(256, 128, cluster_m=2), Kernel(128, 128, cluster_m=2, pingpong=True),
           Kernel(128, 128, cluster_n=2))

# The kernels for few rows (decode), narrowest first: the weight's rows along a 64-row tile, x's
# rows along 16, 32 or 64 columns of it, 128 tiles over N = 8192 on 132 SMs. A module whose epilogue
# is pointwise or an in-tile group norm carries, for calls of few rows, the narrowest that holds
# them: a wider one computes padding, a narrower one reads the weight once per tile over the rows.
# At 1 and 16 rows of 8192 -> 8192 the 16-wide tile ran the bare GEMM at 0.98x cuBLAS, where
# KERNELS took 1.7-2.0x (BENCHMARKS.md sections 30 and 37). On S04 (section 38, x F.linear): at 16
# rows the 16-wide 1.02, the 32-wide 1.05; at 24 and 32 rows the 32-wide 1.04, the 16-wide 1.89; at
# 64 rows the 64-wide 1.06, the 32-wide 1.85; the row pass 1.15-1.16 at each.
FEW_ROWS_KERNELS = (Kernel(64, 16, 128, swapped=True), Kernel(64, 32, 128, swapped=True),
                    Kernel(64, 64, 128, swapped=True))

# The kernel for few rows where no swapped kernel takes the epilogue (a reduction, a norm over the
# row, a gated pair, a training BatchNorm): one of KERNELS, for the selection to measure against the
# row path, not all four to compile. Their 128-row tiles ran 1.7-2.0x F.linear at 16 rows
# (BENCHMARKS.md sections 30 and 37) where the row pass ran 1.15x (section 38); this one's cluster
# lies along N, where one tile of rows leaves half of a cluster along M without rows.
FEW_ROWS_TREE = Kernel(128, 128, cluster_n=2)


# Which calls a GEMM module serves, by their rows: those of each kernel for few rows (Kernel.rows),
# or many; a module met by calls of several kinds carries the kernels of each
MANY = "many rows"
ANY_ROWS = frozenset({MANY, *(kernel.rows for kernel in FEW_ROWS_KERNELS)})


def rows_served(rows: int | None) -> frozenset[str]:
    """The calls a module built for calls of ``rows`` rows (None: any) must serve: those of the
    narrowest kernel for few rows whose tile holds them, or many rows."""
    if rows is None:
        return ANY_ROWS
    holding = [kernel for kernel in FEW_ROWS_KERNELS if rows <= kernel.tile_n]
    return frozenset({holding[0].rows if holding else MANY})


def timed_for(kernels: tuple[Kernel, ...], rows: int) -> tuple[Kernel, ...]:
    """Of a module's ``kernels``, those the selection times for calls of ``rows`` rows: the ones
    built for such calls, or all where none is (a menu without a kernel for few rows serves them
    with the others). A module grown for several kinds of call (an LLM's prefill and decode) so
    does not time a swapped kernel at 1024 rows (15x the others) nor the others at 16 (1.7-2x)."""
    served = rows_served(rows)
    return tuple(kernel for kernel in kernels if kernel.rows in served) or tuple(kernels)


def swaps(program: Program) -> bool:
    """Whether a swapped kernel takes ``program``'s epilogue: pointwise stages and at most a group
    norm of groups inside a tile, one GEMM, no reduction."""
    epilogue = Epilogue.of(program)
    in_tile = epilogue.norm is None or NORMS[epilogue.norm.kind].statistics == "row group"
    return in_tile and epilogue.reduce is None and not program.second_gemms


def menu(program: Program, served: frozenset[str] = ANY_ROWS) -> tuple[Kernel, ...]:
    """The kernels of ``program``'s module for the calls it ``served`` (``rows_served``): KERNELS
    for many rows; for few rows, where its epilogue is pointwise or a group norm of groups inside
    a tile (one GEMM, no reduction), the swapped kernel for them, last. Its epilogue reads the
    accumulators transposed (csrc/gemm_stages.cuh: its leaves follow, and fxg::SwappedGroupNorm
    sums a group along the tile's rows; the other register nodes do not). A module for few rows
    alone carries that kernel alone: KERNELS' 128-row tiles run 1.7-2.0x ``F.linear`` there, and
    each unit costs the cold compile (four programs on 16 cores: 114 s with KERNELS, 151 s with a
    swapped kernel more; BENCHMARKS.md section 37). Other programs get KERNELS for many rows, and
    for few rows alone FEW_ROWS_TREE."""
    if not swaps(program):
        return KERNELS if MANY in served else (FEW_ROWS_TREE,)
    return (KERNELS if MANY in served else ()) + tuple(kernel for kernel in FEW_ROWS_KERNELS if kernel.rows in served)


# csrc/fx_abi.h's FxDtype of each element type the in-GEMM path takes: for x and weight (float32 as
# TF32, while torch allows it), the output and the parameters (others reach the kernels as float32)
FX_DTYPES = {torch.bfloat16: "FX_BF16", torch.float16: "FX_F16", torch.float32: "FX_F32"}
_ELEMENTS = {"FX_F32": "float", "FX_BF16": "cutlass::bfloat16_t", "FX_F16": "cutlass::half_t"}

# fxg::GroupNorm's epilogue subtile: groups of 8, 16, 32 or 64 columns lie inside it
GROUP_NORM_SUBTILE = 64
# fxg::Gated's: 32 gate columns, then the 32 up columns of the same output columns
GATED_SUBTILE = 64
# fxg::RowReduce's: the layout it folds a thread's values by is checked for 64 columns
ROW_REDUCE_SUBTILE = 64
# fxg::ColumnMoments': a warp's lanes end with one 8-column block each, and write 64 adjacent columns
COLUMN_MOMENTS_SUBTILE = 64
# fxg::RowStatistics': a (row, subtile)'s statistics are one partial of the row's
ROW_STATISTICS_SUBTILE = 64


@dataclass(frozen=True)
class Epilogue:
    """A program as the in-GEMM epilogue computes it: float32 expressions without rounding points
    before and after an optional norm, row reduction or row map (``post`` is ``x`` without one)."""

    pre: sympy.Expr
    norm: Norm | None
    post: sympy.Expr
    reduce: Reduce | None = None

    @staticmethod
    def of(program: Program) -> "Epilogue":
        segments, bounds = _composed(epilogue_stages(program))
        norm = next((s for s in reversed(bounds) if isinstance(s, Norm)), None)
        reduce = next((s for s in reversed(bounds) if isinstance(s, Reduce)), None)
        return Epilogue(segments[0], norm, segments[-1] if bounds else E.X, reduce)

    @property
    def row_statistic(self) -> str | None:
        """The fxg::RowStatistic of a norm or row map over the whole row (a LayerNorm, an RMSNorm,
        a softmax, a log_softmax, F.normalize: statistics per (row, subtile) in the epilogue, a
        pass after the GEMM), else None."""
        if self.norm is not None:
            return NORMS[self.norm.kind].row_statistic
        if self.reduce is not None and not self.reduces_rows:
            return REDUCTIONS[self.reduce.kind].in_gemm
        return None

    @property
    def eps(self) -> float:
        """The norm's eps, or a row map's (F.normalize's); 0 for those without one."""
        if self.norm is not None:
            return self.norm.eps
        return (self.reduce.eps if self.reduce is not None else None) or 0.0

    @property
    def reduces_rows(self) -> bool:
        """A reduction to one value a row (fxg::RowReduce: the M x N output is never written)."""
        return self.reduce is not None and REDUCTIONS[self.reduce.kind].changes_shape

    def affine_post(self) -> sympy.Expr:
        """What follows the normalized value: the norm's weight and bias, then the stages after it."""
        x = E.X
        if self.norm.weight is not None:
            x = E.mul(x, E.param(self.norm.weight))
        if self.norm.bias is not None:
            x = E.add(x, E.param(self.norm.bias))
        return E.substitute(self.post, {E.X: x})


def _composed(stages) -> tuple[list[sympy.Expr], list]:
    """The pointwise stages between consecutive norms and reductions composed into one expression
    each, eager's rounding points dropped: the expressions (one more than the bounds) and the
    norms and reductions between them (other stages, a Widen, are left out)."""
    rounding = set(ROUNDING.values())
    segments, bounds = [E.X], []
    for stage in stages:
        if isinstance(stage, Pointwise):
            segments[-1] = E.substitute(stage.expr, {E.X: segments[-1]})
        elif isinstance(stage, (Norm, Reduce)):
            bounds.append(stage)
            segments.append(E.X)
    return [E.without_calls(segment, rounding) for segment in segments], bounds


def epilogue_stages(program: Program) -> tuple:
    """The program's stages as the epilogue composes them: a norm of fixed statistics (an eval-mode
    batch norm) becomes the pointwise stage it is."""
    def composed(stage):
        expr = NORMS[stage.kind].as_pointwise(stage) if isinstance(stage, Norm) else None
        return stage if expr is None else Pointwise(expr)

    return tuple(composed(stage) for stage in program.stages)


def group_size(norm: Norm, n: int) -> int | None:
    """Columns of a group of ``norm`` at N = ``n`` where the in-GEMM group norm takes it, else None."""
    if n % norm.groups:
        return None
    size = n // norm.groups
    return size if size % 8 == 0 and GROUP_NORM_SUBTILE % size == 0 else None


def unsupported_reason(program: Program, dtype: torch.dtype) -> str | None:
    """Why the in-GEMM path cannot take ``program``'s calls on ``dtype`` inputs now (None: it can;
    a group norm's group size is checked per call, by the module): no module can be built for it
    (build_reason), or a float32 GEMM while torch does not allow TF32 (setting_reason)."""
    return build_reason(program, dtype) or setting_reason(dtype)


def setting_reason(dtype: torch.dtype) -> str | None:
    """Why the process's settings keep ``dtype``'s GEMMs off the in-GEMM path now (None: they do
    not): a float32 GEMM is TF32 there, and torch does not allow TF32."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return ("a float32 GEMM is TF32 in the in-GEMM path, and torch.backends.cuda.matmul.allow_tf32 "
                "is off: cuBLAS computes it in float32")
    return None


def build_reason(program: Program, dtype: torch.dtype) -> str | None:
    """Why no GEMM module can be generated for ``program`` on ``dtype`` inputs (None: one can).
    Whatever the process's TF32 setting: a float32 module is TF32 by construction, and a build
    worker, which starts with torch's defaults (TF32 off), must generate and key the module its
    parent asked for (it failed them, and the parent built each again alone)."""
    if dtype not in FX_DTYPES:
        return f"the in-GEMM path takes bfloat16, float16 and (as TF32) float32 GEMMs, not {dtype}"
    if program.steps:
        return (f"{', '.join(program.steps)} of the GEMM output: a step turns the float32 accumulator's "
                "last-bit difference from eager's rounded output into a jump, so the row pass takes it")
    stages = epilogue_stages(program)
    norms = [s for s in stages if isinstance(s, Norm)]
    reductions = [s for s in stages if isinstance(s, Reduce)]
    for stage in stages:
        if not isinstance(stage, (Pointwise, Widen, Norm, Reduce)):
            return f"{type(stage).__name__.lower()} stages are not in the in-GEMM epilogue yet"
    for norm in norms:
        if (reason := NORMS[norm.kind].not_in_gemm(norm)) is not None:
            return reason
    outside = sorted({r.kind for r in reductions if not REDUCTIONS[r.kind].in_gemm})
    if outside:
        return f"{', '.join(outside)} reductions are not in the in-GEMM epilogue yet"
    if len(norms) + len(reductions) > 1:
        return "more than one norm or reduction in a chain is not in the in-GEMM epilogue yet"
    if reductions and program.second_gemms:
        return "a reduction after a gated pair of GEMMs is not in the in-GEMM epilogue yet"
    if any(kind not in ("col", "scalar", "full") for kind in program.operand_kinds):
        return f"{', '.join(sorted(set(program.operand_kinds) - {'col', 'scalar', 'full'}))} parameters are not in the in-GEMM epilogue"
    epilogue = Epilogue.of(program)
    try:
        print_expr(epilogue.pre)
        if epilogue.norm is not None:
            after = print_expr(epilogue.affine_post())
            if any(program.operand_kinds[i] == "full" for i in after.params):
                return (f"an operand of the output's shape after the {epilogue.norm.kind} norm is not in the "
                        "in-GEMM epilogue yet")
        if epilogue.reduces_rows:
            after = print_expr(epilogue.post)
            if any(program.params[i] != "scalar" for i in after.params):
                return "only scalars are read after a row reduction in the in-GEMM epilogue"
        elif epilogue.reduce is not None:
            after = print_expr(epilogue.post)
            if any(program.operand_kinds[i] == "full" for i in after.params):
                return (f"an operand of the output's shape after the {epilogue.reduce.kind} is not in the "
                        "in-GEMM epilogue yet")
    except UnsupportedExpression as error:
        return str(error)
    return None


def gated_unsupported_reason(program: Program) -> str | None:
    """Why the kernel that runs a program's second GEMM itself (``fxg::Gated``) cannot take it
    (None: it can); the module's other kernels still read that GEMM's cuBLAS output."""
    if len(program.second_gemms) != 1:
        return "the gated kernel runs one second GEMM"
    if any(isinstance(s, Norm) for s in epilogue_stages(program)):
        return "a norm after a gated pair of GEMMs is not in the gated kernel yet"
    if "full" in program.params:
        return "an operand of the output's shape beside a second GEMM is not in the gated kernel yet"
    return None


def kernel_param_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter reaches the kernels in (the runtime widens others to float32)."""
    return dtype if dtype in FX_DTYPES else torch.float32


def canonical(program: Program) -> Program:
    """The program as the in-GEMM kernel computes it: its pointwise stages composed without
    rounding points between its norms and reductions (then a Widen where the chain widens).
    Programs that differ only where eager rounds share one GEMM module: it names the module and
    keys its build. Norms stay stages even where the epilogue composes them (``epilogue_stages``):
    the module's facts (``Program.channels_dim1``) follow from them."""
    segments, bounds = _composed(program.stages)
    stages: list = [Pointwise(segments[0])]
    for bound, segment in zip(bounds, segments[1:]):
        stages += [bound, Pointwise(segment)]
    return Program(program.gemm, tuple(stages) + ((Widen(),) if program.widens else ()), program.params)


def generate(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...], namespace: str,
             entry: str, kernels: tuple[Kernel, ...] | None = None, files: int | None = None) -> dict[str, str]:
    """The sources of one GEMM module: file name -> text (``gemm_program.cuh``, ``main.cu`` with
    the exported ``entry`` returning the module's FxGemmInfo, and the units: ``config_<i>.cu`` per
    kernel of the menu (``kernels``, the program's ``menu`` unless given), and for a program with a
    second GEMM ``gated_<i>.cu`` per kernel running it in the kernel beside those reading its
    cuBLAS output). With ``files`` fewer than the units, the units are compiled as about that
    many files (``units_<j>.cu``, ``grouped_units``): the cores a build has, where they are fewer
    than its kernels."""
    reason = build_reason(program, dtype)
    if reason is not None:
        raise UnsupportedProgram(reason)
    kernels = tuple(kernels or menu(program))
    if any(kernel.swapped for kernel in kernels) and not swaps(program):
        raise UnsupportedProgram("a swapped kernel's epilogue is pointwise or an in-tile group norm, and this "
                                 "program's is not")
    if len(param_dtypes) != len(program.params):
        raise UnsupportedProgram(f"{len(param_dtypes)} parameter dtypes for {len(program.params)} parameters")
    header = f"// fxfuse GEMM module (gemm codegen {GEMM_CODEGEN_VERSION}), {dtype}"
    sources = {"gemm_program.cuh": _program_header(program, dtype, param_dtypes, namespace, kernels)}
    gated = bool(program.second_gemms) and gated_unsupported_reason(program) is None
    # (file, tree, unit name, kernel index)
    units = [(f"config_{i}", "Prog", str(i), i) for i in range(len(kernels))]
    if gated:
        units += [(f"gated_{i}", "GatedProg", f"gated_{i}", i) for i in range(len(kernels))]

    def unit_file(*lines: str, pdl: bool = False) -> str:
        # CUTLASS's kernels wait for and release their neighbours in the stream only where this is
        # defined before its headers (gemm_launch.cuh)
        gdc = ["#define CUTLASS_ENABLE_GDC_FOR_SM90"] if pdl else []
        return "\n".join([header, *gdc, '#include "gemm_program.cuh"', "", f"namespace {namespace} {{", *lines,
                          f"}}  // namespace {namespace}", ""])

    sources["main.cu"] = unit_file(
        *[f"FX_DECLARE_GEMM_UNIT({name})" for _, _, name, _ in units],
        f"const fxg::Unit kUnits[] = {{{', '.join(f'FX_GEMM_UNIT({name})' for _, _, name, _ in units)}}};",
        f"FX_DEFINE_GEMM_INFO(Prog, {entry}, {'GatedProg::kGatedBlock' if gated else 0})")
    groups = grouped_units([(prog, kernels[index].swapped, kernels[index].pdl) for _, prog, _, index in units], files)
    for j, group in enumerate(groups):
        file = units[group[0]][0] if len(group) == 1 else f"units_{j}"
        sources[f"{file}.cu"] = unit_file(*(f"FX_DEFINE_GEMM_UNIT({prog}, Menu::At<{index}>, {name})"
                                            for _, prog, name, index in (units[u] for u in group)),
                                          pdl=kernels[units[group[0]][3]].pdl)
    return sources


UNITS_PER_FILE = 4  # four kernels in one file compiled in 5.3 GB of memory, seven in 8.3 GB


def grouped_units(kinds: list[tuple], files: int | None) -> list[list[int]]:
    """The units (each its kind: tree, swapped, PDL; in menu order) as about ``files`` groups of
    consecutive units of one kind (None, or as many files as units: a unit each), a file each. A
    CUTLASS unit's compile is mostly parsing: on one core S01's first kernel compiled in 25-33 s,
    its first four kernels in one file in 44 s, its three swapped ones in 42 s, all seven in 81 s
    (8 GB). So where a build has fewer cores than units, a file per core takes less time and about
    half the work of a unit at a time. Kernels of one kind share the most templates; a PDL kernel's
    file stays apart in any case (it defines CUTLASS_ENABLE_GDC_FOR_SM90 first); no file holds more
    than UNITS_PER_FILE (the compiler's memory grows with them)."""
    if files is None or files >= len(kinds):
        return [[u] for u in range(len(kinds))]
    runs: list[list[int]] = []  # maximal runs of units of one kind
    for u, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1].append(u)
        else:
            runs.append([u])
    groups = []
    for run in runs:
        count = min(len(run), max(1, round(files * len(run) / len(kinds)), -(-len(run) // UNITS_PER_FILE)))
        size, extra = divmod(len(run), count)
        start = 0
        for g in range(count):
            end = start + size + (g < extra)
            groups.append(run[start:end])
            start = end
    return groups


def _program_header(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...],
                    namespace: str, kernels: tuple[Kernel, ...]) -> str:
    epilogue = Epilogue.of(program)
    printed = print_expr(epilogue.pre, x_name="x", prefix="t")
    used = sorted(printed.params)
    element = _ELEMENTS[FX_DTYPES[dtype]]
    out_code = FX_DTYPES[program.output_dtype(dtype)]
    codes = [FX_DTYPES[kernel_param_dtype(d)] for d in param_dtypes]
    kinds = [PARAM_KINDS[kind] for kind in program.params]
    statistics = None if epilogue.norm is None else NORMS[epilogue.norm.kind].statistics
    group, batch = statistics == "row group", statistics == "column"  # an in-tile group norm, a training batch norm
    row_map = epilogue.row_statistic  # a norm or softmax over the row

    # the tree's inputs after the accumulator: the bias, then each parameter the expression reads
    leaves, leaf_args, names = [], [], []
    if program.gemm.bias:
        leaves.append("fxg::Col<Frame, Element>")
        leaf_args.append("fxg::col_args<fxg::Col<Frame, Element>>(a.bias)")
        names.append("bias")
    for index in used:
        leaf_type = _ELEMENTS[codes[index]]
        if program.params[index] == "col":
            leaves.append(f"fxg::Col<Frame, {leaf_type}>")
            leaf_args.append(f"fxg::col_args<fxg::Col<Frame, {leaf_type}>>(a.params[{index}].ptr)")
        elif program.operand_kinds[index] == "full":
            leaves.append(f"fxg::Full<Frame, {leaf_type}>")
            leaf_args.append(f"fxg::full_args<fxg::Full<Frame, {leaf_type}>>(a.params[{index}].ptr, a.m, a.n)")
        else:
            leaves.append(f"fxg::Scalar<{leaf_type}>")
            leaf_args.append(f"fxg::scalar_args<{leaf_type}>(a.params[{index}].ptr)")
        names.append(f"p{index}")
    inputs = ", ".join(["A const& acc"] + [f"A const& in_{name}" for name in names])
    x_value = "acc[e] + in_bias[e]" if program.gemm.bias else "acc[e]"
    comment = program.to_string().replace("*/", "* /")
    chain_out = "Out" if epilogue.norm is None and epilogue.reduce is None else "float"
    chain = f"fxg::Tree<fxg::Pointwise<Chain, {chain_out}>, {', '.join(['fxg::Acc'] + leaves)}>"
    chain_args = f"{{{', '.join(['fxg::acc_args()'] + leaf_args + ['{}'])}}}"
    reduce_kind = "-1"
    if epilogue.reduces_rows:
        reduce_kind = REDUCTIONS[epilogue.reduce.kind].in_gemm
        post = _column_struct("RowFinalize", "after the row reduction: its result through the stages after it",
                              print_expr(epilogue.post, x_name="x", prefix="u"), codes, program.params, ["x"], [])
        tree = f"fxg::Tree<fxg::RowReduce<Frame, {reduce_kind}, {ROW_REDUCE_SUBTILE}>, {chain}>"
        tree_args = f"{{{chain_args}, {{partials, a.m, a.n}}}}"
        subtile = ROW_REDUCE_SUBTILE
    elif epilogue.norm is None and row_map is None:
        post, tree, tree_args, subtile = [], chain, chain_args, 0
    elif batch or row_map is not None:  # partials in the epilogue, then a pass: the weight, bias and After
        post = _column_struct("After", "after the norm or row map: the stages after it",
                              print_expr(epilogue.post, x_name="x", prefix="u"), codes, program.params, ["x"], [])
        post += _affine_struct(epilogue.norm, codes)
        node, subtile = ((f"fxg::ColumnMoments<{COLUMN_MOMENTS_SUBTILE}>", COLUMN_MOMENTS_SUBTILE) if batch else
                         (f"fxg::RowStatistics<{ROW_STATISTICS_SUBTILE}, {row_map}>", ROW_STATISTICS_SUBTILE))
        tree = f"fxg::Tree<{node}, {chain}>"
        tree_args = f"{{{chain_args}, {{partials, a.m, a.n}}}}"
    else:  # a group norm inside the subtile
        post = _post_struct(epilogue, codes, program.params)
        tree = f"fxg::Tree<fxg::GroupNormFor<Frame, Post, {GROUP_NORM_SUBTILE}>, {chain}>"
        tree_args = (f"{{{chain_args}, {{static_cast<int32_t>(a.n / kGroups), {float(epilogue.norm.eps)!r}f, "
                     f"Post::args(a)}}}}")
        subtile = GROUP_NORM_SUBTILE
    supports = "n % 8 == 0 && k % 8 == 0"
    if group:
        supports += (f" && n % kGroups == 0 && (n / kGroups) % 8 == 0 && {GROUP_NORM_SUBTILE} % (n / kGroups) == 0")
    if row_map is not None:
        supports += " && n <= fxg::kRowStatisticsMaxN"
    facts = [
        f"  using Element = {element};",
        f"  using Out = {_ELEMENTS[out_code]};",
        f"  static constexpr int32_t kDtype = {FX_DTYPES[dtype]};",
        f"  static constexpr int32_t kOutDtype = {out_code};",
        f"  static constexpr int32_t kOutKind = {OUT_KINDS[epilogue.reduce.keepdim if epilogue.reduces_rows else None]};",
        f"  static constexpr int32_t kNumParams = {len(program.params)};",
        f"  static constexpr int32_t kParamKinds[{max(1, len(codes))}] = {{{', '.join(kinds) or 'FX_PARAM_SCALAR'}}};",
        f"  static constexpr int32_t kParamDtypes[{max(1, len(codes))}] = {{{', '.join(codes) or 'FX_F32'}}};",
        f"  static constexpr bool kChannelsDim1 = {'true' if program.channels_dim1 else 'false'};",
        f"  static constexpr bool kBatchTrain = {'true' if batch else 'false'};",
        f"  static constexpr int kRowStatistic = {row_map or -1};",
        *([f"  static constexpr float kNormEps = {float_literal(epilogue.eps)};",
           "  using NormAffine = Affine;", "  using NormPost = After;"] if batch or row_map else []),
        *([f"  static constexpr int64_t kGroups = {epilogue.norm.groups};"] if group else []),
        "",
        "  // 16-byte rows for TMA (x, weight, out) and for the column inputs' vector loads"
        + ("; groups inside the norm's subtile" if group else ""),
        f"  static bool supports(int64_t n, int64_t k) {{ return {supports}; }}",
    ]
    progs = _prog_struct("Prog", facts, tree, tree_args, subtile, 0, reduce_kind)
    if program.second_gemms and gated_unsupported_reason(program) is None:  # both GEMMs in one kernel
        post += _gate_struct(epilogue, codes, program.params, program.gemm.bias, element)
        progs += _prog_struct("GatedProg", facts, f"fxg::Tree<fxg::Gated<Gate, {GATED_SUBTILE}, Out>, fxg::Acc>",
                              "{fxg::acc_args(), {static_cast<Out*>(a.out), a.m, a.n, Gate::args(a)}}",
                              GATED_SUBTILE, GATED_SUBTILE // 2, "-1")
    return "\n".join([
        f"// fxfuse GEMM program (gemm codegen {GEMM_CODEGEN_VERSION}), {dtype}",
        f"/* {comment} */",
        "#pragma once",
        '#include "gemm_epilogue.cuh"',
        "",
        f"namespace {namespace} {{",
        "",
        "// the module's kernels, one unit each",
        f"using Menu = fxg::Menu<{', '.join(kernel.cpp for kernel in kernels)}>;",
        "",
        "// the program's pointwise stages on float32 fragments of the accumulator and its inputs",
        "template <class A>",
        "struct Chain {",
        f"  CUTLASS_DEVICE A operator()({inputs}) const {{",
        "    A out;",
        "    CUTLASS_PRAGMA_UNROLL",
        "    for (int e = 0; e < A::kElements; ++e) {",
        f"      const float x = {x_value};",
        *[f"      const float p{i} = in_p{i}[e];" for i in used],
        *["      " + line for line in printed.lines],
        f"      out[e] = {printed.result};",
        "    }",
        "    return out;",
        "  }",
        "};",
        "",
        *post,
        *progs,
        f"}}  // namespace {namespace}",
        "",
    ])


def _prog_struct(name: str, facts: list[str], tree: str, tree_args: str, subtile: int, gated_block: int,
                 reduce_kind: str) -> list[str]:
    """One Prog of csrc/gemm_epilogue.cuh's GemmFor: the module's facts, its subtile and tree."""
    return [
        f"struct {name} {{",
        *facts,
        f"  static constexpr int kEpilogueN = {subtile};",
        f"  static constexpr int kGatedBlock = {gated_block};",
        f"  static constexpr int kReduceKind = {reduce_kind};",
        *(["  using Finalize = RowFinalize;"] if reduce_kind != "-1" else []),
        "",
        "  template <class Frame>",
        f"  using Tree = {tree};",
        "",
        "  template <class Frame>",
        "  static typename Tree<Frame>::Arguments args(const FxGemmLaunch& a, float* partials) {",
        "    (void)a;",
        "    (void)partials;",
        f"    return {tree_args};",
        "  }",
        "};",
        "",
    ]


def _gate_struct(epilogue: Epilogue, codes: list[str], kinds: tuple[str, ...], bias: bool, element: str) -> list[str]:
    """fxg::Gated's Gate: the program's expression on the gate GEMM's value (its bias added) and
    the second GEMM's (its "gemm" parameter), at the output column."""
    printed = print_expr(epilogue.pre, x_name="x", prefix="u")
    ups = [i for i in sorted(printed.params) if kinds[i] == "gemm"]
    gate = f"gate + fxg::load_param<{element}>(a.bias, n)" if bias else "gate"
    return _column_struct("Gate", "the gate GEMM's value and the second GEMM's, through the program's stages",
                          printed, codes, kinds, ["gate", "up"],
                          [f"const float x = {gate};", *[f"const float p{i} = up;" for i in ups]])


def _post_struct(epilogue: Epilogue, codes: list[str], kinds: tuple[str, ...]) -> list[str]:
    """fxg::GroupNorm's Post: the normalized value through the norm's weight and bias and the
    stages after it."""
    printed = print_expr(epilogue.affine_post(), x_name="x", prefix="u")
    return _column_struct("Post", "after the norm: its weight and bias, then the stages after it",
                          printed, codes, kinds, ["x"], [])


def _affine_struct(norm: Norm | None, codes: list[str]) -> list[str]:
    """The norm's weight and bias at column n (1 and 0 where it has none, or no norm: a softmax),
    read as After reads its parameters: fxg::finalize_columns' Affine (a training batch norm),
    fxg::normalize_rows' (a norm or softmax over the row)."""

    def value(index: int | None, default: str) -> str:
        return default if index is None else f"fxg::load_param<{_ELEMENTS[codes[index]]}>(a.ptr[{index}], n)"

    return [
        "// the norm's weight and bias at column n",
        "struct Affine {",
        "  using Arguments = After::Arguments;",
        f"  CUTLASS_DEVICE static float weight(const Arguments& a, int64_t n) {{ (void)a; (void)n; return {value(norm and norm.weight, '1.f')}; }}",
        f"  CUTLASS_DEVICE static float bias(const Arguments& a, int64_t n) {{ (void)a; (void)n; return {value(norm and norm.bias, '0.f')}; }}",
        "};",
        "",
    ]


def _column_struct(name: str, comment: str, printed, codes: list[str], kinds: tuple[str, ...], inputs: list[str],
                   prelude: list[str]) -> list[str]:
    """A node's generated stages at one output column: Arguments (the parameters' pointers and the
    bias's), Scalars (the scalar parameters, read once a subtile), ``prefetch(arguments, n)`` (the
    column parameters' lines at column n, for a caller with work to hide their latency behind)
    and ``apply(arguments, scalars, n, *inputs)``: the prelude, column parameters read at column
    n, then the printed expression."""
    cols = [i for i in sorted(printed.params) if kinds[i] == "col"]
    scalars = [i for i in sorted(printed.params) if kinds[i] == "scalar"]
    return [
        f"// {comment}",
        f"struct {name} {{",
        f"  struct Arguments {{ const void* ptr[{max(1, len(codes))}]; const void* bias; }};",
        "  static Arguments args(const FxGemmLaunch& a) {",
        "    Arguments out{};",
        "    for (int i = 0; i < a.num_params; ++i) out.ptr[i] = a.params[i].ptr;",
        "    out.bias = a.bias;",
        "    return out;",
        "  }",
        "  struct Scalars { " + "".join(f"float p{i}; " for i in scalars) + "};",
        "  CUTLASS_DEVICE static Scalars scalars(const Arguments& a) {",
        "    (void)a;",
        "    return {" + ", ".join(f"fxg::load_param<{_ELEMENTS[codes[i]]}>(a.ptr[{i}], 0)" for i in scalars) + "};",
        "  }",
        "  CUTLASS_DEVICE static void prefetch(const Arguments& a, int64_t n) {",
        "    (void)a;",
        "    (void)n;",
        *[f"    fxg::prefetch_param<{_ELEMENTS[codes[i]]}>(a.ptr[{i}], n);" for i in cols],
        "  }",
        f"  CUTLASS_DEVICE static float apply(const Arguments& a, const Scalars& s, int64_t n, "
        f"{', '.join(f'float {v}' for v in inputs)}) {{",
        *[f"    (void){v};" for v in ["a", "s", "n", *inputs]],
        *["    " + line for line in prelude],
        *[f"    const float p{i} = fxg::load_param<{_ELEMENTS[codes[i]]}>(a.ptr[{i}], n);" for i in cols],
        *[f"    const float p{i} = s.p{i};" for i in scalars],
        *["    " + line for line in printed.lines],
        f"    return {printed.result};",
        "  }",
        "};",
        "",
    ]
