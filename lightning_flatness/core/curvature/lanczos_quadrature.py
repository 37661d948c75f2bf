"""Lanczos runs and their Gauss quadrature: the numerical core of stochastic Lanczos quadrature
(:mod:`lightning_flatness.core.curvature.lanczos`), on any symmetric PSD operator given by its
products.

K runs proceed in lockstep from K start vectors, with full reorthogonalization; the tridiagonal
``T`` of each run gives the nodes ``θ_j`` (Ritz values) and weights ``τ_j²`` (squared first
components of its eigenvectors) of the Gauss quadrature ``vᵀ g(A) v ≈ ‖v‖² Σ_j τ_j² g(θ_j)``
(docs/math.md, "Matrix-free"); :func:`density_sample` turns nodes and eigenvalue counts into a
sample of the spectral density.
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
    "Reduce",
    "density_sample",
    "gauss_quadrature",
    "lanczos",
    "slq_values",
    "truncated",
]

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
