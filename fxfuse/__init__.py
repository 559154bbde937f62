"""fxfuse: GEMM-epilogue fusion for torch.compile.

``torch.compile(model, backend="fxfuse")`` finds every GEMM followed by a chain of epilogue ops in
Dynamo's graph and replaces the chain with one fused op (``torch.ops.fxfuse.linear_epilogue``);
Inductor compiles the rest. The backend is registered through the ``torch_dynamo_backends`` entry
point, so importing fxfuse is not needed to use it (and does not register it again).
"""

from __future__ import annotations

from . import cuda as _cuda  # noqa: F401 - registers the ops' CUDA kernels (imports nothing of CUDA itself)
from .ir import Gemm, Norm, Pointwise, Program, Reduce
from .patterns.activations import register_activation
from .report import Report, last_report, reset_report
from .run_report import report

__all__ = [
    "Gemm", "Norm", "Pointwise", "Program", "Reduce", "Report", "last_report", "register_activation",
    "report", "reset_report",
]
__version__ = "0.1.0"
