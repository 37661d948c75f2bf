"""The :class:`FlatnessReport` of one measurement, and how it is assembled from the curvature
estimate and the per-sample sums of both splits (docs/math.md, "Generalization gap")."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

from torch import Tensor

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.predicted_gap import eq13, headline_gap, predicted_test_nll
from lightning_flatness.core.spectral import SpectralSummary
from lightning_flatness.core.statistics import StatisticSums
from lightning_flatness.core.trust import above_rank_bound, verdict

__all__ = ["FlatnessReport", "build_report"]


@dataclass
class FlatnessReport:
    """Flatness measures and generalization-gap estimates of one measurement.

    Every float is NaN where it is undefined for the inputs given (e.g. no validation data, or
    the accuracy of a regressor). ``train_nll`` / ``val_nll`` are the plain negative
    log-likelihoods of the model's own likelihood, not the user's training loss.
    ``observed_gap_stderr`` is the observed gap's standard deviation about the *expected* gap
    over training sets, which the predicted gaps estimate: ``√(s²_train/m + s²_val/m_val)``
    from the per-sample NLLs of the measured training and held-out samples (one training set's
    mean loss differs from the population's by its own sampling error, as the held-out mean
    does; docs/math.md, "Generalization gap").
    ``eigenvalues`` (the structure's spectrum, float64) and ``blocks`` (per-parameter summaries
    of block-structured approximations, e.g. ``kfac``) are not part of :meth:`as_dict`.
    ``predicted_gap`` is the headline (:func:`~lightning_flatness.core.predicted_gap.headline_gap`):
    the held-out trace ratio times ``rank_λ(F)/(n + rank_λ(F))``, the value that orders runs as
    their gaps; without validation data the training trace ratio stands in
    (``predicted_gap_held_out`` 0, else 1), and it cannot order over-fit runs (Prop. 5.4).
    ``predicted_gap_train`` and ``predicted_gap_val`` are Eq. 13 as the paper writes it, with
    the training and the held-out trace ratio (NaN without validation data; the held-out one
    over-estimates the gap of a model confidently wrong on held-out data).
    ``predicted_test_nll`` is ``train_nll + predicted_gap``, the value to select a checkpoint by.
    ``newton_decrement`` is ``½ gᵀ(F+λI)⁻¹g`` (nat; ``½ gᵀ(F+D)⁻¹g`` under per-group decay),
    g the gradient of the objective ``mean NLL + ½λ‖θ‖²`` over the measured training samples:
    what one Newton step would still take off it, about 0 at a minimum (docs/math.md, "The
    Newton decrement"); exact for ``dense`` and ``gram``, jackknifed over the probe groups for
    ``probe_kernel``, bracketed by one more conjugate-gradient solve for ``cg``
    (``newton_decrement_stderr`` its standard error, NaN where exact), NaN for the other
    structures.
    ``trust_score`` is the training error/uncertainty ratio and ``trusted`` is 1.0 while it is
    at least :data:`~lightning_flatness.core.trust.TRUST_THRESHOLD`, the structure is of exact
    quality, the soft rank is at most ``rank_bound`` and the Newton decrement (where measured)
    is at most :data:`~lightning_flatness.core.trust.DECREMENT_LIMIT` (the predicted gap is
    then to be trusted), else 0.0 (:mod:`lightning_flatness.core.trust`). ``rank_bound`` is
    the largest rank the Fisher of the measured samples can have, ``min(P, m·(C−1))`` for softmax
    (``m·C`` for bce and mse); infinite where the structure does not know it.
    """

    soft_rank: float
    soft_rank2: float
    logdet: float
    trace_fisher: float
    max_eig: float
    trace_cov: float
    trace_ratio_train: float
    trace_ratio_val: float
    predicted_gap: float
    predicted_gap_held_out: float
    predicted_gap_train: float
    predicted_gap_val: float
    predicted_test_nll: float
    thomas_gap: float
    tic: float
    train_nll: float
    val_nll: float
    observed_gap: float
    observed_gap_stderr: float
    train_accuracy: float
    val_accuracy: float
    error_uncertainty_train: float
    error_uncertainty_val: float
    trust_score: float
    trusted: float
    newton_decrement: float
    newton_decrement_stderr: float
    relative_flatness: float
    rank_bound: float
    trace_fisher_val: float
    trace_cov_val: float
    num_samples: int
    num_val_samples: int
    num_train_samples: int
    lam: float
    structure: str
    seconds: float
    eigenvalues: Tensor | None = field(default=None, repr=False, compare=False)
    blocks: dict[str, SpectralSummary] = field(default_factory=dict, repr=False, compare=False)
    coverage: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def as_dict(self) -> dict[str, float]:
        """All scalar fields as floats (``structure`` is the only string)."""
        values = asdict(self)
        for structured in ("eigenvalues", "blocks", "coverage"):
            values.pop(structured)
        values.update(self._random_estimator_extras())
        return {k: (v if isinstance(v, str) else float(v)) for k, v in values.items()}

    def _random_estimator_extras(self) -> dict[str, float]:
        """Standard errors of the random structures and the Hutchinson trace bounds."""
        extras = {}
        stderr = self.blocks.get("stderr")
        if stderr is not None:
            extras.update(soft_rank_stderr=stderr.soft_rank, logdet_stderr=stderr.logdet)
        for bound in ("lower", "estimate", "upper"):
            summary = self.blocks.get(f"hutchinson_{bound}")
            error = self.blocks.get(f"hutchinson_{bound}_stderr")
            if summary is not None:
                extras[f"hutchinson_trace_{bound}"] = summary.trace
            if error is not None:
                extras[f"hutchinson_trace_{bound}_stderr"] = error.trace
        return extras

    @classmethod
    def failed(
        cls,
        structure: str,
        lam: float,
        num_train_samples: int,
        val: StatisticSums | None = None,
    ) -> FlatnessReport:
        """A report of NaNs, recorded when a measurement could not be made; with ``val`` (the
        held-out split's sums, when only the training split failed) its held-out fields are
        kept."""
        nan_fields = {
            f: math.nan
            for f in cls.__dataclass_fields__
            if f
            not in ("structure", "eigenvalues", "blocks", "coverage", "lam", "num_train_samples")
        }
        nan_fields.update(num_samples=0, num_val_samples=0)
        if val is not None:
            nan_fields.update(held_out_fields(val))
        return cls(**nan_fields, lam=lam, num_train_samples=num_train_samples, structure=structure)


def _ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def held_out_fields(val: StatisticSums) -> dict[str, float | int]:
    """The report's fields that only the held-out split's sums determine."""
    trace_cov_val = val.mean("grad_norm_sq")
    trace_fisher_val = val.mean("fisher_trace")
    return {
        "trace_cov_val": trace_cov_val,
        "trace_fisher_val": trace_fisher_val,
        "trace_ratio_val": _ratio(trace_cov_val, trace_fisher_val),
        "val_nll": val.mean("loss"),
        "val_accuracy": val.mean("correct"),
        "error_uncertainty_val": _ratio(val.mean("error"), val.mean("uncertainty")),
        "num_val_samples": int(val.count),
    }


def build_report(
    curvature: CurvatureEstimate,
    train: StatisticSums,
    val: StatisticSums,
    lam: float,
    n: int,
    structure: str,
    seconds: float,
) -> FlatnessReport:
    summary = curvature.summary
    if above_rank_bound(summary.soft_rank, curvature.rank_bound):
        fix = (
            "more probes (structure=KernelOptions(probes=...))"
            if structure == "probe_kernel"
            else "structure='probe_kernel', which measures the whole Fisher's spectrum"
        )
        warnings.warn(
            f"structure={structure!r} reports a soft rank of {summary.soft_rank:,.1f}, above "
            f"{curvature.rank_bound:,.0f}, the largest rank the Fisher of these "
            f"{int(train.count):,} samples can have: its predicted gap is not trusted. Use "
            f"{fix}.",
            stacklevel=3,
        )
    trace_cov = train.mean("grad_norm_sq")
    trace_fisher = train.mean("fisher_trace")
    ratio_train = _ratio(trace_cov, trace_fisher)
    held_out = held_out_fields(val)
    ratio_val = held_out["trace_ratio_val"]
    headline = headline_gap(ratio_val, ratio_train, summary.soft_rank, n)
    train_nll, val_nll = train.mean("loss"), held_out["val_nll"]
    alpha_train = _ratio(train.mean("error"), train.mean("uncertainty"))
    return FlatnessReport(
        soft_rank=summary.soft_rank,
        soft_rank2=summary.soft_rank2,
        logdet=summary.logdet,
        trace_fisher=trace_fisher,
        max_eig=summary.max_eig,
        trace_cov=trace_cov,
        trace_ratio_train=ratio_train,
        predicted_gap=headline,
        predicted_gap_held_out=1.0 if math.isfinite(ratio_val) else 0.0,
        predicted_gap_train=eq13(ratio_train, summary.soft_rank, n),
        predicted_gap_val=eq13(ratio_val, summary.soft_rank, n),
        predicted_test_nll=predicted_test_nll(train_nll, headline),
        thomas_gap=ratio_train / n,
        tic=curvature.tic_trace / n,
        train_nll=train_nll,
        observed_gap=val_nll - train_nll,
        observed_gap_stderr=math.sqrt(train.squared_error_of_mean() + val.squared_error_of_mean()),
        train_accuracy=train.mean("correct"),
        error_uncertainty_train=alpha_train,
        trust_score=alpha_train,
        trusted=verdict(
            alpha_train,
            structure,
            summary.soft_rank,
            curvature.rank_bound,
            curvature.newton_decrement,
            disagreement=_ratio(ratio_val, ratio_train),
        ),
        newton_decrement=curvature.newton_decrement,
        newton_decrement_stderr=curvature.newton_decrement_stderr,
        relative_flatness=train.mean("relative_flatness"),
        rank_bound=curvature.rank_bound,
        num_samples=int(train.count),
        **held_out,
        num_train_samples=n,
        lam=lam,
        structure=structure,
        seconds=seconds,
        eigenvalues=curvature.eigenvalues,
        blocks=curvature.blocks,
        coverage=curvature.coverage,
    )
