"""Probe rows of many parameters made short: a random block-orthogonal projection of each row,
in jackknife groups (docs/math.md, "The probe kernel", sketched rows).

Past a few tens of thousands of parameters the kept probe rows are the stored-row estimate's
whole cost: every Lanczos step reads them twice, and past memory they cannot be kept at all.
A row ``v`` (P numbers) is replaced by ``S v`` (k = P / ``factor`` numbers), with
``S = [S_1; …; S_G] / √G`` stacked from G independent groups. Each ``S_g`` acts on blocks of
:data:`SKETCH_BLOCK` consecutive coordinates: on a block of w coordinates it is ``√(w/k_b) Qᵀ``
with Q a random w × k_b matrix of orthonormal columns (the QR factor of a Gaussian one,
uniformly distributed), so ``E[S_gᵀ S_g] = I`` and every inner product of two rows, hence the
kernel ``K = V Vᵀ / m``, is unbiased: ``E[V Sᵀ S Vᵀ] = V Vᵀ``.

The soft rank is a concave function of the kernel, so the sketched one is biased low, by a
term that falls like 1/k. Leaving out sketch group g (its columns dropped, the rest times
G/(G − 1)) gives the delete-one-group jackknife of that bias, beside the probe groups' own
(:class:`~lightning_flatness.core.curvature.run_sets.RunSets`). It removes most of it, not all:
on the 78,042-parameter ladder ResNet (20,000 rows, soft rank 2,928 from the whole rows) the
jackknifed value was 0.98 of the whole rows' at k = P/4, 0.95 at P/8 and 0.86 at P/16 (at P/8
the same for 2, 4 or 8 sketch groups; docs/RESULTS.md, "Sketched rows"). The trace stays exact:
the whole rows' squared norms, summed before the projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SKETCH_BLOCK", "RowSketch", "SketchPlan", "kept_width"]

#: coordinates mixed by one orthogonal block (512 and 2,048 measured alike)
SKETCH_BLOCK = 512


class RowSketch:
    """``S``: rows of ``width`` numbers to ``groups`` groups of about ``width / (factor · groups)``
    numbers each (module docstring), its columns ordered by block, then by group.

    Args:
        width: P, the rows' length.
        factor: how many times shorter the sketched rows are (1 keeps every dimension: a
            rotation of the rows, the kernel unchanged).
        groups: the sketch's groups (its jackknife's).
        seed: the projection's seed (the same on every call with the same arguments).
        device: where the projection lives (the rows').
        dtype: the projection's dtype (the rows').
    """

    def __init__(
        self,
        width: int,
        factor: int,
        groups: int,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if factor < 1 or groups < 1:
            raise ValueError(
                f"a row sketch needs factor ≥ 1 and groups ≥ 1, not {factor}, {groups}"
            )
        self.width, self.factor, self.groups = int(width), int(factor), int(groups)
        #: blocks, coordinates of a block, columns of one group per block (:func:`_layout`)
        self.blocks, block, self.per_block = _layout(self.width, self.factor, self.groups)
        generator = torch.Generator().manual_seed(seed)
        mats = torch.zeros(self.blocks, block, self.groups * self.per_block, dtype=torch.float64)
        for index in range(self.blocks):
            rows = min(block, self.width - index * block)
            keep = min(self.per_block, rows)
            for group in range(self.groups):
                gaussian = torch.randn(rows, keep, generator=generator, dtype=torch.float64)
                q, r = torch.linalg.qr(gaussian)
                q = q * torch.sign(torch.diagonal(r)).masked_fill(torch.diagonal(r) == 0, 1.0)
                columns = slice(group * self.per_block, group * self.per_block + keep)
                mats[index, :rows, columns] = q * math.sqrt(rows / keep / self.groups)
        self.block = block
        self._mats = mats.to(device=device, dtype=dtype)

    @property
    def sketched_width(self) -> int:
        """k, the sketched rows' length."""
        return self.groups * self.blocks * self.per_block

    def group_of_columns(self) -> Tensor:
        """Each sketched column's group, ``(k,)`` of int64."""
        group = torch.arange(self.groups).repeat_interleave(self.per_block)
        return group.repeat(self.blocks).to(self._mats.device)

    def project(self, rows: Tensor) -> Tensor:
        """``rows`` ``(…, P)`` sketched to ``(…, k)`` in the rows' dtype."""
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, self.width)
        mats = self._mats.to(flat.dtype)
        out = flat.new_empty(flat.shape[0], self.blocks, mats.shape[-1])
        for index in range(self.blocks):
            start = index * self.block
            stop = min(start + self.block, self.width)
            out[:, index] = flat[:, start:stop] @ mats[index, : stop - start]
        return out.reshape(*lead, self.sketched_width)


@dataclass(frozen=True)
class SketchPlan:
    """When and how the probe kernel sketches the rows it keeps for the stored-row estimate:
    ``factor`` times shorter in ``groups`` groups, for models of at least ``from_parameters``."""

    factor: int
    groups: int
    from_parameters: int

    def applies(self, num_parameters: int, max_parameters: int, side: str = "auto") -> bool:
        """Whether rows of ``num_parameters`` are sketched: asked for (``factor`` > 1, at least
        two groups for the jackknife of the sketch's bias), P at least ``from_parameters``, and
        no P × P side to move to (P above ``max_parameters``, the side not forced to the
        parameters')."""
        return (
            self.factor > 1
            and self.groups >= 2
            and num_parameters >= self.from_parameters
            and num_parameters > max_parameters
            and side != "parameters"
        )

    def build(self, width: int, like: Tensor) -> RowSketch:
        """The projection of rows of ``width``, on ``like``'s device and in its dtype."""
        return RowSketch(width, self.factor, self.groups, device=like.device, dtype=like.dtype)

    def width(self, num_parameters: int) -> int:
        """k, the length of a sketched row of ``num_parameters`` (:func:`kept_width`)."""
        return kept_width(num_parameters, self.factor, self.groups)


def _layout(width: int, factor: int, groups: int) -> tuple[int, int, int]:
    """A sketch's blocks of rows of ``width``, the coordinates of a block (the last, shorter
    block is zero-padded), and each group's columns per block (at factor 1 all of them: every
    direction of each group, an exact rotation)."""
    blocks = math.ceil(width / SKETCH_BLOCK)
    block = min(SKETCH_BLOCK, width)
    per_block = block if factor == 1 else max(1, math.ceil(block / (factor * groups)))
    return blocks, block, per_block


def kept_width(num_parameters: int, factor: int, groups: int) -> int:
    """k, the length of a row of ``num_parameters`` sketched ``factor`` times shorter in
    ``groups`` groups (:class:`RowSketch`), without building the projection."""
    blocks, _, per_block = _layout(num_parameters, factor, groups)
    return groups * blocks * per_block
