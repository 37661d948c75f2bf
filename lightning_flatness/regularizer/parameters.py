"""Which parameters the penalty differentiates (``params=``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_flatness.core.last_layer import last_layer
from lightning_flatness.regularizer.arguments import (
    ParamSpec,
)

__all__ = ["constants_of", "select_parameters"]


_MAX_NAMES_SHOWN = 20


def select_parameters(model: nn.Module, params: ParamSpec = "all") -> dict[str, nn.Parameter]:
    """The trainable parameters the penalty differentiates, keyed as in ``named_parameters()``.

    Args:
        model: the classifier.
        params: ``"all"`` (every parameter with ``requires_grad``), ``"last_layer"`` (the
            trainable parameters of :func:`~lightning_flatness.core.last_layer.last_layer`, the
            last ``nn.Linear``, ``nn.Bilinear`` or convolution in ``model.modules()`` order),
            or one or more module
            names from ``model.named_modules()`` (each contributes its parameters, including
            those of its submodules; ``""`` is the whole model).

    Returns:
        ``{parameter name: parameter}`` in ``named_parameters()`` order; the flat parameter
        axis of the rows follows this order.

    Raises:
        ValueError: for unknown module names, or a selection without trainable parameters.
    """
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if isinstance(params, str) and params == "all":
        selected = trainable
    elif isinstance(params, str) and params == "last_layer":
        head = last_layer(model)
        if head is None:
            raise ValueError(
                'params="last_layer" selects the last nn.Linear, nn.Bilinear or convolution in '
                "model.modules() order, but the model has none; pass module names instead, "
                f"e.g. params={[name for name, _ in model.named_modules() if name][:4]}."
            )
        last = next(name for name, module in model.named_modules() if module is head)
        selected = _parameters_of(model, [last], trainable)
    else:
        names = [params] if isinstance(params, str) else list(params)
        if not names or not all(isinstance(name, str) for name in names):
            raise ValueError(
                f'params must be "all", "last_layer" or a non-empty list of module names, got '
                f"params={params!r}."
            )
        selected = _parameters_of(model, names, trainable)
    if not selected:
        raise ValueError(
            f"params={params!r} selects no trainable parameter (requires_grad=False everywhere "
            "in the selection); the penalty would be a constant."
        )
    return selected


def _parameters_of(
    model: nn.Module, names: Sequence[str], trainable: dict[str, nn.Parameter]
) -> dict[str, nn.Parameter]:
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown:
        available = [name for name in modules if name]
        shown = ", ".join(repr(name) for name in available[:_MAX_NAMES_SHOWN])
        more = f", … ({len(available)} in all)" if len(available) > _MAX_NAMES_SHOWN else ""
        raise ValueError(
            f"Unknown module name(s) {unknown} in params; the model's modules "
            f"(model.named_modules()) are: {shown}{more}."
        )
    wanted: set[str] = set()
    for name in names:
        prefix = f"{name}." if name else ""
        wanted.update(key for key in trainable if key.startswith(prefix))
    return {key: p for key, p in trainable.items() if key in wanted}


def constants_of(model: nn.Module, selected: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """Detached copies of the trainable parameters that are not differentiated."""
    return {
        name: p.detach()
        for name, p in model.named_parameters()
        if p.requires_grad and name not in selected
    }
