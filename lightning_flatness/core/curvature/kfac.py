"""``structure="kfac"``: a block-diagonal Fisher with Kronecker-factored layers, from layer hooks.

Accumulates the :class:`~lightning_flatness.core.batch_terms.BatchTerms` of every batch (sums over
samples, so the numbers do not depend on the batch size) and turns them into one spectrum, block
by block (docs/math.md, "Kronecker factors from layer hooks"):

- each weight of a ``Linear``/``Conv1d``/``Conv2d``/``Embedding`` layer: KFC's ``G ⊗ A`` with
  ``A = (1/m) Σ_i Σ_t a aᵀ`` and ``G = (1/m) Σ_i (1/T) Σ_t Σ_rows s sᵀ`` (Grosse & Martens,
  2016, Eq. 22; for one position, T = 1, KFAC). Its eigenvalues are all products ``g_j a_k``
  (:func:`~lightning_flatness.core.spectral.kron_summary`): two small eigendecompositions per layer;
  an embedding's ``A`` is diagonal (token counts);
- each bias of such a layer: its exact Fisher block ``(1/m) Σ_i Σ_rows b bᵀ`` — for a layer
  applied once per sample (T = 1) the same matrix as its weight's ``G``, whose eigenvalues
  are then used for both;
- every other parameter (normalisation scales and shifts, attention projections, class tokens,
  positional embeddings, shared weights): its exact diagonal.

The soft rank of this block-diagonal approximation is an upper bound on the soft rank of the
exact blocks it replaces, and that of any block-diagonal part on the full Fisher (pinching,
Prop. 6.1) — except for the Kronecker factorisation itself, which is an approximation.

The sums are kept in float64; the eigenvalues are computed in float32 when the model is below
float64 and :func:`~lightning_flatness.core.spectral.factorisation_dtype` says it is accurate
enough (for ``G ⊗ A`` with the bound ``‖G ⊗ A‖ ≤ Tr(G)·‖A‖``, or ``‖G‖·Tr(A)`` when G is the
smaller factor: the smaller one is always decomposed in float64, and gives the norm).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_flatness.core.batch_terms import BatchTerms, scale_terms
from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.spectral import (
    SpectralSummary,
    clean_eigenvalues,
    factorisation_dtype,
    kron_eigenvalues,
    kron_summary,
    psd_eigenvalues,
    spectral_summary,
    sum_summaries,
)

__all__ = ["KFACFisher", "describe_coverage"]


class KFACFisher(CurvatureAccumulator):
    """Running sums of the block-diagonal KFAC Fisher (module docstring).

    Args:
        order: the parameters' order of the per-parameter blocks (default: as first added).
        precision: the model's dtype (float32 eigendecompositions where accurate, module
            docstring).
        decay: per-group decays: each batch's terms are scaled to those of
            ``D^{-1/2} F D^{-1/2}`` (:func:`~lightning_flatness.core.batch_terms.scale_terms`),
            to be estimated at λ = 1.
    """

    name = "kfac"

    def __init__(
        self,
        order: list[str] | None = None,
        precision: torch.dtype = torch.float64,
        decay: ParameterDecay | None = None,
    ) -> None:
        self.order = order
        self.decay = decay
        self.precision = precision
        self.kronecker: dict[str, list[Tensor]] = {}
        self.blocks: dict[str, Tensor] = {}
        self.diagonal: dict[str, Tensor] = {}
        #: ``{bias: (weight, multiplier)}``: the bias's block is ``multiplier × G`` of
        #: ``weight`` (:attr:`~lightning_flatness.core.batch_terms.BatchTerms.bias_factors`)
        self.bias_factors: dict[str, tuple[str, float]] = {}

    def add(self, batch: CurvatureBatch) -> None:
        """Add one batch's sums (its layer-hook ``terms``, scaled by the decay)."""
        terms = scale_terms(batch.terms, self.decay)
        blocks, bias_factors = self._settle_bias_blocks(terms)
        for name, factors in terms.kronecker.items():
            if name in self.kronecker:
                for total, term in zip(self.kronecker[name], factors, strict=True):
                    total += term
            else:
                self.kronecker[name] = [factor.clone() for factor in factors]
        for store, source in ((self.blocks, blocks), (self.diagonal, terms.diagonal)):
            for name, value in source.items():
                if name in store:
                    store[name] += value
                else:
                    store[name] = value.clone()
        self.bias_factors.update(bias_factors)

    def _settle_bias_blocks(
        self, terms: BatchTerms
    ) -> tuple[dict[str, Tensor], dict[str, tuple[str, float]]]:
        """One batch's bias blocks and biases recorded as ``G`` factors, made consistent with
        the sums so far: a bias seen both ways (a layer with one position in some batches
        and more in others) keeps its own block from then on."""
        blocks = dict(terms.blocks)
        bias_factors = {}
        for name, (weight, multiplier) in terms.bias_factors.items():
            if name in self.blocks:
                blocks[name] = multiplier * terms.kronecker[weight][0]
            else:
                bias_factors[name] = (weight, multiplier)
        for name in blocks:
            if name in self.bias_factors:
                self.blocks[name] = self.block(name).clone()
                del self.bias_factors[name]
        return blocks, bias_factors

    def summable_states(self) -> list[Tensor]:
        """The running sums, in a fixed order, to be summed across processes in place."""
        states = [factor for factors in self.kronecker.values() for factor in factors]
        return states + list(self.blocks.values()) + list(self.diagonal.values())

    def block(self, name: str) -> Tensor:
        """The exact block of the bias ``name``, ``Σ_i Σ_rows b bᵀ`` (float64)."""
        if name in self.blocks:
            return self.blocks[name]
        weight, multiplier = self.bias_factors[name]
        return multiplier * self.kronecker[weight][0]

    def block_eigenvalues(self, num_samples: int, lam: float) -> dict[str, list[Tensor]]:
        """Each block's factor eigenvalues of ``F = (1/m) Σ``: ``[g, a]`` for a Kronecker
        block, ``[μ]`` for an exact or diagonal block (in float32 where accurate at ``lam``,
        module docstring)."""
        result: dict[str, list[Tensor]] = {}
        for name, (g, a) in self.kronecker.items():
            result[name] = self._factor_eigenvalues(g, a, num_samples, lam)
        for name, block in self.blocks.items():
            dtype = factorisation_dtype(
                float(block.diagonal().sum()) / num_samples, lam, self.precision
            )
            result[name] = [psd_eigenvalues(block / num_samples, dtype)]
        for name, (weight, multiplier) in self.bias_factors.items():
            result[name] = [multiplier * result[weight][0]]
        for name, diagonal in self.diagonal.items():
            result[name] = [clean_eigenvalues(diagonal / num_samples)]
        return result

    def _factor_eigenvalues(
        self, g: Tensor, a: Tensor, num_samples: int, lam: float
    ) -> list[Tensor]:
        """``[g, a]``: the smaller factor (or an embedding's diagonal A) in float64, its
        largest eigenvalue times the other's trace bounding ‖G ⊗ A‖, which decides the other's
        precision (module docstring): a dense layer's 1,152 × 1,152 input factor in float32
        takes 40% of the float64 time."""
        g, a = g / num_samples, a / num_samples
        a_smaller = a.dim() == 1 or a.shape[0] <= g.shape[0]
        small, large = (a, g) if a_smaller else (g, a)
        small_values = small if small.dim() == 1 else psd_eigenvalues(small)
        small_max = float(small_values.max()) if small_values.numel() else 0.0
        bound = float(large.diagonal().sum()) * small_max  # ≥ ‖G ⊗ A‖
        large_values = psd_eigenvalues(large, factorisation_dtype(bound, lam, self.precision))
        g_values, a_values = (
            (large_values, small_values) if a_smaller else (small_values, large_values)
        )
        return [g_values, clean_eigenvalues(a_values)]

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The spectral summary, with per-parameter blocks in :attr:`order`."""
        eigen = self.block_eigenvalues(num_samples, lam)
        order = self.order if self.order is not None else list(eigen)
        blocks: dict[str, SpectralSummary] = {}
        spectra = []
        for name in order:
            if name not in eigen:
                continue
            values = eigen[name]
            if len(values) == 2:
                blocks[name] = kron_summary(values, lam)
                spectra.append(kron_eigenvalues(values))
            else:
                blocks[name] = spectral_summary(values[0], lam)
                spectra.append(values[0])
        spectrum = torch.cat(spectra) if spectra else torch.zeros(0, dtype=torch.float64)
        return CurvatureEstimate(sum_summaries(blocks.values()), spectrum, blocks=blocks)


def describe_coverage(coverage: dict[str, str]) -> str:
    """One line saying how the parameters were measured, e.g. for a log message."""
    counts: dict[str, int] = {}
    for kind in coverage.values():
        counts[kind] = counts.get(kind, 0) + 1
    diagonal = counts.get("diagonal", 0) + counts.get("diagonal (whole model)", 0)
    parts = [
        f"{counts.get('kronecker', 0)} Kronecker-factored weights",
        f"{counts.get('exact block', 0)} exact bias blocks",
        f"{diagonal} exact diagonal blocks",
    ]
    text = "measured from layer hooks: " + ", ".join(parts)
    slow = [name for name, kind in coverage.items() if kind == "diagonal (whole model)"]
    if slow:
        text += (
            f"; {len(slow)} through per-sample passes of the whole model (slow: used outside "
            f"their layer's forward or shared by layers of different types): {', '.join(slow)}"
        )
    return text + "."
