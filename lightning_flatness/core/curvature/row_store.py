"""The probe kernel's kept rows, written once into preallocated slabs of memory.

A batch's probe rows ``(s, N, P)`` arrive as one piece per layer (``(s, N, P_l)``, the
parameters in order). Concatenating them into a batch's rows, then the batches into one block
for the stored-row estimate, copied every number twice into freshly allocated memory: on the
78,042-parameter ladder ResNet (16,384 rows, 5 GB of float32) those copies were 18 s of a
110 s measurement. Here each piece is copied once, into its place in one of a few large
slabs (:data:`SLAB_NUMBERS`), and the slabs are what the estimates read
(:meth:`RowStore.chunks`). The rows' squared norms per probe (the exact trace) are summed from
the pieces as they are written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_flatness.core.curvature.row_sketch import RowSketch

__all__ = ["FIRST_SLAB_SAMPLES", "SLAB_NUMBERS", "RowStore", "slab_capacity", "slab_starts"]

#: the most numbers of one slab (4 GiB of float32). Products over many small slabs are slow
#: (16,384 rows of 78,042 parameters: 1.25 s a Lanczos step in 40 slabs, 0.90 s in 12), and
#: the part of the last slab no row reached is never touched, so on the host it takes address
#: space, not memory
SLAB_NUMBERS = 2**30
#: the samples of the first slab (fewer where that is more than :data:`SLAB_NUMBERS` numbers)
FIRST_SLAB_SAMPLES = 256


def slab_capacity(probes: int, width: int, kept: int) -> int:
    """The samples of the next slab of a store of ``probes`` rows of ``width`` per sample that
    keeps ``kept`` samples in full slabs: :data:`FIRST_SLAB_SAMPLES`, then as many as are kept
    so far (doubling), at most :data:`SLAB_NUMBERS` numbers."""
    most = max(1, SLAB_NUMBERS // max(probes * width, 1))
    return min(most, max(FIRST_SLAB_SAMPLES, kept))


def slab_starts(probes: int, width: int, samples: int) -> list[int]:
    """The first sample of each slab of a store of ``samples`` samples, then ``samples``: the
    slabs depend on the number of samples only (:class:`RowStore`)."""
    starts = [0]
    while starts[-1] < samples:
        starts.append(min(samples, starts[-1] + slab_capacity(probes, width, starts[-1])))
    return starts


class RowStore:
    """Probe rows of ``probes`` per sample and ``width`` parameters, kept in slabs of samples.

    A slab holds ``(probes, capacity, width)``; the first :data:`FIRST_SLAB_SAMPLES` samples,
    each later one as many as are kept so far (doubling), at most :data:`SLAB_NUMBERS` numbers,
    so a small measurement allocates about what it keeps and a large one wastes at most one
    slab's unused part. The slabs' sizes depend on the number of samples only, never on the
    batches (the stored-row estimate's order of rows follows them).
    """

    def __init__(self, probes: int, width: int) -> None:
        self.probes, self.width = int(probes), int(width)
        self._slabs: list[Tensor] = []
        self._filled: list[int] = []
        #: each probe's Σ ‖v‖² over the kept rows (float64, on the host)
        self.squared_norms = torch.zeros(self.probes, dtype=torch.float64)
        #: samples kept
        self.samples = 0

    def append(
        self,
        pieces: list[Tensor] | Tensor,
        squared_norms: Tensor | None = None,
        sketch: RowSketch | None = None,
    ) -> None:
        """Keep one batch's rows: ``pieces``, ``(probes, N, P_l)`` each, the parameters in order
        (their widths sum to :attr:`width`), or one ``(probes, N, width)`` tensor; with
        ``sketch``, the rows sketched by it (:attr:`width` is then its sketched width), their
        whole squared norms counted; ``squared_norms`` (per probe) where the pieces are already
        a sketch of rows whose norms count."""
        pieces = [pieces] if isinstance(pieces, Tensor) else list(pieces)
        if sketch is not None:
            rows = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
            with torch.no_grad():
                squared_norms = torch.linalg.vecdot(rows, rows).sum(1, dtype=torch.float64)
                pieces = [sketch.project(rows)]
        count = pieces[0].shape[1]
        if sum(piece.shape[-1] for piece in pieces) != self.width:
            widths = [piece.shape[-1] for piece in pieces]
            raise ValueError(f"row pieces of widths {widths} do not make {self.width} parameters")
        with torch.no_grad():
            if squared_norms is None:
                for piece in pieces:
                    norms = torch.linalg.vecdot(piece, piece).sum(1, dtype=torch.float64)
                    self.squared_norms += norms.cpu()
            else:
                self.squared_norms += squared_norms.to(torch.float64).cpu()
            self._write(pieces, count)
        self.samples += count

    def sketched(self, sketch: RowSketch) -> RowStore:
        """A store of these rows sketched by ``sketch`` (the same squared norms), each slab
        freed once it is sketched."""
        store = RowStore(self.probes, sketch.sketched_width)
        while self._slabs:
            slab, filled = self._slabs.pop(0), self._filled.pop(0)
            rows = torch.stack(
                [sketch.project(slab[probe, :filled]) for probe in range(self.probes)]
            )
            store.append(rows, torch.zeros(self.probes))
            del slab
        store.squared_norms += self.squared_norms
        self.clear()
        return store

    def _write(self, pieces: list[Tensor], count: int) -> None:
        done = 0
        while done < count:
            slab, filled = self._room(pieces[0])
            take = min(count - done, slab.shape[1] - filled)
            column = 0
            for piece in pieces:
                span = slice(column, column + piece.shape[-1])
                slab[:, filled : filled + take, span] = piece[:, done : done + take]
                column = span.stop
            self._filled[-1] += take
            done += take

    def _room(self, like: Tensor) -> tuple[Tensor, int]:
        """The last slab and its samples in use, after allocating a new one if it is full."""
        if self._slabs and self._filled[-1] < self._slabs[-1].shape[1]:
            return self._slabs[-1], self._filled[-1]
        kept = sum(self._filled)  # every slab so far is full
        capacity = slab_capacity(self.probes, self.width, kept)
        self._slabs.append(like.new_empty(self.probes, capacity, self.width))
        self._filled.append(0)
        return self._slabs[-1], 0

    def chunks(self) -> list[Tensor]:
        """The kept rows, ``(probes, n_j, width)`` views of the slabs in order of samples."""
        return [slab[:, :filled] for slab, filled in zip(self._slabs, self._filled, strict=True)]

    def clear(self) -> None:
        """Free the rows."""
        self._slabs.clear()
        self._filled.clear()
        self.squared_norms.zero_()
        self.samples = 0
