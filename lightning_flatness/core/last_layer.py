"""The model's last layer, defined once for every part of the package that needs one."""

from __future__ import annotations

from torch import nn

__all__ = ["LAYER_TYPES", "last_layer"]

#: the module types that count as layers: dense and convolutional maps of their input
LAYER_TYPES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


def last_layer(model: nn.Module) -> nn.Module | None:
    """The last ``nn.Linear``, ``nn.Bilinear`` or convolution in ``model.modules()`` order.

    It is the classifier head of the models this package measures (the paper's CNN ends in a
    convolution whose output is the logits): the layer ``params="last_layer"`` of the
    regularizer differentiates, and — when it is an ``nn.Linear`` producing the outputs — the
    layer of the relative flatness measure (docs/math.md, "Relative flatness").
    """
    found = None
    for module in model.modules():
        if isinstance(module, LAYER_TYPES):
            found = module
    return found
