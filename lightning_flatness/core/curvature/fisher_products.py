"""Products with the Fisher and with its sample-space kernel, one pass over the kept inputs each:
the operators that :mod:`lightning_flatness.core.curvature.lanczos` and
:mod:`lightning_flatness.core.curvature.cg` iterate on.

With ``V`` the (mC × P) stack of the square-root factors ``V_i = A_i J_i``
(:class:`~lightning_flatness.core.likelihoods.OutputCore`), ``F = ṼᵀṼ`` and ``K = ṼṼᵀ``
(``Ṽ = V/√m``, docs/math.md, "Gram trick"). ``J_i v`` comes from forward-mode tangents and
``J_iᵀ u`` from backward passes, a chunk of samples at a time; under data parallelism the
sums over samples are reduced across processes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_flatness.core.likelihoods import OutputCore

__all__ = ["ParameterSpaceFisher", "SampleSpaceKernel"]


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


class SampleSpaceKernel:
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
