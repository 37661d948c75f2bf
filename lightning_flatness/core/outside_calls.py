"""``F.linear`` calls that use an ``nn.Linear``'s weight outside that layer's own forward.

A model may apply a layer's weight a second time through the functional call, e.g. a head
whose weight also maps other features directly (``self.head(h) + F.linear(g, self.head.weight)``).
Such a call is one more application of
the same linear map to other inputs: sample i's gradient of the weight is
``Σ_calls Σ_t s_t a_tᵀ`` over the layer's own calls and these, so the weight stays a Kronecker
block whose calls are its positions (docs/math.md, "Kronecker factors from layer hooks"), as a
weight tied across layers already is. Only the weight is shared: a call without the layer's
bias is recorded as *weight-only* (:attr:`~lightning_flatness.core.layer_rules.LayerCall.
weight_only`), and the bias's gradients come from the calls that add it.

:class:`OutsideLinearCalls` is a ``TorchFunctionMode`` that sees every ``F.linear`` while the
hooked forward pass runs, and records into the layer's rule the calls whose weight *is* a
hooked layer's weight (the same tensor, not a view or a product of it) made while that layer's
own forward is not running. The first batch's coverage check then decides, as for every rule,
whether the weight's per-sample gradients are right.

:func:`outside_calls_where_found` is how both the measurement's hooked pass and the
regularizer's recording use it: a model's first recorded forward (for a set of followed weights)
looks for such calls, and a model where it found none is not intercepted again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_flatness.core.hook_recorder import HookRecorder
from lightning_flatness.core.layer_rules import KroneckerRule, LayerCall, Rule, is_linear

__all__ = [
    "OutsideLinearCalls",
    "followed_weights",
    "outside_calls_where_found",
    "outside_linear_calls",
]

#: per model, the sets of followed weights (by ``id``) whose first recorded forward applied
#: none of them outside its layer
_NO_OUTSIDE_CALLS: weakref.WeakKeyDictionary[nn.Module, set[frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def followed_weights(rules: list[Rule]) -> dict[int, KroneckerRule]:
    """The ``nn.Linear`` weights the rules cover (by ``id``), with their rule."""
    owners = {}
    for rule in rules:
        module = rule.modules[0]
        if isinstance(rule, KroneckerRule) and is_linear(module) and "weight" in rule.names:
            owners[id(module.weight)] = rule
    return owners


class OutsideLinearCalls(TorchFunctionMode):
    """Records ``F.linear(x, layer.weight, b)`` made outside ``layer``'s forward into the
    layer's :class:`KroneckerRule` (module docstring).

    Args:
        rules: the hooked pass's rules; those of an ``nn.Linear`` whose weight they cover are
            followed.
        detach: records the call's input detached (the measurement); the output stays in the
            graph, and what the model computes downstream is a copy of it, as for a hooked
            layer's output.
    """

    def __init__(self, rules: list[Rule], detach: bool = True) -> None:
        super().__init__()
        #: the followed weights (by ``id``) and the rules that cover them
        self.owners = followed_weights(rules)
        self.detach = detach
        #: the followed layers whose own forward is running
        self.running: set[int] = set()
        #: the rules (by ``id``) that an outside call was recorded into
        self.recorded_rules: set[int] = set()

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func is not F.linear or not isinstance(output, Tensor):
            return output
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        rule = self.owners.get(id(weight))
        if rule is None or any(id(layer) in self.running for layer in rule.modules):
            return output
        layer = rule.modules[0]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        inputs = args[0] if args else kwargs["input"]
        recorded = inputs.detach() if self.detach else inputs
        weight_only = layer.bias is None or bias is not layer.bias
        rule.calls.append(LayerCall(layer, (recorded,), {}, output, weight_only=weight_only))
        self.recorded_rules.add(id(rule))
        return output.clone()


@contextmanager
def outside_linear_calls(rules: list[Rule], detach: bool = True) -> Iterator[OutsideLinearCalls]:
    """:class:`OutsideLinearCalls` active for the block, with the followed layers' own forward
    passes marked while they run (forward pre- and post-hooks, removed on exit)."""
    mode = OutsideLinearCalls(rules, detach=detach)
    layers = {id(layer): layer for rule in mode.owners.values() for layer in rule.modules}
    with HookRecorder() as hooks, mode:
        for layer in layers.values():
            hooks.around(
                layer,
                lambda m, _: mode.running.add(id(m)),
                lambda m, _, __: mode.running.discard(id(m)),
            )
        yield mode


def _compiles(model: nn.Module) -> bool:
    """``model`` is, or contains, a ``torch.compile`` wrapper."""
    return any(isinstance(getattr(m, "_orig_mod", None), nn.Module) for m in model.modules())


@contextmanager
def outside_calls_where_found(
    rules: list[Rule], model: nn.Module, detach: bool = True
) -> Iterator[None]:
    """:func:`outside_linear_calls` for the block, unless ``model``'s first recorded forward
    with these followed weights found none (then nothing is intercepted), or ``model`` is
    compiled (its layers' hooks do not run inside compiled code, so every call would look
    outside)."""
    key = frozenset(followed_weights(rules))
    if not key or key in _NO_OUTSIDE_CALLS.get(model, ()):
        yield
        return
    if _compiles(model):
        _NO_OUTSIDE_CALLS.setdefault(model, set()).add(key)
        yield
        return
    with outside_linear_calls(rules, detach=detach) as outside:
        yield
    if not outside.recorded_rules:
        _NO_OUTSIDE_CALLS.setdefault(model, set()).add(key)
