"""``structure="hutchinson"``: one-backward Hutchinson estimates of diag(F) and Tr(F), with bounds.

fim_bounds_hutchinson.txt, Eq. 2 and Prop. 12 (docs/math.md, "Hutchinson estimates of F"): with
``h = Σ_x Σ_c √p̃_xc log p_xc ξ_xc`` (p̃ detached, ξ Rademacher or Gaussian, one entry per
sample and class) the gradient ``g = ∂h/∂θ`` — one backward pass — satisfies ``E g gᵀ = Σ_x F_x``,
so ``g∘g`` estimates the diagonal (std ≤ √2 × mean per entry) and ``‖g‖²`` the trace. Two
variants change the core ``Λ = diag p − ppᵀ`` of ``F = Σ_x J_xᵀ Λ_x J_x`` (Prop. 6):

- upper bound, Eq. 8 / Prop. 13: ``h = Σ_x Σ_c √p̃_xc z_xc ξ_xc`` (raw logits, weight p̃) estimates
  ``Σ_x Σ_c p_xc ∇z_c ∇z_cᵀ ⪰ F``;
- lower bound, Eq. 9 / Prop. 14: ``h = Σ_x √λ̃_C ṽ_Cᵀ z(x) ξ_x`` (one ξ per sample) with
  ``(λ_C, v_C)`` the top eigenpair of ``Λ_x`` (power iteration) estimates
  ``Σ_x λ_C J_xᵀ v_C v_Cᵀ J_x ⪯ F``.

Each batch gets its own probe vector, covering every sample and class of that batch, and its
``g_b∘g_b`` is added to the running sum: ``E Σ_b g_b∘g_b = Σ_b Σ_{x∈b} diag F_x``, unbiased for
any batching (the cross terms between batches, zero in expectation, are simply not formed).
Divided by the sample count m this estimates ``diag F`` with ``F = (1/m) Σ_x F_x``. The sums
are the only state and add up across processes.

The structure's spectrum is the estimated diagonal, as for ``structure="diag"``: its spectral
summary is the trace functions of ``diag F`` (pinching, an upper bound of the soft rank,
Prop. 6.1 of the flatness paper). Every variant is averaged over ``probes`` independent probes.
The soft rank, rank⁽²⁾ and log-det of a noisy diagonal are biased low (``h`` is concave:
``E h(d̂) < h(E d̂)``), the more so the noisier each probe — and a probe is noisier for bigger
batches, since each batch gets one. The reported values are therefore the jackknife
bias-corrected ones over probes, which remove the ``O(1/probes)`` term of that bias (docs/math.md,
"Hutchinson estimates of F"); the trace, linear in the diagonal, is unbiased as it is. Standard
errors are jackknife estimates over probes (for the trace, exactly std/√probes).
The bounds' summaries sit in ``blocks`` (see :meth:`HutchinsonFisher.estimate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.functional_stats import FunctionalModel
from lightning_flatness.core.jackknife import jackknife
from lightning_flatness.core.likelihoods import OutputCore
from lightning_flatness.core.spectral import SpectralSummary, check_lam, spectral_summary

__all__ = ["VARIANTS", "HutchinsonFisher", "jackknife_summary"]

#: The three Hutchinson variants: Eq. 2 (unbiased), Eq. 8 (upper bound), Eq. 9 (lower bound).
VARIANTS = ("estimate", "upper", "lower")
#: the draw stream of the power iteration's standard Gaussian starts (streams 0–2: the variants)
POWER_START_STREAM = 3


def jackknife_summary(
    per_probe: list[Tensor], lam: float
) -> tuple[SpectralSummary, SpectralSummary]:
    """Jackknife summary of the mean of per-probe diagonals, and its standard errors.

    With K probes ``d_k``, their mean ``d̄`` and leave-one-out means ``d₋ₖ``, a nonlinear trace
    function s (soft rank, rank⁽²⁾, log-det) is reported bias-corrected,
    ``K·s(d̄) − (K−1)·mean_k s(d₋ₖ)``, which removes the ``O(1/K)`` term of the bias of
    ``s(d̄)``; the trace and the largest entry are ``s(d̄)``. The standard error is
    ``√((K−1)/K · Σ_k (s(d₋ₖ) − mean_k s(d₋ₖ))²)``; for the (linear) trace it is the plain
    ``std/√K``. With a single probe: ``s(d̄)`` and NaN errors.
    """
    num = len(per_probe)
    mean = torch.stack(per_probe).mean(0) if num > 1 else per_probe[0]
    if num < 2:
        return jackknife(spectral_summary(mean, lam), [])
    leave_outs = [spectral_summary((num * mean - d) / (num - 1), lam) for d in per_probe]
    return jackknife(spectral_summary(mean, lam), leave_outs)


class HutchinsonFisher(CurvatureAccumulator):
    """Accumulates ``Σ_b g_b∘g_b`` for each variant and probe; see the module docstring.

    Args:
        model: the functional view of the classifier.
        loss: ``"cross_entropy"`` or ``"mse"`` (then ``Λ = I``: the upper bound is unbiased and
            the lower bound keeps one random output direction per sample).
        probes: probe vectors per batch (≥ 2 for standard errors).
        distribution: ``"rademacher"`` or ``"gaussian"``.
        draw_sample_probes: ``(stream, first, shape) →`` draws of ``shape = (K, B, C)`` (in
            ``distribution``; ``stream`` 3 asks for standard Gaussians, the power iteration's
            starts) for this process's samples ``first … first + B − 1`` of the measured set,
            float64 (by the samples' positions in the whole set where they are known).
        power_iterations: power iterations for the top eigenpair of ``Λ`` (Eq. 9).
        bounds: also estimate the upper (Eq. 8) and lower (Eq. 9) bounds.
        grad_sq_sum: the running ``Σ_i g_i∘g_i`` of the true-label gradients (filled by the
            backend's statistics pass) for the diagonal TIC, or None.
        decay: the per-group decays: the diagonals of F and C are scaled by ``1/λ_j`` and
            summarised at λ = 1 (``Σ μ_k/(μ_k + λ_k)`` and ``Σ C_kk/(F_kk + λ_k)``).
    """

    name = "hutchinson"

    def __init__(
        self,
        model: FunctionalModel,
        *,
        loss: str,
        probes: int,
        distribution: str,
        draw_sample_probes: Callable[[int, int, tuple[int, int, int]], Tensor],
        power_iterations: int,
        bounds: bool,
        grad_sq_sum: Tensor | None = None,
        decay: ParameterDecay | None = None,
    ) -> None:
        self.grad_sq_sum, self.decay = grad_sq_sum, decay
        #: ``1/λ_j`` (P,) under per-group decay
        self.diagonal_scale = None if decay is None else model.decay_diagonal(decay).reciprocal()
        self.model, self.loss, self.probes = model, loss, probes
        self.distribution, self.draw_sample_probes = distribution, draw_sample_probes
        self.seen = 0  # this process's samples drawn for so far
        self.power_iterations = power_iterations
        self.variants = VARIANTS if bounds else VARIANTS[:1]
        self.squares: Tensor | None = None

    def _cotangents(self, logits: Tensor) -> Tensor:
        """Cotangents on the logits, (variants·probes, B, C): ``∂h/∂z`` of Eq. 2, 8 and 9."""
        core = OutputCore.from_logits(logits, self.loss)
        batch, classes = logits.shape
        shape = (self.probes, batch, classes)
        dtype, device = logits.dtype, logits.device

        first, self.seen = self.seen, self.seen + batch

        def draw(stream: int, shape: tuple[int, int, int]) -> Tensor:
            return self.draw_sample_probes(stream, first, shape).to(device=device, dtype=dtype)

        cotangents = [core.sqrt_transpose(draw(0, shape))]  # Σ_c √p̃_c ξ_c ∂log p_c/∂z
        if "upper" in self.variants:
            cotangents.append(core.diagonal(logits).sqrt() * draw(1, shape))  # Σ_c √p̃_c ξ_c e_c
        if "lower" in self.variants:
            start = self.draw_sample_probes(POWER_START_STREAM, first, (1, batch, classes))[0]
            value, vector = core.top_eigenpair(start, self.power_iterations)
            direction = value.sqrt().to(dtype).unsqueeze(-1) * vector.to(dtype)
            cotangents.append(direction * draw(2, (self.probes, batch, 1)))  # √λ̃_C ṽ_C ξ_x
        return torch.cat(cotangents)

    def add(self, batch: CurvatureBatch) -> None:
        """Add one batch's (or chunk's) ``g_b∘g_b`` for every variant and probe, from one
        backward pass of the probes on its ``inputs``."""
        logits, backward = self.model.vjp(batch.inputs)
        grads = backward(self._cotangents(logits))  # {name: (variants·probes, *shape)}
        if self.squares is None:
            first = next(iter(grads.values()))
            shape = (len(self.variants), self.probes, self.model.num_parameters)
            self.squares = first.new_zeros(shape)
        flat = self.squares.reshape(-1, self.model.num_parameters)
        for name, view in self.model.unflatten(flat).items():
            view.addcmul_(grads[name], grads[name])

    def summable_states(self) -> list[Tensor]:
        """The running sums, to be summed across processes in place."""
        states = [] if self.squares is None else [self.squares]
        return states if self.grad_sq_sum is None else [*states, self.grad_sq_sum]

    def _scaled(self, diagonal: Tensor) -> Tensor:
        if self.diagonal_scale is None:
            return diagonal
        return diagonal * self.diagonal_scale.to(device=diagonal.device, dtype=torch.float64)

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """Summaries of the estimated diagonals of ``F = (1/m) Σ_x F_x``, m = ``num_samples``.

        Returns:
            ``summary``: trace functions of the estimated ``diag F`` (Eq. 2); ``eigenvalues``:
            that diagonal (float64, P); ``tic_trace``: ``Σ_k C_kk/(F_kk+λ)`` when
            :attr:`grad_sq_sum` is kept; ``blocks``: ``"stderr"`` (of ``summary``),
            ``"hutchinson_estimate"`` / ``"hutchinson_estimate_stderr"`` (Eq. 2, = ``summary``),
            ``"hutchinson_upper"`` / ``"hutchinson_upper_stderr"`` (Eq. 8) and
            ``"hutchinson_lower"`` / ``"hutchinson_lower_stderr"`` (Eq. 9), each a
            :class:`SpectralSummary` of the mean diagonal of that variant and its errors.
        """
        lam = check_lam(lam)
        if self.squares is None:
            raise ValueError("No batch was added; there is no Fisher to estimate.")
        blocks: dict[str, SpectralSummary] = {}
        diagonal = None
        summary = None
        for index, variant in enumerate(self.variants):
            per_probe = [
                self._scaled(d.to(torch.float64) / num_samples) for d in self.squares[index]
            ]
            variant_summary, stderr = jackknife_summary(per_probe, lam)
            blocks[f"hutchinson_{variant}"] = variant_summary
            blocks[f"hutchinson_{variant}_stderr"] = stderr
            if variant == "estimate":
                summary, diagonal = variant_summary, torch.stack(per_probe).mean(0)
                blocks["stderr"] = stderr
        tic = math.nan
        if self.grad_sq_sum is not None:
            covariance = self._scaled(self.grad_sq_sum.to(torch.float64) / num_samples)
            tic = float((covariance / (diagonal.clamp_min(0.0) + lam)).sum())
        return CurvatureEstimate(summary, diagonal, tic_trace=tic, blocks=blocks)
