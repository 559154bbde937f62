"""``fxfuse.report(model, *inputs)``: compile a copy of the model, run it once, return the report."""

from __future__ import annotations

import copy

import torch

from . import report as _report


def report(model: torch.nn.Module, *inputs, **options) -> _report.Report:
    """Coverage of ``model`` on ``inputs``: one row per GEMM in every graph Dynamo captured.

    ``options`` are torch.compile options for the fxfuse backend (``allow_cpu=True`` to fuse CPU
    tensors). The model is deep-copied first, so its BatchNorm statistics are left untouched.
    """
    from .backend import fxfuse_backend

    def backend(gm, example_inputs, **kwargs):  # a new backend object: Dynamo compiles afresh
        return fxfuse_backend(gm, example_inputs, **kwargs)

    collector = _report.Collector()
    _report._ACTIVE.append(collector)
    try:
        compiled = torch.compile(copy.deepcopy(model), backend=backend, options=options or None)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1 << 20):
            compiled(*inputs)
    finally:
        _report._ACTIVE.remove(collector)
    return collector.report
