"""The probe kernel across processes above its P × P guard: each process keeps the probe rows
of its own samples (docs/math.md, "The probe kernel", rows across processes).

Under data parallelism each process r keeps the probe rows ``V_r`` of its samples, the global
positions ``r, r + W, …``. The stored-row estimate
(:func:`~lightning_flatness.core.curvature.stored_rows.stored_rows_estimate`) then runs in the
rows' space with its vectors split across the processes: each holds its rows' entries, a
product with the kernel is ``V_r (Σ_r' V_r'ᵀ x_r') / m`` (the sum over rows by one all-reduce a
step), and the Lanczos runs' inner products are summed too. The Hutchinson probes are the ones
one process draws on the union (:mod:`~lightning_flatness.core.curvature.row_positions`), so the
processes together compute what one process computes on the union, up to the order of float
additions; the Newton decrement's runs live in the parameters' space and advance on the same
summed products.

Where one process would form the kernel instead (the probe rows over every process no more
than ``max_kernel_size``, not sketched, within the rows' memory), the processes gather the rows
in the union's order by one all-reduce (each writes its rows at its samples' global positions
of a zero block) and every process computes the one-process estimate of the formed kernel:
the same rows, the same numbers. The quadrature's bracket, which at a small λ can be wide at
its step cap, is then not needed.

The rows are sketched where one process on the union would sketch them: a process sketches
its own once they, times the processes, are too many for a formed kernel (or its memory), and
at the estimate the processes agree (any one sketched, or the union's rows too many: all do,
by the one projection every process builds alike).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.probe_kernel import (
    ProbeKernelFisher,
    kept_rows_estimate,
    row_pieces,
)
from lightning_flatness.core.curvature.row_positions import union_entries, union_samples
from lightning_flatness.core.failures import AllReduce
from lightning_flatness.core.memory import rows_refusal

__all__ = ["SpreadProbeKernel"]


def _process_shard() -> tuple[int, int]:
    """This process's ``(rank, world)`` where torch.distributed says, else a world of one."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    return 0, 1


class SpreadProbeKernel(ProbeKernelFisher):
    """The probe kernel across processes above its P × P guard: each process keeps the rows of
    its own samples (within ``max_row_elements``; sketched where one process on the union would
    sketch them, every process alike) and the estimate is the one-process estimate of the
    union's rows, gathered, or the stored-row estimate with its vectors split across the
    processes (module docstring). Nothing of its state is summed before the estimate: its
    products are.

    Args:
        num_parameters: P.
        all_reduce: sums a tensor across processes in place.
        shard: ``(rank, world)``: this process's samples are the global positions
            ``rank, rank + world, …``; default torch.distributed's rank and world (a world of
            one where it is not initialized).
        **options: the other arguments of
            :class:`~lightning_flatness.core.curvature.probe_kernel.ProbeKernelFisher` (not
            ``summable`` or ``side``: these are the rows' own).
    """

    def __init__(
        self,
        num_parameters: int,
        *,
        all_reduce: AllReduce,
        shard: tuple[int, int] | None = None,
        **options,
    ) -> None:
        super().__init__(num_parameters, side="samples", **options)
        self.all_reduce = all_reduce
        self.shard = shard if shard is not None else _process_shard()
        self.summable = True
        self.sketches = self.sketching is not None and self.sketching.applies(
            self.num_parameters, self.max_parameters
        )

    def _add_rows(self, rows: Tensor | list[Tensor]) -> None:
        """Keep one batch's probe rows ``(s, N, P)`` (or their pieces per parameter), sketched
        once the rows over every process are, as far as this process can tell, too many for a
        formed kernel (its own times the processes) or its own pass the rows' memory."""
        pieces = row_pieces(rows, self.probes, self.num_parameters)
        self.precision = pieces[0].dtype
        self.store.append(pieces, sketch=self.sketch)
        self.kept_rows = self.store.samples * self.probes
        too_big = self.kept_rows * self.store.width > self.max_row_elements
        beyond_kernel = self.kept_rows * self.shard[1] > self.max_kernel_size
        if self.sketch is None and self.sketches and (too_big or beyond_kernel):
            self._sketch(pieces[0])
            too_big = self.kept_rows * self.store.width > self.max_row_elements
        if too_big:
            raise rows_refusal(self.kept_rows, self.store.width, self.max_row_elements, self.sketch)

    def _sketch(self, like: Tensor) -> None:
        """Sketch the kept rows (and every later batch's) by the one projection every process
        builds alike."""
        self.sketch = self.sketching.build(self.num_parameters, like)
        self.store = self.store.sketched(self.sketch)

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate over every process's rows (every process calls this together). The
        processes first agree on the sketch as one process on the union would have it: the
        rows are sketched if any process sketched its own or the union's rows are too many
        for a formed kernel; then they are gathered where they fit a formed kernel (the
        one-process estimate of it) or measured by the split runs (module docstring)."""
        total = union_samples(self.store.samples, self.shard, self.all_reduce, self.device)
        rows = total * self.probes
        if self.sketches:
            flag = torch.tensor([float(self.sketch is not None)], device=self.device)
            anyone = bool(self.all_reduce(flag)[0] > 0)
            if self.sketch is None and (anyone or rows > self.max_kernel_size):
                self._sketch(torch.empty(0, dtype=self.precision, device=self.device))
        formed = rows <= self.max_kernel_size and rows * self.store.width <= self.max_row_elements
        if self.sketch is None and formed:
            return self._gathered(total).estimate(num_samples, lam)
        store = self.store
        entries = union_entries(
            self.probes, self.groups, store.width, store.samples, self.shard, total
        )
        union = (self.probes * total, entries.to(self.device))
        return kept_rows_estimate(self, num_samples, lam, all_reduce=self.all_reduce, union=union)

    def _gathered(self, total: int) -> ProbeKernelFisher:
        """One process's probe kernel holding every process's rows in the union's order
        (module docstring; every process calls this together), this process's own freed."""
        gathered = torch.zeros(
            self.probes, total, self.store.width, dtype=self.precision, device=self.device
        )
        rank, world = self.shard
        first = 0
        for chunk in self.store.chunks():
            positions = torch.arange(first, first + chunk.shape[1], device=self.device)
            gathered[:, positions * world + rank] = chunk
            first += chunk.shape[1]
        self.store.clear()
        gathered = self.all_reduce(gathered)  # x + 0 = x: the rows as they were
        union = ProbeKernelFisher(
            self.num_parameters,
            probes=self.probes,
            groups=self.groups,
            side="samples",
            max_parameters=self.max_parameters,
            max_kernel_size=self.max_kernel_size,
            max_row_elements=self.max_row_elements,
            device=self.device,
            quadrature=self.quadrature,
            spectrum=self.spectrum,
        )
        union._add_rows(gathered)  # the rows as added here: already scaled
        union.gradient = self.gradient
        return union
