"""GPU benchmarks for fxfuse: ``python bench/bench.py --help``; ``bench.bench.run`` from Python."""
