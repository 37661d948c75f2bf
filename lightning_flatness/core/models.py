"""The paper's architectures ("Flatness After All?", Section 7) and a small residual net.

- ``mlp``: one hidden layer of 70 ReLU units;
- ``bigmlp``: two hidden layers of 70 ReLU units;
- ``cnn``: 3×3 convolutions with 15, then 20 channels, then a 10-channel class layer
  (on 7×7 inputs without padding the spatial size goes 7 → 5 → 3 → 1, so the last
  convolution's output *is* the logits; on larger inputs an average pool reduces it to 1×1);
- ``resmlp``: a residual MLP (``h + block(h)``), the smallest model that needs BackPACK's
  graph converter — used to test residual graphs.

All are plain ``nn.Module`` s with no Lightning dependency.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["ARCHITECTURES", "ResidualMLP", "build_model"]

ARCHITECTURES = ("mlp", "bigmlp", "cnn", "resmlp")


class ResidualMLP(nn.Module):
    """``x → Linear → ReLU → (h + Linear(ReLU(Linear(h)))) → Linear``: one residual block."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.stem = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.stem(self.flatten(x)))
        h = h + self.block(h)
        return self.head(h)


def _cnn(input_shape: Sequence[int], num_classes: int, channels: Sequence[int]) -> nn.Module:
    in_channels, height, width = input_shape
    layers: list[nn.Module] = []
    for out_channels in (*channels, num_classes):
        if layers:
            layers.append(nn.ReLU())
        layers.append(nn.Conv2d(in_channels, out_channels, kernel_size=3))
        in_channels, height, width = out_channels, height - 2, width - 2
    if height < 1 or width < 1:
        raise ValueError(
            f"The CNN needs inputs of at least 7×7 pixels (three 3×3 convolutions without "
            f"padding), got input_shape={tuple(input_shape)}."
        )
    if (height, width) != (1, 1):
        layers.append(nn.AvgPool2d(kernel_size=(height, width)))
    layers.append(nn.Flatten())
    return nn.Sequential(*layers)


def build_model(
    architecture: str,
    input_shape: Sequence[int] = (1, 7, 7),
    num_classes: int = 10,
    hidden: int = 70,
    channels: Sequence[int] = (15, 20),
) -> nn.Module:
    """Build one of :data:`ARCHITECTURES` for inputs of shape ``(channels, height, width)``.

    ``hidden`` is the width of the MLPs' hidden layers and ``channels`` the CNN's two hidden
    convolution widths; the defaults are the paper's.
    """
    features = int(torch.tensor(tuple(input_shape)).prod())
    name = architecture.lower()
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )
    if name == "bigmlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
    if name == "cnn":
        return _cnn(input_shape, num_classes, channels=channels)
    if name == "resmlp":
        return ResidualMLP(features, hidden, num_classes)
    raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}.")
