"""csrc/fx_abi.h's FxGemmInfo read from Python, and the size queries a new GEMM module answers
before any process of the user's loads it.

Only the standard library is imported here: the build runs this file as a script in a child
process (``python -I gemm_info.py LIBRARY ENTRY``, build.probe_size_queries), which then starts in
tens of milliseconds, not the seconds an import of torch takes.
"""

from __future__ import annotations

import ctypes
import sys

# the calls a new module's size queries answer before it is loaded: few rows, odd sizes, many
PROBE_SHAPES = ((1, 64, 64), (7, 520, 264), (4096, 4096, 4096))
PROBE_SMS = 132  # the multiprocessors a workspace query assumes (an H100's)


class GemmInfoView(ctypes.Structure):
    """csrc/fx_abi.h's FxGemmInfo (the configurations, their supports and workspace sizes;
    launches go through csrc/runtime.cpp)."""

    _fields_ = [
        ("abi_version", ctypes.c_int32), ("dtype", ctypes.c_int32), ("out_dtype", ctypes.c_int32),
        ("out_kind", ctypes.c_int32), ("batch_train", ctypes.c_int32), ("channels_dim1", ctypes.c_int32),
        ("num_params", ctypes.c_int32), ("param_kinds", ctypes.POINTER(ctypes.c_int32)),
        ("param_dtypes", ctypes.POINTER(ctypes.c_int32)), ("gated_block", ctypes.c_int32),
        ("first_gated_config", ctypes.c_int32), ("num_configs", ctypes.c_int32),
        ("config_names", ctypes.POINTER(ctypes.c_char_p)),
        ("supports", ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)),
        ("workspace", ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                       ctypes.c_int32)),
    ]


def query_sizes(library: str, entry: str) -> None:
    """Ask the module ``library`` (its FxGemmInfo from ``entry``) every configuration's supports
    and workspace on PROBE_SHAPES: host code that crashes if anything does."""
    function = getattr(ctypes.CDLL(library), entry)
    function.restype = ctypes.c_void_p
    info = GemmInfoView.from_address(function())
    for m, n, k in PROBE_SHAPES:
        for config in range(info.num_configs):
            info.supports(m, n, k, config), info.workspace(m, n, k, PROBE_SMS, config)


if __name__ == "__main__":
    query_sizes(sys.argv[1], sys.argv[2])
