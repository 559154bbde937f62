"""Which builds a GPU test run needs: those its selected tests name, so that a run narrowed with
``-k`` builds the modules of the tests it selects (at once, in parallel), not every module of
their files."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import pytest

Key = TypeVar("Key")


def selected(request: pytest.FixtureRequest, keys: Iterable[Key],
             named: Callable[[pytest.Item, Key], bool]) -> list[Key]:
    """The keys that some selected test of the requesting file names (``named(item, key)``), in
    the order of ``keys``."""
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    return [key for key in keys if any(named(item, key) for item in items)]


def parameters(item: pytest.Item) -> dict:
    """A test's parameters (empty for a test without any)."""
    return getattr(getattr(item, "callspec", None), "params", {})
