"""Attributes set on instances for a block, and what the instances hold afterwards."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local.instances import replaced
from torch import nn


def test_a_block_replaces_each_forward_and_leaves_the_class_forward_after() -> None:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    x = torch.ones(1, 2)
    with replaced(layers, "forward", lambda layer: lambda _: torch.zeros(1, 2)) as count:
        assert count == 2 and all(torch.equal(layer(x), torch.zeros(1, 2)) for layer in layers)
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert torch.equal(layers[0](x), x @ layers[0].weight.t() + layers[0].bias)


def test_nested_blocks_and_errors_give_back_the_instance_forward_there_was() -> None:
    layer = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    with replaced([layer], "forward", lambda _: lambda _: torch.full((1, 2), 1.0)):
        with pytest.raises(RuntimeError), replaced([layer], "forward", lambda _: lambda _: torch.full((1, 2), 2.0)):
            assert float(layer(x)[0, 0]) == 2.0
            raise RuntimeError
        assert float(layer(x)[0, 0]) == 1.0
    assert "forward" not in layer.__dict__


def test_an_instance_attribute_holding_none_is_given_back() -> None:
    layer = nn.Linear(2, 2)
    layer.cast_input_dtype_enabled = None
    with replaced([layer], "cast_input_dtype_enabled", lambda _: False):
        assert layer.cast_input_dtype_enabled is False
    assert "cast_input_dtype_enabled" in layer.__dict__ and layer.cast_input_dtype_enabled is None
