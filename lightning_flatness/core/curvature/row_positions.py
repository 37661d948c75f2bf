"""Where each process's kept probe rows sit in the rows' space of one process measuring the
union (docs/math.md, "The probe kernel", rows across processes).

The stored-row estimate orders the rows' space by probe group, then by slab of samples, then
by probe and sample (:class:`~lightning_flatness.core.curvature.stored_rows.StoredRows`), and
draws its Hutchinson probes over that order. Under data parallelism process r measures the
samples at positions ``r, r + W, r + 2W, …`` of the set all W processes measure together
(``shard``), and keeps only their rows. To draw exactly the probes one process would draw on the
union, each process draws the union's probes (a few numbers per row, cheap beside the rows) and
takes the entries of its own rows, found here: a row's place in the union's order follows from
its group, its probe and its sample's global position, because the union's slabs depend on
its number of samples only (:func:`~lightning_flatness.core.curvature.row_store.slab_starts`).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from lightning_flatness.core.curvature.row_store import slab_starts
from lightning_flatness.core.failures import AllReduce

__all__ = ["union_entries", "union_samples"]


def union_samples(
    samples: int,
    shard: tuple[int, int],
    all_reduce: AllReduce,
    device: torch.device | str | None = None,
) -> int:
    """The samples of the union's order: one past the last global position any process
    measures (every process calls this together). With the shares a distributed sampler gives
    (process r the positions r, r + W, …) it is the number of samples over every process; with
    other shares some positions are empty, which only leaves their probe entries unused."""
    rank, world = shard
    counts = torch.zeros(world, dtype=torch.float64, device=device)
    counts[rank] = samples
    counts = all_reduce(counts)
    last = [(int(count) - 1) * world + r + 1 for r, count in enumerate(counts.tolist()) if count]
    return max(last, default=0)


def union_entries(
    probes: int,
    groups: int,
    width: int,
    samples: int,
    shard: tuple[int, int],
    total: int,
) -> Tensor:
    """The index in the union's rows' space of each entry of this process's rows' space.

    Args:
        probes: s, the probe rows per sample (in ``groups`` groups of s/G).
        groups: G.
        width: the rows' length (the union's slabs depend on it).
        samples: this process's samples (its slabs, like the union's, follow from their
            number).
        shard: ``(rank, world)``; this process's sample j is global position ``j·world + rank``.
        total: the union's samples (:func:`union_samples`).
    """
    rank, world = shard
    per_group = probes // groups
    starts = torch.tensor(slab_starts(probes, width, total), dtype=torch.long)
    local_starts = slab_starts(probes, width, samples)
    pieces = []
    for group in range(groups):
        for first, stop in itertools.pairwise(local_starts):
            position = torch.arange(first, stop, dtype=torch.long) * world + rank
            slab = torch.searchsorted(starts, position, right=True) - 1
            begin, size = starts[slab], starts[slab + 1] - starts[slab]
            probe = torch.arange(per_group, dtype=torch.long)[:, None]
            entry = group * per_group * total + per_group * begin + probe * size + position - begin
            pieces.append(entry.reshape(-1))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
