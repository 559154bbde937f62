"""The operands the selection times on: a graph's values on the compile's example inputs.

``values_on_example_inputs`` runs only what the asked nodes depend on, leaves the model's state
and the random number generators as they were, and gives nothing where running the graph part
could change the model (a mutation) or where a value is not what Dynamo traced.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.example_values import values_on_example_inputs
from support import captured


def linear_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is F.linear or n.target is torch._C._nn.linear]


class TwoLayers(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.p = p

    def forward(self, x, residual):
        h = F.dropout(torch.relu(self.up(x)), self.p, self.training)
        return self.down(h) + residual


def test_the_second_gemms_input_is_the_first_layers_output():
    model = TwoLayers().eval()
    x, residual = torch.randn(4, 8), torch.randn(4, 8)
    gm, inputs = captured(model, x, residual)
    down = linear_nodes(gm)[1]
    wanted = {down.args[0], down.args[1]}
    values = values_on_example_inputs(gm.graph, gm, inputs, wanted)
    assert set(values) == wanted
    torch.testing.assert_close(values[down.args[0]], torch.relu(model.up(x)))
    assert values[down.args[1]] is model.down.weight  # a parameter is the parameter itself


def test_random_ops_run_without_moving_the_generators():
    model = TwoLayers(p=0.5).train()
    gm, inputs = captured(model, torch.randn(4, 8), torch.randn(4, 8))
    down = linear_nodes(gm)[1]
    state = torch.random.get_rng_state()
    values = values_on_example_inputs(gm.graph, gm, inputs, {down.args[0]})
    assert down.args[0] in values
    assert torch.equal(torch.random.get_rng_state(), state)


class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.proj(x * self.calls)


def test_a_graph_part_that_mutates_is_not_run():
    model = Mutating()
    gm, inputs = captured(model, torch.randn(4, 8))
    (proj,) = linear_nodes(gm)
    before = model.calls.clone()
    assert values_on_example_inputs(gm.graph, gm, inputs, {proj.args[0]}) == {}
    assert torch.equal(model.calls, before)


def test_a_value_unlike_the_traced_one_is_dropped():
    model = TwoLayers().eval()
    gm, inputs = captured(model, torch.randn(4, 8), torch.randn(4, 8))
    down = linear_nodes(gm)[1]
    wrong = [t.double() if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 4 else t for t in inputs]
    assert values_on_example_inputs(gm.graph, gm, wrong, {down.args[0]}) == {}  # traced float32, ran float64
    assert values_on_example_inputs(gm.graph, gm, inputs[:-1], {down.args[0]}) == {}  # inputs missing


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.proj = nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.bn(x))


def test_a_training_batch_norm_updates_its_statistics_so_nothing_runs_but_in_eval_it_does():
    for train, runs in ((True, False), (False, True)):
        model = Normed().train(train)
        gm, inputs = captured(model, torch.randn(4, 8))
        (proj,) = linear_nodes(gm)
        before = model.bn.running_mean.clone()
        assert bool(values_on_example_inputs(gm.graph, gm, inputs, {proj.args[0]})) is runs
        assert torch.equal(model.bn.running_mean, before)


def test_a_chain_that_did_not_fuse_has_no_operands_to_time():
    from fxfuse.backend import _operands
    from fxfuse.match import Chain

    model = TwoLayers().eval()
    gm, inputs = captured(model, torch.randn(4, 8), torch.randn(4, 8))
    up = linear_nodes(gm)[0]
    values = values_on_example_inputs(gm.graph, gm, inputs, {up.args[0], up.args[1]})
    unfused = Chain(up, "not_fused", ["linear"], [], "a reason")
    assert _operands(unfused, values) is None
