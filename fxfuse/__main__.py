"""fxfuse's command line: ``python -m fxfuse {report, cache} ...`` (``--help`` on each).

``report FILE.py[:ModelName]``: the coverage report of a model file. FILE.py follows the
KernelBench problem-file convention: it defines the model class (``Model`` by default),
``get_inputs()`` and, when the constructor takes arguments, ``get_init_inputs()``; the examples'
files also take a size name (``get_inputs(size)``). The model runs on CUDA when there is a GPU,
else on the CPU with ``allow_cpu``, unless ``--device`` says otherwise.

``cache``: where the build cache is, its size and entries; ``--clear`` empties it.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

DESCRIPTION = (
    "fxfuse: GEMM-epilogue fusion for torch.compile (backend=\"fxfuse\"). Each GEMM and the chain of "
    "epilogue ops after it becomes one fused op; these commands show what fuses and manage the builds."
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(Exception):
    """A bad argument: printed as one line, exit status 2."""


def _load(path: str):
    if not Path(path).is_file():
        raise UsageError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _takes_size(fn) -> bool:
    return bool(inspect.signature(fn).parameters)


def _call(fn, size: str | None):
    return fn(size) if size is not None and _takes_size(fn) else fn()


def _sizes(module) -> list[str]:
    """The size names a file's ``get_inputs(size)`` knows, where it says (a ``SIZES`` mapping)."""
    sizes = getattr(module, "SIZES", None)
    return sorted(sizes) if isinstance(sizes, dict) else []


def report_command(args) -> int:
    from .run_report import report

    path, _, name = args.target.partition(":")
    module = _load(path)
    name = name or "Model"
    if not isinstance(getattr(module, name, None), type):
        raise UsageError(f"{path} defines no model class {name!r}")
    if not hasattr(module, "get_inputs"):
        raise UsageError(f"{path} defines no get_inputs()")
    if args.size is not None:
        if not _takes_size(module.get_inputs):
            raise UsageError(f"--size: {path}'s get_inputs() takes no size; its sizes are the module-level "
                             "values it uses (edit them, or write get_inputs(size))")
        known = _sizes(module)
        if known and args.size not in known:
            raise UsageError(f"--size: {args.size!r} is not one of {', '.join(known)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    dtype = DTYPES[args.dtype]
    init = _call(module.get_init_inputs, args.size) if hasattr(module, "get_init_inputs") else []
    with torch.device(device):
        model = getattr(module, name)(*init)
    model = model.to(device=device, dtype=dtype)
    model.train(not args.eval)
    inputs = [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) if isinstance(t, torch.Tensor)
              else t for t in _call(module.get_inputs, args.size)]
    options = {"policy": args.policy}
    if device.type == "cpu":
        options["allow_cpu"] = True
    result = report(model, *inputs, **options)
    print(result.to_json(indent=2) if args.json else result)
    return 0


def cache_command(args) -> int:
    from .cuda.build import cache_summary, clear_cache, configured_cache_root

    if args.clear:
        freed = clear_cache()
        print(f"cleared {configured_cache_root()} ({freed / 2**20:.1f} MiB)")
        return 0
    summary = cache_summary()
    entries = ", ".join(f"{n} {kind}" for kind, n in sorted(summary.entries.items())) or "no builds"
    print(f"{summary.root}\n{summary.bytes / 2**20:.1f} MiB: {entries}; {summary.selections} measured path choices\n"
          "(FXFUSE_CACHE_DIR moves it; `python -m fxfuse cache --clear` empties it)")
    return 0


def parser() -> argparse.ArgumentParser:
    from .policy import POLICIES

    p = argparse.ArgumentParser(prog="python -m fxfuse", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True, metavar="{report,cache}")
    cmd = sub.add_parser("report", help="coverage report of a model file: what fuses, on which path, and why not",
                         description="Compile the model with backend='fxfuse', run it once on its inputs and "
                                     "print one row per GEMM (the program column is fxfuse's IR: stages separated "
                                     "by ' | ', then ' || ' and the kind of each parameter p0, p1, ...: 'col' a "
                                     "per-column vector, 'scalar' one value).")
    cmd.add_argument("target", help="FILE.py or FILE.py:ModelName (KernelBench convention: Model, get_inputs(), "
                                    "get_init_inputs())")
    cmd.add_argument("--size", help="size name for get_inputs(size)/get_init_inputs(size) (the examples': the keys "
                                    "of their SIZES, e.g. small, full); files whose get_inputs() takes none keep their own sizes")
    cmd.add_argument("--eval", action="store_true", help="report the model in eval mode (default: training mode)")
    cmd.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="model and input dtype (default fp32)")
    cmd.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    cmd.add_argument("--policy", choices=list(POLICIES), default="fastest",
                     help="'fastest' leaves chains to Inductor where it measured faster; 'always' fuses all")
    cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    cmd.set_defaults(run=report_command)
    cache = sub.add_parser("cache", help="where the build cache is, its size and entries",
                           description="The JIT build cache (FXFUSE_CACHE_DIR or ~/.cache/fxfuse): compiled "
                                       "kernels and measured path choices.")
    cache.add_argument("--clear", action="store_true", help="remove every build and choice from the cache")
    cache.set_defaults(run=cache_command)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:
        print(f"python -m fxfuse {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
