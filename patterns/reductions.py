"""The reduction family: row reductions and row maps over the feature dim — sum, mean,
amax/amin, max/min(dim) (with ``.values`` / ``[0]``), logsumexp, the Euclidean norm, var and
std, softmax, log_softmax, normalize.

Their spellings, and one entry per kind (``FAMILY``) holding what the reference, the row kernels
and the generated backward need of it; the IR's Reduce stage names its kind. Norms of order 1 and
±inf are rewritten as the reductions of |y| they are, softmin as the softmax of -y (``recognise``)."""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import AliasOp, PointwiseOp, ReduceOp, Rejected, RowSelection, example_value
from . import spell
from .written_norms import rewrite_keeps_dtypes

if TYPE_CHECKING:
    from ..ir import Reduce


@dataclass(frozen=True)
class ReductionFamily:
    """One reduction. ``changes_shape``: a reduction to one value a row (a row map keeps the row).
    ``reference(v, stage)``: eager's result over the last dim for the ir.Reduce ``stage`` (its
    keepdim, max/min's gradient rule ``ties``, normalize's ``eps``). ``row_stage``: the row kernels' member function
    (csrc/row_epilogue.cuh); ``backward_code``: its code in the generated backward
    (csrc/row_grad.cuh); ``in_gemm``: its kind in the in-GEMM epilogue, where it has one (a
    fxg::ReduceKind for a reduction to one value a row, csrc/gemm_row_reduce.cuh; a
    fxg::RowStatistic for a row map, csrc/gemm_row_statistics.cuh)."""

    kind: str
    changes_shape: bool
    reference: Callable[[torch.Tensor, "Reduce"], torch.Tensor]
    row_stage: str
    backward_code: str
    # what it is over one value (the size-1 dim a keepdim reduction left): "x", the value itself
    # (sum, max, ...); a pointwise function of the vocabulary (softmax's, patterns/functions.py);
    # None where it is neither (the norm's |v|, var's 0 or NaN)
    of_one_value: str | None = None
    attribute: str | None = None  # the ir.Reduce field it reads ("eps": normalize's, "correction": var's)
    in_gemm: str | None = None  # its kind in the in-GEMM epilogue (above)


def _extremum(kind: str) -> Callable[[torch.Tensor, "Reduce"], torch.Tensor]:
    """max/min in the spelling that has eager's gradient at ties."""
    by_index, split = (torch.max, torch.amax) if kind == "max" else (torch.min, torch.amin)

    def reference(v: torch.Tensor, stage: "Reduce") -> torch.Tensor:
        if stage.ties == "first":
            return by_index(v, -1, keepdim=stage.keepdim).values
        return split(v, -1, keepdim=stage.keepdim)

    return reference


FAMILY: dict[str, ReductionFamily] = {entry.kind: entry for entry in (
    ReductionFamily("sum", True, lambda v, s: v.sum(-1, keepdim=s.keepdim), "reduce_sum", "fx::kSum",
                    of_one_value="x", in_gemm="fxg::kSum"),
    ReductionFamily("mean", True, lambda v, s: v.mean(-1, keepdim=s.keepdim), "reduce_mean", "fx::kMean",
                    of_one_value="x", in_gemm="fxg::kMean"),
    ReductionFamily("max", True, _extremum("max"), "reduce_max", "fx::kMax", of_one_value="x", in_gemm="fxg::kMax"),
    ReductionFamily("min", True, _extremum("min"), "reduce_min", "fx::kMin", of_one_value="x", in_gemm="fxg::kMin"),
    ReductionFamily("logsumexp", True, lambda v, s: torch.logsumexp(v, -1, keepdim=s.keepdim),
                    "reduce_logsumexp", "fx::kLogSumExp", of_one_value="x", in_gemm="fxg::kLogSumExp"),
    # the Euclidean norm of the row (torch.norm / Tensor.norm / linalg.vector_norm, p = 2)
    ReductionFamily("vector_norm", True, lambda v, s: torch.linalg.vector_norm(v, 2, -1, keepdim=s.keepdim),
                    "reduce_vector_norm", "fx::kVectorNorm", in_gemm="fxg::kVectorNorm"),
    # the row's variance and standard deviation with Bessel's ``correction`` (torch.var / torch.std)
    ReductionFamily("var", True, lambda v, s: torch.var(v, -1, correction=s.correction, keepdim=s.keepdim),
                    "reduce_var", "fx::kVar", attribute="correction"),
    ReductionFamily("std", True, lambda v, s: torch.std(v, -1, correction=s.correction, keepdim=s.keepdim),
                    "reduce_std", "fx::kStd", attribute="correction"),
    ReductionFamily("softmax", False, lambda v, s: F.softmax(v, -1), "softmax", "fx::kSoftmax",
                    of_one_value="softmax_of_one", in_gemm="fxg::kRowSoftmax"),
    ReductionFamily("log_softmax", False, lambda v, s: F.log_softmax(v, -1), "log_softmax",
                    "fx::kLogSoftmax", of_one_value="log_softmax_of_one", in_gemm="fxg::kRowLogSoftmax"),
    # F.normalize(p=2): the row over max(its norm, eps)
    ReductionFamily("normalize", False, lambda v, s: F.normalize(v, 2.0, -1, s.eps), "normalize", "fx::kNormalize",
                    attribute="eps", in_gemm="fxg::kRowNormalize"),
)}


def _reduction(kind: str):
    def build(input, dim=None, keepdim=False, *, dtype=None):
        if dim is None:
            return Rejected(f"{kind} over every dim")
        if dtype is not None:
            return Rejected(f"{kind} with dtype={dtype}")
        return ReduceOp(kind, input, dim, bool(keepdim))

    build.__name__ = kind
    return build


def _amax(kind: str):
    def build(input, dim=(), keepdim=False):
        if dim in ((), []):
            return Rejected(f"a{kind} over every dim")
        return ReduceOp(kind, input, dim, bool(keepdim))

    build.__name__ = f"a{kind}"
    return build


def _max_or_min(kind: str):
    """torch.max/min: over a dim (values, indices), against another tensor, or over everything."""

    def build(input, other=None, keepdim=False, *, dim=None):
        if isinstance(other, Node) and dim is None:
            return PointwiseOp("maximum" if kind == "max" else "minimum", (input, other))
        dim = other if dim is None else dim
        if dim is None:
            return Rejected(f"{kind} over every dim")
        return ReduceOp(kind, input, dim, bool(keepdim), tuple_output=True)

    return build


def logsumexp(input, dim, keepdim=False):
    return ReduceOp("logsumexp", input, dim, bool(keepdim))


# the reductions of |y| that norms of these orders are
_LP_NORMS = {1: torch.sum, math.inf: torch.amax, -math.inf: torch.amin}


def _two_norm(p, dim, dtype) -> Rejected | None:
    """Why a norm call is not the row's Euclidean norm (None: it is). Norms of order 1 and ±inf
    over one dim reach here only where ``recognise`` left them: under autocast."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) != 1):
        return Rejected("a norm over every dim" if dim is None else f"a norm over dims {tuple(dim)}")
    if dtype is not None:
        return Rejected(f"a norm with dtype={dtype}")
    if isinstance(p, (int, float)) and p in _LP_NORMS:
        return Rejected(f"a vector norm with p={p!r} of a 16-bit value under autocast (which computes it in other "
                        "dtypes than the reductions of |y| it is)")
    if p not in (2, 2.0, "fro"):
        return Rejected(f"a vector norm with p={p!r} (only p = 1, 2 and ±inf are row reductions here)")
    return None


def norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm`` / ``Tensor.norm`` over one dim with p = 2 (or "fro", the same there)."""
    rejected = (Rejected("a norm with out=") if out is not None else None) or _two_norm(p, dim, dtype)
    return rejected or ReduceOp("vector_norm", input, dim, bool(keepdim))


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    rejected = (Rejected("a norm with out=") if out is not None else None) or _two_norm(ord, dim, dtype)
    return rejected or ReduceOp("vector_norm", x, dim, bool(keepdim))


def recognise(graph: Graph) -> int:
    """Rewrite the reductions written as others: norms of order 1 and ±∞, softmin. How many."""
    return _lp_norms(graph) + _softmins(graph)


def _softmins(graph: Graph) -> int:
    """``F.softmin(y, dim)`` (``nn.Softmin``) as ``softmax(-y, dim)``, which is how F.softmin
    computes it (so eager's values and gradients)."""
    found = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.softmin:
            continue
        args = {**dict(zip(("input", "dim", "_stacklevel", "dtype"), node.args)), **node.kwargs}
        if not isinstance(args.get("dim"), int) or args.get("dtype") is not None:
            continue  # the implicit dim's choice, or a cast: left to the spelling's reason
        with graph.inserting_before(node):
            negated = graph.call_function(torch.neg, (args["input"],))
            softmax = graph.call_function(torch.softmax, (negated, args["dim"]))
        negated.meta = dict(args["input"].meta)  # -y: y's shape and dtype
        softmax.meta = dict(node.meta)
        node.replace_all_uses_with(softmax)
        graph.erase_node(node)
        found += 1
    return found


def _lp_norms(graph: Graph) -> int:
    """Every norm of order 1, ∞ or -∞ over one dim (torch.norm, Tensor.norm,
    torch.linalg.vector_norm) as the reduction of |y| it is: sum, amax, amin. Eager's values,
    and its gradients: abs's sgn times sum's broadcast, or amax's even split among ties, as
    vector_norm's backward gives them."""
    found = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.linalg.vector_norm:
            signature, order = inspect.signature(vector_norm), "ord"
        elif (node.op, node.target) in (("call_function", torch.norm), ("call_method", "norm")):
            signature, order = inspect.signature(norm), "p"
        else:
            continue
        try:
            arguments = signature.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        arguments.apply_defaults()
        args = arguments.arguments
        reduction = _LP_NORMS.get(args[order]) if isinstance(args[order], (int, float)) else None
        dim = args["dim"]
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        value = next(iter(args.values()))
        if (reduction is None or not isinstance(dim, int) or args["dtype"] is not None or args["out"] is not None
                or not isinstance(value, Node) or not rewrite_keeps_dtypes(graph, value)):
            continue  # under autocast the norm and the reductions of |y| may compute in other dtypes
        with graph.inserting_before(node):
            magnitude = graph.call_function(torch.abs, (value,))
            reduced = graph.call_function(reduction, (magnitude, dim, bool(args["keepdim"])))
        magnitude.meta = dict(value.meta)  # |y|: y's shape and dtype
        reduced.meta = dict(node.meta)
        node.replace_all_uses_with(reduced)
        graph.erase_node(node)
        found += 1
    return found


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    if p not in (2, 2.0):
        return Rejected(f"normalize with p={p!r} (only p = 2 is a row map here)")
    if out is not None or not isinstance(eps, (int, float)):
        return Rejected("normalize with out=" if out is not None else "normalize with a symbolic eps")
    return ReduceOp("normalize", input, dim, eps=float(eps))


def _spread(kind: str):
    """torch.var / torch.std and their methods: ``(input, dim, unbiased, keepdim)``, the older
    ``(input, unbiased)`` and ``correction=`` (1, Bessel's, by default)."""

    def build(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        if isinstance(dim, bool):  # var(input, unbiased)
            dim, unbiased = None, dim
        if dim is None:
            return Rejected(f"{kind} over every dim")
        if unbiased is not None and correction is not None:
            return Rejected(f"{kind} with both unbiased and correction")
        if correction is None:
            correction = 0 if unbiased is False else 1
        if not isinstance(correction, (int, float)) or isinstance(correction, bool):
            return Rejected(f"{kind} with a symbolic correction")
        return ReduceOp(kind, input, dim, bool(keepdim), correction=float(correction))

    build.__name__ = kind
    return build


def _row_map(kind: str):
    def build(input, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            return Rejected(f"{kind} without dim")
        if dtype is not None:
            return Rejected(f"{kind} with dtype={dtype}")
        return ReduceOp(kind, input, dim)

    return build


def getitem(value, index):
    """``max(dim)[0]`` / ``.values`` is the reduction's value; ``y[:, 0]`` (leading dims indexed,
    the last left whole) selects rows; anything else is not ours."""
    from . import lookup

    reduce = lookup(value) if isinstance(value, Node) else None
    if isinstance(reduce, ReduceOp) and reduce.tuple_output:
        return AliasOp(value) if index == 0 else Rejected(f"reads the indices of {reduce.kind}(dim)")
    if isinstance(value, Node) and _selects_rows(example_value(value), index):
        return RowSelection(value)
    return Rejected("indexing")


def _selects_rows(value, index) -> bool:
    """``value[index]`` picks whole rows: indexing (ints, slices, one ``...``, integer or boolean
    index tensors: CLIP's ``h[arange(B), eos_positions]``) of the leading dims of a tensor of at
    least two, its last dim untouched."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    entries = index if isinstance(index, tuple) else (index,)
    if not entries or not all(isinstance(e, (int, slice)) or e is Ellipsis or _index_tensor(e) for e in entries):
        return False
    if sum(e is Ellipsis for e in entries) > 1:
        return False
    if Ellipsis in entries:  # the entries after it index the trailing dims: the last must be whole
        after = entries[entries.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(entries) < value.dim() or entries[value.dim() - 1] == slice(None)


def _index_tensor(entry) -> bool:
    value = example_value(entry) if isinstance(entry, Node) else None
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


SPELLINGS = (
    spell(_reduction("sum"), torch.sum, "sum"),
    spell(_reduction("mean"), torch.mean, "mean"),
    spell(_amax("max"), torch.amax, "amax"),
    spell(_amax("min"), torch.amin, "amin"),
    spell(_max_or_min("max"), torch.max, "max"),
    spell(_max_or_min("min"), torch.min, "min"),
    spell(logsumexp, torch.logsumexp, "logsumexp"),
    spell(norm, torch.norm, "norm"),
    spell(_spread("var"), torch.var, "var"),
    spell(_spread("std"), torch.std, "std"),
    spell(vector_norm, torch.linalg.vector_norm),
    spell(_row_map("softmax"), F.softmax, torch.softmax, "softmax"),
    spell(_row_map("log_softmax"), F.log_softmax, torch.log_softmax, "log_softmax"),
    spell(normalize, F.normalize),
    spell(getitem, operator.getitem),
)
