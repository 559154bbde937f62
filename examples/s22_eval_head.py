"""S22: eval-mode head: Linear(2048 -> 1024), BatchNorm1d, ReLU, Dropout(0.1), Linear(1024 -> 10).

Meant to be used after ``model.eval()``: BatchNorm1d then normalises with its running statistics and
Dropout is the identity.
"""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=4096, in_features=2048, hidden=1024, num_classes=10),
    "small": dict(batch=8, in_features=64, hidden=128, num_classes=10),
    "tiny": dict(batch=8, in_features=64, hidden=64, num_classes=10),
}


class Model(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.bn(x)
        x = self.relu(x)
        x = self.dropout(x)
        x = self.fc2(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["hidden"], s["num_classes"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
