"""The differentiable trace function of a Gram matrix (the kernel form of
:mod:`lightning_flatness.core.trace_functions`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from lightning_flatness.core.spectral import check_lam
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS
from lightning_flatness.regularizer.arguments import (
    FUNCTIONS,
    FunctionName,
    check_choice,
)

__all__ = ["gram_trace_function"]


class _TraceFunction(torch.autograd.Function):
    """``Σ h(μ)`` of ``s · G`` (G PSD) with its closed-form gradient in ``G``, from the kernel
    form of the trace function ``h``
    (:class:`~lightning_flatness.core.trace_functions.KernelForm`).

    The factorisation and the inverse are float64 (``I + sG`` may be ill-conditioned); the
    gradient's product (``(I + sG)⁻²`` for the soft rank) is formed in ``G``'s dtype, at least
    float32: it is handed back in that dtype anyway, and a float64 product of B × B matrices
    costs four times as much on a CPU."""

    @staticmethod
    def forward(ctx: FunctionCtx, gram: Tensor, coefficient: float, name: str) -> Tensor:
        kernel = TRACE_FUNCTIONS[name].kernel
        assert kernel is not None
        ctx.gram_dtype = gram.dtype  # type: ignore[attr-defined]
        ctx.product_dtype = torch.promote_types(gram.dtype, torch.float32)  # type: ignore[attr-defined]
        gram = gram.to(torch.float64)
        size = gram.shape[0]
        system = torch.eye(size, dtype=gram.dtype, device=gram.device) + coefficient * gram
        factor, info = torch.linalg.cholesky_ex(0.5 * (system + system.mT))
        if int(info) != 0:
            raise FloatingPointError(
                "I + K/λ is not positive definite: the per-sample gradients contain NaN/inf or "
                "overflow. Check the model's outputs and the learning rate."
            )
        inverse = torch.cholesky_inverse(factor)
        ctx.coefficient = coefficient  # type: ignore[attr-defined]
        ctx.kernel = kernel  # type: ignore[attr-defined]
        ctx.save_for_backward(inverse)
        return kernel.value(factor, inverse)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        inverse = inverse.to(ctx.product_dtype)
        gradient = ctx.coefficient * ctx.kernel.gradient(inverse)
        return (grad_output.to(inverse.dtype) * gradient).to(ctx.gram_dtype), None, None


def gram_trace_function(
    gram: Tensor, *, lam: float, scale: float = 1.0, function: FunctionName = "soft_rank"
) -> Tensor:
    """Differentiable ``Σ_k h(μ_k)`` over the eigenvalues ``μ_k`` of ``scale · gram``.

    With ``A = I + scale · gram / λ = LLᵀ`` (Cholesky, float64): the soft rank is
    ``Σ μ/(μ+λ) = Tr(I − A⁻¹)`` and the log-det complexity ``½ Σ log(1 + μ/λ) = Σ_k log L_kk``
    (docs/math.md, "Spectral functions of F"). Since ``h(0) = 0``, ``VVᵀ`` and ``VᵀV`` give the same
    value (the first step of the proof of Theorem 6.5). The gradient is closed-form
    (``λ(K+λI)⁻²`` and ``½(K+λI)⁻¹`` in ``K = scale · gram``); it is not twice differentiable.

    Args:
        gram: a symmetric PSD matrix, e.g. ``V_b V_bᵀ``.
        lam: λ > 0.
        scale: positive factor in front of ``gram`` (``1/n`` for ``F_b``).
        function: ``"soft_rank"`` or ``"logdet"`` (with the ½).

    Returns:
        A float64 scalar.
    """
    lam = check_lam(lam)
    check_choice("function", function, FUNCTIONS)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be a square matrix, got shape {tuple(gram.shape)}.")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}.")
    return _TraceFunction.apply(gram, float(scale) / lam, function)
