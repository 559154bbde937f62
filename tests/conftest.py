"""Shared test setup: a fresh Dynamo cache and report per test, deterministic seeds, and true
float32 GEMMs on CUDA (TF32 off, as PyTorch's default) unless a test turns TF32 on."""

import pytest
import torch

import fxfuse


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    torch._dynamo.reset()
    fxfuse.reset_report()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
