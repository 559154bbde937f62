"""``python -m fxfuse report FILE.py[:ModelName] [--size NAME] [--json]``

FILE.py follows the KernelBench problem-file convention: it defines the model class (``Model`` by
default), ``get_inputs()`` and, when the constructor takes arguments, ``get_init_inputs()``. The
model runs on CUDA when there is a GPU, else on the CPU with ``allow_cpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from .run_report import report


def _load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _call(fn, size: str | None):
    return fn(size) if size is not None and inspect.signature(fn).parameters else fn()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxfuse")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("report", help="coverage report of a model file")
    cmd.add_argument("target", help="FILE.py or FILE.py:ModelName")
    cmd.add_argument("--size", help="size name passed to get_inputs/get_init_inputs, if they take one")
    cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    path, _, name = args.target.partition(":")
    module = _load(path)
    model_class = getattr(module, name or "Model")
    init = _call(module.get_init_inputs, args.size) if hasattr(module, "get_init_inputs") else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_class(*init).to(device)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in _call(module.get_inputs, args.size)]
    result = report(model, *inputs, **({"allow_cpu": True} if device == "cpu" else {}))
    print(result.to_json(indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
