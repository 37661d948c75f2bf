"""The per-sample probes ξ of the matrix-free structures, drawn by the samples' positions.

Each of ``lanczos``, ``cg`` and ``hutchinson`` draws its probes from a stream of its own,
keyed by each sample's position in the whole measured set (plus the seed;
:mod:`~lightning_flatness.core.positional`), so that ξ is the same however the set is split
into batches or shared among processes. Under data parallelism without known positions (no
``shard``) each process draws from streams shifted by its rank instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flatness.core.curvature.hutchinson import POWER_START_STREAM
from lightning_flatness.core.positional import position_draws, shard_positions

__all__ = [
    "CG_PROBE_STREAM",
    "HUTCHINSON_PROBE_STREAM",
    "LANCZOS_PROBE_STREAM",
    "PROCESS_STREAM_SPACING",
    "SampleProbes",
    "process_rank",
]

#: the position-keyed draw streams (plus the seed) of ``cg``'s and ``lanczos``'s sample probes,
#: apart from the layer hooks' 2·seed + {0, 1}
CG_PROBE_STREAM = 2**40
LANCZOS_PROBE_STREAM = 2**41
HUTCHINSON_PROBE_STREAM = 2**42  # + 4·seed + the variant's stream
#: where the positions of a process's samples in the whole set are unknown, process r draws from
#: the streams shifted by r times this
PROCESS_STREAM_SPACING = 2**36


def process_rank(explicit: int | None, all_reduce: Callable[[Tensor], Tensor] | None) -> int:
    """This process's rank: ``explicit`` if given, else ``torch.distributed``'s under data
    parallelism (``all_reduce`` given), else 0 (with a warning when ``all_reduce`` is given
    without a process group: every process would draw the same probes)."""
    if explicit is not None:
        return int(explicit)
    if all_reduce is None:
        return 0
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    warnings.warn(
        "all_reduce is given but no torch.distributed process group is initialized: pass "
        "MatrixFreeOptions(rank=<this process's rank>) so that each process draws its "
        "own probes (identical probes on different samples bias the Lanczos estimate).",
        stacklevel=3,
    )
    return 0


@dataclass(frozen=True)
class SampleProbes:
    """Draws ξ of shape (K, B, C) on this process's measured samples, in the model's dtype.

    Attributes:
        seed: the measurement's seed, added to every stream.
        shard: ``(rank, world_size)`` when this process measures the samples at positions
            ``rank, rank + world_size, …`` of the whole set, else None (positions ``0, 1, …``).
        rank: this process's rank (:func:`process_rank`).
        positions_unknown: data parallelism without ``shard``: each process draws its own.
        distribution: ``"rademacher"`` or ``"gaussian"`` entries (Lanczos and Hutchinson).
        device / dtype: where and in which dtype the probes are returned.
    """

    seed: int
    shard: tuple[int, int] | None
    rank: int
    positions_unknown: bool
    distribution: str
    device: torch.device
    dtype: torch.dtype

    def draw(self, stream: int, shape: tuple[int, int, int], kind: str, first: int = 0) -> Tensor:
        """ξ of shape (K, B, C) on this process's measured samples ``first … first + B − 1``:
        drawn by the samples' positions in the whole measured set (the same ξ however the set
        is shared among processes), or, under data parallelism when the positions are unknown,
        from a stream of this process's own."""
        if self.positions_unknown:
            stream += PROCESS_STREAM_SPACING * self.rank  # this process's own draws
        positions = shard_positions(shape[1], self.shard, first)
        draws = position_draws(stream + self.seed, positions, shape[0], shape[2], kind)
        return draws.to(device=self.device, dtype=self.dtype)

    def lanczos(self, shape: tuple[int, int, int]) -> Tensor:
        """``lanczos``'s start probes on all of this process's samples."""
        return self.draw(LANCZOS_PROBE_STREAM, shape, self.distribution)

    def cg(self, shape: tuple[int, int, int]) -> Tensor:
        """``cg``'s Rademacher probes on all of this process's samples."""
        return self.draw(CG_PROBE_STREAM, shape, "rademacher")

    def hutchinson(self, stream: int, first: int, shape: tuple[int, int, int]) -> Tensor:
        """``hutchinson``'s draws (:class:`~lightning_flatness.core.curvature.hutchinson.
        HutchinsonFisher`): stream 0–2 its variants' probes, :data:`POWER_START_STREAM` the
        power iteration's Gaussian starts."""
        kind = "gaussian" if stream == POWER_START_STREAM else self.distribution
        return self.draw(HUTCHINSON_PROBE_STREAM + 3 * self.seed + stream, shape, kind, first)
