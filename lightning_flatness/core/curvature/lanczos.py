"""``structure="lanczos"``: stochastic Lanczos quadrature (SLQ) over Fisher products.

Every trace function of docs/math.md, "Spectral functions of F" (soft rank, rank⁽²⁾, log-det,
trace) is ``Tr h(F) = Σ_k h(μ_k)`` with ``h(0) = 0``; the max eigenvalue is the largest Ritz
value. docs/math.md, "Matrix-free": estimate them from products with F alone.

The probes. With ``V`` the (mC × P) stack of the square-root factors ``V_i = A_i J_i``
(:class:`~lightning_flatness.core.functional_stats.OutputCore`), ``F = ṼᵀṼ`` and ``K = ṼṼᵀ``
(``Ṽ = V/√m``, docs/math.md, "Gram trick") have the same nonzero eigenvalues. For a random
``ξ ∈ R^{mC}`` (one Rademacher or Gaussian entry per sample and class, ``E ξξᵀ = I``),
``ξᵀ h(K) ξ`` is an unbiased (Hutchinson) estimate of ``Tr h(K) = Tr h(F)``. It is evaluated by
Lanczos with full reorthogonalization in whichever space is smaller (``space="auto"``):

- ``"samples"``: Lanczos on K from ``Πξ`` (Π removes each sample's ``√p_i`` component, an exact
  null direction of K, so ``(Πξ)ᵀ h(K) Πξ = ξᵀ h(K) ξ``): estimate ``‖Πξ‖² Σ_j τ_j² h(θ_j)``;
- ``"parameters"``: Lanczos on F from ``v = Ṽᵀξ`` — the gradient of Eq. 2 of
  fim_bounds_hutchinson.txt, ``∂/∂θ Σ_x Σ_c √p̃_xc log p_xc ξ_xc / √m``. Since
  ``ξᵀ h(K) ξ = vᵀ (h(F)/F) v``, the estimate is ``‖v‖² Σ_j τ_j² h(θ_j)/θ_j``. The start lies in
  the range of F, so the Krylov space never sees F's (huge) exact null space and the quadrature
  integrates the smooth ``h(μ)/μ`` (e.g. ``1/(μ+λ)`` for the soft rank) instead of the steep
  ``h`` next to an atom of mass ≈ 1 at 0. ``start="random"`` is classic SLQ instead
  (``z ∈ R^P``, estimate ``‖z‖² Σ_j τ_j² h(θ_j)``).

Here ``θ_j`` are the Ritz values (eigenvalues of the Lanczos tridiagonal, negatives from
round-off clamped to 0) and ``τ_j`` the first components of its eigenvectors (Gauss
quadrature). When a Krylov space is exhausted (breakdown, ``β_j ≈ 0``) that probe stops with an
exact quadrature. Each function is averaged over ``probes``; its standard error is the spread
over probes (std/√probes). All probes run in lockstep, so one pass over the data serves them
all. Under data parallelism every product sums across processes — the product vectors
(``"parameters"``), or the intermediate ``Σ_i V_iᵀ u_i`` and all inner products (``"samples"``,
whose vectors hold each process's own samples) — so every process runs the same Lanczos
recurrence and gets the same numbers.

Cost: one Fisher product is one pass over the data, each chunk of samples costing one forward
pass with K forward-mode tangents (``J v``) and one forward pass with K backward passes
(``Jᵀ u``), K = probes: about (3K + 2) forward passes over the data per Lanczos step.
``space="parameters"`` needs one more pass for the start vectors. Memory: the Lanczos basis,
``steps × probes × dim`` numbers (dim = P or m·C), one reused block of ``probes × P`` numbers,
and the activations of a chunk (bounded by ``chunk_elements``). With the range start the
quadrature converges in few steps (10M-parameter CNN, 1024 samples, λ = 1/1024: +3 % after 8
steps, +0.7 % after 12, +0.02 % after 16, within 1e-6 after 20; :func:`truncated` shows it for
any run); the error is then the probes' spread, which the standard errors report.

The spectral density: the nodes ``θ_j`` carry estimated eigenvalue counts
``w_j = ‖v‖² τ_j² h₀(θ_j)`` averaged over probes (``h₀ = 1/μ`` for the range start, 1 otherwise),
i.e. the number of eigenvalues near ``θ_j``. ``eigenvalues`` repeats each node by its rounded
count (a sample of the spectrum with ≈ rank entries, scaled down to at most ``max_histogram``
entries), so its histogram is the SLQ spectral density; the raw nodes and counts are
:attr:`SLQEstimate.nodes` and :attr:`SLQEstimate.weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.curvature.fisher_products import (
    ParameterSpaceFisher,
    SampleSpaceKernel,
)
from lightning_flatness.core.curvature.lanczos_quadrature import (
    LanczosDecomposition,
    Reduce,
    density_sample,
    gauss_quadrature,
    lanczos,
    slq_values,
    truncated,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.functional_stats import FunctionalModel, probe_vectors
from lightning_flatness.core.options import MatrixFreeOptions
from lightning_flatness.core.spectral import SpectralSummary, check_lam
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS

# the Lanczos core and its quadrature are read from here as well
__all__ = [
    "FIELDS",
    "LanczosDecomposition",
    "LanczosFisher",
    "SLQEstimate",
    "density_sample",
    "gauss_quadrature",
    "lanczos",
    "slq_values",
    "truncated",
]

#: Trace functions estimated by SLQ, in :class:`SpectralSummary` order (``max_eig`` separate).
FIELDS = tuple(TRACE_FUNCTIONS)


@dataclass
class SLQEstimate(CurvatureEstimate):
    """A :class:`CurvatureEstimate` with the SLQ error bars and spectral density.

    Attributes:
        stderr: standard errors (std over probes / √probes) of each summary field; for
            ``max_eig`` the spread of the per-probe largest Ritz values. Also in
            ``blocks["stderr"]``.
        nodes: all Ritz values (float64), probe after probe.
        weights: estimated eigenvalue counts at each node, averaged over probes.
        probe_values: (probes, 5) per-probe estimates in :class:`SpectralSummary` field order.
        space: ``"parameters"`` or ``"samples"``.
        decomposition: the Lanczos coefficients; its leading s steps give the estimate after
            s steps (:func:`truncated`), a check of the quadrature's convergence.
        divide_by_mu: whether the quadrature integrates ``h(μ)/μ`` (range start).
    """

    stderr: SpectralSummary | None = None
    nodes: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    weights: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    probe_values: Tensor = field(default_factory=lambda: torch.zeros(0, 5, dtype=torch.float64))
    space: str = ""
    decomposition: LanczosDecomposition | None = None
    divide_by_mu: bool = False


class LanczosFisher(CurvatureAccumulator):
    """SLQ estimate of the Fisher's trace functions (see the module docstring).

    Args:
        model: the functional view of the classifier.
        source: where :meth:`add` keeps each batch's inputs (``add(inputs)``), re-iterable
            with ``chunks()`` / ``chunks(with_rows=True)`` over this process's kept inputs and
            ``num_samples`` (local sample count)
            (:mod:`~lightning_flatness.core.backends.kept_inputs`).
        loss: ``"cross_entropy"`` or ``"mse"``.
        settings: the matrix-free options read here: ``probes`` (K ≥ 1; ≥ 2 for standard
            errors), ``lanczos_steps`` (per probe, capped at the space's dimension),
            ``space`` (``"auto"``: the smaller of P and m·C, ``"parameters"`` or
            ``"samples"``), ``start`` (``"range"``, Ṽᵀξ, or ``"random"``, classic SLQ; for
            ``"parameters"`` only), ``distribution`` (``"rademacher"`` or ``"gaussian"``
            entries of ξ and z), ``max_basis_elements`` (refuse a larger Lanczos basis),
            ``max_histogram`` (at most this many entries in ``eigenvalues``) and
            ``breakdown_tol`` (see :func:`lanczos`).
        draw_sample_probes: ξ of a shape (K, m_local, C) on this process's samples, in the
            model's dtype (by the samples' positions in the whole set where they are known).
        shared_generator: draws ``z`` for ``start="random"`` (must agree between processes).
        all_reduce: sums a tensor across processes in place and returns it, or None.
        decay: the per-group decays D: the spectrum is that of ``D^{-1/2} F D^{-1/2}``, to be
            summarised at λ = 1.
    """

    name = "lanczos"

    def __init__(
        self,
        model: FunctionalModel,
        source,
        *,
        loss: str,
        settings: MatrixFreeOptions,
        draw_sample_probes: Callable[[tuple[int, int, int]], Tensor],
        shared_generator: torch.Generator,
        all_reduce: Reduce | None,
        decay: ParameterDecay | None = None,
    ) -> None:
        #: ``D^{-1/2}`` (P,) in the model's dtype under per-group decay
        self.column_scale = None
        if decay is not None:
            self.column_scale = model.decay_diagonal(decay).rsqrt().to(model.dtype)
        self.decay = decay
        self.model, self.source, self.loss = model, source, loss
        #: C, the number of outputs (known from the first batch)
        self.classes = 0
        self.probes, self.steps = settings.probes, settings.lanczos_steps
        self.space, self.start = settings.space, settings.start
        self.distribution = settings.distribution
        self.draw_sample_probes, self.shared_generator = draw_sample_probes, shared_generator
        self.all_reduce = all_reduce
        self.max_basis_elements = settings.max_basis_elements
        self.max_histogram = settings.max_histogram
        self.breakdown_tol = settings.breakdown_tol

    def add(self, batch: CurvatureBatch) -> None:
        """Keep one batch's ``inputs`` for the Lanczos passes of :meth:`estimate`."""
        self.source.add(batch.inputs)
        self.classes = batch.outputs

    def _sum(self, tensor: Tensor) -> Tensor:
        return tensor if self.all_reduce is None else self.all_reduce(tensor)

    def _resolve_space(self, total_rows: int) -> str:
        if self.space != "auto":
            return self.space
        if self.start == "random":
            return "parameters"
        return "samples" if total_rows <= self.model.num_parameters else "parameters"

    def estimate(self, num_samples: int, lam: float) -> SLQEstimate:
        """Run SLQ over the Fisher of ``num_samples`` samples (all processes) at weight decay λ."""
        lam = check_lam(lam)
        classes = self.classes
        total_rows = num_samples * classes
        space = self._resolve_space(total_rows)
        dim = total_rows if space == "samples" else self.model.num_parameters
        steps = max(1, min(self.steps, dim))
        local_dim = self.source.num_samples * classes if space == "samples" else dim
        if steps * self.probes * local_dim > self.max_basis_elements:
            raise StructureTooLargeError(
                f"structure='lanczos' in space {space!r} needs a Lanczos basis of steps × probes "
                f"× dim = {steps} × {self.probes} × {local_dim:,} numbers, more than "
                f"max_basis_elements={self.max_basis_elements:,}. Use fewer lanczos_steps or "
                "probes, space='samples' with fewer samples (dim = samples × classes), or raise "
                "MatrixFreeOptions.max_basis_elements."
            )
        model = self.model
        xi_shape = (self.probes, self.source.num_samples, classes)
        divide_by_mu = False
        if space == "samples":
            operator = SampleSpaceKernel(
                model,
                self.source,
                self.loss,
                num_samples,
                classes,
                self.all_reduce,
                self.column_scale,
            )
            xi = self.draw_sample_probes(xi_shape).to(torch.float64)
            start = operator.projected_start(xi)
            reduce = self._sum
        else:
            operator = ParameterSpaceFisher(
                model, self.source, self.loss, num_samples, self.all_reduce, self.column_scale
            )
            reduce = None
            if self.start == "random":
                shape = (self.probes, dim)
                start = probe_vectors(
                    shape, self.shared_generator, model.dtype, model.device, self.distribution
                )
            else:
                xi = self.draw_sample_probes(xi_shape)
                start = operator.range_start(xi)
                divide_by_mu = True
        decomposition = lanczos(
            operator, start, steps, reduce=reduce, breakdown_tol=self.breakdown_tol
        )
        return self._summarize(decomposition, lam, divide_by_mu, space)

    def _summarize(
        self, decomposition: LanczosDecomposition, lam: float, divide_by_mu: bool, space: str
    ) -> SLQEstimate:
        finite = torch.isfinite(decomposition.alphas).all() & torch.isfinite(decomposition.norms)
        if not bool(finite.all()):
            raise FloatingPointError(
                "Fisher-vector products returned NaN or inf (an overflow in the model's Jacobian "
                "products); measure in float64 or fix the model's numerics."
            )
        rows, all_nodes, all_weights = [], [], []
        for index in range(self.probes):
            nodes, weights = gauss_quadrature(decomposition, index)
            scale = float(decomposition.norms[index]) ** 2
            values = slq_values(nodes, weights, scale, lam, divide_by_mu)
            largest = float(nodes.max()) if nodes.numel() else 0.0
            rows.append([values[name] for name in FIELDS] + [largest])
            counts = scale * weights
            if divide_by_mu:
                floor = 1e-12 * largest
                counts = torch.where(nodes > floor, counts / nodes.clamp_min(floor or 1.0), 0.0)
            all_nodes.append(nodes)
            all_weights.append(counts / self.probes)
        values = torch.tensor(rows, dtype=torch.float64)
        mean = values.mean(0)
        if self.probes > 1:
            stderr = SpectralSummary(*(float(v) for v in values.std(0) / math.sqrt(self.probes)))
        else:
            stderr = SpectralSummary(*([math.nan] * 5))
        summary = SpectralSummary(*(float(v) for v in mean[:4]), max_eig=float(values[:, 4].max()))
        nodes = torch.cat(all_nodes)
        weights = torch.cat(all_weights)
        return SLQEstimate(
            summary=summary,
            eigenvalues=density_sample(nodes, weights, self.max_histogram),
            blocks={"stderr": stderr},
            stderr=stderr,
            nodes=nodes,
            weights=weights,
            probe_values=values,
            space=space,
            decomposition=decomposition,
            divide_by_mu=divide_by_mu,
        )
