"""``fxfuse.report(model, *inputs)``: compile the model, run it once, return the report."""

from __future__ import annotations

import torch

from . import report as _report


def report(model: torch.nn.Module, *inputs, **options) -> _report.Report:
    """Coverage of ``model`` on ``inputs``: one row per GEMM in every graph Dynamo captured.

    ``options`` are torch.compile options for the fxfuse backend (``allow_cpu=True`` to fuse CPU
    tensors). The model is not copied (a copy would double the memory of a large one): its
    buffers (BatchNorm statistics) are saved first and restored after the run, and the run is
    under ``torch.no_grad()``, so the parameters are untouched.
    """
    from .backend import fxfuse_backend

    def backend(gm, example_inputs, **kwargs):  # a new backend object: Dynamo compiles afresh
        return fxfuse_backend(gm, example_inputs, **kwargs)

    collector = _report.Collector()
    _report._ACTIVE.append(collector)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        compiled = torch.compile(model, backend=backend, options=options or None)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1 << 20):
            compiled(*inputs)
    finally:
        _report._ACTIVE.remove(collector)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return collector.report
