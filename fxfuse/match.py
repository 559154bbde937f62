"""Step 2: from each GEMM, grow the epilogue chain and turn it into a Program.

Growth is greedy in graph order: the earliest node that reads the chain is absorbed when its
canonical op fits (pointwise ops may read any value of the current pointwise segment, so
``y * sigmoid(y)``, ``y + y`` and ``sigmoid(y) * 2 + y`` fuse; a norm or reduction closes the segment).
The first node that does not fit stops growth, with a reason. The fused region is then the longest
prefix whose only value read from outside is its last one, so an intermediate that something else
also reads is never fused away.

Every op rounds its result to its own output dtype, as eager's does. In a bfloat16/float16 chain
that is the GEMM's dtype, or float32 where autocast runs an op in float32 (a norm, softmax or sum
on CUDA), a float32 operand promotes one, or the user casts (``x.float()``): such an op reads the
chain's values exactly, and from there on the chain computes in float32 (a Widen stage in the IR;
a pointwise op of the GEMM's dtype may still read values from before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import sympy
import torch
from torch.fx import Node

from . import expr as E
from .canonical import (
    AliasOp,
    CanonicalOp,
    DropoutOp,
    DropoutSeed,
    GemmOp,
    NormOp,
    Operand,
    PointwiseOp,
    PoolOp,
    ReduceOp,
    Rejected,
    RejectedGemm,
    ReshapeOp,
    RotaryOp,
    RowSelection,
    example_value,
)
from .describe import describe
from .ir import Dropout, Gemm, Keep, Narrow, Norm, Pointwise, Pool, Program, Reduce, Rotary, Stage, Widen
from .vocabulary import ROUNDING, call, is_rounding
from .patterns.norms import FAMILY as NORMS
from .patterns.reductions import FAMILY as REDUCTIONS
from .patterns.functions import PREDICATES
from .patterns.gemm import moves_features, transposed_for_gemms
from .patterns.split_gemms import splits_features

if TYPE_CHECKING:
    from .cuda.engine import Selection

FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RMS_NORM_DEFAULT_EPS = torch.finfo(torch.float32).eps  # eps=None: float's eps (opmath for halves)


@dataclass(frozen=True)
class BatchNormUpdate:
    """The running-statistics update of a training-mode BatchNorm, done after the fused op."""

    running_mean: Node
    running_var: Node
    momentum: Operand


@dataclass(frozen=True)
class Fusion:
    """What matched after one GEMM: the program and every graph value the rewrite reads or
    replaces."""

    program: Program
    nodes: list[Node]  # the GEMM and the ops the fused op replaces; the last one's value is its output
    x: Node
    weight: Node
    bias: Node | None
    params: list[Node | DropoutSeed]  # a seed: drawn by the rewrite
    casts_operands: bool = False  # autocast casts the GEMM's operands to the chain's dtype
    weight_is_kn: bool = False  # ``weight`` is stored (K, N): the fused op reads weight.t()
    batch_norm_update: BatchNormUpdate | None = None
    view: Node | None = None  # the chain's last view (rows regrouped): the op's output is viewed so
    kept: Node | None = None  # a chain value also read outside the chain: the op returns it too
    kept_view: Node | None = None  # the last view before ``kept`` (its rows regrouped as the op's are not)
    second_gemms: list[Node] = field(default_factory=list)  # GEMMs on the same x the op runs too ("gemm" params)

    @property
    def gemm(self) -> Node:
        return self.nodes[0]


@dataclass(frozen=True)
class Decision:
    """What the backend chose for a fused chain on the GPU: the path its shape measured fastest on,
    with the times (fxfuse.cuda.select), and the measurement behind it where one was taken."""

    path: str
    selection: "Selection | None" = None


@dataclass(frozen=True)
class Chain:
    """One GEMM's row: what the report shows (the status, the ops in the user's names, why growth
    stopped), what matched (``fusion``, None when nothing fuses) and what was decided for it on
    the GPU (``decision``)."""

    gemm: Node
    status: str  # "fused" | "partial" | "not_fused"
    chain: list[str]  # user-level names: the fused ops, then the op the chain stopped at
    fused: list[str]
    reason: str | None
    fusion: Fusion | None = None
    dtype: torch.dtype | None = None  # the GEMM's output dtype, the chain's element type
    stops_at_wider_dtype: bool = False  # growth ended at an op computing in a dtype it cannot widen to
    without_keep: "Chain | None" = None  # the chain ending at ``fusion.kept``, for a back end without second outputs
    decision: Decision | None = None
    # GEMMs the matcher joined to this chain's op (a gated MLP's up projection): their report rows
    # follow this one, fused with it or not
    second_gemms: list[Node] = field(default_factory=list)

    @property
    def program(self) -> Program | None:
        return None if self.fusion is None else self.fusion.program

    @property
    def path(self) -> str | None:
        return None if self.decision is None else self.decision.path

    def unfused(self, reason: str) -> "Chain":
        """This GEMM's row with nothing fused, for ``reason`` (a back end's or the policy's)."""
        return replace(self, status="not_fused", fused=[], reason=reason, fusion=None, decision=None)


class Stop(Exception):
    """Growth ends at this node, for this reason (None: the chain simply ends here);
    ``wider_dtype`` when the node computes in a wider dtype than the chain can take (float64):
    an op Inductor would fuse with the chain; ``natural_end`` when the chain is complete there all
    the same (a view into attention's heads: the reason says why a chain with no epilogue op
    before it has none)."""

    def __init__(self, reason: str | None, wider_dtype: bool = False, natural_end: bool = False):
        super().__init__(reason)
        self.reason, self.wider_dtype, self.natural_end = reason, wider_dtype, natural_end


def _autocast_casts_to(gemm: Node, device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``gemm`` runs under an autocast to ``dtype``: the compile happens inside an autocast
    region, or Dynamo's graph enters one (``_enter_autocast``) before ``gemm`` and has not left it."""
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype:
        return True
    regions: list[Node] = []
    for node in gemm.graph.nodes:
        if node is gemm:
            break
        if node.target is torch.amp.autocast_mode._enter_autocast:
            regions.append(node)
        elif node.target is torch.amp.autocast_mode._exit_autocast and regions:
            regions.pop()
    return bool(regions) and regions[-1].args[:3] == (device_type, dtype, True)


def match_all(graph, canon: dict[Node, CanonicalOp], allow_cpu: bool) -> list[Chain]:
    """The chain of every GEMM, in graph order. A node goes to one chain only: where two GEMMs'
    values meet in one op, the earlier GEMM's chain takes it. A later GEMM on the same input that
    only that op reads (``silu(gate(x)) * up(x)``: a gated MLP) joins the earlier one's op as its
    second GEMM (``Fusion.second_gemms``, no chain of its own); otherwise the later one stops there."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    claimed: set[Node] = set()
    chains = []
    gemm_like = (n for n, op in canon.items() if isinstance(op, (GemmOp, RejectedGemm)))
    for node in sorted(gemm_like, key=order.__getitem__):
        if node in claimed:  # an earlier chain's second GEMM
            continue
        op = canon[node]
        if isinstance(op, RejectedGemm):  # a row of its own: the report covers every GEMM
            chains.append(Chain(node, "not_fused", [describe(node)], [], op.reason))
            continue
        chain = _Matcher(node, op, canon, order, allow_cpu, claimed).run()
        if chain.fusion is not None:
            claimed.update(chain.fusion.nodes, chain.second_gemms)
        chains.append(chain)
    return chains


@dataclass
class _Snapshot:
    """The state right after absorbing one node: enough to build the Program of that prefix."""

    node: Node
    stages: tuple[Stage, ...]
    expr: sympy.Expr  # the node's value within the current pointwise segment
    n_params: int
    bias: Node | None
    batch_norm_update: BatchNormUpdate | None
    is_tuple: bool


class _Matcher:
    def __init__(self, gemm: Node, op: GemmOp, canon, order, allow_cpu: bool, claimed: frozenset | set = frozenset(),
                 keep: Node | None = None):
        self.gemm, self.op, self.canon, self.order, self.allow_cpu = gemm, op, canon, order, allow_cpu
        self.claimed = claimed  # nodes an earlier GEMM's chain fuses
        self.keep = keep  # a chain value also read outside the chain: a keep() stage, a second output
        self.escaped: Node | None = None  # the value that stopped the longest chain by being read outside
        self.region: list[Node] = [gemm]
        self.segment: dict[Node, sympy.Expr] = {gemm: E.X}
        self.stages: list[Stage] = []
        self.params: list[Node] = []
        self.param_kinds: list[str] = []
        self.second_gemms: dict[int, Node] = {}  # a "gemm" parameter's index -> the GEMM it runs
        self.bias: Node | None = op.bias
        self.batch_norm_update: BatchNormUpdate | None = None
        self.has_batch_norm_training = False
        self.reduced = False  # a row reduction changed the shape
        self.keeps_reduced_dim = False  # the reduced value keeps its feature dim, of size 1
        self.broadcast_back = False  # the reduced value met a per-column vector: a row of N again
        self.snapshots: list[_Snapshot] = []
        self._downstream: set[Node] | None = None
        self.dtype: torch.dtype | None = None  # the GEMM's output dtype: the chain's element type
        self.node_dtype: torch.dtype | None = None  # the output dtype of the node being absorbed
        self.widened = False  # an op of the chain computes in float32 (in a bf16/fp16 chain)
        self.casts_operands = False
        self.stopped_at_wider_dtype = False
        self.natural_end = False

    # -- driver -------------------------------------------------------------------------------

    def run(self) -> Chain:
        try:
            self._check_gemm()
        except Stop as stop:
            return Chain(self.gemm, "not_fused", [describe(self.gemm)], [], stop.reason)
        stop_node, stop_reason = None, None
        while (candidate := self._next_candidate()) is not None:
            try:
                self._absorb(candidate)
            except Stop as stop:
                stop_node, stop_reason, self.stopped_at_wider_dtype = candidate, stop.reason, stop.wider_dtype
                self.natural_end = stop.natural_end
                break
        chain = self._result(stop_node, stop_reason)
        if self.keep is None and self.escaped is not None:  # go on past it, returning it too
            kept = _Matcher(self.gemm, self.op, self.canon, self.order, self.allow_cpu, self.claimed,
                            keep=self.escaped).run()
            if kept.fusion is not None and kept.fusion.kept is not None and (
                    chain.fusion is None or len(kept.fusion.nodes) > len(chain.fusion.nodes)):
                return replace(kept, without_keep=chain)
        return chain

    def _next_candidate(self) -> Node | None:
        region = set(self.region)
        users = {u for n in self.region for u in n.users if u not in region}
        return min(users, key=self.order.__getitem__, default=None)

    def _result(self, stop_node: Node | None, stop_reason: str | None) -> Chain:
        chain = [describe(n) for n in self.region]
        if stop_node is not None and stop_node.op != "output":
            chain.append(describe(stop_node))
        best, shrink_reason = self._longest_closed_prefix()
        if best is None or not best.stages:
            dead = len(self.region) > 1 and not self.region[-1].users  # (a pooler output nobody reads)
            reason = shrink_reason or stop_reason or (
                "nothing reads the chain's value (dead code, which Inductor removes)" if dead
                else "no epilogue op after the GEMM")
            after = chain[1 : len(self.region)]  # the ops matched after the GEMM
            if best is not None and not best.stages and best.bias is not None and not shrink_reason:
                only_bias = self.op.bias is None and len(after) == 1
                reason = stop_reason or ("only a bias add after the GEMM" if only_bias else
                                         f"no epilogue op after the GEMM: {', '.join(after)} "
                                         f"{'is an identity' if len(after) == 1 else 'are identities'} here")
            return Chain(self.gemm, "not_fused", chain, [], reason, dtype=self.dtype)
        nodes = self.region[: self.region.index(best.node) + 1]
        complete = len(nodes) == len(self.region) and (stop_reason is None or self.natural_end)
        kept = self.keep if self.keep in nodes[1:] and self.keep is not best.node else None
        stages = best.stages if kept is not None else tuple(s for s in best.stages if not isinstance(s, Keep))
        program = Program(
            Gemm(bias=best.bias is not None),
            stages,
            tuple(self.param_kinds[: best.n_params]),
        )
        fusion = Fusion(
            program,
            nodes,
            self.op.input,
            self.op.weight,
            best.bias,
            self.params[: best.n_params],
            casts_operands=self.casts_operands,
            weight_is_kn=self.op.weight_is_kn,
            batch_norm_update=best.batch_norm_update,
            view=next((n for n in reversed(nodes) if isinstance(self.canon.get(n), ReshapeOp)), None),
            kept=kept,
            kept_view=None if kept is None else next(
                (n for n in reversed(nodes[: nodes.index(kept) + 1]) if isinstance(self.canon.get(n), ReshapeOp)), None),
            second_gemms=[g for i, g in self.second_gemms.items() if i < best.n_params],
        )
        return Chain(
            self.gemm,
            "fused" if complete else "partial",
            chain,
            [describe(n) for n in nodes],
            None if complete else (shrink_reason or stop_reason),
            fusion,
            self.dtype,
            self.stopped_at_wider_dtype and shrink_reason is None,
            second_gemms=fusion.second_gemms,
        )

    def _longest_closed_prefix(self) -> tuple[_Snapshot | None, str | None]:
        """The longest prefix read from outside only through its last node (and the kept value,
        once one is), and (if it is not the whole region) why the longer ones were not; the first
        inner value read from outside goes to ``escaped``."""
        reason = None
        for k in range(len(self.snapshots), 0, -1):
            snapshot = self.snapshots[k - 1]
            nodes = self.region[: self.region.index(snapshot.node) + 1]  # (a second GEMM's branch has no snapshot)
            prefix = set(nodes)
            escaping = [n for n in nodes if any(u not in prefix for u in n.users)]
            inner = [n for n in escaping if n is not snapshot.node and n is not self.keep]
            if (not inner and snapshot.node in escaping and not snapshot.is_tuple
                    and self._kept_read_after(snapshot.node) and self._kept_then_computed(snapshot)):
                return snapshot, reason
            if reason is None and inner:
                user = next(u for u in inner[0].users if u not in prefix)
                reason = f"the value of {describe(inner[0])} is also read by {describe(user)}"
                if self.keep is None and self._keepable(inner[0]):
                    self.escaped = inner[0]
        return None, reason

    def _kept_read_after(self, last: Node) -> bool:
        """Whether every reader of the kept value outside the chain ending at ``last`` comes after
        ``last`` in the graph (the fused op, which returns it, takes ``last``'s place)."""
        if self.keep is None or self.keep not in self.region[: self.region.index(last)]:
            return True
        chain = set(self.region[: self.region.index(last) + 1])
        return all(self.order[u] > self.order[last] for u in self.keep.users if u not in chain)

    def _kept_then_computed(self, snapshot: _Snapshot) -> bool:
        """Whether a stage that computes follows the keep() stage in ``snapshot``'s program (after
        only views and casts the kept value would be the output itself), or the prefix ends at or
        before the kept value."""
        if self.keep is None or self.keep not in self.region[: self.region.index(snapshot.node)]:
            return True
        at = next(i for i, s in enumerate(snapshot.stages) if isinstance(s, Keep))
        return any(isinstance(s, (Pointwise, Norm, Reduce)) for s in snapshot.stages[at + 1 :])

    def _keepable(self, node: Node) -> bool:
        """Whether ``node``'s value can be the op's second output: one tensor of the chain's shape
        (before any reduction), in the dtype the chain computes in there."""
        value = example_value(node)
        return (node is not self.gemm and isinstance(value, torch.Tensor) and value.dim() in (2, 3)
                and value.shape[-1] == self.n and not isinstance(self.canon.get(node), ReduceOp))

    # -- checks on the GEMM -------------------------------------------------------------------

    def _check_gemm(self) -> None:
        x, w = example_value(self.op.input), example_value(self.op.weight)
        b = example_value(self.op.bias) if self.op.bias is not None else None
        tensors = [t for t in (x, w, b) if t is not None]
        if not all(isinstance(t, torch.Tensor) for t in tensors) or len(tensors) < 2:
            raise Stop("GEMM operands are not tensors")
        out = example_value(self.gemm)
        self.dtype, self.device = getattr(out, "dtype", x.dtype), x.device
        self.node_dtype = self.dtype
        if any(t.dtype not in FUSABLE_DTYPES for t in (*tensors, out)):
            raise Stop(f"dtype {self.dtype} (fxfuse fuses float32, bfloat16 and float16)")
        if any(t.device != x.device for t in tensors):
            raise Stop("GEMM operands on different devices")
        if any(t.dtype != self.dtype for t in tensors):
            if not _autocast_casts_to(self.gemm, x.device.type, self.dtype):
                raise Stop("GEMM operands differ in dtype")  # eager raises; so does the graph
            self.casts_operands = True  # autocast casts them to its dtype, the GEMM's
        if x.device.type == "cpu" and not self.allow_cpu:
            raise Stop("CPU tensors (set FXFUSE_ALLOW_CPU=1 or options={'allow_cpu': True})")
        if x.device.type not in ("cpu", "cuda"):
            raise Stop(f"device {x.device.type}")
        if w.dim() != 2 or x.dim() not in (2, 3) or (b is not None and b.dim() != 1):
            raise Stop("GEMM shapes other than (M, K) or (B, T, K) by an (N, K) weight")
        self.n = w.shape[1] if self.op.weight_is_kn else w.shape[0]
        self.ndim = x.dim()
        self.shape = (*x.shape[:-1], self.n)  # the chain value's shape (a view regroups its rows)
        self.rows = tuple(x.shape[:-1])  # the fused op's rows, as x's leading dims

    # -- absorbing one node -------------------------------------------------------------------

    def _absorb(self, node: Node) -> None:
        op = self.canon.get(node)
        if node.op == "output" or isinstance(op, (GemmOp, RowSelection)):
            raise Stop(None)  # the chain's natural end: a complete chain
        if op is None:
            if transposed_for_gemms(node):
                raise Stop(None)  # a GEMM reads the value, transposed: the chain's natural end
            if moves_features(node):
                raise Stop(f"{describe(node)} moves the feature dim (the output transposed, as a token-mixing "
                           "MLP's): the kernels write the GEMM's rows of features, so the chain ends before it")
            if splits_features(node):
                raise Stop(f"{describe(node)} splits the features into separate values (as attention's q, k and v "
                           "are): the chain ends before it")
            raise Stop(f"{describe(node)} is not an epilogue op")
        if node in self.claimed:
            raise Stop(f"{describe(node)} is fused into another GEMM's chain")
        if isinstance(op, Rejected):
            raise Stop(op.reason)
        value = example_value(node)
        # a comparison's bool value: 0s and 1s inside the chain, never its end (no snapshot)
        predicate = isinstance(op, PointwiseOp) and op.fn in PREDICATES
        if not predicate:
            self.node_dtype = self._dtype_of(node, op, value.dtype if isinstance(value, torch.Tensor) else self.dtype)
        expr, is_tuple = self._rounded(E.X), False
        if predicate:
            expr = self._pointwise(node, op)
        elif isinstance(op, AliasOp):  # a cast back to the chain's dtype rounds here
            expr = self._rounded(self._segment_value(op.input))
        elif isinstance(op, ReshapeOp):
            self._regroup_rows(node, value)
            expr = self._segment_value(op.input)
        elif isinstance(op, PointwiseOp):
            expr = self._rounded(self._pointwise(node, op))
        elif isinstance(op, ReduceOp) and self._reduces_one_value(op):
            expr, is_tuple = self._one_value(op), op.tuple_output
        else:  # a norm, dropout, pooling or reduction: the next segment reads its result
            stage = (self._norm(op) if isinstance(op, NormOp) else self._dropout(node, op) if isinstance(op, DropoutOp)
                     else self._pool(op) if isinstance(op, PoolOp) else self._rotary(op) if isinstance(op, RotaryOp)
                     else self._reduce(op))
            self._close_segment(op.input, stage)
            self.segment, is_tuple = {}, isinstance(op, ReduceOp) and op.tuple_output
        self.segment[node] = expr
        if node is self.keep:
            self._keep_here(node, expr, value)
            expr = E.X
        self.region.append(node)
        if not predicate:
            self.snapshots.append(
                _Snapshot(node, self._stages_with(expr), expr, len(self.params), self.bias,
                          self.batch_norm_update, is_tuple)
            )

    def _keep_here(self, node: Node, expr: sympy.Expr, value) -> None:
        """A keep() stage after ``node``: its value (``expr`` in the segment) is an output too; the
        ops after it read it as the next segment's input."""
        if self.reduced or not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(self.shape):
            raise Stop(f"{describe(node)} is read outside the chain after a row reduction")
        if self.pooled:
            raise Stop(f"{describe(node)} is read outside the chain after a pooling")
        if self.widened and self.node_dtype != torch.float32:
            raise Stop(f"{describe(node)} is read outside the chain in {self.node_dtype} after a cast back")
        self.stages[:] = self._stages_with(expr)
        self.stages.append(Keep())
        self.segment = {node: E.X}

    def _regroup_rows(self, node: Node, value) -> None:
        """A view of the chain's value that keeps the feature dim: the kernels see the same rows."""
        if self.reduced:
            raise Stop(f"{describe(node)} after a row reduction")
        if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3) or value.shape[-1] != self.shape[-1]:
            if (isinstance(value, torch.Tensor) and value.dim() == len(self.shape) + 1
                    and tuple(value.shape[:-2]) == tuple(self.shape[:-1])
                    and value.shape[-2] * value.shape[-1] == self.shape[-1]):
                raise Stop(f"{describe(node)} changes the feature dim: it splits the features into "
                           f"{value.shape[-2]} heads of {value.shape[-1]} (attention's layout), and the chain ends there",
                           natural_end=True)
            raise Stop(f"{describe(node)} changes the feature dim")
        self.ndim, self.shape = value.dim(), tuple(value.shape)

    def _dtype_of(self, node: Node, op: CanonicalOp, dtype: torch.dtype) -> torch.dtype:
        """The dtype ``node`` computes in: the GEMM's, or float32 in a bfloat16/float16 chain
        (autocast's float32 ops, a float32 operand's promotion, a cast), which widens the chain
        from here on. Promotion never lets a value of a widened op flow into an op of the
        GEMM's dtype, so only pointwise ops of that dtype may follow (on earlier values)."""
        if dtype == self.dtype:
            if self.widened and not isinstance(op, (PointwiseOp, AliasOp)):
                raise Stop(f"{describe(node)} computes in {dtype} after the chain widened to float32")
            return dtype
        if dtype != torch.float32 or self.dtype not in ROUNDING:
            raise Stop(f"{describe(node)} computes in {dtype} (autocast's or type promotion's choice); "
                       f"a fused chain computes in the GEMM's {self.dtype} or widens it to float32",
                       wider_dtype=True)
        self.widened = True
        return dtype

    def _rounded(self, expr: sympy.Expr) -> sympy.Expr:
        """``expr`` rounded to the node's dtype, as eager rounds each op's result (a no-op in
        float32; the last rounding of a chain is the op's output cast and is kept)."""
        name = ROUNDING.get(self.node_dtype)
        if name is None or self._is_rounding(expr):
            return expr
        return call(name, expr)

    def _is_rounding(self, expr: sympy.Expr) -> bool:
        return is_rounding(expr, self.dtype)

    def _stages_with(self, expr: sympy.Expr) -> tuple[Stage, ...]:
        """The stages so far, the current pointwise segment's (unless it is the identity) and,
        once the chain widened, the Widen stage after the segment where it happened."""
        trivial = expr == E.X or (self._is_rounding(expr) and expr.args[0] == E.X)
        segment = () if trivial else (Pointwise(expr),)
        widen = (Widen(),) if self.widened and Widen() not in self.stages else ()
        narrow = (Narrow(),) if self.widened and self.node_dtype == self.dtype else ()  # cast back
        return tuple(self.stages) + segment + widen + narrow

    def _segment_value(self, node: Node) -> sympy.Expr:
        if node in self.segment:
            return self.segment[node]
        if node in self.region:
            raise Stop(f"reads {describe(node)} from before a norm, reduction or dropout")
        raise Stop(f"reads {describe(node)}, which is not part of the chain")

    def _close_segment(self, input: Node, stage: Stage) -> None:
        self.stages[:] = self._stages_with(self._segment_value(input))
        self.stages.append(stage)

    def _pointwise(self, node: Node, op: PointwiseOp) -> sympy.Expr:
        if self._folds_into_bias(op):
            return E.X
        args = [self._operand(o) for o in op.operands]
        if op.expression is not None:  # a registered activation (patterns/activations.py)
            return E.substitute(op.expression, {E.X: args[0]})
        attrs = [E.const(a) for a in op.attrs]
        fn = op.fn
        if fn == "add" and attrs:  # torch.add(a, b, alpha=c)
            return E.add(args[0], E.mul(args[1], attrs[0]))
        if fn in ("add", "sub", "mul", "div"):
            return getattr(E, fn)(*args)
        if fn == "pow":
            return E.power(*args)
        if fn == "neg":
            return E.neg(args[0])
        if fn == "where":  # where(c, a, b), c a comparison's 0/1: a where it holds, b elsewhere
            condition, picked, other = args
            if not self._is_predicate(op.operands[0]):
                raise Stop(f"torch.where's condition {op.operands[0]!r} is not a comparison of the chain's values")
            return E.add(call("pick", condition, picked), call("pick", E.sub(E.const(1.0), condition), other))
        return call(fn, *args, *attrs)

    def _is_predicate(self, operand: Operand) -> bool:
        """A comparison absorbed into this chain (a bool value of 0s and 1s)."""
        op = self.canon.get(operand) if isinstance(operand, Node) else None
        return isinstance(op, PointwiseOp) and op.fn in PREDICATES and operand in self.region

    def _folds_into_bias(self, op: PointwiseOp) -> bool:
        """``matmul(x, W.T) + b`` (or a bias-free Linear then ``+ b``) is a GEMM with bias. Only in
        float32: in bf16/fp16 eager rounds the product before adding, a GEMM's bias epilogue does
        not, and a value near a kink (relu's 0) may then land on the other side of it."""
        if op.fn != "add" or op.attrs or self.bias is not None or len(self.region) != 1:
            return False
        if self.dtype in ROUNDING:
            return False
        a, b = op.operands
        other = b if a is self.gemm else a if b is self.gemm else None
        value = example_value(other)
        if not isinstance(value, torch.Tensor) or self._is_downstream(other):
            return False
        if tuple(value.shape) != (self.n,) or value.dtype != self.dtype or value.device != self.device:
            return False
        self.bias = other
        return True

    def _operand(self, operand: Operand) -> sympy.Expr:
        if isinstance(operand, bool) or operand is None:
            raise Stop(f"operand {operand!r}")
        if isinstance(operand, (int, float)):
            return E.const(operand)
        if operand in self.segment or operand in self.region:
            return self._segment_value(operand)
        if self._is_second_gemm(operand):
            return self._second_gemm(operand)
        branch = self._second_gemm_branch(operand)
        if branch is not None:
            return self._branch_value(branch)
        return E.param(self._param(operand, self._value_kind(operand)))

    def _second_gemm(self, node: Node) -> sympy.Expr:
        """The value of a second GEMM the op runs (a "gemm" parameter, ``_is_second_gemm``)."""
        op = self.canon[node]
        index = self._param(op.weight, "gemm")
        self.second_gemms[index] = node
        if op.bias is None:
            return E.param(index)
        # its bias, added to its output and rounded as the GEMM's own output is
        value = E.add(E.param(index), E.param(self._param(op.bias, "col")))
        rounding = ROUNDING.get(self.dtype)
        return value if rounding is None else call(rounding, value)

    def _second_gemm_branch(self, node: Node) -> list[Node] | None:
        """``[gemm, op, ..., node]`` where ``node`` is pointwise ops of one value applied to a second
        GEMM (``up(x) * silu(gate(x))``, the up projection first in the graph), each read only by
        the next and computing in the chain's dtype; None otherwise. The op runs that GEMM and the
        ops too."""
        path = [node]
        while True:
            op = self.canon.get(path[0])
            if isinstance(op, GemmOp):
                break
            if (not isinstance(op, PointwiseOp) or op.inplace or len(path[0].users) != 1 or path[0] in self.claimed
                    or getattr(example_value(path[0]), "dtype", None) != self.dtype):
                return None
            inputs = [o for o in op.operands if isinstance(o, Node)]
            numbers = [o for o in op.operands if isinstance(o, (int, float)) and not isinstance(o, bool)]
            if len(inputs) != 1 or len(inputs) + len(numbers) != len(op.operands):
                return None
            path.insert(0, inputs[0])
        return path if len(path) > 1 and self._is_second_gemm(path[0]) else None

    def _branch_value(self, branch: list[Node]) -> sympy.Expr:
        """The value of a second GEMM's branch (``_second_gemm_branch``): its ops computed on the
        GEMM's output as the chain computes its own, rounded where eager rounds; they join the
        fused region (before the node being absorbed), so the rewrite removes them."""
        value = self._second_gemm(branch[0])
        node_dtype, self.node_dtype = self.node_dtype, self.dtype
        try:
            for before, node in zip(branch, branch[1:]):
                self.segment[before] = value
                value = self._rounded(self._pointwise(node, self.canon[node]))
        finally:
            self.node_dtype = node_dtype
            for node in branch[:-1]:
                self.segment.pop(node, None)
        self.region.extend(branch[1:])
        return value

    def _is_second_gemm(self, node: Node) -> bool:
        """Whether ``node`` is a later GEMM on this chain's input, of this GEMM's output shape and
        dtypes, read only by the node being absorbed: the op runs it too (a gated MLP's up
        projection), instead of reading its output as an operand. Its bias, if any, is a column
        parameter of the weight's dtype (not under an autocast that casts it)."""
        op = self.canon.get(node)
        if not isinstance(op, GemmOp) or node in self.claimed or len(node.users) != 1 or self.reduced:
            return False
        if self.order[node] < self.order[self.gemm]:  # an earlier GEMM has a row (and chain) of its own
            return False
        if op.input is not self.op.input or op.weight_is_kn or self.op.weight_is_kn:
            return False
        w, mine, value = example_value(op.weight), example_value(self.op.weight), example_value(node)
        bias = example_value(op.bias) if op.bias is not None else None
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.n,)
                                 or bias.dtype != getattr(w, "dtype", None) or self.casts_operands):
            return False  # (under autocast its bias would need autocast's cast too)
        return (isinstance(w, torch.Tensor) and isinstance(value, torch.Tensor) and w.shape == mine.shape
                and w.dtype == mine.dtype and w.device == mine.device and value.dtype == self.dtype
                and tuple(value.shape) == self.shape)

    def _value_kind(self, node: Node) -> str:
        """"col", "scalar", "full" (the chain value's own shape: a residual, a gate) or "row" (one
        value per row of it: (M, 1), (B, T, 1)) for a tensor that broadcasts against the chain
        value without changing its shape, dtype or device; Stop otherwise."""
        if self._is_downstream(node):
            raise Stop(f"operand {describe(node)} is computed from the chain's value")
        value = example_value(node)
        if not isinstance(value, torch.Tensor):
            raise Stop(f"operand {describe(node)} is a symbolic scalar")
        if value.dtype not in {self.dtype, self.node_dtype} or value.device != self.device:
            raise Stop(f"operand {describe(node)} has dtype {value.dtype} on {value.device}")
        shape = tuple(value.shape)
        if len(shape) > self.ndim:
            raise Stop(f"operand {describe(node)} of shape {shape} would broadcast the output")
        if all(d == 1 for d in shape):
            return "scalar"
        if self.pooled and not (self.reduced and self.keeps_reduced_dim and self._is_per_row(shape)):
            raise Stop(f"operand {describe(node)} of shape {shape} after a pooling (only scalars, and one value "
                       "per row after a reduction, are read there)")
        if not self.reduced and shape[-1] == self.n and all(d == 1 for d in shape[:-1]):
            return "col"
        if (self.reduced and (self.keeps_reduced_dim or self.broadcast_back) and shape[-1] == self.n
                and all(d == 1 for d in shape[:-1])):  # one value a row against N: a row of N again
            self.broadcast_back, self.keeps_reduced_dim = True, False
            return "col"
        if not self.reduced and (shape == self.shape or self._is_per_leading_rows(shape)):
            return "full"
        if (not self.reduced or self.keeps_reduced_dim) and self._is_per_row(shape):
            return "row"
        raise Stop(f"operand {describe(node)} of shape {shape} is not a per-column vector, a scalar, one value per "
                   "row or of the output's shape")

    def _is_per_leading_rows(self, shape: tuple) -> bool:
        """A tensor of the chain value's trailing shape broadcast along its leading dims ((T, N) or
        (1, T, N) against (B, T, N): a position embedding), where the op's rows are the chain's (no
        view regrouped them): read as an operand of the output's shape, expanded."""
        trailing = shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)):]
        return (len(trailing) >= 2 and tuple(self.shape[:-1]) == self.rows
                and tuple(self.shape[len(self.shape) - len(trailing):]) == tuple(trailing))

    def _is_per_row(self, shape: tuple) -> bool:
        """One value per row of the chain value: (*rows, 1), or a shape that broadcasts to it along
        the leading dims ((B, 1, 1) against (B, T, N): a per-sample scale) where the op's rows are
        the chain's (no view regrouped them)."""
        lead = tuple(self.shape[:-1])
        if len(shape) != len(lead) + 1 or shape[-1] != 1:
            return False
        if tuple(shape[:-1]) == lead:
            return True
        return lead == self.rows and all(d == 1 or d == s for d, s in zip(shape[:-1], lead))

    def _param(self, node: Node, kind: str) -> int:
        if node in self.params:
            return self.params.index(node)
        self.params.append(node)
        self.param_kinds.append(kind)
        return len(self.params) - 1

    def _norm_param(self, node: Node | None) -> int | None:
        """A per-column norm vector (weight, bias, running statistics), any float dtype."""
        if node is None:
            return None
        value = example_value(node)
        if self._is_downstream(node) or not isinstance(value, torch.Tensor):
            raise Stop(f"norm argument {describe(node)} is not a parameter")
        if tuple(value.shape) != (self.n,) or value.dtype not in (self.node_dtype, torch.float32):
            raise Stop(f"norm argument {describe(node)} of shape {tuple(value.shape)}, {value.dtype}")
        return self._param(node, "col")

    def _norm(self, op: NormOp) -> Norm:
        if self.reduced:
            raise Stop("a norm after a row reduction")
        if self.pooled:
            raise Stop("a norm after a pooling")
        family = NORMS[op.kind]
        if family.over_channels and self.ndim != 2:
            raise Stop(f"{op.kind}_norm of a {self.ndim}-D value normalises dim 1, not the features")
        if not family.over_channels and op.normalized_shape != (self.n,):
            raise Stop(f"{op.kind}_norm over {op.normalized_shape}, not the last dim ({self.n})")
        reason = family.check(op, self.n)
        if reason is not None:
            raise Stop(reason)
        eps = RMS_NORM_DEFAULT_EPS if op.eps is None else op.eps
        weight, bias = self._norm_param(op.weight), self._norm_param(op.bias)
        if not family.running_statistics:
            return Norm(op.kind, eps, groups=op.groups, weight=weight, bias=bias)
        has_running = op.running_mean is not None and op.running_var is not None
        if not op.training:
            if not has_running:
                raise Stop("batch_norm in eval mode without running statistics")
            running = self._norm_param(op.running_mean), self._norm_param(op.running_var)
            return Norm("batch", eps, weight=weight, bias=bias, running_mean=running[0],
                        running_var=running[1])
        if self.has_batch_norm_training:
            raise Stop("a second training-mode batch_norm in one chain")
        if has_running:
            if op.momentum is None or self._is_downstream(op.momentum):
                raise Stop("batch_norm with momentum=None")
            for node in (op.running_mean, op.running_var):
                if self._is_downstream(node):
                    raise Stop(f"running statistic {describe(node)} is computed from the chain")
            self.batch_norm_update = BatchNormUpdate(op.running_mean, op.running_var, op.momentum)
        self.has_batch_norm_training = True
        return Norm("batch", eps, weight=weight, bias=bias, training=True)

    def _dropout(self, node: Node, op: DropoutOp) -> Dropout:
        """A dropout stage; its seed is an operand the rewrite draws on each call. Later ops read
        the dropped values only (a value from before it ends the chain, as after a norm)."""
        if self.reduced or self.pooled:
            raise Stop(f"dropout after a {'row reduction' if self.reduced else 'pooling'}")
        return Dropout(op.p, self._param(DropoutSeed(node), "seed"))

    @property
    def pooled(self) -> bool:
        """A pooling narrowed the rows (its stage closed a segment)."""
        return any(isinstance(s, Pool) for s in self.stages)

    def _pool(self, op: PoolOp) -> Pool:
        """A pooling along the features: the rows narrow to the pooled width from here on."""
        if self.reduced or self.pooled:
            raise Stop(f"a pooling after a {'row reduction' if self.reduced else 'pooling'}")
        stage = Pool(op.kind, op.kernel, op.stride)
        self.shape = (*self.shape[:-1], stage.width(self.shape[-1]))
        return stage

    def _rotary(self, op: RotaryOp) -> Rotary:
        """Attention's rotary embedding of the row's heads; its cos and sin tables are "head"
        operands: D values a row, for every P-th row of the chain value (P dividing its rows)."""
        if self.reduced or self.pooled:
            raise Stop(f"a rotary embedding after a {'row reduction' if self.reduced else 'pooling'}")
        d = example_value(op.cos).shape[-1]
        if d % 2 or self.n % d:
            raise Stop(f"a rotary embedding of heads of {d} in rows of {self.n}")
        rows = math.prod(self.shape[:-1])
        for table in (op.cos, op.sin):
            value = example_value(table)
            if self._is_downstream(table):
                raise Stop(f"rotary table {describe(table)} is computed from the chain's value")
            if value.dtype != self.node_dtype or value.device != self.device or value.requires_grad:
                raise Stop(f"rotary table {describe(table)} has dtype {value.dtype} on {value.device}"
                           + (" and a gradient" if value.requires_grad else ""))
            table_rows = math.prod(value.shape[:-1])
            if value.shape[-1] != d or not table_rows or rows % table_rows:
                raise Stop(f"rotary table {describe(table)} of shape {tuple(value.shape)} against rows {self.shape}")
        return Rotary(d, self._param(op.cos, "head"), self._param(op.sin, "head"))

    def _reduces_one_value(self, op: ReduceOp) -> bool:
        """A reduction or row map over the size-1 feature dim a row reduction with keepdim left:
        each row reduces its one value (KernelBench's ``x.mean(1, keepdim=True)`` then softmax)."""
        dims = op.dim if isinstance(op.dim, (list, tuple)) else (op.dim,)
        family = REDUCTIONS[op.kind]
        return (self.keeps_reduced_dim and family.of_one_value is not None and len(dims) == 1
                and isinstance(dims[0], int) and dims[0] % self.ndim == self.ndim - 1)

    def _one_value(self, op: ReduceOp) -> sympy.Expr:
        """The sum, mean, max, min or logsumexp of one value: the value; softmax and log_softmax
        of it: the pointwise function they are there. Without keepdim a reduction drops the
        size-1 dim, which the row reduction before it then drops instead."""
        function = REDUCTIONS[op.kind].of_one_value
        if function != "x":
            return self._rounded(call(function, self._segment_value(op.input)))
        if not op.keepdim:
            index = max(i for i, stage in enumerate(self.stages) if isinstance(stage, Reduce))
            self.stages[index] = replace(self.stages[index], keepdim=False)
            self.ndim -= 1
            self.keeps_reduced_dim = False
        return self._segment_value(op.input)

    def _reduce(self, op: ReduceOp) -> Reduce:
        if self.reduced:
            raise Stop(f"{op.kind} after a row reduction")
        dims = op.dim if isinstance(op.dim, (list, tuple)) else (op.dim,)
        if len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % self.ndim != self.ndim - 1:
            raise Stop(f"{op.kind} over dim {op.dim}, not the feature dim")
        if not REDUCTIONS[op.kind].changes_shape:  # a row map
            stage = Reduce(op.kind, eps=op.eps)
        else:  # max(dim)/min(dim) send the gradient to the index they return (Reduce.ties)
            stage = Reduce(op.kind, op.keepdim, "first" if op.tuple_output else "split", correction=op.correction)
        if stage.changes_shape:
            self.reduced = True
            self.ndim -= 0 if op.keepdim else 1
            self.keeps_reduced_dim = op.keepdim
        return stage

    def _is_downstream(self, node) -> bool:
        """True when ``node`` depends on the GEMM's value (it cannot be an input of the fused op)."""
        if not isinstance(node, Node):
            return False
        if self._downstream is None:
            seen, stack = set(), [self.gemm]
            while stack:
                for user in stack.pop().users:
                    if user not in seen:
                        seen.add(user)
                        stack.append(user)
            self._downstream = seen
        return node in self._downstream or node is self.gemm

