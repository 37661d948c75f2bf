"""A small BatchNorm ResNet for the benchmarks (1-channel images, e.g. the 7×7 MNIST)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ResidualBlock", "SmallResNet"]


class ResidualBlock(nn.Module):
    """conv3×3–BN–ReLU–conv3×3–BN plus a shortcut, then ReLU.

    The shortcut is the identity, or a strided 1×1 convolution with BatchNorm when the block
    changes the resolution or the width.

    Args:
        in_channels / out_channels: widths.
        stride: stride of the first convolution (and of the projection).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        """The block's output for inputs ``(batch, in_channels, H, W)``."""
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A BatchNorm ResNet for 1×7×7 images with a few thousand parameters.

    conv3×3 stem (``width`` channels) + BN + ReLU, a residual block at 7×7, a residual block with
    stride 2 to 4×4 and ``2·width`` channels (1×1 projection shortcut), global average pooling
    and a linear layer to the classes. ``width = 8`` gives P = 5,122 parameters, small enough
    for the exact dense Fisher.

    Args:
        width: channels of the stem and the first block.
        num_classes: outputs.
        in_channels: image channels.
    """

    def __init__(self, width: int = 8, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.block1 = ResidualBlock(width, width)
        self.block2 = ResidualBlock(width, 2 * width, stride=2)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(batch, num_classes)`` for images ``(batch, in_channels, H, W)``."""
        out = self.block2(self.block1(self.stem(x)))
        return self.head(out.mean(dim=(2, 3)))
