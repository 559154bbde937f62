"""Step 6: the coverage report — one row per GEMM: its chain, what fused, and why it stopped."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import tabulate

from .describe import describe
from .match import Chain

STATUSES = ("fused", "partial", "not_fused")


@dataclass(frozen=True)
class Row:
    graph: int
    gemm: str
    status: str
    chain: list[str]
    fused: list[str]
    reason: str | None
    program: str | None
    dtype: str | None
    path: str | None = None  # the GPU path taken and the measured times

    @staticmethod
    def of(graph: int, chain: Chain) -> "Row":
        return Row(
            graph=graph,
            gemm=chain.chain[0] if chain.chain else "",
            status=chain.status,
            chain=list(chain.chain),
            fused=list(chain.fused),
            reason=chain.reason,
            program=None if chain.program is None else chain.program.to_string(),
            dtype=None if chain.dtype is None else str(chain.dtype).removeprefix("torch."),
            path=chain.path,
        )

    @staticmethod
    def all_of(graph: int, chain: Chain) -> list["Row"]:
        """The chain's row, then one for each second GEMM its op runs (a gated MLP's up
        projection): that GEMM is fused, or not, with the chain; the path and its times are the
        op's, shown on the chain's row only."""
        row = Row.of(graph, chain)
        rows = [row]
        for gemm in chain.second_gemms:
            joined = [describe(gemm), f"second GEMM of {row.gemm}'s op"]
            rows.append(replace(row, gemm=joined[0], chain=joined, fused=joined if row.fused else [], path=None))
        return rows


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, int]:
        counts = {status: sum(r.status == status for r in self.rows) for status in STATUSES}
        return {"gemms": len(self.rows), **counts}

    def to_dict(self) -> dict:
        return {"rows": [asdict(r) for r in self.rows], "totals": self.totals}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        paths = any(r.path for r in self.rows)
        table = [
            [r.graph, r.status, " → ".join(r.chain), r.reason or "", r.program or ""] + ([r.path or ""] if paths else [])
            for r in self.rows
        ]
        headers = ["graph", "status", "chain", "stopped because", "program"] + (["GPU path"] if paths else [])
        widths = [None, None, 50, 40, 60] + ([40] if paths else [])
        totals = ", ".join(f"{v} {k}" for k, v in self.totals.items())
        return f"{tabulate.tabulate(table, headers, maxcolwidths=widths)}\n{totals}"


class Collector:
    """Receives the rows of every graph the backend compiles."""

    def __init__(self) -> None:
        self.report = Report()
        self.graphs = 0

    def add_graph(self, chains: list[Chain]) -> None:
        self.report.rows.extend(row for c in chains for row in Row.all_of(self.graphs, c))
        self.graphs += 1


_LAST = Collector()
_ACTIVE: list[Collector] = []


def record(chains: list[Chain]) -> None:
    """Called by the backend once per compiled graph."""
    _LAST.add_graph(chains)
    for collector in _ACTIVE:
        collector.add_graph(chains)


def last_report() -> Report:
    """Rows of every graph compiled with backend="fxfuse" since the last ``reset_report()``."""
    return _LAST.report


def reset_report() -> None:
    global _LAST
    _LAST = Collector()
