"""Random draws keyed by a sample's position in the measured set, not by the process.

Under data parallelism every process measures a share of one fixed set of samples (process r
of W holds the samples at positions r, r + W, r + 2W, …). A probe drawn from a per-process
generator gives every process different probes for different samples, so the processes
together compute a different (equally valid) estimate from the one a single process computes
on the union. Drawn by position instead, a sample gets the same probe however the set is cut
into batches or shared among processes: the processes log exactly what one process would.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["position_draws", "position_signs", "shard_positions"]

#: samples per block of position-keyed probe draws
_SIGN_BLOCK = 1024


def shard_positions(count: int, shard: tuple[int, int] | None, first: int = 0) -> Tensor:
    """The positions in the whole set of this process's samples ``first … first + count − 1``
    (``shard = (rank, world_size)``; None: one process)."""
    rank, world_size = shard or (0, 1)
    return (torch.arange(count) + first) * world_size + rank


def position_signs(stream: int, positions: Tensor, probes: int, outputs: int) -> Tensor:
    """Rademacher signs ``(probes, len(positions), outputs)`` of the samples at ``positions`` of
    a stream: block b of :data:`_SIGN_BLOCK` positions is drawn from a generator seeded with
    ``(stream, b)``, so a sample's signs depend on its position and the stream's seed only,
    never on how the stream is cut into batches or shared among processes."""
    return position_draws(stream, positions, probes, outputs, "rademacher")


def position_draws(stream: int, positions: Tensor, probes: int, outputs: int, kind: str) -> Tensor:
    """Rademacher (±1), standard Gaussian or uniform [0, 1) draws
    ``(probes, len(positions), outputs)``, float64, keyed by position as :func:`position_signs`."""
    if kind not in ("rademacher", "gaussian", "uniform"):
        raise ValueError(f"probe distribution must be 'rademacher' or 'gaussian', got {kind!r}.")
    positions = positions.reshape(-1).to(torch.long)
    out = torch.empty(probes, positions.numel(), outputs, dtype=torch.float64)
    blocks = torch.div(positions, _SIGN_BLOCK, rounding_mode="floor")
    for block in blocks.unique().tolist():
        chosen = (blocks == block).nonzero().squeeze(1)
        draws = _draw_block(int(stream), int(block), probes, outputs, kind)
        out[:, chosen] = draws[:, positions[chosen] - block * _SIGN_BLOCK]
    return out


@functools.lru_cache(maxsize=4)
def _draw_block(stream: int, block: int, probes: int, outputs: int, kind: str) -> Tensor:
    """The draws of one block of positions (cached: consecutive batches share a block)."""
    generator = torch.Generator().manual_seed((stream * 1_000_003 + block) % (2**63))
    shape = (probes, _SIGN_BLOCK, outputs)
    if kind == "gaussian":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "uniform":
        return torch.rand(shape, generator=generator, dtype=torch.float64)
    return 2 * torch.randint(0, 2, shape, generator=generator).to(torch.float64) - 1
