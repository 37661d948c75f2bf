"""The K cotangent rows on the logits that one backward pass each turns into per-sample
gradients (:mod:`lightning_flatness.core.hooked_pass`; docs/math.md, "The three matrices",
"Kronecker factors from layer hooks"):

- the residual ``∂ℓ_i/∂z_i`` of the true labels (per-sample gradients → ``Tr(C)``);
- the rows of ``A_i`` with ``A_iᵀA_i = Λ_i`` (``"exact"``: C rows), or ``mc_samples`` scores
  of labels drawn from the model (``"sampled"``), or ``mc_samples`` Rademacher probes through
  the square root, ``A_iᵀξ`` with ``ξ ∈ {±1}^C`` (``"probe"``, the Hutchinson estimate of Eq. 2
  of the Hutchinson-Fisher paper), each divided by ``√mc_samples``; ``Σ_rows g gᵀ`` is then
  ``J_iᵀ Λ_i J_i`` exactly, or in expectation.

Drawn labels and probes are keyed by each sample's position in the measured stream and the
seed (:mod:`~lightning_flatness.core.positional`), so they depend neither on the batch size nor
on how processes share the samples.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_flatness.core.batch_terms import FisherRows
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.positional import position_draws, position_signs

__all__ = ["SAMPLED_LABEL_STREAM", "fisher_cotangents"]

#: the position-keyed stream (plus 2·seed, and 1 for the held-out split) of the sampled labels
SAMPLED_LABEL_STREAM = 2**43


def fisher_cotangents(
    likelihood: Likelihood,
    logits: Tensor,
    targets: Tensor,
    positions: Tensor,
    *,
    kfac_mode: str,
    trace_estimator: str,
    mc_samples: int,
    seed: int,
    curvature: bool,
) -> tuple[Tensor, FisherRows]:
    """The K rows ``(K, N, C)``: residual, then exact, sampled and/or probe Fisher rows (only
    those of the trace when ``curvature`` is False, the held-out split), and which rows are
    which.

    Args:
        likelihood: the output likelihood.
        logits: the batch's logits ``(N, C)``.
        targets: the true labels, prepared for ``likelihood``.
        positions: each sample's position in the whole measured stream ``(N,)``.
        kfac_mode / trace_estimator: ``"exact"``, ``"sampled"`` or ``"probe"``: which rows give
            the curvature and which ``Tr(F)``.
        mc_samples: drawn labels or probes per sample.
        seed: the seed of the draws.
        curvature: whether the curvature's rows are wanted (training data).
    """
    z = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        (residual,) = torch.autograd.grad(likelihood.nll(z, targets).sum(), z)
    rows = [residual.unsqueeze(0)]
    exact = sampled = None
    factors = kfac_mode if curvature else None
    wanted = {factors, trace_estimator}
    # the square root A_i of the output Fisher, for the exact rows and the probes
    core = likelihood.output_core(logits.detach()) if {"exact", "probe"} & wanted else None
    if "exact" in (factors, trace_estimator):
        classes = logits.shape[1]
        identity = torch.eye(classes, dtype=logits.dtype, device=logits.device)
        rows.append(core.sqrt_transpose(identity.unsqueeze(1).expand(-1, z.shape[0], -1)))
        exact = slice(1, 1 + classes)
    if "sampled" in (factors, trace_estimator):
        start = sum(r.shape[0] for r in rows)
        scores = []
        outputs = 1 if likelihood.noise_per_sample else z.shape[1]
        stream = SAMPLED_LABEL_STREAM + seed * 2 + int(not curvature)
        noise = position_draws(stream, positions, mc_samples, outputs, likelihood.noise_kind)
        if likelihood.noise_per_sample:  # one number per sample: (mc_samples, B)
            noise = noise.squeeze(-1)
        for index in range(mc_samples):
            draw = likelihood.draw_from(z.detach(), noise[index])
            with torch.enable_grad():
                objective = likelihood.sampled_score(z, draw).sum()
                (score,) = torch.autograd.grad(objective, z)
            scores.append(score / math.sqrt(mc_samples))
        rows.append(torch.stack(scores))
        sampled = slice(start, start + mc_samples)
    probe = None
    if "probe" in (factors, trace_estimator):
        start = sum(r.shape[0] for r in rows)
        stream = seed * 2 + int(not curvature)
        signs = position_signs(stream, positions, mc_samples, z.shape[1])
        signs = signs.to(device=z.device, dtype=z.dtype)
        rows.append(core.sqrt_transpose(signs) / math.sqrt(mc_samples))
        probe = slice(start, start + mc_samples)
    kinds = {"exact": exact, "sampled": sampled, "probe": probe}
    chosen = kinds[factors] if factors else None
    return torch.cat(rows).detach(), FisherRows(chosen, kinds[trace_estimator])
