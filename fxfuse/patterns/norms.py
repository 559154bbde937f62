"""Normalisation spellings: group_norm, layer_norm, rms_norm, batch_norm (nn modules call these)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..canonical import NormOp
from . import spell


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    return NormOp("group", input, float(eps), groups=int(num_groups), weight=weight, bias=bias)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return NormOp("layer", input, float(eps), normalized_shape=shape, weight=weight, bias=bias)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return NormOp("rms", input, None if eps is None else float(eps), normalized_shape=shape,
                  weight=weight)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    return NormOp("batch", input, float(eps), weight=weight, bias=bias, running_mean=running_mean,
                  running_var=running_var, training=bool(training), momentum=momentum)


SPELLINGS = (
    spell(group_norm, F.group_norm),
    spell(layer_norm, F.layer_norm),
    spell(rms_norm, F.rms_norm, torch.rms_norm),
    spell(batch_norm, F.batch_norm),
)
