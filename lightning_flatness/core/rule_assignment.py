"""Which layer rule covers which parameter, and the hook body that records a layer's call.

:func:`assign_rules` gives each trainable parameter the rule of the module that owns it
(:mod:`lightning_flatness.core.layer_rules` for the one-map layers,
:mod:`lightning_flatness.core.module_rules` for modules with their own forward), or the
whole-model fallback; :func:`record_call` is what a forward hook does with a call, and
:func:`recording` hooks the rules' modules with it for the length of a ``with`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_flatness.core.hook_recorder import HookRecorder
from lightning_flatness.core.layer_rules import (
    KroneckerRule,
    LayerCall,
    NormRule,
    Rule,
    is_linear,
    is_transposed_linear,
)
from lightning_flatness.core.module_rules import AttentionRule, LocalRule, RecurrentRule
from lightning_flatness.core.outside_calls import outside_calls_where_found
from lightning_flatness.core.recurrent import (
    joint_output,
    packed_joint,
    split_joint,
    split_packed_joint,
    unrolls,
)

__all__ = ["assign_rules", "broadcast_lookup", "make_rule", "record_call", "recording"]


_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def _kronecker_ready(module: nn.Module) -> bool:
    if is_linear(module):
        return True
    if isinstance(module, nn.Embedding):
        return module.max_norm is None and not module.scale_grad_by_freq
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1 or module.padding_mode != "zeros":
            return False
        if module.padding == "same":
            return all(
                (d * (k - 1)) % 2 == 0
                for d, k in zip(module.dilation, module.kernel_size, strict=True)
            )
        return True
    return False


_STOCK_FORWARDS = (nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Embedding.forward)


def make_rule(modules: list[nn.Module], names: dict[str, str]) -> Rule | None:
    """The rule for parameters used by ``modules`` (``{attribute: user name}``), or None when
    they must go to the whole-model fallback: shared by modules that are not all stock
    Kronecker layers of one type, used by a module with children (a class token), or by
    BatchNorm without running statistics (samples coupled even in eval mode)."""
    module = modules[0]
    kronecker = all(
        type(m) is type(module)
        and (type(m).forward in _STOCK_FORWARDS or is_transposed_linear(m))
        and _kronecker_ready(m)
        for m in modules
    )
    if kronecker:
        return KroneckerRule(modules, names)
    if len(modules) > 1:
        return None
    if isinstance(module, _NORMS):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None:
            return None
        return NormRule(modules, names)
    if isinstance(module, (nn.RNN, nn.LSTM, nn.GRU)):
        return RecurrentRule(modules, names)
    if isinstance(module, nn.MultiheadAttention):
        return AttentionRule(modules, names)
    if not any(True for _ in module.children()):
        return LocalRule(modules, names)
    return None


def assign_rules(model: nn.Module) -> tuple[list[str], list[Rule], list[str]]:
    """Trainable parameter names, the rules that cover some of them, and the rest.

    A parameter owned by one module goes to that module's rule; a weight (or bias) shared
    by several layers of one Kronecker type (tied weights) to one rule over all of them,
    whose calls are positions of one layer; anything else to the fallback.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, str] = {}
    attention_parts: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            attention_parts.update(id(m) for m in module.modules() if m is not module)
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) in attention_parts:
            continue
        recurse = isinstance(module, nn.MultiheadAttention)
        for attr, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
            if param.requires_grad:
                places = owners.setdefault(id(param), [])
                if all(module is not owner for owner, _ in places):
                    places.append((module, attr))
                names.setdefault(id(param), f"{prefix}.{attr}" if prefix else attr)
    ordered = [n for n, p in model.named_parameters() if p.requires_grad]
    rules: dict[tuple, Rule] = {}
    fallback: list[str] = []
    for param_id, places in owners.items():
        modules = [module for module, _ in places]
        key = tuple(id(module) for module in modules)
        if key not in rules:
            rule = make_rule(modules, {})
            if rule is None:
                fallback.append(names[param_id])
                continue
            rules[key] = rule
        attrs = {attr for _, attr in places}
        if len(attrs) != 1:
            fallback.append(names[param_id])
            continue
        rules[key].names[attrs.pop()] = names[param_id]
    order = {name: i for i, name in enumerate(ordered)}
    fallback.sort(key=order.__getitem__)
    return ordered, [rule for rule in rules.values() if rule.names], fallback


def broadcast_lookup(module: nn.Module, args: tuple, output: Tensor, batch: int) -> bool:
    """An embedding looked up once for the whole batch: indices and output with a leading
    dimension of one, broadcast over ``batch > 1`` samples downstream."""
    return (
        isinstance(module, nn.Embedding)
        and batch > 1
        and output.dim() >= 2
        and output.shape[0] == 1
        and bool(args)
        and isinstance(args[0], Tensor)
        and args[0].dim() >= 1
        and args[0].shape[0] == 1
    )


def _detach_tree(value: object) -> object:
    """A tensor, or a tuple of tensors (an LSTM's state), detached."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach_tree(v) for v in value)
    return value


def record_call(
    rules: list[Rule],
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output: object,
    batch: int,
    *,
    keep_graph: bool = False,
) -> object:
    """Record one call of ``module`` for ``rules`` (a forward hook's body) and return what the
    module should return instead: the same values, downstream of the recorded output tensor, so
    the gradient of that tensor is what the rest of the model does with the output.

    - A recurrent layer (:class:`RecurrentRule`) records each sample's output sequence and final
      states as one tensor (:func:`~lightning_flatness.core.recurrent.joint_output`); fed a
      ``PackedSequence``, it records the padded input with its lengths.
    - An embedding looked up once for the batch (Hugging Face's position ids of shape (1, T))
      is expanded to the ``batch`` samples, each with its own output gradient.
    - Downstream code gets a copy, so an in-place op there (``ReLU(inplace=True)``) cannot
      change the recorded tensor.

    Inputs are recorded detached unless ``keep_graph`` (the regularizer differentiates the rows).
    Returns None (output unchanged, nothing recorded) for an output that is not a tensor.
    """
    keep = (lambda value: value) if keep_graph else _detach_tree
    recurrent = any(isinstance(rule, RecurrentRule) for rule in rules)
    packed = recurrent and bool(args) and isinstance(args[0], PackedSequence)
    if packed or (recurrent and unrolls(module, args)):
        kept = {key: keep(value) for key, value in kwargs.items()}
        if packed:  # recorded padded, batch first, with the lengths
            joint, args, kept["lengths"] = packed_joint(module, args, output)
        else:
            joint = joint_output(module, output[0], output[1])
        copy = joint.clone()
        call = LayerCall(module, tuple(keep(a) for a in args), kept, joint)
        for rule in rules:
            rule.calls.append(call)
        if packed:
            return split_packed_joint(module, copy, output)
        return split_joint(module, copy, output[0], output[1])
    tensor = output[0] if isinstance(output, tuple) else output
    if not isinstance(tensor, Tensor):
        return None
    if broadcast_lookup(module, args, tensor, batch):
        tensor = tensor.expand(batch, *tensor.shape[1:])
        args = (args[0].expand(batch, *args[0].shape[1:]), *args[1:])
    copy = tensor.clone()
    call = LayerCall(
        module,
        tuple(keep(a) for a in args),
        {key: keep(value) for key, value in kwargs.items()},
        tensor,
    )
    for rule in rules:
        rule.calls.append(call)
    return (copy, *output[1:]) if isinstance(output, tuple) else copy


@contextmanager
def recording(
    rules: list[Rule], batch: int, *, keep_graph: bool = False, model: nn.Module | None = None
) -> Iterator[None]:
    """Forward hooks on the rules' modules that record each call (:func:`record_call`) into the
    ``calls`` of every rule using the module, cleared first; removed when the block ends.

    With ``model``, ``F.linear`` calls that apply a hooked ``nn.Linear``'s weight outside its
    layer are recorded too (:mod:`~lightning_flatness.core.outside_calls`) — in every forward
    of a model whose first recorded forward had some, in none of one whose first had none (nor
    in a compiled one)."""

    def hook_for(owners: list[Rule]):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: object):
            return record_call(owners, module, args, kwargs, output, batch, keep_graph=keep_graph)

        return record

    for rule in rules:
        rule.calls.clear()
    with HookRecorder() as hooks:
        hooks.record_calls(rules, hook_for)
        if model is None:
            yield
        else:
            with outside_calls_where_found(rules, model, detach=not keep_graph):
                yield
