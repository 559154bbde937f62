"""A model met at many batch sizes: what each size's first call costs, and its calls after that.

    python bench/dynamic_batch.py [--device cuda|cpu] [--dtype bf16|fp16|fp32] [--hidden H]
                                  [--sizes 1024,2048,300,16,4096,64] [--calls 200] [--json out.json]

``FourChains`` (bench/compile_time.py: four GEMMs, four kinds of epilogue, eval mode) compiled once
per backend with torch.compile's defaults: Dynamo compiles the first size as a static graph and the
second as a graph with a symbolic batch, which then serves every later size. Under fxfuse the
selection times each chain at the size a graph was traced with; a call in another bucket of M is
timed on its first call (Engine.measure_call). For each size in order this prints the first call's
wall time (synchronized: compiles, builds and that timing included) and then the GPU time per call
of ``--calls`` calls back to back (after a warm-up), fxfuse against Inductor. Builds come from
the caches as they are (bench/compile_time.py times cold compiles); Dynamo is reset before each
backend's run, so both see the first size static and the second symbolic. fxfuse's coverage
report follows the table: its graphs' chains, their paths and measured times. On a CPU
(``--device cpu``, fxfuse's reference kernels under ``allow_cpu``) it checks the script only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fxfuse  # noqa: E402

from bench.compile_time import DTYPES, FourChains  # noqa: E402
from fxfuse.cuda.timing import time_us  # noqa: E402

BACKENDS = ("inductor", "fxfuse")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_ms(call, device: str, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls back to back after a warm-up: GPU time between CUDA
    events on a GPU, wall time on a CPU."""
    for _ in range(10):
        call()
    synchronize(device)
    if device == "cuda":
        return time_us(call, calls) / 1000.0
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) * 1000.0 / calls


def run_sizes(backend: str, args) -> list[dict]:
    """The first call's seconds and then the per-call milliseconds at each size, in order."""
    torch._dynamo.reset()  # Dynamo's sizes seen so far (which dims it makes symbolic) belong to one backend's run
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model = FourChains(args.hidden).to(args.device, dtype).eval()
    options = {"allow_cpu": True} if backend == "fxfuse" and args.device == "cpu" else None
    compiled = torch.compile(model, backend=backend, options=options)
    results = []
    with torch.no_grad():
        for rows in args.sizes:
            x = torch.randn(rows, args.hidden, device=args.device, dtype=dtype)
            synchronize(args.device)
            start = time.perf_counter()
            compiled(x)
            synchronize(args.device)
            first = time.perf_counter() - start
            results.append({"rows": rows, "first_s": first,
                            "per_call_ms": per_call_ms(lambda: compiled(x), args.device, args.calls)})
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--sizes", default="1024,2048,300,16,4096,64",
                        type=lambda text: [int(s) for s in text.split(",")])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fxfuse.reset_report()
    results = {backend: run_sizes(backend, args) for backend in BACKENDS}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, FourChains({args.hidden}), sizes in this order")
    print(f"{'rows':>6}{'Inductor first s':>18}{'fxfuse first s':>16}{'Inductor ms':>13}{'fxfuse ms':>11}"
          f"{'fxfuse / Inductor':>19}")
    for inductor, ours in zip(results["inductor"], results["fxfuse"]):
        print(f"{inductor['rows']:>6}{inductor['first_s']:>18.2f}{ours['first_s']:>16.2f}"
              f"{inductor['per_call_ms']:>13.3f}{ours['per_call_ms']:>11.3f}"
              f"{ours['per_call_ms'] / inductor['per_call_ms']:>19.2f}")
    rows = fxfuse.last_report().rows  # the static graph's chains, then the symbolic graph's
    print(f"fxfuse fused {sum(r.status == 'fused' for r in rows)} of {len(rows)} chains in its graphs:")
    print(fxfuse.last_report())
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "dtype": args.dtype,
                                               "hidden": args.hidden, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
