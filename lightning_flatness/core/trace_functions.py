"""The trace functions ``h`` of the Fisher's spectrum, each defined once.

A trace function of a PSD matrix ``F`` with eigenvalues ``μ_k`` is ``h(F) = Σ_k h(μ_k)`` for a
scalar ``h`` with ``h(0) = 0`` (docs/math.md, "Spectral functions of F"). Each entry of
:data:`TRACE_FUNCTIONS` holds everything the package computes from its ``h``:

- ``value(μ, λ)``: ``h(μ)`` elementwise (exact spectra, Kronecker products of factor spectra,
  Gauss quadrature nodes);
- ``over_mu(μ, λ)``: ``h(μ)/μ`` with its limit ``h'(0)`` at ``μ = 0`` (Lanczos quadrature started
  in the range of ``F``, docs/math.md, "Stochastic Lanczos quadrature");
- ``derivative(μ, λ)``: ``h'(μ)``;
- for the functions the regularizer differentiates, the kernel form (:class:`KernelForm`):
  ``Σ_k h(μ_k)`` of ``K = s·G`` and its gradient in ``G`` from the Cholesky factor of
  ``A = I + (s/λ) G`` (docs/math.md, "Batched upper bound (Theorem 6.5) — the regularizer").

======================  ======================  =====================  ==========================
name                    ``h(μ)``                ``h'(μ)``              kernel form: value, ∂/∂G
======================  ======================  =====================  ==========================
``soft_rank``           ``μ/(μ+λ)``             ``λ/(μ+λ)²``           ``m − Tr A⁻¹``, ``c A⁻²``
``soft_rank2``          ``(μ/(μ+λ))²``          ``2μλ/(μ+λ)³``         —
``logdet``              ``½ log(1 + μ/λ)``      ``½/(μ+λ)``            ``Σ log L_kk``, ``½ c A⁻¹``
``trace``               ``μ``                   ``1``                  —
======================  ======================  =====================  ==========================

with ``c = s/λ`` and ``L`` the Cholesky factor of the m × m matrix ``A``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TRACE_FUNCTIONS", "KernelForm", "TraceFunction", "trace_function"]

Elementwise = Callable[[Tensor, float], Tensor]


@dataclass(frozen=True)
class KernelForm:
    """``Σ_k h(μ_k(s·G))`` and its gradient in ``G`` from ``A = I + (s/λ)G = LLᵀ``.

    Attributes:
        value: ``(L, A⁻¹) -> Σ_k h(μ_k)``.
        gradient: ``A⁻¹ -> (1/c) ∂/∂G Σ_k h(μ_k)`` with ``c = s/λ``.
    """

    value: Callable[[Tensor, Tensor], Tensor]
    gradient: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class TraceFunction:
    """One scalar function ``h`` with ``h(0) = 0`` and the forms the package evaluates it in."""

    name: str
    value: Elementwise
    over_mu: Elementwise
    derivative: Elementwise
    kernel: KernelForm | None = None


def _log_term_over_mu(mu: Tensor, lam: float) -> Tensor:
    """``½ log(1 + μ/λ) / μ`` with the limit ``½/λ`` at ``μ → 0``."""
    tiny = mu <= 1e-300
    safe = torch.where(tiny, 1.0, mu)
    return torch.where(tiny, 0.5 / lam, 0.5 * torch.log1p(safe / lam) / safe)


TRACE_FUNCTIONS: dict[str, TraceFunction] = {
    function.name: function
    for function in (
        TraceFunction(
            "soft_rank",
            value=lambda mu, lam: mu / (mu + lam),
            over_mu=lambda mu, lam: 1.0 / (mu + lam),
            derivative=lambda mu, lam: lam / (mu + lam).square(),
            kernel=KernelForm(
                value=lambda factor, inverse: inverse.shape[0] - inverse.diagonal().sum(),
                gradient=lambda inverse: inverse @ inverse,
            ),
        ),
        TraceFunction(
            "soft_rank2",
            value=lambda mu, lam: (mu / (mu + lam)).square(),
            over_mu=lambda mu, lam: mu / (mu + lam).square(),
            derivative=lambda mu, lam: 2.0 * mu * lam / (mu + lam) ** 3,
        ),
        TraceFunction(
            "logdet",
            value=lambda mu, lam: 0.5 * torch.log1p(mu / lam),
            over_mu=_log_term_over_mu,
            derivative=lambda mu, lam: 0.5 / (mu + lam),
            kernel=KernelForm(
                value=lambda factor, inverse: torch.log(factor.diagonal()).sum(),
                gradient=lambda inverse: 0.5 * inverse,
            ),
        ),
        TraceFunction(
            "trace",
            value=lambda mu, lam: mu,
            over_mu=lambda mu, lam: torch.ones_like(mu),
            derivative=lambda mu, lam: torch.ones_like(mu),
        ),
    )
}


def trace_function(name: str) -> TraceFunction:
    """The entry of :data:`TRACE_FUNCTIONS` called ``name``, or a ValueError naming them."""
    try:
        return TRACE_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"Unknown trace function {name!r}; known: {tuple(TRACE_FUNCTIONS)}."
        ) from None
