"""Shared test setup: a fresh Dynamo cache and report per test, deterministic seeds."""

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
