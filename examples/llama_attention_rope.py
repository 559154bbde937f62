"""Llama's attention projections with their rotary embedding (LlamaAttention up to SDPA): q, k, v
projections of h, q and k rotated by the positions' cos and sin tables, causal attention. Not a
suite row: ``bench/bench.py --rows llama_attention_rope`` times it the suite's way."""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "full": dict(batch=8, seq_len=1024, heads=32, head_dim=128),
    "small": dict(batch=2, seq_len=8, heads=4, head_dim=16),
    "tiny": dict(batch=1, seq_len=8, heads=2, head_dim=16),
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Model(nn.Module):
    def __init__(self, heads: int, head_dim: int, seq_len: int, theta: float = 10000.0):
        super().__init__()
        hidden = heads * head_dim
        self.head_dim = head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(seq_len).float()[:, None] * inv_freq[None]
        emb = torch.cat((angles, angles), dim=-1)[None]  # (1, T, D), as LlamaRotaryEmbedding's
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = self.q_proj(h).view(shape).transpose(1, 2)
        k = self.k_proj(h).view(shape).transpose(1, 2)
        v = self.v_proj(h).view(shape).transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1).to(h.dtype), self.sin.unsqueeze(1).to(h.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["heads"], s["head_dim"], s["seq_len"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["heads"] * s["head_dim"])]
