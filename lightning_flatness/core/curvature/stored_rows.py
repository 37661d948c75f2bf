"""The probe kernel's estimate from its kept probe rows without forming the kernel: stochastic
Lanczos quadrature on products with the stored rows (docs/math.md, "The probe kernel", stored
rows).

The kernel ``K = V Vᵀ / m`` of the R = m·s stacked probe rows ``V`` (R × P) has the nonzero
spectrum of ``F̂ = Vᵀ V / m``. Forming it costs R²·P multiply-adds (3·10¹³ for 20,000 rows of
78,000 parameters); a product of a block of b vectors with it, ``V (Vᵀ X) / m``, costs 2·b·R·P
and no pass through the network. So the trace functions ``Tr h(K)`` come from Hutchinson's
estimator with Gauss quadrature (:mod:`~lightning_flatness.core.curvature.lanczos_quadrature`):
for Rademacher ``z`` in the rows' space, ``zᵀ h(K) z ≈ ‖z‖² Σ_j τ_j² h(θ_j)`` from a Lanczos run
started at ``z``. Because ``h(K)`` has eigenvalues in [0, 1) for the soft rank, the Hutchinson
variance is at most ``2 Tr h(K) / probes``: a relative error of ``√(2 / (probes · soft rank))``,
under 1% for a soft rank of 1,000 with 16 probes.

The probes' bias is removed as on the formed kernel, by the delete-one-group jackknife: the
leave-one-group-out kernel is ``K`` restricted to the other groups' rows (times G/(G − 1)), and
its runs start from the same ``z`` with that group's entries zeroed, all in one block of
products. ``h(0) = 0``, so the zeroed rows add nothing. The trace is exact (the rows' squared
norms); the largest eigenvalue is the top Ritz value.

Given the objective's gradient g, the Newton decrement ``½ gᵀ(F̂+λI)⁻¹g`` of the whole estimate
and of each leave-one-group-out one is bracketed by the Gauss and Gauss–Radau rules of Lanczos
runs from g with products ``Vᵀ(Vx)/m`` through the same rows
(:class:`~lightning_flatness.core.curvature.newton_decrement.FormRuns`), jackknifed. Those
runs advance in the same passes over the rows as the soft rank's (:meth:`StoredRows.lockstep`):
the decrement costs a few more columns of products, not passes of its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.lanczos_quadrature import LanczosRuns
from lightning_flatness.core.curvature.newton_decrement import (
    FormRuns,
    guarded_decrement,
    probe_decrement,
)
from lightning_flatness.core.curvature.row_sketch import RowSketch
from lightning_flatness.core.curvature.row_store import RowStore
from lightning_flatness.core.curvature.run_sets import RunSets
from lightning_flatness.core.curvature.run_summary import bracketed, run_summary
from lightning_flatness.core.failures import AllReduce
from lightning_flatness.core.options import (
    SLQ_EXTENSION,
    SLQ_LOOSE_TOLERANCE,
    SLQ_PROBES,
    SLQ_STEPS,
    SLQ_TOLERANCE,
)

__all__ = [
    "QuadratureBudget",
    "StoredRows",
    "decrement_of",
    "keeps_rows",
    "quadrature_seconds",
    "stored_rows_estimate",
]

#: Lanczos steps between two checks of the bracket
CHECK_EVERY = 5


@dataclass(frozen=True)
class QuadratureBudget:
    """The stored-row estimate's Hutchinson probes, its Lanczos steps, the relative half-width
    of the soft rank's quadrature bracket at which the runs stop, and how many times the steps
    the runs may take while the bracket is wider than
    :data:`~lightning_flatness.core.options.SLQ_LOOSE_TOLERANCE`."""

    probes: int = SLQ_PROBES
    steps: int = SLQ_STEPS
    tolerance: float = SLQ_TOLERANCE
    extension: int = SLQ_EXTENSION


#: how much wider, relatively, the Newton decrement's quadrature bracket may be than the soft
#: rank's: the decrement is read against a limit (0.1 nat) and its own probes' standard error
#: was 1–50% on the fits measured (docs/RESULTS.md, "The settled test: short fits"); on the
#: 78,042-parameter ladder ResNet its runs took 65 steps to a 2% bracket
DECREMENT_LOOSENESS = 2.5

#: the default budget: :data:`SLQ_PROBES` probes of at most :data:`SLQ_STEPS` steps, stopping
#: at :data:`SLQ_TOLERANCE`
DEFAULT_QUADRATURE = QuadratureBudget()


class StoredRows:
    """The kept probe rows (a :class:`~lightning_flatness.core.curvature.row_store.RowStore`)
    read as blocks of each group's rows, and products with the kernel and its
    leave-one-group-out restrictions. The rows' space is ordered by group, then by slab of
    samples, then by probe and sample position, whatever the batches were, so the estimate does
    not depend on the batch size.

    Args:
        store: the rows, ``(s, m, P)`` in slabs of samples.
        groups: the jackknife's probe groups (divides s).
        num_samples: m, the measured samples (the kernel is ``V Vᵀ / m``).
    """

    def __init__(self, store: RowStore, groups: int, num_samples: int) -> None:
        per_group = store.probes // groups
        total = store.samples
        #: (group, its rows in one slab (s/G · n_j, P), their span in the rows' space)
        self.blocks: list[tuple[int, Tensor, slice]] = []
        for group in range(groups):
            offset = group * per_group * total
            for chunk in store.chunks():
                rows = chunk[group * per_group : (group + 1) * per_group].reshape(-1, store.width)
                self.blocks.append((group, rows, slice(offset, offset + rows.shape[0])))
                offset += rows.shape[0]
        self.group_norms = store.squared_norms.reshape(groups, per_group).sum(1)
        self.groups, self.probes = groups, store.probes
        self.num_samples = num_samples
        self.group_size = per_group * total
        self.size = groups * self.group_size
        self.width = store.width
        self.dtype, self.device = self.blocks[0][1].dtype, self.blocks[0][1].device

    def lockstep(
        self,
        sample: RowSpaceRuns,
        parameter: ParameterSpaceRuns | None,
        reduce: AllReduce | None = None,
    ) -> None:
        """Advance Lanczos runs in the rows' space (products with the kernel restricted by each
        run's mask, ``scale · M K M x``) and runs in the parameters' space (products with the
        estimates ``F̂_k``, ``scale · V_kᵀ V_k x / m``) until both have finished, every pass over
        a group's rows serving both: a rows'-space product is ``V`` then ``Vᵀ``, a
        parameters'-space one ``Vᵀ`` then ``V``, so the second half of one run's step and the
        first half of the other's are one matrix product. On the 78,042-parameter ladder
        ResNet the decrement's runs then cost a tenth of a soft rank's step, not half.

        A group's rows take part only in the runs that keep them: a leave-one-group-out run
        never multiplies the left-out group's rows.

        With ``reduce`` (a sum across processes, every process calling this together) the
        rows are this process's and the rows'-side vectors its entries of them: the products'
        first halves, sums over rows, are summed across processes, and the second halves give
        each process its own entries."""
        dtype = self.dtype
        reach = sample.kept_runs()
        kept = parameter.kept_runs() if parameter is not None else None
        in_flight: list[Tensor] | None = None  # the parameter runs' V x, per block
        while True:
            rows_side = not sample.runs.finished
            if not rows_side and in_flight is None and (parameter is None or parameter.done):
                return
            # first half, products with V: rows' side Vᵀ(Mx), parameters' side Vᵀ(Vx)
            masked = (sample.runs.block() * sample.masks).to(dtype) if rows_side else None
            sums = self._through_rows(masked, reach, in_flight)
            if reduce is not None:
                sums = self._summed(sums, reduce)
            weights = None
            if rows_side:
                weights = masked.new_zeros(masked.shape[0], self.width)
                for group, total in sums.items():
                    weights[reach[group]] += total[: len(reach[group])]
                if sample.columns is not None:  # a left-out sketch group's columns
                    weights *= sample.columns.to(dtype)
            if in_flight is not None:
                count = parameter.kept.shape[0]
                outcome = torch.zeros(count, self.width, dtype=dtype, device=self.device)
                for group, total in sums.items():
                    outcome[kept[group]] += total[len(reach[group]) if rows_side else 0 :]
                parameter.advance(outcome, self.num_samples)
            # second half, products with Vᵀ: rows' side V(Vᵀ M x), parameters' side V x
            vectors = parameter.next_block(dtype) if parameter is not None else None
            out = masked.new_zeros(masked.shape) if rows_side else None
            in_flight = self._back_through_rows(weights, reach, vectors, kept, out)
            if rows_side:
                sample.advance(out, self.num_samples)

    def _through_rows(
        self, masked: Tensor | None, reach: list[Tensor], in_flight: list[Tensor] | None
    ) -> dict[int, Tensor]:
        """Each group's ``Σ_j Xⱼ V_j`` over its blocks j: ``Xⱼ`` stacks the rows'-side vectors
        ``masked`` of the runs reaching the group on the block's span, then the parameter runs'
        ``in_flight`` products of the block. One accumulating product per block, no temporary
        (an indexed sum per block was a third of a step over 40 blocks)."""
        sums: dict[int, Tensor] = {}
        for index, (group, rows, span) in enumerate(self.blocks):
            pieces = [masked[reach[group], span]] if masked is not None else []
            if in_flight is not None:
                pieces.append(in_flight[index])
            if not pieces:
                break
            block = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            if group not in sums:
                sums[group] = block.new_zeros(block.shape[0], self.width)
            sums[group].addmm_(block, rows)
        return sums

    def _summed(self, sums: dict[int, Tensor], reduce: AllReduce) -> dict[int, Tensor]:
        """Every process's :meth:`_through_rows` sums, in one all-reduce (in float64, whatever
        the rows' dtype)."""
        counts = [sums[group].shape[0] for group in range(self.groups)]
        flat = torch.cat([sums[group].to(torch.float64) for group in range(self.groups)])
        return dict(enumerate(reduce(flat).to(self.dtype).split(counts)))

    def _back_through_rows(
        self,
        weights: Tensor | None,
        reach: list[Tensor],
        vectors: Tensor | None,
        kept: list[Tensor] | None,
        out: Tensor | None,
    ) -> list[Tensor] | None:
        """Each block's ``X V_jᵀ``, the second half of :meth:`_through_rows`: the rows'-side
        ``weights`` of the runs reaching its group go into ``out`` on the block's span, the
        parameter runs' ``vectors`` that keep its group give the block's products in flight
        (returned; None without parameter runs)."""
        in_flight = None if vectors is None else []
        for group, rows, span in self.blocks:
            parts = [weights[reach[group]]] if weights is not None else []
            if vectors is not None:
                parts.append(vectors[kept[group]])
            if not parts:
                break
            product = torch.cat(parts) @ rows.T
            split = parts[0].shape[0] if weights is not None else 0
            if weights is not None:
                out[reach[group], span] = product[:split]
            if vectors is not None:
                in_flight.append(product[split:])
        return in_flight


@dataclass
class RowSpaceRuns:
    """Lanczos runs on the kernel restricted by each run's 0/1 row mask ``(k, R)`` and scaled by
    ``scales`` (k,): the soft rank's runs on the whole kernel and its leave-one-group-out ones,
    each keeping the probe groups ``kept`` (k, G) of 0/1; on sketched rows each run's 0/1
    ``columns`` ``(k, width)`` keep the sketch groups it keeps (``V Mᶜ Vᵀ``; None: every
    column)."""

    runs: LanczosRuns
    masks: Tensor
    scales: Tensor
    kept: Tensor
    columns: Tensor | None = None

    def kept_runs(self) -> list[Tensor]:
        """For each group, the indices of the runs that keep its rows."""
        return [torch.nonzero(self.kept[:, g] > 0).squeeze(1) for g in range(self.kept.shape[1])]

    def advance(self, product: Tensor, num_samples: int) -> None:
        """One step from ``V Vᵀ M x`` (the rows' dtype)."""
        block = self.runs.block()
        scaled = product.to(block.dtype) * self.masks * (self.scales[:, None] / num_samples)
        self.runs.advance(scaled)


@dataclass
class ParameterSpaceRuns:
    """Lanczos runs on the estimates ``F̂_k``, each keeping the groups ``kept[k]`` (k, G) of 0/1
    and scaled by ``scales`` (k,): the Newton decrement's runs from g (:class:`FormRuns`)."""

    forms: FormRuns
    kept: Tensor
    scales: Tensor

    @property
    def runs(self) -> LanczosRuns:
        return self.forms.runs

    @property
    def done(self) -> bool:
        return self.runs.finished

    def kept_runs(self) -> list[Tensor]:
        """For each group, the indices of the runs that keep its rows."""
        return [torch.nonzero(self.kept[:, g] > 0).squeeze(1) for g in range(self.kept.shape[1])]

    def next_block(self, dtype: torch.dtype) -> Tensor | None:
        """The vectors of the next step in ``dtype``, or None once the runs have finished."""
        return None if self.done else self.runs.block().to(dtype)

    def advance(self, product: Tensor, num_samples: int) -> None:
        """One step from ``Σ_g V_gᵀ V_g x`` over each run's kept groups (the rows' dtype)."""
        block = self.runs.block()
        self.runs.advance(product.to(block.dtype) * (self.scales[:, None] / num_samples))


def _form_runs(
    store: StoredRows, gradient: Tensor, lam: float, tolerance: float
) -> ParameterSpaceRuns:
    """The Newton decrement's Lanczos runs from g on ``F̂`` and each leave-one-group-out
    estimate: a block of G + 1 runs bracketed to ``tolerance`` (module docstring)."""
    device = store.device
    sets = RunSets(store.groups)
    kept, scales = sets.kept_groups(device), sets.scales(device)
    forms = FormRuns(gradient.to(device), kept.shape[0], lam, tolerance=tolerance)
    return ParameterSpaceRuns(forms, kept, scales)


def decrement_of(forms: FormRuns) -> tuple[float, float]:
    """The jackknifed ``½ gᵀ(F̂+λI)⁻¹g`` (:func:`probe_decrement`) of finished runs and its
    standard error, with the half-width of its quadrature bracket in quadrature."""
    midpoints, bounds = forms.brackets()
    values = (0.5 * midpoints).tolist()
    value, spread = probe_decrement(values[0], values[1:])
    remaining = 0.5 * float(bounds[0])
    stderr = math.hypot(0.0 if math.isnan(spread) else spread, remaining)
    return value, stderr if len(values) > 1 or remaining > 0 else math.nan


def keeps_rows(
    num_parameters: int, num_rows: int, *, side: str, max_parameters: int, max_kernel_size: int
) -> bool:
    """Whether the probe kernel measures ``num_rows`` rows of ``num_parameters`` by this
    module's estimate: too many rows for a formed kernel, and no P × P side to move to (it is
    too large, or ``side="samples"`` asks for the rows)."""
    if num_rows <= max_kernel_size:
        return False
    return side == "samples" or num_parameters > max_parameters


def _run_layout(
    store: StoredRows,
    probes: int,
    generator: torch.Generator,
    sets: RunSets,
    union: tuple[int, Tensor] | None = None,
) -> tuple:
    """Start vectors, masks, scales and kept groups of the runs: each Rademacher probe on every
    run set's kernel (:class:`~lightning_flatness.core.curvature.run_sets.RunSets`). With
    ``union`` (the rows' space's size over every process and the index there of each of this
    process's entries), the probes are the union's, at this process's entries."""
    device = store.device
    size = union[0] if union is not None else store.size
    signs = torch.randint(0, 2, (probes, size), generator=generator, dtype=torch.float64)
    if union is not None:
        signs = signs[:, union[1]]
    signs = (2 * signs - 1).to(device)
    kept, run_scales = sets.kept_groups(device), sets.scales(device)
    runs = kept.shape[0]
    # each group's entries of the rows' space take its run set's 0/1
    masks = kept.repeat_interleave(store.group_size, dim=1).unsqueeze(1).expand(-1, probes, -1)
    scales = run_scales.unsqueeze(1).expand(-1, probes)
    start = (signs.unsqueeze(0) * masks).reshape(runs * probes, -1)
    run_kept = kept.repeat_interleave(probes, dim=0)
    return start, masks.reshape(runs * probes, -1), scales.reshape(-1), run_kept


def stored_rows_estimate(
    rows: RowStore,
    groups: int,
    num_samples: int,
    lam: float,
    *,
    budget: QuadratureBudget = DEFAULT_QUADRATURE,
    seed: int = 0,
    gradient: Tensor | None = None,
    sketch: RowSketch | None = None,
    all_reduce: AllReduce | None = None,
    union: tuple[int, Tensor] | None = None,
) -> CurvatureEstimate:
    """The jackknifed trace functions of the kernel of ``rows`` by stochastic Lanczos
    quadrature (module docstring), with standard errors that add the probe groups' spread,
    the Hutchinson probes' and what is left of the quadrature's bracket in quadrature
    (``blocks["stderr"]``), and the plain estimate (``blocks["uncorrected"]``); with the
    objective's ``gradient``, the Newton decrement (:func:`_form_runs`), whose runs share the
    soft rank's passes over the rows (:meth:`StoredRows.lockstep`). On rows sketched by
    ``sketch`` (:mod:`~lightning_flatness.core.curvature.row_sketch`) the runs also take each
    leave-one-sketch-group-out kernel, and the two jackknifes' corrections add
    (:class:`~lightning_flatness.core.curvature.run_sets.RunSets`). Sketched rows give no
    Newton decrement (NaN): ``gᵀ(F̂+λI)⁻¹g`` lives on the part of g outside the rows' span, which
    a space k times smaller than P shrinks, and no jackknife of the sketch's groups restores it.

    Each run's value is the midpoint of its Gauss and Gauss–Radau rules, which bracket the
    soft rank; the runs stop as soon as the jackknifed soft rank's bracket is within the
    ``budget``'s tolerance of it (relative half-width), and at the ``budget``'s steps once it is
    within :data:`~lightning_flatness.core.options.SLQ_LOOSE_TOLERANCE`; a wider bracket goes on
    up to the ``budget``'s extension times those steps.

    With ``all_reduce`` (a sum across processes in place; every process calls this together)
    ``rows`` are this process's, ``num_samples`` is m over every process and ``union`` the size
    of the rows' space over every process with the index there of each of this process's
    entries (:func:`~lightning_flatness.core.curvature.row_positions.union_entries`): the runs'
    vectors are split across the processes, each holding its rows' entries, with their inner
    products and the products' sums over rows summed, and the probes are the union's, so the
    processes together compute what one process computes on the union, up to the order of
    float additions."""
    probes, tolerance = budget.probes, budget.tolerance
    store = StoredRows(rows, groups, num_samples)
    generator = torch.Generator().manual_seed(seed)
    sets = RunSets(groups, sketch.groups if sketch is not None else 0)
    start, masks, scales, kept = _run_layout(store, probes, generator, sets, union)
    columns = None
    if sketch is not None:
        columns = sets.column_keep(sketch).to(store.device).repeat_interleave(probes, dim=0)
    size = union[0] if union is not None else store.size
    steps = max(1, min(budget.steps, size))
    cap = max(1, min(budget.extension * budget.steps, size))
    # the trace is exact: the rows' squared norms
    norms = store.group_norms.to(store.device).clone()
    traces = (all_reduce(norms) if all_reduce is not None else norms).cpu() / num_samples
    stop = bracketed(sets, probes, lam, tolerance, steps=steps, loose=SLQ_LOOSE_TOLERANCE)
    soft_rank_runs = LanczosRuns(start, cap, reduce=all_reduce, stop=stop, check_every=CHECK_EVERY)
    forms = None
    if sketch is None and gradient is not None and bool(torch.isfinite(gradient).all()):
        forms = _form_runs(store, gradient, lam, DECREMENT_LOOSENESS * tolerance)
    sample = RowSpaceRuns(soft_rank_runs, masks, scales, kept, columns)
    store.lockstep(sample, forms, reduce=all_reduce)
    summary = run_summary(soft_rank_runs.decomposition(), sets, probes, lam, traces)
    decrement = (math.nan, math.nan)
    if gradient is not None and sketch is None:
        decrement = guarded_decrement("probe_kernel", gradient, lambda g: decrement_of(forms.forms))
    return summary.estimate(decrement)


#: the most numbers of the random rows :func:`quadrature_seconds` times its products on (128 MiB
#: of float32: on fewer, the products' time per row is higher than on the whole rows; 2²³ put
#: the quadrature of 20,000 rows of 14,514 parameters at 19–20 s, 2²⁵ at 12–14 s, measured 11 s)
TIMING_NUMBERS = 2**25


def quadrature_seconds(
    num_rows: int,
    num_parameters: int,
    *,
    groups: int,
    probes: int = SLQ_PROBES,
    steps: int = SLQ_STEPS,
    sketch_groups: int = 0,
    device: torch.device | str | None = None,
) -> float:
    """The predicted seconds of :func:`stored_rows_estimate`'s products on ``num_rows`` rows of
    ``num_parameters``: one Lanczos step's two products timed on float32 rows (at most
    :data:`TIMING_NUMBERS` numbers of them), scaled to all rows and all steps. A step's columns
    are what reaches each row: the whole kernel's probes and the one leave-one-group-out run
    set that keeps the row's group (G·probes over all rows), and the Newton decrement's G + 1
    runs that share the passes. A fit-start trial on a few samples never takes the stored-row
    path, so its own time does not contain this part (a measurement of 16,000 rows of 61,514
    parameters was predicted at 13 s from the trial and took 82 s)."""
    sample = max(1, min(num_rows, TIMING_NUMBERS // max(num_parameters, 1)))
    # each row: the whole kernel's probes, the one probe leave-out that keeps it, every sketch
    # leave-out; and without a sketch the decrement's runs
    sets = RunSets(groups, sketch_groups)
    reach = (groups if groups > 1 else 1) + sets.sketch_families
    columns = reach * probes + (0 if sketch_groups else RunSets(groups).count)
    # constant entries: a product's time does not depend on the values, and drawing 2²⁵ random
    # ones took 0.19 s of the 0.24 s this timing cost (no RNG is touched either)
    rows = torch.full((sample, num_parameters), 0.5, device=device)
    block = torch.full((columns, sample), 0.5, device=device)
    best = math.inf
    for _ in range(2):
        started = time.perf_counter()
        (block @ rows) @ rows.T
        best = min(best, time.perf_counter() - started)
    return best * (num_rows / sample) * steps
