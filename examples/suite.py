"""The public suite (SUITE.md) as data: one ``SuiteRow`` per benchmarked model and size.

Tests, the quickstart and ``bench/bench.py`` all iterate ``ROWS`` so that a row is defined once, in
its example file; this module only says which file, which size and which mode.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn

__all__ = ["SuiteRow", "ROWS", "get_row", "select", "load", "build", "make_inputs"]


@dataclass(frozen=True)
class SuiteRow:
    """One suite entry: the model in ``module`` at ``size``, in eval mode if ``eval_mode``."""

    id: str  # "S01", or "S23-S01-M16" for the decode-shape rows
    module: str  # importable module name, e.g. "examples.s01_scale_leakyrelu"
    size: str = "full"  # key into the module's SIZES used for GPU benchmarks
    eval_mode: bool = False  # models stay in training mode (BatchNorm uses batch stats) unless set
    description: str = ""


_BASE: list[tuple[str, str, str]] = [
    ("S01", "s01_scale_leakyrelu", "Linear, x * 2.0, LeakyReLU(0.1)"),
    ("S02", "s02_groupnorm_leakyrelu_double", "Linear, GroupNorm(512), LeakyReLU(0.01), x + x"),
    ("S03", "s03_batchnorm_gelu_relu", "Linear, BatchNorm1d (train), GELU, ReLU"),
    (
        "S04",
        "s04_groupnorm_swish_scale_swish",
        "Linear, GroupNorm(256), x*sigmoid(x), x * vector, x*sigmoid(x)",
    ),
    ("S05", "s05_logsumexp_leakyrelu_gelu", "Linear, logsumexp(dim=1), LeakyReLU x2, GELU x2"),
    ("S06", "s06_groupnorm_hardtanh", "Linear, GroupNorm(16), Hardtanh(-2, 2)"),
    ("S07", "s07_scale_batchnorm", "Linear, x * vector, BatchNorm1d (train)"),
    ("S08", "s08_swish_bias_groupnorm", "Linear (K=1024), sigmoid(x)*x, + vector, GroupNorm(64)"),
    ("S09", "s09_nobias_bias_relu", "Linear (no bias), + vector, ReLU"),
    ("S10", "s10_divide_gelu", "Linear, x / 10.0, GELU"),
    ("S11", "s11_gelu_softmax", "Linear, GELU, softmax(dim=1)"),
    ("S12", "s12_mish_mish", "Linear, Mish, Mish"),
    ("S13", "s13_subtract_multiply_relu", "Linear, x - 2.0, x * 1.5, ReLU"),
    (
        "S14",
        "s14_swish_divide_clamp_tanh_clamp",
        "Linear (no bias), x*sigmoid(x), / 2, clamp, tanh, clamp",
    ),
    ("S15", "s15_matmul_divide_sum_scale", "matmul(x, W.T), / 2, sum(dim=1), * 1.5"),
    ("S16", "s16_sigmoid_sum", "Linear (128 x 32768 -> 32768), sigmoid, sum(dim=1)"),
    ("S17", "s17_bias_hardtanh_mish_groupnorm", "Linear, + vector, Hardtanh, Mish, GroupNorm(256)"),
    (
        "S18",
        "s18_batchnorm_bias_divide_swish",
        "Linear, BatchNorm1d (train), + vector (1,), / 1.0, x*sigmoid(x)",
    ),
    ("S19", "s19_ffn_gelu_tanh", "FFN on (8, 512, 4096): Linear, GELU(tanh), Linear"),
    ("S20", "s20_layernorm_silu", "Linear on (8, 512, 4096), LayerNorm, SiLU"),
    ("S21", "s21_rmsnorm_silu", "Linear on (8, 512, 4096), RMSNorm, SiLU"),
    ("S22", "s22_eval_head", "eval head: Linear, BatchNorm1d (eval), ReLU, Dropout, Linear"),
    ("S24", "s24_bert_output", "BERT output block on (8, 1024, 16384): LayerNorm(dropout(Linear(h)) + x), eval"),
    ("S25", "s25_gpt2_mlp", "GPT-2 MLP on (8, 1024, 4096): x + dropout(Conv1D(gelu_new(Conv1D(x)))), eval"),
    ("S26", "s26_llama_mlp", "Llama MLP on (8, 1024, 4096): down(silu(gate(x)) * up(x)) + x"),
    ("S27", "s27_prenorm_residual", "pre-norm residual: h = x + Linear(a); returns h and RMSNorm(h)"),
]
_EVAL_ROWS = {"S22", "S24", "S25"}  # S24, S25: their dropout in training is random (tests/test_dropout.py)
_DECODE_ROWS = ["S01", "S02", "S04", "S10"]  # S23: these rows at M = 16 and M = 1
_DECODE_SIZES = [("M16", "decode16"), ("M1", "decode1")]


def _make_rows() -> list[SuiteRow]:
    rows = [
        SuiteRow(id=rid, module=f"examples.{name}", eval_mode=rid in _EVAL_ROWS, description=desc)
        for rid, name, desc in _BASE
    ]
    by_id = {r.id: r for r in rows}
    for base in _DECODE_ROWS:
        for tag, size in _DECODE_SIZES:
            b = by_id[base]
            rows.append(
                SuiteRow(
                    id=f"S23-{base}-{tag}",
                    module=b.module,
                    size=size,
                    eval_mode=b.eval_mode,
                    description=f"decode shape ({tag[1:]} x 8192 -> 8192): {b.description}",
                )
            )
    return rows


ROWS: list[SuiteRow] = _make_rows()
_BY_ID: dict[str, SuiteRow] = {r.id: r for r in ROWS}


def get_row(row_id: str) -> SuiteRow:
    """The row called ``row_id`` (case-insensitive), e.g. ``"S01"`` or ``"S23-S01-M16"``."""
    try:
        return _BY_ID[row_id.upper()]
    except KeyError:
        raise KeyError(f"unknown suite row {row_id!r}; known: {', '.join(_BY_ID)}") from None


def select(ids: list[str] | None = None) -> list[SuiteRow]:
    """Rows named by ``ids``, in that order; ``"S23"`` means all eight decode rows; None: all. An
    id that names an example file instead (``"llama_attention_rope"``) is that model at its full
    size, as a row of its own (examples that are not suite rows)."""
    if not ids:
        return list(ROWS)
    out: list[SuiteRow] = []
    for rid in ids:
        key = rid.strip().upper()
        group = [r for r in ROWS if r.id.startswith(key + "-")]
        if not group and key not in _BY_ID and importlib.util.find_spec(_module_name(rid.strip())) is not None:
            module = load(rid.strip())
            out.append(SuiteRow(id=rid.strip(), module=module.__name__,
                                description=(module.__doc__ or "").strip().split(":")[0]))
            continue
        out.extend(group if group and key not in _BY_ID else [get_row(key)])
    return out


def _module_name(row_or_module_name: SuiteRow | str) -> str:
    if isinstance(row_or_module_name, SuiteRow):
        return row_or_module_name.module
    if row_or_module_name.upper() in _BY_ID:
        return _BY_ID[row_or_module_name.upper()].module
    if "." not in row_or_module_name:  # bare file name such as "s01_scale_leakyrelu"
        return f"examples.{row_or_module_name}"
    return row_or_module_name


def load(row_or_module_name: SuiteRow | str) -> ModuleType:
    """The example module of a row (a SuiteRow, a row id, or a module name)."""
    return importlib.import_module(_module_name(row_or_module_name))


def make_inputs(
    row: SuiteRow | str,
    size: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """A fresh draw of ``row``'s inputs at ``size`` (default: the row's own), on device/dtype."""
    if isinstance(row, str):
        row = get_row(row)
    mod = load(row)
    with torch.device(device):
        inputs = mod.get_inputs(size or row.size)
    return [t.to(dtype=dtype) if t.is_floating_point() else t for t in inputs]


def build(
    row: SuiteRow | str,
    size: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, list[torch.Tensor]]:
    """``(model, inputs)`` for ``row`` at ``size`` (default: the row's own), on device, in dtype.

    Parameters and inputs are created directly on ``device`` (full-size models are large, and
    initialising them on the CPU first is slow); seeding is the caller's business. The model is in
    training mode unless the row is an eval-mode row.
    """
    if isinstance(row, str):
        row = get_row(row)
    mod = load(row)
    size = size or row.size
    with torch.device(device):
        model = mod.Model(*mod.get_init_inputs(size))
    model = model.to(dtype=dtype)
    model.train(not row.eval_mode)
    return model, make_inputs(row, size, device, dtype)
