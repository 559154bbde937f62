"""The correctness rule, element by element (fxfuse.accuracy): an element agrees with eager's when
it is within the tolerance of it, or no further from the float64 answer than eager's is."""

from __future__ import annotations

import torch

from fxfuse.accuracy import rule_breaks

TOL = 1e-2
EXACT = torch.tensor([1.0, 2.0, -3.0])


def breaks(out, eager, exact=EXACT):
    return rule_breaks(torch.tensor(out), torch.tensor(eager), exact, TOL).tolist()


def test_an_element_within_the_tolerance_of_eagers_agrees_however_far_from_the_answer():
    assert breaks([1.5, 2.0, -3.0], [1.49, 2.0, -3.0]) == [False, False, False]


def test_an_element_off_eagers_but_nearer_the_answer_agrees():
    assert breaks([1.0, 2.0, -3.0], [1.5, 2.0, -3.05]) == [False, False, False]


def test_an_element_off_eagers_and_further_from_the_answer_breaks_the_rule():
    assert breaks([1.5, 2.0, -3.2], [1.1, 2.0, -3.1]) == [True, False, True]


def test_nan_agrees_only_where_eager_has_nan_and_infinity_only_where_eager_has_the_same_one():
    nan, inf = float("nan"), float("inf")
    exact = torch.tensor([1.0, nan, inf, inf])
    assert breaks([nan, 1.0, inf, -inf], [1.0, nan, inf, inf], exact) == [True, True, False, True]
    assert breaks([nan], [nan], torch.tensor([nan])) == [False]


def test_low_precision_results_are_judged_in_float64():
    out = torch.tensor([1.0078125], dtype=torch.bfloat16)  # one bf16 step above 1
    eager = torch.tensor([1.0], dtype=torch.bfloat16)
    assert not rule_breaks(out, eager, torch.tensor([1.2]), TOL).any()  # nearer the answer
    assert not rule_breaks(out, eager, torch.tensor([0.0]), TOL).any()  # within 1e-2 + 1e-2 * 1
