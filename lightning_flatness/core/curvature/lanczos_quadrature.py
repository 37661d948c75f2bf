"""Lanczos runs and their Gauss quadrature: the numerical core of stochastic Lanczos quadrature
(:mod:`lightning_flatness.core.curvature.lanczos`), on any symmetric PSD operator given by its
products.

K runs proceed in lockstep from K start vectors, with full reorthogonalization; the tridiagonal
``T`` of each run gives the nodes ``θ_j`` (Ritz values) and weights ``τ_j²`` (squared first
components of its eigenvectors) of the Gauss quadrature ``vᵀ g(A) v ≈ ‖v‖² Σ_j τ_j² g(θ_j)``
(docs/math.md, "Matrix-free"); :func:`density_sample` turns nodes and eigenvalue counts into a
sample of the spectral density.

:func:`radau_quadrature` is the Gauss–Radau rule of the same run with one node fixed at the
spectrum's lower end 0. For ``g(μ) = 1/(μ + λ)``, whose even derivatives are positive and odd
ones negative on [0, ∞), the Gauss rule is below ``vᵀ g(A) v`` and the Radau rule above it
(Golub and Meurant, *Matrices, Moments and Quadrature*): the soft rank's share
``vᵀ A(A + λ)⁻¹ v = ‖v‖² − λ vᵀ(A + λ)⁻¹ v`` lies between the two rules' values, so a run can
stop when they agree (:func:`lanczos`'s ``stop``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flatness.core.progress import progress
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS

__all__ = [
    "LanczosDecomposition",
    "LanczosRuns",
    "Reduce",
    "density_sample",
    "gauss_quadrature",
    "lanczos",
    "radau_quadrature",
    "slq_values",
    "truncated",
]

Reduce = Callable[[Tensor], Tensor]

#: the Lanczos steps a run's basis grows by at a time
BASIS_BLOCK = 64


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
        residuals: (K,) the last step's ``β`` (its coupling to the next Krylov vector; 0 after
            a breakdown), which the Radau rule needs; None where it was not kept.
    """

    alphas: Tensor
    betas: Tensor
    lengths: Tensor
    norms: Tensor
    residuals: Tensor | None = None


class LanczosRuns:
    """K independent Lanczos runs in lockstep, with full reorthogonalization, advanced one
    product at a time: :meth:`block` is the vectors whose products the next step needs and
    :meth:`advance` takes those products. A caller that owns the products can so interleave two
    sets of runs through one pass over the data each step (the stored rows'
    :meth:`~lightning_flatness.core.curvature.stored_rows.StoredRows.lockstep`); :func:`lanczos`
    is the plain loop.

    Args:
        start: (K, n) start vectors (any norm; zero vectors give empty runs).
        steps: Lanczos steps (Krylov dimension) per run.
        reduce: sums a tensor of partial inner products across processes (for vectors that are
            split across processes); identity by default.
        breakdown_tol: a run stops when ``β_j ≤ tol · ‖T‖`` (its Krylov space is invariant);
            default ``√eps`` of the vectors' dtype.
        stop: called with the decomposition so far every ``check_every`` steps; all runs end
            there when it returns True (``steps`` is then a cap).
        check_every: steps between calls of ``stop``.

    Reorthogonalization is classical Gram–Schmidt applied twice against all previous vectors
    (kept in a basis of (steps, K, n), allocated as the steps are taken: :data:`BASIS_BLOCK`
    steps at a time, so a high cap that the stopping rule rarely reaches costs no memory).
    """

    def __init__(
        self,
        start: Tensor,
        steps: int,
        *,
        reduce: Reduce | None = None,
        breakdown_tol: float | None = None,
        stop: Callable[[LanczosDecomposition], bool] | None = None,
        check_every: int = 10,
    ) -> None:
        self.reduce = reduce or _identity
        self.steps, self.stop, self.check_every = steps, stop, check_every
        num, dim = start.shape
        eps = torch.finfo(start.dtype).eps
        self.tol = breakdown_tol if breakdown_tol is not None else math.sqrt(eps)
        float64 = {"dtype": torch.float64, "device": start.device}
        self.alphas = torch.zeros(num, steps, **float64)
        self.betas = torch.zeros(num, steps, **float64)
        self.lengths = torch.zeros(num, dtype=torch.long, device=start.device)
        self.norms = self.reduce(torch.einsum("kn,kn->k", start, start).to(torch.float64)).sqrt()
        self.active = self.norms > 0
        self.basis = start.new_zeros(min(steps, BASIS_BLOCK), num, dim)
        divisor = torch.where(self.active, self.norms, 1.0).to(start.dtype).unsqueeze(1)
        if steps > 0:
            self.basis[0] = start / divisor
        self.scale = torch.zeros(num, **float64)
        self.previous_beta = torch.zeros(num, **float64)
        self.residuals = torch.zeros(num, **float64)
        self.step = 0
        #: whether the runs have ended (every step taken, every run broken down, or ``stop``)
        self.finished = steps < 1
        self._result: LanczosDecomposition | None = None

    def block(self) -> Tensor:
        """The current Lanczos vectors (K, n), whose products :meth:`advance` takes next."""
        return self.basis[self.step]

    def advance(self, product: Tensor) -> None:
        """One step of every run from ``product``, the products of :meth:`block`."""
        j, w, reduce = self.step, product, self.reduce
        q, basis = self.basis[j], self.basis
        progress("lanczos", j + 1, self.steps, "steps")
        alpha = reduce(torch.einsum("kn,kn->k", q, w).to(torch.float64))
        w.sub_(alpha.to(w.dtype).unsqueeze(1) * q)
        if j > 0:
            w.sub_(self.previous_beta.to(w.dtype).unsqueeze(1) * basis[j - 1])
        for _ in range(2):
            coefficients = reduce(torch.einsum("skn,kn->sk", basis[: j + 1], w))
            w.sub_(torch.einsum("sk,skn->kn", coefficients, basis[: j + 1]))
        beta = reduce(torch.einsum("kn,kn->k", w, w).to(torch.float64)).sqrt()
        self.alphas[:, j] = torch.where(self.active, alpha, 0.0)
        self.lengths += self.active.long()
        self.scale = torch.maximum(self.scale, alpha.abs() + beta + self.previous_beta)
        self.active = self.active & (beta > self.tol * self.scale)
        self.residuals = torch.where(self.active, beta, 0.0)
        if j + 1 == self.steps or not bool(self.active.any()):
            self.finished = True
            return
        self.betas[:, j] = self.residuals
        if self.stop is not None and (j + 1) % self.check_every == 0:
            so_far = LanczosDecomposition(
                self.alphas[:, : j + 1],
                self.betas[:, : j + 1],
                self.lengths.clone(),
                self.norms,
                self.residuals,
            )
            if self.stop(so_far):
                self.finished, self._result = True, so_far
                return
        self.previous_beta = self.betas[:, j]
        divisor = torch.where(self.active, beta, math.inf).to(w.dtype).unsqueeze(1)
        if j + 1 == basis.shape[0]:  # room for the next block of steps
            room = min(BASIS_BLOCK, self.steps - basis.shape[0])
            self.basis = basis = torch.cat([basis, basis.new_zeros(room, *basis.shape[1:])])
        torch.div(w, divisor, out=basis[j + 1])
        self.step = j + 1

    def decomposition(self) -> LanczosDecomposition:
        """The tridiagonal coefficients of the steps taken (all of them once :attr:`finished`)."""
        if self._result is not None:
            return self._result
        return LanczosDecomposition(
            self.alphas, self.betas, self.lengths, self.norms, self.residuals
        )


def lanczos(
    matmat: Callable[[Tensor], Tensor],
    start: Tensor,
    steps: int,
    *,
    reduce: Reduce | None = None,
    breakdown_tol: float | None = None,
    stop: Callable[[LanczosDecomposition], bool] | None = None,
    check_every: int = 10,
) -> LanczosDecomposition:
    """K independent Lanczos runs in lockstep (:class:`LanczosRuns`, whose arguments these
    are), ``matmat`` mapping a block (K, n) of vectors to their products with a symmetric PSD
    matrix.

    Returns:
        The tridiagonal coefficients.
    """
    runs = LanczosRuns(
        start,
        steps,
        reduce=reduce,
        breakdown_tol=breakdown_tol,
        stop=stop,
        check_every=check_every,
    )
    while not runs.finished:
        runs.advance(matmat(runs.block()))
    return runs.decomposition()


def truncated(decomposition: LanczosDecomposition, steps: int) -> LanczosDecomposition:
    """The decomposition after the first ``steps`` steps (the leading blocks of each T)."""
    betas = decomposition.betas[:, :steps]
    residuals = None
    if steps < decomposition.alphas.shape[1]:
        residuals = betas[:, steps - 1] if steps > 0 else None
    elif decomposition.residuals is not None:
        residuals = decomposition.residuals
    return LanczosDecomposition(
        decomposition.alphas[:, :steps],
        betas,
        decomposition.lengths.clamp(max=steps),
        decomposition.norms,
        residuals,
    )


def gauss_quadrature(decomposition: LanczosDecomposition, index: int) -> tuple[Tensor, Tensor]:
    """Nodes (Ritz values, clamped to ≥ 0) and weights ``τ_j²`` (sum 1) of one run."""
    tridiagonal = _tridiagonal(decomposition, index)
    if tridiagonal.shape[0] == 0:
        return tridiagonal.new_zeros(0), tridiagonal.new_zeros(0)
    return _rule(tridiagonal)


def _tridiagonal(decomposition: LanczosDecomposition, index: int) -> Tensor:
    """The tridiagonal ``T`` of one run's valid steps."""
    length = int(decomposition.lengths[index])
    alphas = decomposition.alphas[index, :length]
    off = decomposition.betas[index, : max(length - 1, 0)]
    return torch.diag(alphas) + torch.diag(off, 1) + torch.diag(off, -1)


def _rule(tridiagonal: Tensor) -> tuple[Tensor, Tensor]:
    """The nodes (clamped to ≥ 0) and weights of the quadrature rule of a Jacobi matrix."""
    nodes, vectors = torch.linalg.eigh(tridiagonal)
    return nodes.clamp_min(0.0), vectors[0].square()


def radau_quadrature(
    decomposition: LanczosDecomposition, index: int, anchor: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Nodes and weights of the Gauss–Radau rule of one run with a node fixed at ``anchor``
    (at or below the operator's smallest eigenvalue; 0 for a PSD one): the run's ``T`` extended
    by one row and column, ``β`` its last residual and the new diagonal entry
    ``anchor + δ_k`` with ``(T − anchor·I) δ = β² e_k`` (Golub and Meurant). A run that ended
    in a breakdown (``β = 0``) is exact already: its Gauss rule is returned."""
    length = int(decomposition.lengths[index])
    if decomposition.residuals is None:
        raise ValueError("the Radau rule needs the decomposition's last residuals")
    residual = float(decomposition.residuals[index])
    if length == 0 or residual == 0.0:
        return gauss_quadrature(decomposition, index)
    tridiagonal = _tridiagonal(decomposition, index)
    last = tridiagonal.new_zeros(length)
    last[-1] = residual**2
    shifted = tridiagonal - anchor * torch.eye(length, dtype=last.dtype, device=last.device)
    try:
        delta = torch.linalg.solve(shifted, last)
    except torch.linalg.LinAlgError:  # a Ritz value at the anchor: no room below it
        return gauss_quadrature(decomposition, index)
    extended = tridiagonal.new_zeros(length + 1, length + 1)
    extended[:length, :length] = tridiagonal
    extended[length - 1, length] = extended[length, length - 1] = residual
    extended[length, length] = anchor + delta[-1]
    return _rule(extended)


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
