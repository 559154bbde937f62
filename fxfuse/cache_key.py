"""What torch's compile caches must key on besides the fused graph.

Inductor's FX graph cache and AOTAutograd's cache key a compiled graph on the graph handed to
``compile_fx`` — for fxfuse, the rewritten graph with each fused op's program string — but not on
the Python that AOTAutograd traces the fused op's backward from (fxfuse.op, fxfuse.reference, the
vocabulary, the choice of the generated backward). Without more, a cached backward outlives a
change of that code or of ``FXFUSE_GENERATED_BACKWARD``. Both caches key on the uuid of a custom
post-grad pass, so the backend installs one that does nothing and whose uuid is the hash of
fxfuse's Python sources and of the settings read when the backward is traced.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

TRACE_TIME_SETTINGS = ("FXFUSE_GENERATED_BACKWARD",)  # environment read while a backward is traced


@functools.lru_cache(maxsize=None)
def _sources_hash() -> str:
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fxfuse_uuid() -> str:
    """The sources' hash and the trace-time settings, as one string."""
    settings = ",".join(f"{name}={os.environ.get(name, '')}" for name in TRACE_TIME_SETTINGS)
    return f"fxfuse:{_sources_hash()}:{settings}"


class KeyedPass(CustomGraphPass):
    """A post-grad pass that runs ``inner`` (the user's own pass, if any) and keys the caches on
    fxfuse's uuid as well as on ``inner``'s."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._uuid = fxfuse_uuid()

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        if self.inner is None:
            return self._uuid
        inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
        return None if inner is None else (self._uuid, inner)  # None: the inner pass bypasses caching


def keyed_options(options: dict) -> dict:
    """``options`` with the keyed pass in the post-grad slot (wrapping a pass already there)."""
    from torch._inductor import config

    slot = "post_grad_custom_pre_pass"
    inner = options.get(slot, getattr(config, slot))
    return {**options, slot: KeyedPass(inner)}
