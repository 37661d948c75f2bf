"""The one place the package hooks a model: what each kind of hook records, and that closing
the recorder leaves the model without a hook of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_flatness.core.hook_recorder import HookRecorder, modules_of


def _hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_calls_are_hooked_once_per_module_with_every_rule_that_follows_it():
    first, second = nn.Linear(3, 4), nn.Linear(4, 2)
    model = nn.Sequential(first, nn.Tanh(), second)
    rules = [SimpleNamespace(modules=[first]), SimpleNamespace(modules=[first, second])]
    assert [(m, len(owners)) for m, owners in modules_of(rules)] == [(first, 2), (second, 1)]
    seen = []

    def hook_for(owners):
        def record(module, args, kwargs, output):
            seen.append((module, len(owners)))

        return record

    with HookRecorder() as hooks:
        hooks.record_calls(rules, hook_for)
        model(torch.randn(5, 3))
    assert seen == [(first, 2), (second, 1)]
    assert _hook_counts(model) == 0


def test_around_leaves_even_when_the_forward_raises():
    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("inside")

    module, events = Failing(), []
    with HookRecorder() as hooks:
        hooks.around(module, lambda m, a: events.append("enter"), lambda *_: events.append("leave"))
        with pytest.raises(RuntimeError, match="inside"):
            module(torch.zeros(1))
    assert events == ["enter", "leave"]
    assert _hook_counts(module) == 0


def test_last_layer_inputs_all_or_the_latest_and_only_while_asked():
    layer = nn.Linear(3, 2)
    recording = {"on": False}
    hooks = HookRecorder()
    every = hooks.last_layer_inputs(layer)
    latest = hooks.last_layer_inputs(layer, latest=True)
    gated = hooks.last_layer_inputs(layer, when=lambda: recording["on"])
    inputs = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
    layer(inputs[0])
    recording["on"] = True
    layer(inputs[1])
    layer(inputs[2])
    assert [t.data_ptr() for t in every] == [t.data_ptr() for t in inputs]
    assert len(latest) == 1 and torch.equal(latest[0], inputs[2])
    assert len(gated) == 2 and not any(t.requires_grad for t in every)
    hooks.close()
    layer(inputs[0])
    assert len(every) == 3 and _hook_counts(layer) == 0
    assert HookRecorder().last_layer_inputs(None) == []
