"""One way to hook a model: every forward hook the package installs goes through a
:class:`HookRecorder`, which keeps the handles and removes them all together, so a measurement
leaves the model as it found it.

Three kinds of hook are needed, each written once here:

- **the layers' calls** (:meth:`HookRecorder.record_calls`): a forward hook with keyword
  arguments on every module a layer rule follows, one per module however many rules share it
  (the hooked pass's per-sample terms, the regularizer's recording);
- **a bracket around a module's forward** (:meth:`HookRecorder.around`): a pre-hook and a
  post-hook that runs even when the forward raises (the outside-call interception marks the
  layers' own forwards; attention collects its projections' calls while its forward runs);
- **the last layer's inputs** (:meth:`HookRecorder.last_layer_inputs`): the features that
  the TIC's last-layer block and the output statistics read (the hooked pass, the functional
  statistics, the BackPACK copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookRecorder", "modules_of"]

#: a forward hook with keyword arguments: ``(module, args, kwargs, output) -> output or None``
CallHook = Callable[[nn.Module, tuple, dict, Any], Any]


def modules_of(rules: Iterable[Any]) -> list[tuple[nn.Module, list[Any]]]:
    """Each module the ``rules`` follow (their ``modules``), once, with the rules that follow
    it, in the rules' order."""
    by_module: dict[int, tuple[nn.Module, list[Any]]] = {}
    for rule in rules:
        for module in rule.modules:
            by_module.setdefault(id(module), (module, []))[1].append(rule)
    return list(by_module.values())


class HookRecorder:
    """The hooks of one measurement (module docstring): registered by its methods, removed by
    :meth:`close` (or at the end of a ``with`` block)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def record_calls(
        self, rules: Iterable[Any], hook_for: Callable[[list[Any]], CallHook]
    ) -> list[tuple[nn.Module, list[Any]]]:
        """A forward hook (with keyword arguments) on each module the ``rules`` follow:
        ``hook_for(rules of that module)``. Returns the modules and their rules."""
        modules = modules_of(rules)
        for module, owners in modules:
            self._handles.append(module.register_forward_hook(hook_for(owners), with_kwargs=True))
        return modules

    def around(
        self,
        module: nn.Module,
        enter: Callable[[nn.Module, tuple], None],
        leave: Callable[[nn.Module, tuple, Any], None],
    ) -> None:
        """``enter`` before ``module``'s forward and ``leave`` after it, even when it raises."""
        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(leave, always_call=True))

    def last_layer_inputs(
        self, layer: nn.Module | None, when: Callable[[], bool] | None = None, latest: bool = False
    ) -> list[Tensor]:
        """The inputs of ``layer``'s forward calls, detached, in a list the recorder fills
        (only while ``when()`` holds, if given; with ``latest``, only the last one kept); an
        empty list that stays empty for no layer."""
        inputs: list[Tensor] = []
        if layer is None:
            return inputs

        def record(module: nn.Module, args: tuple, output: Any) -> None:
            if when is None or when():
                if latest:
                    inputs.clear()
                inputs.append(args[0].detach())

        self._handles.append(layer.register_forward_hook(record))
        return inputs

    def close(self) -> None:
        """Remove every hook; the model is as it was before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> HookRecorder:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
