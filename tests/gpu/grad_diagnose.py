"""How far fxfuse's and eager's bf16 gradients are from each other and from float32 (a script).

    python tests/gpu/grad_diagnose.py S06,S07,S09,S17,S18

For each suite row at its small size: the same model and inputs in bf16 under eager and under
fxfuse, and in float32 under eager (the reference); prints, per gradient, the largest absolute
differences and the gradient's scale. Tells rounding (fxfuse nearer float32 than eager is) from a
wrong backward.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import suite  # noqa: E402
from support import compile_fxfuse  # noqa: E402


def grads(model, inputs, grad_out, compiled=None):
    xs = [t.clone().requires_grad_() for t in inputs]
    out = (compiled if compiled is not None else model)(*xs)
    out.backward(grad_out.to(out.dtype))
    named = [("input", xs[0].grad)] + [(n, p.grad) for n, p in model.named_parameters()]
    return {n: g.float() for n, g in named if g is not None}


def main(rows: list[str]) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    for row_id in rows:
        mod = suite.load(suite.get_row(row_id))
        torch.manual_seed(0)
        base = mod.Model(*mod.get_init_inputs("small")).cuda().train()
        inputs = [t.cuda() for t in mod.get_inputs("small")]
        f32 = copy.deepcopy(base)
        b16 = copy.deepcopy(base).to(torch.bfloat16)
        fx = copy.deepcopy(b16)
        grad_out = torch.randn_like(f32(*inputs))
        ref = grads(f32, inputs, grad_out)
        eager = grads(b16, [t.bfloat16() for t in inputs], grad_out)
        fused = grads(fx, [t.bfloat16() for t in inputs], grad_out, compile_fxfuse(fx))
        print(f"{row_id}: {'gradient':22} {'scale':>9} {'|fx-eager|':>11} {'|eager-f32|':>12} {'|fx-f32|':>10}")
        for name in ref:
            def d(a, b):
                return (a - b).abs().max().item()
            print(f"     {name:22} {ref[name].abs().max().item():9.3g} {d(fused[name], eager[name]):11.3g} "
                  f"{d(eager[name], ref[name]):12.3g} {d(fused[name], ref[name]):10.3g}")
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(",")))
