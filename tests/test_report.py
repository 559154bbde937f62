"""The coverage report: rows, totals, JSON, the CLI, and the last compile's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from examples import suite
from support import check_against_eager

ROOT = Path(__file__).resolve().parents[1]


def _s19():
    mod = suite.load("S19")
    return mod.Model(*mod.get_init_inputs("small")), mod.get_inputs("small")


def test_report_has_one_row_per_gemm_with_status_chain_and_reason():
    model, inputs = _s19()
    report = fxfuse.report(model, *inputs, allow_cpu=True)
    first, second = report.rows
    assert first.status == "fused" and first.fused == ["linear", "gelu"]
    assert first.chain == ["linear", "gelu", "linear"]  # stopped at the next GEMM
    assert "gelu_tanh" in first.program
    assert second.status == "not_fused" and second.reason == "no epilogue op after the GEMM"
    assert report.totals == {"gemms": 2, "fused": 1, "partial": 0, "not_fused": 1}


def test_report_to_dict_and_json():
    model, inputs = _s19()
    data = fxfuse.report(model, *inputs, allow_cpu=True).to_dict()
    assert set(data) == {"rows", "totals"}
    assert {"status", "chain", "fused", "reason", "program"} <= set(data["rows"][0])
    assert json.loads(fxfuse.report(model, *inputs, allow_cpu=True).to_json()) == data


def test_report_text_is_a_table_with_totals():
    model, inputs = _s19()
    text = str(fxfuse.report(model, *inputs, allow_cpu=True))
    assert "status" in text and "linear → gelu → linear" in text
    assert text.splitlines()[-1] == "2 gemms, 1 fused, 0 partial, 1 not_fused"


def test_report_leaves_the_model_untouched():
    mod = suite.load("S03")
    model = mod.Model(*mod.get_init_inputs("small"))
    before = model.batch_norm.running_mean.clone()
    fxfuse.report(model, *mod.get_inputs("small"), allow_cpu=True)
    assert torch.equal(model.batch_norm.running_mean, before)


def test_partial_chain_names_the_op_it_stopped_at():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 16)

        def forward(self, x):
            return torch.cumsum(torch.relu(self.linear(x)), dim=1)

    (row,) = fxfuse.report(Model(), torch.randn(4, 8), allow_cpu=True).rows
    assert row.status == "partial" and row.fused == ["linear", "relu"]
    assert row.chain[-1] == "cumsum(1)" and "cumsum(1) is not an epilogue op" in row.reason


def test_a_gemm_fxfuse_cannot_take_still_gets_a_row_with_the_reason():
    """Batched matmuls of activations (matmul, bmm, baddbmm, einsum of 3-D values) are in the
    report too, beside the GEMMs fxfuse takes (here GPT-2's Conv1D spelling, addmm with the weight
    stored (K, N))."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 16))  # (K, N)
            self.bias = nn.Parameter(torch.randn(16))

        def forward(self, x):
            y = torch.relu(torch.addmm(self.bias, x, self.weight)).unsqueeze(0)
            yt = y.transpose(1, 2)
            return (torch.relu(y @ yt), torch.bmm(y, yt).relu(), torch.baddbmm(x[:1, :1], y, yt).relu(),
                    torch.einsum("bij,bjk->bik", y, yt).relu())

    rows = fxfuse.report(Model(), torch.randn(4, 8), allow_cpu=True).rows
    assert rows[0].fused == ["addmm", "relu"]  # the weight stored (K, N): read as its transpose
    assert [(r.status, r.reason) for r in rows[1:]] == [
        ("not_fused", "a batched matmul: its right operand is not a 2-D weight"),
        ("not_fused", "a batched matmul (bmm) of two 3-D values"),
        ("not_fused", "a batched matmul (baddbmm) of two 3-D values"),
        ("not_fused", "einsum 'bij,bjk->bik' is not a GEMM by a 2-D weight"),
    ]


def test_einsum_and_matmul_by_a_weight_stored_k_by_n_are_gemms():
    """``einsum("bk,nk->bn", x, W)`` is a Linear; ``x @ W`` and ``einsum("...k,kn->...n")`` with
    W stored (K, N) are GPT-2's Conv1D without the bias: all fuse, gradients included."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.w_kn = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return (torch.relu(torch.einsum("bk,nk->bn", x, self.w)), torch.tanh(x @ self.w_kn),
                    torch.sigmoid(torch.einsum("...k,kn->...n", x, self.w_kn)))

    report = check_against_eager(Model, lambda: [torch.randn(4, 8)], train=True, grads=True)
    assert [(r.status, r.chain) for r in report.rows] == [
        ("fused", ["einsum", "relu"]), ("fused", ["matmul", "tanh"]), ("fused", ["einsum", "sigmoid"])]


def test_last_report_holds_the_graphs_of_the_last_compiles():
    model, inputs = _s19()
    fxfuse.reset_report()
    torch.compile(model, backend="fxfuse", options={"allow_cpu": True})(*inputs)
    assert [r.status for r in fxfuse.last_report().rows] == ["fused", "not_fused"]


def test_cli_reports_a_kernelbench_style_file():
    result = subprocess.run(
        [sys.executable, "-m", "fxfuse", "report", str(ROOT / "examples/s02_groupnorm_leakyrelu_double.py"),
         "--size", "small", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["totals"]["fused"] == 1
    assert data["rows"][0]["fused"] == ["linear", "group_norm(8, 1e-05)", "leaky_relu(0.01)", "add"]


def test_cli_takes_a_model_class_name(tmp_path):
    path = tmp_path / "problem.py"
    path.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(8, 16)\n"
        "    def forward(self, x):\n"
        "        return torch.sigmoid(self.fc(x)).sum(dim=1)\n"
        "def get_inputs():\n"
        "    return [torch.rand(4, 8)]\n"
    )
    result = subprocess.run([sys.executable, "-m", "fxfuse", "report", f"{path}:Net"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "1 gemms, 1 fused" in result.stdout


def test_a_gated_mlps_up_projection_row_names_the_op_it_joined_and_its_path_shows_once():
    """The up projection of ``silu(gate(x)) * up(x)`` runs inside the gate's op: its row says so,
    fused with it, and the GPU path measured for that op is on the gate's row only."""
    from dataclasses import replace

    from fxfuse.canonicalize import canonicalize
    from fxfuse.match import Decision, match_all
    from fxfuse.report import Row
    from support import captured

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x):
            return torch.nn.functional.silu(self.gate(x)) * self.up(x)

    gm, _ = captured(Gated(), torch.randn(4, 8))
    (chain,) = match_all(gm.graph, canonicalize(gm.graph), allow_cpu=True)
    gate, up = Row.all_of(0, replace(chain, decision=Decision("in-GEMM epilogue; measured: ...")))
    assert gate.status == up.status == "fused" and up.chain == ["linear", "second GEMM of linear's op"]
    assert gate.path == "in-GEMM epilogue; measured: ..." and up.path is None


def test_a_chain_whose_value_nothing_reads_says_so():
    """A GEMM chain computed and then dropped (transformers' pooler when only the last hidden
    state is used) is not fused, and the report says why."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.pooler = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.body(x))
            torch.tanh(self.pooler(h[:, 0]))  # computed, never used
            return h

    rows = fxfuse.report(Model(), torch.randn(2, 3, 8), allow_cpu=True).rows
    assert rows[0].fused == ["linear", "relu"]  # (then read by the pooler's row selection)
    assert rows[1].status == "not_fused"
    assert rows[1].reason == "nothing reads the chain's value (dead code, which Inductor removes)"


def test_a_chain_read_by_a_row_selection_is_fused_in_full():
    """BERT's and ViT's last block: Linear, + residual, LayerNorm, its value returned and its first
    token taken by the pooler (``h[:, 0]``). Picking whole rows leaves the epilogue nothing to do:
    the chain ends there as it ends at the next GEMM. An index into the features does not."""

    class Model(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.dense, self.norm, self.pooler, self.index = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), index

        def forward(self, x, residual):
            h = self.norm(self.dense(x) + residual)
            picked = h[self.index]
            return h, torch.tanh(self.pooler(picked)) if picked.shape[-1] == 8 else picked

    inputs = (torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    for index, shown in (((slice(None), 0), "[:, 0]"), ((Ellipsis, 0, slice(None)), "[..., 0, :]"), (0, "[0]")):
        rows = fxfuse.report(Model(index), *inputs, allow_cpu=True).rows
        assert (rows[0].status, rows[0].chain[-1]) == ("fused", shown)
    rows = fxfuse.report(Model((Ellipsis, slice(None, 4))), *inputs, allow_cpu=True).rows
    assert (rows[0].status, rows[0].chain[-1], rows[0].reason) == ("partial", "[..., :4]", "indexing")


def test_rows_picked_by_index_tensors_end_a_chain_fused_in_full():
    """CLIP's text tower: the last block's normalised value, then each sequence's end-of-text row
    (``h[torch.arange(B), positions]``, integer index tensors on the leading dims) for the
    projection. An index tensor into the features stops the chain."""

    class Model(nn.Module):
        def __init__(self, into_features=False):
            super().__init__()
            self.dense, self.norm, self.projection = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)
            self.into_features = into_features

        def forward(self, x, residual, positions):
            h = self.norm(self.dense(x) + residual)
            if self.into_features:
                return h[..., positions]
            return self.projection(h[torch.arange(h.shape[0]), positions])

    inputs = (torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.tensor([2, 0]))
    rows = fxfuse.report(Model(), *inputs, allow_cpu=True).rows
    assert rows[0].status == "fused" and "layer_norm" in rows[0].program
    rows = fxfuse.report(Model(into_features=True), *inputs, allow_cpu=True).rows
    assert (rows[0].status, rows[0].reason) == ("partial", "indexing")


def test_a_value_transposed_for_a_gemm_or_the_output_ends_a_chain_fused_in_full():
    """CLIP's logits: ``text @ image.t()`` (a move to the device it is on between), scaled, returned
    transposed. Nothing is left for an epilogue: the chains end there as at a GEMM reading the
    value. A transpose read by an elementwise op is not an end."""

    class Model(nn.Module):
        def __init__(self, then_relu=False):
            super().__init__()
            self.text, self.image, self.then_relu = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False), then_relu

        def forward(self, t, i, scale):
            text = F.normalize(self.text(t), dim=-1)
            image = F.normalize(self.image(i), dim=-1)
            logits = text @ image.t().to(text.device) * scale
            return torch.relu(logits.t()) if self.then_relu else logits.t()

    inputs = (torch.randn(5, 8), torch.randn(3, 8), torch.tensor(2.0))
    rows = fxfuse.report(Model(), *inputs, allow_cpu=True).rows
    assert [r.status for r in rows] == ["fused"] * 3, [(r.status, r.reason) for r in rows]
    assert "normalize(eps=1e-12)" in rows[0].program and rows[2].program.endswith("|| scalar")
    rows = fxfuse.report(Model(then_relu=True), *inputs, allow_cpu=True).rows
    assert rows[2].status == "partial" and rows[2].reason.startswith("t moves the feature dim")


def test_a_transpose_of_the_output_names_the_feature_dim_it_moves():
    """MLP-Mixer's token-mixing MLP: ``fc2(h).transpose(1, 2) + x``. The kernels write the GEMM's
    rows of features; the report says that the transpose moves them, not merely that it is no
    epilogue op."""

    class TokenMixing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x.transpose(1, 2)))).transpose(1, 2)

    rows = fxfuse.report(TokenMixing(), torch.randn(2, 16, 8), allow_cpu=True).rows
    assert [r.status for r in rows] == ["fused", "not_fused"]
    assert rows[1].reason == ("transpose(1, 2) moves the feature dim (the output transposed, as a token-mixing "
                              "MLP's): the kernels write the GEMM's rows of features, so the chain ends before it")


def test_a_chain_on_the_gpu_without_a_gemm_module_says_why(monkeypatch):
    """At policy "always" nothing is timed against the row pass where the chain has no GEMM
    module, and the report says why it has none: here a float32 GEMM while torch does not allow
    TF32 (the in-GEMM path computes in TF32). (The GPU back end stood in for: the chain counts as
    a CUDA chain, nothing builds, and the selection finds no module, as it does on a GPU.)"""
    from fxfuse import backend, cuda

    monkeypatch.setattr(backend, "_on_cuda", lambda chain: chain.fusion is not None)
    monkeypatch.setattr(cuda, "prepare_many", lambda items, workers=None, gemm_items=(): {})
    monkeypatch.setattr(cuda, "select", lambda *args: None)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model, inputs = _s19()
    report = fxfuse.report(model, *inputs, allow_cpu=True, policy="always")
    fused = [row for row in report.rows if row.status == "fused"]
    assert fused and all(row.path == "cuBLAS + row pass (a float32 GEMM is TF32 in the in-GEMM path, and "
                         "torch.backends.cuda.matmul.allow_tf32 is off: cuBLAS computes it in float32)"
                         for row in fused)
