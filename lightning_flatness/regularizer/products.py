"""``R ↦ RRᵀ`` with a one-product backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["gram_product"]


class _Gram(torch.autograd.Function):
    """``R ↦ R Rᵀ`` with the one-product backward ``(G + Gᵀ) R`` (autograd would use two).

    Under autocast the product may come out in a lower precision than ``R`` (bfloat16 for
    float32 rows); its gradient is cast back to ``R``'s dtype, as autograd's own matmul does."""

    @staticmethod
    def forward(ctx: FunctionCtx, rows: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        return rows @ rows.mT

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (rows,) = ctx.saved_tensors
        return (grad_output + grad_output.mT).to(rows.dtype) @ rows


def gram_product(rows: Tensor) -> Tensor:
    """``rows @ rowsᵀ``, differentiable once (the penalty's gradient is all that is needed)."""
    return _Gram.apply(rows) if rows.requires_grad else rows @ rows.mT
