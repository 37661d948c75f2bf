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

from lightning_flatness.core.curvature.base import CurvatureAccumulator, CurvatureEstimate
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.functional_stats import FunctionalModel, probe_vectors
from lightning_flatness.core.likelihoods import OutputCore
from lightning_flatness.core.progress import progress
from lightning_flatness.core.spectral import SpectralSummary, check_lam
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS

__all__ = [
    "FIELDS",
    "LanczosDecomposition",
    "LanczosFisher",
    "SLQEstimate",
    "gauss_quadrature",
    "lanczos",
    "slq_values",
    "truncated",
]

#: Trace functions estimated by SLQ, in :class:`SpectralSummary` order (``max_eig`` separate).
FIELDS = tuple(TRACE_FUNCTIONS)

Reduce = Callable[[Tensor], Tensor]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class LanczosDecomposition:
    """Tridiagonal matrices of K Lanczos runs.

    Attributes:
        alphas: (K, steps) diagonals, float64.
        betas: (K, steps) off-diagonals (``betas[k, j]`` couples steps j and j+1), float64.
        lengths: (K,) number of valid steps of each run (smaller after a breakdown).
        norms: (K,) norms of the start vectors, float64.
    """

    alphas: Tensor
    betas: Tensor
    lengths: Tensor
    norms: Tensor


def lanczos(
    matmat: Callable[[Tensor], Tensor],
    start: Tensor,
    steps: int,
    *,
    reduce: Reduce | None = None,
    breakdown_tol: float | None = None,
) -> LanczosDecomposition:
    """K independent Lanczos runs in lockstep, with full reorthogonalization.

    Args:
        matmat: maps a block (K, n) of vectors to their products with a symmetric PSD matrix.
        start: (K, n) start vectors (any norm; zero vectors give empty runs).
        steps: Lanczos steps (Krylov dimension) per run.
        reduce: sums a tensor of partial inner products across processes (for vectors that are
            split across processes); identity by default.
        breakdown_tol: a run stops when ``β_j ≤ tol · ‖T‖`` (its Krylov space is invariant);
            default ``√eps`` of the vectors' dtype.

    Returns:
        The tridiagonal coefficients. Reorthogonalization is classical Gram–Schmidt applied
        twice against all previous vectors (kept in a (steps, K, n) basis).
    """
    reduce = reduce or _identity
    num, dim = start.shape
    tol = breakdown_tol if breakdown_tol is not None else math.sqrt(torch.finfo(start.dtype).eps)
    float64 = {"dtype": torch.float64, "device": start.device}
    alphas = torch.zeros(num, steps, **float64)
    betas = torch.zeros(num, steps, **float64)
    lengths = torch.zeros(num, dtype=torch.long, device=start.device)
    norms = reduce(torch.einsum("kn,kn->k", start, start).to(torch.float64)).sqrt()
    active = norms > 0
    basis = start.new_zeros(steps, num, dim)
    basis[0] = start / torch.where(active, norms, 1.0).to(start.dtype).unsqueeze(1)
    scale = torch.zeros(num, **float64)
    previous_beta = torch.zeros(num, **float64)
    for j in range(steps):
        q = basis[j]
        w = matmat(q)
        progress("lanczos", j + 1, steps, "steps")
        alpha = reduce(torch.einsum("kn,kn->k", q, w).to(torch.float64))
        w.sub_(alpha.to(w.dtype).unsqueeze(1) * q)
        if j > 0:
            w.sub_(previous_beta.to(w.dtype).unsqueeze(1) * basis[j - 1])
        for _ in range(2):
            coefficients = reduce(torch.einsum("skn,kn->sk", basis[: j + 1], w))
            w.sub_(torch.einsum("sk,skn->kn", coefficients, basis[: j + 1]))
        beta = reduce(torch.einsum("kn,kn->k", w, w).to(torch.float64)).sqrt()
        alphas[:, j] = torch.where(active, alpha, 0.0)
        lengths += active.long()
        scale = torch.maximum(scale, alpha.abs() + beta + previous_beta)
        active = active & (beta > tol * scale)
        if j + 1 == steps or not bool(active.any()):
            break
        betas[:, j] = torch.where(active, beta, 0.0)
        previous_beta = betas[:, j]
        divisor = torch.where(active, beta, math.inf).to(w.dtype).unsqueeze(1)
        torch.div(w, divisor, out=basis[j + 1])
    return LanczosDecomposition(alphas, betas, lengths, norms)


def truncated(decomposition: LanczosDecomposition, steps: int) -> LanczosDecomposition:
    """The decomposition after the first ``steps`` steps (the leading blocks of each T)."""
    return LanczosDecomposition(
        decomposition.alphas[:, :steps],
        decomposition.betas[:, :steps],
        decomposition.lengths.clamp(max=steps),
        decomposition.norms,
    )


def gauss_quadrature(decomposition: LanczosDecomposition, index: int) -> tuple[Tensor, Tensor]:
    """Nodes (Ritz values, clamped to ≥ 0) and weights ``τ_j²`` (sum 1) of one run."""
    length = int(decomposition.lengths[index])
    alphas = decomposition.alphas[index, :length]
    if length == 0:
        return alphas.new_zeros(0), alphas.new_zeros(0)
    off = decomposition.betas[index, : length - 1]
    tridiagonal = torch.diag(alphas) + torch.diag(off, 1) + torch.diag(off, -1)
    nodes, vectors = torch.linalg.eigh(tridiagonal)
    return nodes.clamp_min(0.0), vectors[0].square()


def slq_values(
    nodes: Tensor, weights: Tensor, scale: float, lam: float, divide_by_mu: bool
) -> dict[str, float]:
    """``scale · Σ_j τ_j² g(θ_j)`` for each trace function ``h`` of
    :data:`~lightning_flatness.core.trace_functions.TRACE_FUNCTIONS`, ``g = h`` or ``h/μ``."""
    values = {
        name: (h.over_mu if divide_by_mu else h.value)(nodes, lam)
        for name, h in TRACE_FUNCTIONS.items()
    }
    return {name: scale * float((weights * g).sum()) for name, g in values.items()}


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


def density_sample(nodes: Tensor, weights: Tensor, max_entries: int) -> Tensor:
    """Each node repeated by its (rounded) count: a 1-D sample of the spectral density.

    Counts are rounded by differences of the rounded cumulative sum, so the total is preserved;
    beyond ``max_entries`` all counts are scaled down proportionally.
    """
    weights = weights.clamp_min(0.0)
    total = float(weights.sum())
    if total <= 0.0 or nodes.numel() == 0:
        return nodes.new_zeros(0)
    if total > max_entries:
        weights = weights * (max_entries / total)
    order = torch.argsort(nodes)
    cumulative = torch.cumsum(weights[order], 0).round().long()
    counts = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    return torch.repeat_interleave(nodes[order], counts)


class ParameterSpaceFisher:
    """``F V = (1/m) Σ_i J_iᵀ Λ_i J_i V`` for a block of flat parameter vectors (K, P).

    Products are accumulated into one reused (K, P) buffer (large fresh allocations are slow).
    With ``column_scale`` S (P,), the products and probes are those of ``S F S`` (per-group
    decay, ``S = D^{-1/2}``: docs/math.md, "Per-group weight decay").
    """

    def __init__(self, model, source, loss, num_samples, all_reduce, column_scale=None):
        self.model, self.source, self.loss = model, source, loss
        self.num_samples, self.all_reduce = num_samples, all_reduce
        self.column_scale: Tensor | None = column_scale
        self.buffer: Tensor | None = None

    def _zeroed(self, like: Tensor) -> Tensor:
        if self.buffer is None or self.buffer.shape != like.shape:
            self.buffer = torch.zeros_like(like)
        return self.buffer.zero_()

    def __call__(self, vectors: Tensor) -> Tensor:
        total = self._zeroed(vectors)
        scale = self.column_scale
        if scale is not None:
            vectors = vectors * scale
        for inputs in self.source.chunks():
            logits, tangents = self.model.jvp(inputs, vectors)
            core = OutputCore.from_logits(logits, self.loss)
            _, backward = self.model.vjp(inputs)
            self.model.accumulate(total, backward(core.fisher(tangents)))
        if self.all_reduce is not None:
            total = self.all_reduce(total)
        total = total.div_(self.num_samples)
        return total if scale is None else total.mul_(scale)

    def range_start(self, xi: Tensor) -> Tensor:
        """``Ṽᵀ ξ = (1/√m) Σ_i V_iᵀ ξ_i`` (the Eq. 2 gradient) for ξ of shape (K, m_local, C)."""
        model = self.model
        total = torch.zeros(
            xi.shape[0], model.num_parameters, dtype=model.dtype, device=model.device
        )
        for inputs, rows in self.source.chunks(with_rows=True):
            logits, backward = model.vjp(inputs)
            core = OutputCore.from_logits(logits, self.loss)
            model.accumulate(total, backward(core.sqrt_transpose(xi[:, rows])))
        if self.all_reduce is not None:
            total = self.all_reduce(total)
        total = total.div_(math.sqrt(self.num_samples))
        return total if self.column_scale is None else total.mul_(self.column_scale)


class _SampleSpaceKernel:
    """``K U = (1/m) V Vᵀ U`` for a block (K, m_local·C) of this process's sample-space rows
    (``V S² Vᵀ`` with a ``column_scale`` S, the kernel of ``S F S``).

    Two passes: ``w = Σ_i V_iᵀ u_i`` (backward, summed across processes, in one reused (K, P)
    buffer), then ``V_i w`` (forward mode).
    """

    def __init__(self, model, source, loss, num_samples, classes, all_reduce, column_scale=None):
        self.model, self.source, self.loss = model, source, loss
        self.num_samples, self.classes, self.all_reduce = num_samples, classes, all_reduce
        self.squared_scale = None if column_scale is None else column_scale.square()
        self.buffer: Tensor | None = None

    def __call__(self, vectors: Tensor) -> Tensor:
        num, model = vectors.shape[0], self.model
        rows_view = vectors.reshape(num, -1, self.classes)
        if self.buffer is None or self.buffer.shape[0] != num:
            self.buffer = torch.zeros(
                num, model.num_parameters, dtype=model.dtype, device=model.device
            )
        w = self.buffer.zero_()
        for inputs, rows in self.source.chunks(with_rows=True):
            logits, backward = model.vjp(inputs)
            core = OutputCore.from_logits(logits, self.loss)
            model.accumulate(w, backward(core.sqrt_transpose(rows_view[:, rows])))
        if self.all_reduce is not None:
            w = self.all_reduce(w)
        if self.squared_scale is not None:  # the kernel V S² Vᵀ of S F S
            w = w * self.squared_scale
        out = torch.empty_like(rows_view)
        for inputs, rows in self.source.chunks(with_rows=True):
            logits, tangents = model.jvp(inputs, w)
            core = OutputCore.from_logits(logits, self.loss)
            out[:, rows] = core.sqrt(tangents).to(out.dtype)
        return out.reshape(num, -1).div_(self.num_samples)

    def projected_start(self, xi: Tensor) -> Tensor:
        """``Π ξ``: each sample's ``√p_i`` component removed (K, m_local·C)."""
        out = torch.empty_like(xi)
        for inputs, rows in self.source.chunks(with_rows=True):
            with torch.no_grad():
                logits = self.model.logits(self.model.params, inputs)
            out[:, rows] = OutputCore.from_logits(logits, self.loss).project(xi[:, rows])
        return out.reshape(xi.shape[0], -1)


class LanczosFisher(CurvatureAccumulator):
    """SLQ estimate of the Fisher's trace functions (see the module docstring).

    Args:
        model: the functional view of the classifier.
        source: re-iterable data with ``chunks()`` / ``chunks(with_rows=True)`` over this
            process's cached inputs and ``num_samples`` (local sample count).
        loss: ``"cross_entropy"`` or ``"mse"``.
        classes: C, the number of outputs.
        probes: number of probe vectors K (≥ 1; ≥ 2 for standard errors).
        steps: Lanczos steps per probe (capped at the space's dimension).
        space: ``"auto"`` (the smaller of P and m·C), ``"parameters"`` or ``"samples"``.
        start: ``"range"`` (Ṽᵀξ) or ``"random"`` (classic SLQ); for ``"parameters"`` only.
        distribution: ``"rademacher"`` or ``"gaussian"`` entries of ξ (and z).
        draw_sample_probes: ξ of a shape (K, m_local, C) on this process's samples, in the
            model's dtype (by the samples' positions in the whole set where they are known).
        column_scale: ``D^{-1/2}`` (P,) under per-group decay: the spectrum is that of
            ``D^{-1/2} F D^{-1/2}``, to be summarised at λ = 1.
        shared_generator: draws ``z`` for ``start="random"`` (must agree between processes).
        all_reduce: sums a tensor across processes in place and returns it, or None.
        max_basis_elements: refuse a Lanczos basis larger than this many numbers.
        max_histogram: at most this many entries in ``eigenvalues``.
        breakdown_tol: see :func:`lanczos`.
    """

    name = "lanczos"

    def __init__(
        self,
        model: FunctionalModel,
        source,
        *,
        loss: str,
        classes: int,
        probes: int,
        steps: int,
        space: str,
        start: str,
        distribution: str,
        draw_sample_probes: Callable[[tuple[int, int, int]], Tensor],
        shared_generator: torch.Generator,
        all_reduce: Reduce | None,
        max_basis_elements: int,
        max_histogram: int,
        breakdown_tol: float | None,
        column_scale: Tensor | None = None,
    ) -> None:
        self.column_scale = column_scale
        self.model, self.source, self.loss, self.classes = model, source, loss, classes
        self.probes, self.steps, self.space, self.start = probes, steps, space, start
        self.distribution = distribution
        self.draw_sample_probes, self.shared_generator = draw_sample_probes, shared_generator
        self.all_reduce = all_reduce
        self.max_basis_elements, self.max_histogram = max_basis_elements, max_histogram
        self.breakdown_tol = breakdown_tol

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
                "matrix_free_options['max_basis_elements']."
            )
        model = self.model
        xi_shape = (self.probes, self.source.num_samples, classes)
        divide_by_mu = False
        if space == "samples":
            operator = _SampleSpaceKernel(
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
