"""The stored-row estimate in the parameters' space: the probe rows kept by several processes,
never gathered (docs/math.md, "The probe kernel", rows across processes).

Under data parallelism each process r keeps the probe rows ``V_r`` of its own samples. The
rows' space (one entry per row) is then split across processes, the parameters' space is not:
``F̂ = Σ_r V_rᵀ V_r / m`` has the kernel's nonzero spectrum, and its product with a block of
vectors is each process's ``V_rᵀ(V_r X)`` summed by one all-reduce. So the Hutchinson probes
are drawn in the parameters' space (the same on every process, from one seed), the Lanczos runs
advance alike on every process from the summed products, and the trace functions
``Tr h(F̂) = Tr h(K)`` (h(0) = 0) come out the same everywhere, with the stored-row estimate's
quadrature bracket, stopping rule and jackknife
(:mod:`~lightning_flatness.core.curvature.run_summary`).

The run sets are those of the rows'-space estimate
(:class:`~lightning_flatness.core.curvature.run_sets.RunSets`): a probe group's leave-out keeps
the other groups' rows, ``Σ_{g′≠g} V_g′ᵀ V_g′`` times G/(G − 1); a sketch group's leave-out drops
that group's columns on both sides, ``M Vᵀ V M`` (the nonzero spectrum of ``V M Vᵀ``), its runs
started from probes with those entries zeroed. The Newton decrement's runs from g live in this
space already and advance in the same products (none on sketched rows, as in the rows' space).

One process measuring with an ``all_reduce`` (a world of one) takes this path too, so a
process alone computes what the processes together compute on the union: the same probes and
the same sums, up to the order of the float additions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.lanczos_quadrature import LanczosRuns
from lightning_flatness.core.curvature.newton_decrement import FormRuns, guarded_decrement
from lightning_flatness.core.curvature.probe_kernel import ProbeKernelFisher, row_pieces
from lightning_flatness.core.curvature.row_sketch import RowSketch
from lightning_flatness.core.curvature.row_store import RowStore
from lightning_flatness.core.curvature.run_sets import RunSets
from lightning_flatness.core.curvature.run_summary import bracketed, run_summary
from lightning_flatness.core.curvature.stored_rows import (
    CHECK_EVERY,
    DECREMENT_LOOSENESS,
    DEFAULT_QUADRATURE,
    QuadratureBudget,
    decrement_of,
)
from lightning_flatness.core.failures import AllReduce
from lightning_flatness.core.memory import rows_refusal

__all__ = ["LocalRows", "SpreadProbeKernel", "parameter_space_estimate"]


class LocalRows:
    """One process's kept rows by probe group, and its share of the products with ``F̂``.

    Args:
        store: the rows, ``(s, m_r, width)`` in slabs of samples (possibly none).
        groups: the jackknife's probe groups (divides s).
        width: the rows' length (P, or the sketched k), known even without rows.
    """

    def __init__(self, store: RowStore, groups: int, width: int) -> None:
        per_group = store.probes // groups
        self.groups, self.width = groups, width
        #: (group, its rows in one slab, (s/G · n_j, width))
        self.blocks = [
            (group, chunk[group * per_group : (group + 1) * per_group].reshape(-1, width))
            for group in range(groups)
            for chunk in store.chunks()
        ]
        self.group_norms = store.squared_norms.reshape(groups, per_group).sum(1)

    def products(self, vectors: Tensor, kept: Tensor) -> Tensor:
        """``Σ_g kept[:, g] · V_gᵀ(V_g x)`` for each row x of ``vectors`` ``(n, width)``, over this
        process's rows, in float64; a group's rows multiply only the vectors that keep it."""
        out = torch.zeros(vectors.shape[0], self.width, dtype=torch.float64, device=vectors.device)
        reach = [torch.nonzero(kept[:, g] > 0).squeeze(1) for g in range(self.groups)]
        for group, rows in self.blocks:
            if reach[group].numel() == 0:
                continue
            block = vectors[reach[group]].to(rows.dtype)
            out[reach[group]] += ((block @ rows.T) @ rows).to(torch.float64)
        return out


def _probe_starts(
    sets: RunSets,
    probes: int,
    width: int,
    seed: int,
    columns: Tensor | None,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """Start vectors of the runs (each Rademacher probe on every run set, zeroed off the run
    set's columns), each run's kept groups ``(runs, G)`` and its scale."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (probes, width), generator=generator, dtype=torch.float64)
    signs = (2 * signs - 1).to(device)
    start = signs.unsqueeze(0).expand(sets.count, -1, -1)
    if columns is not None:
        start = start * columns.unsqueeze(1)
    kept = sets.kept_groups(device).repeat_interleave(probes, dim=0)
    scales = sets.scales(device).repeat_interleave(probes)
    return start.reshape(sets.count * probes, width).clone(), kept, scales


def parameter_space_estimate(
    rows: RowStore,
    groups: int,
    num_samples: int,
    lam: float,
    *,
    width: int,
    budget: QuadratureBudget = DEFAULT_QUADRATURE,
    seed: int = 0,
    gradient: Tensor | None = None,
    sketch: RowSketch | None = None,
    all_reduce: AllReduce | None = None,
    device: torch.device | str | None = None,
) -> CurvatureEstimate:
    """The stored-row estimate (module docstring) of this process's ``rows`` and, through
    ``all_reduce`` (a sum in place across processes; every process calls this together), the
    other processes' rows: jackknifed trace functions, their standard errors
    (``blocks["stderr"]``), the plain ones (``blocks["uncorrected"]``) and, with the objective's
    ``gradient`` and rows not sketched, the Newton decrement. ``num_samples`` is m over every
    process; ``width`` the rows' length."""
    reduce = all_reduce if all_reduce is not None else (lambda tensor: tensor)
    local = LocalRows(rows, groups, width)
    device = torch.device(device) if device is not None else torch.device("cpu")
    traces = reduce(local.group_norms.to(device)).cpu() / num_samples
    sets = RunSets(groups, sketch.groups if sketch is not None else 0)
    columns = sets.column_keep(sketch).to(device) if sketch is not None else None
    probes = budget.probes
    start, kept, scales = _probe_starts(sets, probes, width, seed, columns, device)
    run_columns = columns.repeat_interleave(probes, dim=0) if columns is not None else None
    steps = max(1, min(budget.steps, width))
    stop = bracketed(sets, probes, lam, budget.tolerance)
    soft_rank = LanczosRuns(start, steps, stop=stop, check_every=CHECK_EVERY)
    forms = None
    if sketch is None and gradient is not None and bool(torch.isfinite(gradient).all()):
        tolerance = DECREMENT_LOOSENESS * budget.tolerance
        forms = FormRuns(gradient.to(device), sets.count, lam, tolerance=tolerance)
    form_kept = sets.kept_groups(device)
    form_scales = sets.scales(device)
    while not soft_rank.finished or (forms is not None and not forms.runs.finished):
        parts = []  # (runs, their kept groups, scales, columns) that take a product this step
        if not soft_rank.finished:
            parts.append((soft_rank, kept, scales, run_columns))
        if forms is not None and not forms.runs.finished:
            parts.append((forms.runs, form_kept, form_scales, None))
        vectors = torch.cat([part[0].block() for part in parts])
        both = torch.cat([part[1] for part in parts])
        product = reduce(local.products(vectors, both))  # one all-reduce a step
        offset = 0
        for runs, _, run_scales, keep in parts:
            count = run_scales.shape[0]
            share = product[offset : offset + count] * (run_scales[:, None] / num_samples)
            if keep is not None:
                share = share * keep
            runs.advance(share.to(runs.block().dtype))
            offset += count
    summary = run_summary(soft_rank.decomposition(), sets, probes, lam, traces)
    decrement = (float("nan"), float("nan"))
    if gradient is not None and sketch is None:
        decrement = guarded_decrement("probe_kernel", gradient, lambda g: decrement_of(forms))
    return summary.estimate(decrement)


class SpreadProbeKernel(ProbeKernelFisher):
    """The probe kernel across processes above its P × P guard: each process keeps the rows of
    its own samples (within ``max_row_elements``; sketched from its first rows where the sketch
    applies, every process alike) and the estimate is :func:`parameter_space_estimate` with
    ``all_reduce``. Nothing of its state is summed before the estimate: its products are.

    Args:
        num_parameters: P.
        all_reduce: sums a tensor across processes in place.
        **options: the other arguments of
            :class:`~lightning_flatness.core.curvature.probe_kernel.ProbeKernelFisher` (not
            ``summable`` or ``side``: these are the rows' own).
    """

    def __init__(self, num_parameters: int, *, all_reduce: AllReduce, **options) -> None:
        super().__init__(num_parameters, side="samples", **options)
        self.all_reduce = all_reduce
        self.summable = True
        self.sketches = self.sketching is not None and self.sketching.applies(
            self.num_parameters, self.max_parameters
        )

    def add(self, rows: Tensor | list[Tensor]) -> None:
        """Keep one batch's probe rows ``(s, N, P)`` (or their pieces per parameter)."""
        pieces = row_pieces(rows, self.probes, self.num_parameters)
        self.precision = pieces[0].dtype
        if self.sketch is None and self.sketches:
            self.sketch = self.sketching.build(self.num_parameters, pieces[0])
            self.store = self.store.sketched(self.sketch)
        self.store.append(pieces, sketch=self.sketch)
        self.kept_rows = self.store.samples * self.probes
        if self.kept_rows * self.store.width > self.max_row_elements:
            raise rows_refusal(self.kept_rows, self.store.width, self.max_row_elements, self.sketch)

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate over every process's rows (every process calls this together; one that
        kept no rows takes part with the projection the others built from theirs)."""
        if self.sketch is None and self.sketches:
            self.sketch = self.sketching.build(self.num_parameters, torch.empty(0))
        width = self.sketch.sketched_width if self.sketch is not None else self.num_parameters
        return parameter_space_estimate(
            self.store,
            self.groups,
            num_samples,
            lam,
            width=width,
            budget=self.quadrature,
            gradient=self.gradient,
            sketch=self.sketch,
            all_reduce=self.all_reduce,
            device=self.device,
        )
