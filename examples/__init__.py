"""The public suite's models (see SUITE.md), one KernelBench-style file per row.

Each module has ``SIZES`` (``"full"`` is the GPU benchmark size, ``"small"`` the CPU test size,
``"tiny"`` the 8 x 64 -> 64 size used to measure per-call CPU cost), ``Model``,
``get_init_inputs(size)`` and ``get_inputs(size)``. ``examples.suite`` lists the rows.
"""
