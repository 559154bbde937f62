"""tests/gpu: the CUDA path of fxfuse.

Files ending in ``_cpu.py`` run anywhere (code generator, device functions compiled as host code,
the kernels under the host emulator, build cache and locks); they skip what needs a compiler they
cannot find. Every other test file needs a CUDA device and is not collected without one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import programs`
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: `import support`


def pytest_ignore_collect(collection_path, config):
    """Without CUDA, only the *_cpu.py test files of this directory are collected."""
    if torch.cuda.is_available():
        return None
    name = collection_path.name
    if name.startswith("test_") and name.endswith(".py") and not name.endswith("_cpu.py"):
        return True
    return None
