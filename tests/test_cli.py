"""The command line: `python -m fxfuse --help`, `report` with its options, `cache`, and one-line
errors with exit status 2 for bad arguments."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fxfuse
from fxfuse.__main__ import main, parser

ROOT = Path(__file__).resolve().parents[1]
S01 = str(ROOT / "examples/s01_scale_leakyrelu.py")
BATCH_NORM_FILE = (
    "import torch\n"
    "class Model(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__(); self.fc = torch.nn.Linear(8, 16); self.bn = torch.nn.BatchNorm1d(16)\n"
    "    def forward(self, x):\n"
    "        return torch.relu(self.bn(self.fc(x)))\n"
    "def get_inputs():\n"
    "    return [torch.rand(4, 8)]\n"
)


def report_json(capsys, *args) -> dict:
    assert main(["report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_help_says_what_fxfuse_is_and_lists_the_commands():
    text = parser().format_help()
    assert "GEMM-epilogue fusion for torch.compile" in text
    assert "report" in text and "cache" in text


def test_help_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "fxfuse", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "report" in result.stdout


def test_report_in_eval_mode_uses_the_running_statistics(tmp_path, capsys):
    path = tmp_path / "bn.py"
    path.write_text(BATCH_NORM_FILE)
    train = report_json(capsys, str(path), "--policy", "always")["rows"][0]["program"]
    evaluation = report_json(capsys, str(path), "--eval", "--policy", "always")["rows"][0]["program"]
    assert "training=True" in train
    assert "training" not in evaluation and "running_mean=" in evaluation


def test_report_in_another_dtype(capsys):
    row = report_json(capsys, S01, "--size", "small", "--dtype", "bf16")["rows"][0]
    assert row["dtype"] == "bfloat16" and row["status"] == "fused"


@pytest.mark.parametrize("args,message", [
    (["nothere.py"], "no such file: nothere.py"),
    ([f"{S01}:Nope"], "defines no model class 'Nope'"),
    ([S01, "--size", "huge"], "'huge' is not one of decode1, decode16, full, small, tiny"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_size_of_a_file_whose_get_inputs_takes_none_is_refused_plainly(tmp_path, capsys):
    path = tmp_path / "problem.py"
    path.write_text(BATCH_NORM_FILE)
    assert main(["report", str(path), "--size", "small"]) == 2
    assert "get_inputs() takes no size" in capsys.readouterr().err


def test_an_unknown_option_value_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", S01, "--dtype", "fp64"])
    assert info.value.code == 2


def test_the_report_does_not_copy_the_model():
    """A copy would double the memory of a large model: its buffers are restored instead."""
    from examples import suite

    mod = suite.load("S03")

    class Uncopyable(mod.Model):
        def __deepcopy__(self, memo):
            raise AssertionError("the model was copied")

    model = Uncopyable(*mod.get_init_inputs("small"))
    before = model.batch_norm.running_mean.clone()
    with pytest.raises(AssertionError):
        copy.deepcopy(model)
    assert fxfuse.report(model, *mod.get_inputs("small"), allow_cpu=True).totals["fused"] == 1
    assert model.batch_norm.running_mean.equal(before)


def test_cache_shows_where_and_what_and_clears_only_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    for key, kind, label in (("a" * 32, "runtime", "runtime (sm_90a)"),
                             ("b" * 32, "program", "linear(bias=True) [float32]"),
                             ("c" * 32, "in-GEMM", "in-GEMM linear(bias=True) [bfloat16]")):
        (tmp_path / key).mkdir()
        (tmp_path / key / "ok").write_text(json.dumps({"label": label, "kind": kind, "library": "lib.so"}))
        (tmp_path / key / "lib.so").write_bytes(b"x" * 1000)
    (tmp_path / ("d" * 32 + ".lock")).write_text("")
    (tmp_path / "selections").mkdir()
    (tmp_path / "selections" / "s.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not ours")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "1 in-GEMM, 1 program, 1 runtime" in out and "1 measured path choices" in out
    assert main(["cache", "--clear"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
