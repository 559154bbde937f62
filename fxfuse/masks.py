"""Dropout masks: which elements a dropout stage keeps, as a pure function of (seed, row, column).

A counter-based hash instead of a stream of random numbers: the row kernels compute each
element's bit where they hold the element (csrc/row_random.cuh computes the same bits, the
emulator tests compare them), the backward recomputes the mask from the saved seed instead of
storing it, and the reference (this module, in int64 torch ops behind an op of its own, which the
backward graph calls) is exact; on CUDA that recomputation holds a few (M, N) int64 temporaries. The hash is Wellons' lowbias32 (xor-shift-multiply, full avalanche):

    key  = mix(seed0 ^ mix(seed1 ^ 0x9E3779B9))          per call (the two seed values < 2^31)
    rk   = mix(row_lo ^ mix(row_hi ^ key))               per row of the (M, N) output
    bits = mix(rk ^ column * 0x9E3779B1)                 per element (distinct within a row)

An element is kept when its top 24 bits are at least ``threshold(p)`` = round(p * 2^24).
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B9
COLUMN_MULTIPLIER = 0x9E3779B1
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
MASK32 = 0xFFFFFFFF
SEED_HIGH = 2**31 - 1  # seeds are drawn in [0, SEED_HIGH): every lowering of randint takes it


def threshold(p: float) -> int:
    """The 24-bit threshold below which an element is dropped: P(drop) = threshold / 2^24 ~ p."""
    return int(round(p * (1 << 24)))


def scale(p: float) -> float:
    """The factor a kept element is multiplied by, 1 / (1 - p), as a float32 value."""
    return float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow (two 16-bit halves of c)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MULTIPLIERS[1])
    return x ^ (x >> 16)


@torch.library.custom_op("fxfuse::dropout_keep_mask", mutates_args=())
def keep_mask(seed: torch.Tensor, m: int, n: int, p: float) -> torch.Tensor:
    """The (m, n) bool mask of the kept elements for ``seed`` (two int64 values). An op of its
    own, so that compiled graphs (the backward, which recomputes the mask) call it rather than
    trace its int64 arithmetic, which Inductor took minutes to compile."""
    seed = seed.reshape(2).to(torch.int64) & MASK32
    key = mix(seed[0] ^ mix(seed[1] ^ GOLDEN))
    rows = torch.arange(m, device=seed.device, dtype=torch.int64)
    rk = mix((rows & MASK32) ^ mix((rows >> 32) ^ key))
    cols = _mul32(torch.arange(n, device=seed.device, dtype=torch.int64), COLUMN_MULTIPLIER)
    bits = mix(rk[:, None] ^ cols[None, :])
    return (bits >> 8) >= threshold(p)


@keep_mask.register_fake
def _keep_mask_fake(seed, m, n, p):
    return seed.new_empty((m, n), dtype=torch.bool)
