"""The correctness rule low-precision results are held to, element by element.

An element of a result agrees with eager's when it is within ``tol`` (atol = rtol) of eager's, or
no further from the float64 answer than eager's is (Inductor's accuracy rule, taken per element);
NaN where eager has NaN, an infinity where eager has the same one. fxfuse's chains compute in
float32 and round once where eager rounds after every op, so they are held to this rule, not to
eager's rounding. One definition for the tests, the benchmark and the diagnostics.
"""

from __future__ import annotations

import torch


def rule_breaks(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, tol: float) -> torch.Tensor:
    """The elements of ``out`` that break the rule against eager's result ``eager`` and the float64
    answer ``exact`` (a boolean tensor of their shape)."""
    o, e, x = out.double(), eager.double(), exact.double()
    close = ((o - e).abs() <= tol + tol * e.abs()) & e.isfinite()  # tol * inf would take any value
    no_further = (o - x).abs() <= (e - x).abs() * 1.0001 + 1e-6
    same_inf = o.isinf() & (o == e)
    return (o.isnan() != e.isnan()) | ~(close | no_further | same_inf | e.isnan())
