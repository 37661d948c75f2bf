"""What the first batch's coverage check decided for a model
(:mod:`lightning_flatness.core.coverage_check`), remembered for later measurements of it: the
same assignment every epoch, and the check's cost paid once.

A plan is kept per user module (dropped with it) and reused only while the call, the inputs'
structure and the trainable parameters are those it was made for.
"""

from __future__ import annotations

import weakref
from contextlib import suppress
from dataclasses import dataclass

from torch import nn

from lightning_flatness.core.batches import LogitsModule
from lightning_flatness.core.layer_rules import Rule
from lightning_flatness.core.module_rules import LocalRule

__all__ = ["Plan", "apply_plan", "remember_plan"]


@dataclass(frozen=True)
class Plan:
    """The check's decisions for one model."""

    key: tuple
    covered: dict[str, int]  # parameter → its rule's samples' dimension
    tapped: tuple[str, ...]
    fallback: tuple[str, ...]
    #: parameters of modules not followed through their linear maps (the check refused them)
    unfollowed: frozenset[str] = frozenset()


#: the plan of each measured model, by the user's module (dropped with it)
_PLANS: weakref.WeakKeyDictionary[nn.Module, Plan] = weakref.WeakKeyDictionary()


def _plan_key(model: LogitsModule) -> tuple:
    """What the plan depends on: the call, the inputs' structure and the parameters."""
    params = tuple((name, id(p)) for name, p in model.model.named_parameters() if p.requires_grad)
    return (model.logits_fn, model.spec, params)


def remember_plan(
    model: LogitsModule, rules: list[Rule], tapped: list[str], fallback: list[str]
) -> None:
    """Keep the checked assignment of ``model``: each rule's parameters with their samples'
    dimension, the tapped and the fallback parameters."""
    covered = {name: rule.batch_dim for rule in rules for name in rule.names.values()}
    unfollowed = frozenset(
        name
        for rule in rules
        if isinstance(rule, LocalRule) and rule.unfollowed
        for name in rule.names.values()
    )
    plan = Plan(_plan_key(model), covered, tuple(tapped), tuple(fallback), unfollowed)
    # a module that cannot be weakly referenced is simply checked again next time
    with suppress(TypeError):
        _PLANS[model.model] = plan


def apply_plan(model: LogitsModule, rules: list[Rule]) -> Plan | None:
    """Reuse the model's remembered plan on freshly assigned ``rules`` (trimmed to the
    parameters it covers, in place); None when there is none (or it is stale)."""
    try:
        plan = _PLANS.get(model.model)
    except TypeError:  # a module that cannot be weakly referenced
        return None
    if plan is None or plan.key != _plan_key(model):
        return None
    for rule in rules:
        for attr in [a for a, n in rule.names.items() if n not in plan.covered]:
            del rule.names[attr]
        for name in rule.names.values():
            rule.batch_dim = plan.covered[name]
            if name in plan.unfollowed and isinstance(rule, LocalRule):
                rule.unfollowed = True
    return plan
