"""Small blocks of ``h'(F̂)`` as dense matrices, several blocks per matrix product.

The compositional penalty's quadratic form ``Σ_k u^(k)ᵀ h'(F̂) u^(k)`` rotates each block's
probe gradient into the block's eigenbasis and back (docs/math.md, "Compositional gradient of
h(F)"): some ten tensor operations per parameter, whatever its size. Biases, normalisation
scales and small layers are many blocks of a few dozen entries each, and on such models those
fixed costs outweigh the arithmetic. For a small block the matrix

    h'(F̂_block) = Q diag(h'(μ)) Qᵀ,   Q = Q_L ⊗ Q_R  (rows of the block's ``m × k`` view),

is formed once per refresh of the spectra, and the small blocks are gathered into groups of at
most :data:`GROUP_SIZE` entries whose matrices are block-diagonal. One product per group then
gives the quadratic form and its gradient ``2 h'(F̂) u`` for every block of the group.

The dense path computes in float64. ``h'(μ) = λ/(μ + λ)²`` spans many orders of magnitude between
the null directions of ``F̂`` (about ``1/λ``) and its large eigenvalues, and a probe gradient lies
mostly along the large ones: in float32 the product with the dense matrix would lose its small
terms in the round-off of the large entries, which the rotation keeps apart. The groups are
small, so float64 costs little.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_flatness.regularizer.running_fisher import KroneckerSpectrum, matrix_shape

__all__ = [
    "GROUP_SIZE",
    "SMALL_BLOCK",
    "dense_derivative",
    "group_form",
    "group_matrix",
    "small_block_groups",
]

#: a block with at most this many entries is small (its dense matrix is at most 256 × 256)
SMALL_BLOCK = 256
#: the most entries of one group (its block-diagonal matrix at most 512 × 512 in float64)
GROUP_SIZE = 512


def small_block_groups(shapes: Mapping[str, torch.Size]) -> tuple[list[list[str]], list[str]]:
    """The small blocks gathered, in order, into groups of at most :data:`GROUP_SIZE` entries,
    and the other blocks."""
    groups: list[list[str]] = []
    others: list[str] = []
    current: list[str] = []
    total = 0
    for name, shape in shapes.items():
        size = shape.numel()
        if size > SMALL_BLOCK:
            others.append(name)
            continue
        if current and total + size > GROUP_SIZE:
            groups.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    if current:
        groups.append(current)
    return groups, others


def dense_derivative(
    spectrum: KroneckerSpectrum,
    shape: torch.Size,
    derivative: Callable[[Tensor, float], Tensor],
    lam: float,
) -> Tensor:
    """``Q diag(h'(μ)) Qᵀ`` (``h'(μ) = derivative(μ, λ)``) of one block in float64, rows and
    columns in the order of the parameter's entries (its ``m × k`` view flattened by rows, so
    ``Q = Q_L ⊗ Q_R``; a side of length one has no eigenvectors)."""
    rows, cols = matrix_shape(shape)
    values = spectrum.values.double()
    sides = [
        vectors.double() if vectors is not None else torch.eye(size, dtype=torch.float64)
        for vectors, size in ((spectrum.left, rows), (spectrum.right, cols))
    ]
    basis = torch.kron(*(side.to(values.device) for side in sides))
    return (basis * derivative(values, lam).reshape(-1)) @ basis.mT


def group_matrix(blocks: list[Tensor]) -> Tensor:
    """The block-diagonal matrix of ``blocks`` (square, float64)."""
    size = sum(block.shape[0] for block in blocks)
    matrix = blocks[0].new_zeros(size, size)
    start = 0
    for block in blocks:
        end = start + block.shape[0]
        matrix[start:end, start:end] = block
        start = end
    return matrix


def group_form(gradients: list[Tensor], matrix: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``Σ_k u^(k)ᵀ M u^(k)`` (float64) over the K probes of the group's blocks side by side,
    and its gradient ``2 M u`` per block (in each gradient's shape and dtype), for the group's
    block-diagonal matrix ``M`` (float64)."""
    count = gradients[0].shape[0]
    sizes = [gradient[0].numel() for gradient in gradients]
    side_by_side = torch.cat([gradient.reshape(count, -1) for gradient in gradients], dim=1)
    side_by_side = side_by_side.to(matrix.device, torch.float64)
    product = side_by_side @ matrix
    value = (product * side_by_side).sum()
    doubled = (2 * product).to(gradients[0].device, gradients[0].dtype)
    pieces = doubled.split(sizes, dim=1)
    return value, [
        piece.reshape(gradient.shape).to(gradient.dtype)
        for piece, gradient in zip(pieces, gradients, strict=True)
    ]
