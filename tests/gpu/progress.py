"""Progress of long builds inside test fixtures, shown although pytest captures output."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def shown(request, what: str):
    """Lets a build inside a fixture print its progress (pytest captures it otherwise): a first
    line saying what is built and how to skip it, then the builds' own line per module."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{what}", file=sys.stderr, flush=True)
        yield
