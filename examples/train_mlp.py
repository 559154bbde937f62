"""Train an MLP with GroupNorm, BatchNorm and LayerNorm blocks under fxfuse and under eager.

    python examples/train_mlp.py [--steps 300] [--device cuda|cpu]

Both copies start from the same weights and see the same batches (a fixed random regression
task); the script prints both loss curves every 25 steps and the largest difference. On a machine
without a GPU it runs fxfuse's CPU reference kernel (``allow_cpu``), which checks the fused
training path (forward, backward, BatchNorm running statistics) end to end.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn


class Block(nn.Module):
    """Linear, then a norm, then an activation: one fused chain each."""

    def __init__(self, features: int, norm: str):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.norm = {
            "group": lambda: nn.GroupNorm(8, features),
            "batch": lambda: nn.BatchNorm1d(features),
            "layer": lambda: nn.LayerNorm(features),
        }[norm]()
        self.act = nn.GELU() if norm == "batch" else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(x)))


class MLP(nn.Module):
    def __init__(self, features: int = 64, inputs: int = 32, outputs: int = 1):
        super().__init__()
        self.stem = nn.Linear(inputs, features)
        self.blocks = nn.Sequential(Block(features, "group"), Block(features, "batch"), Block(features, "layer"))
        self.head = nn.Linear(features, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def batches(steps: int, batch: int, inputs: int, device: str, seed: int = 0):
    """A fixed regression task: y = sin(x @ a) summed, plus noise."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(inputs, 4, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, inputs, generator=g)
        y = torch.sin(x @ a).sum(-1, keepdim=True) + 0.05 * torch.randn(batch, 1, generator=g)
        yield x.to(device), y.to(device)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
}


def train(model: nn.Module, steps: int, device: str, batch: int = 64, optimizer: str = "adamw") -> list[float]:
    """Loss per optimizer step."""
    optimizer = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for x, y in batches(steps, batch, 32, device):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def compare(steps: int, device: str, seed: int = 0, optimizer: str = "adamw"):
    """(eager losses, fxfuse losses, eager model, fxfuse model) after ``steps`` steps from one init."""

    torch.manual_seed(seed)
    eager = MLP().to(device).train()
    fused = copy.deepcopy(eager)
    options = {} if device == "cuda" else {"allow_cpu": True}
    compiled = torch.compile(fused, backend="fxfuse", options={"policy": "always", **options})
    return (train(eager, steps, device, optimizer=optimizer), train(compiled, steps, device, optimizer=optimizer),
            eager, fused)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    eager, fused, _, _ = compare(args.steps, args.device)
    print(f"{'step':>5} {'eager':>10} {'fxfuse':>10}")
    for i in range(0, args.steps, 25):
        print(f"{i:>5} {eager[i]:>10.5f} {fused[i]:>10.5f}")
    print(f"largest |difference| over {args.steps} steps: {max(abs(a - b) for a, b in zip(eager, fused)):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
