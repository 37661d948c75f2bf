"""``measure()``: the one entry point from a model and its data to a :class:`FlatnessReport`.

It streams over *all* batches it is given (up to ``max_samples``): the soft rank of a Fisher
averaged over m samples is a concave function of a sample mean and so is biased low for small m
(docs/math.md, "Sample size"). Every structure runs through one pipeline
(:func:`~lightning_flatness.pipeline.run_pipeline`: one loop over the batches, one
cross-process failure check, one reduction, one report) with one of three backends
(:mod:`lightning_flatness.backends`): layer hooks on the live model for ``kfac``, ``diag`` and
``diag_mc``, ``torch.func`` for the matrix-free ones, and BackPACK on a private extended copy
for ``dense`` and ``gram``. Every one evaluates the model in eval mode; the user's
model, its gradients, its mode, its BatchNorm statistics and the global RNG state are left
exactly as found, and a ``torch.compile`` wrapper is measured as the module it compiles.

The report combines (docs/math.md, "Generalization gap"):

- ``predicted_gap`` = Eq. (13): ``(1/n) · Tr(C)/Tr(F) · rank_λ(F)``, with the held-out trace
  ratio when validation batches are given (the training one → 0 when the model overfits,
  Prop. 5.4), else the training one; ``predicted_gap_train`` always uses the training ratio;
- ``thomas_gap`` = Eq. (11): ``(1/n) · Tr(C)/Tr(F)`` (training data);
- ``tic`` = ``(1/n) · Tr(C (F+λI)⁻¹)`` where the structure supports it (dense, gram: exact;
  diag/diag_mc/hutchinson: the diagonal formula; kfac, lanczos: NaN);
- ``observed_gap`` = ``val_nll − train_nll``: the negative log-likelihood of the model's own
  likelihood on each split (plain: no label smoothing, no regularizer, whatever the user's
  training loss adds; docs/math.md, "Label smoothing").

Batches, model calls and outputs are read by :mod:`lightning_flatness.batches` (``unpack_batch=``,
``logits_fn=``), losses by :mod:`lightning_flatness.likelihoods` (``loss=``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from lightning_flatness.backends import make_backend
from lightning_flatness.batches import (
    LogitsFn,
    UnpackBatch,
    num_samples,
    prepared_batches,
    wrap_for_batches,
)
from lightning_flatness.curvature import STRUCTURES
from lightning_flatness.curvature.base import CurvatureEstimate
from lightning_flatness.failures import MeasurementError
from lightning_flatness.likelihoods import get_likelihood
from lightning_flatness.matrix_free import MATRIX_FREE_STRUCTURES
from lightning_flatness.model_state import per_sample_modes, rng_devices, uncompiled
from lightning_flatness.pipeline import model_device_dtype, run_pipeline
from lightning_flatness.spectral import SpectralSummary, check_lam
from lightning_flatness.statistics import StatisticSums

__all__ = [
    "MATRIX_FREE_STRUCTURES",
    "FlatnessReport",
    "MeasurementError",
    "check_batch",
    "measure",
]

AllReduce = Callable[[Tensor], Tensor]


@dataclass
class FlatnessReport:
    """Flatness measures and generalization-gap estimates of one measurement.

    Every float is NaN where it is undefined for the inputs given (e.g. no validation data, or
    the accuracy of a regressor). ``train_nll`` / ``val_nll`` are the plain negative
    log-likelihoods of the model's own likelihood, not the user's training loss.
    ``eigenvalues`` (the structure's spectrum, float64) and ``blocks`` (per-parameter summaries
    of block-structured approximations, e.g. ``kfac``) are not part of :meth:`as_dict`.
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
    predicted_gap_train: float
    thomas_gap: float
    tic: float
    train_nll: float
    val_nll: float
    observed_gap: float
    train_accuracy: float
    val_accuracy: float
    error_uncertainty_train: float
    error_uncertainty_val: float
    relative_flatness: float
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
    def failed(cls, structure: str, lam: float, num_train_samples: int) -> FlatnessReport:
        """A report of NaNs, recorded when a measurement could not be made."""
        nan_fields = {
            f: math.nan
            for f in cls.__dataclass_fields__
            if f
            not in ("structure", "eigenvalues", "blocks", "coverage", "lam", "num_train_samples")
        }
        nan_fields.update(num_samples=0, num_val_samples=0)
        return cls(**nan_fields, lam=lam, num_train_samples=num_train_samples, structure=structure)


def _ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def measure(
    model: nn.Module,
    train_batches: Iterable,
    *,
    lam: float,
    num_train_samples: int,
    structure: str = "kfac",
    val_batches: Iterable | None = None,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    trace_estimator: str | None = None,
    kfac_mode: str = "exact",
    mc_samples: int = 1,
    loss: str = "cross_entropy",
    dense_max_parameters: int | None = None,
    gram_max_kernel_size: int | None = None,
    seed: int = 0,
    all_reduce: AllReduce | None = None,
    matrix_free_options: dict | None = None,
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
) -> FlatnessReport:
    """Measure the flatness of ``model`` on ``train_batches`` and predict its generalization gap.

    Args:
        model: a classifier (or a regressor with ``loss="mse"``); its logits are read with
            ``logits_fn``.
        train_batches: iterable of training batches, ``(inputs, targets, ...)`` or mappings
            (see ``unpack_batch``); all are used (up to ``max_samples``), since the soft rank is
            biased low on subsets. Inputs may be a tensor, a tuple or a dict of tensors.
        lam: the coupled L2 weight decay λ > 0 of the objective ``mean loss + ½λ‖θ‖²``.
        num_train_samples: n, the size of the training set (scales the predicted gap).
        structure: ``"kfac"`` (block-diagonal with Kronecker-factored layers, from layer hooks,
            any differentiable model; see ``report.coverage``), ``"diag"``, ``"diag_mc"``
            (the exact or sampled-label diagonal, same hooks), ``"dense"``, ``"gram"``
            (BackPACK), or ``"lanczos"`` (stochastic Lanczos
            quadrature of the exact F) and
            ``"hutchinson"`` (Hutchinson diagonal with its Eq. 8/9 bounds), matrix-free for any
            differentiable model (options: :mod:`lightning_flatness.matrix_free`).
        val_batches: held-out batches for the trace ratio, validation loss and observed gap.
        max_samples / max_val_samples: stop after this many training / validation samples.
        trace_estimator: ``"exact"`` Tr(F), or ``"sampled"`` (unbiased, cheaper). Default:
            exact; for the matrix-free structures exact only when the per-sample Jacobians are
            small (``C·P ≤ 2²⁵``), else sampled.
        kfac_mode: ``"exact"`` (the C rows of the output Fisher's square root) or
            ``"sampled"`` (``mc_samples`` labels drawn from the model per input).
        mc_samples: labels sampled per input for the Monte-Carlo structures.
        loss: ``"cross_entropy"`` (softmax classification), ``"bce"`` (independent sigmoid
            outputs: multi-label, or binary with one logit; ``Λ = diag σ(1−σ)``) or ``"mse"``
            (Gaussian regression, F = JᵀJ); see :mod:`lightning_flatness.likelihoods`.
        dense_max_parameters / gram_max_kernel_size: size guards of ``dense`` / ``gram``.
        seed: seeds the Monte-Carlo structures in a forked RNG (global RNG left untouched).
        all_reduce: sums a tensor across processes in place and returns it (data parallelism);
            every sum is reduced before any eigenvalue or ratio is taken.
        matrix_free_options: options of the matrix-free structures (probes, Lanczos steps, ...).
        unpack_batch: ``batch -> (inputs, targets)``; default
            :func:`~lightning_flatness.batches.default_unpack_batch` (sequences and mappings
            with a ``labels``/``label``/``targets``/``target``/``y`` key).
        logits_fn: ``(model, inputs) -> logits``; default
            :func:`~lightning_flatness.batches.default_logits_fn` (calls the model, reads a
            tensor, ``.logits``, ``["logits"]`` or the first element of a tuple).

    Returns:
        A :class:`FlatnessReport`.

    Raises:
        ValueError: bad arguments (the message names the value and the fix).
        BatchError: a batch, call or output that cannot be read (names ``unpack_batch=`` or
            ``logits_fn=``).
        TargetError: targets that do not fit ``loss`` (names the loss that fits them).
        MeasurementError: no samples, or a non-finite loss.
        UnsupportedModelError: a layer BackPACK cannot handle, for ``dense`` and ``gram``
            (names the module type).
    """
    lam = check_lam(lam)
    if structure not in STRUCTURES + MATRIX_FREE_STRUCTURES:
        raise ValueError(
            f"structure must be one of {STRUCTURES + MATRIX_FREE_STRUCTURES}, got {structure!r}."
        )
    if int(num_train_samples) < 1:
        raise ValueError(
            f"num_train_samples (n, the training-set size) must be ≥ 1, got {num_train_samples!r}."
        )
    for name, value in (("max_samples", max_samples), ("max_val_samples", max_val_samples)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be ≥ 1 or None (all samples), got {value!r}.")
    get_likelihood(loss)
    start = time.perf_counter()
    wrapped, first_pass, found = wrap_for_batches(model, train_batches, unpack_batch, logits_fn)
    if not found and all_reduce is None:
        raise MeasurementError(
            "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
        )
    with uncompiled(wrapped):
        backend = make_backend(
            structure,
            wrapped,
            loss=loss,
            kfac_mode=kfac_mode,
            mc_samples=mc_samples,
            trace_estimator=trace_estimator,
            seed=seed,
            all_reduce=all_reduce,
            matrix_free_options=matrix_free_options,
            unpack_batch=unpack_batch,
            repeatable_train_batches=train_batches,
            max_samples=max_samples,
            dense_max_parameters=dense_max_parameters,
            gram_max_kernel_size=gram_max_kernel_size,
        )
        curvature, train_sums, val_sums = run_pipeline(
            backend,
            wrapped,
            first_pass,
            val_batches,
            lam=lam,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            all_reduce=all_reduce,
            unpack_batch=unpack_batch,
        )
    return _report(
        curvature,
        train_sums,
        val_sums,
        lam,
        int(num_train_samples),
        structure,
        time.perf_counter() - start,
    )


def check_batch(
    model: nn.Module,
    batch: object,
    *,
    loss: str = "cross_entropy",
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
) -> tuple[int, int]:
    """Read one real batch the way :func:`measure` will, and fail now if it cannot.

    Unpacks the batch, calls the model (eval mode, no gradient, forked RNG; every module's mode
    restored), reads the logits and checks the targets against ``loss``. Nothing of the
    model's state changes.

    Returns:
        ``(batch size, number of outputs)``.

    Raises:
        BatchError / TargetError: with a message naming the argument that fixes the problem.
    """
    likelihood = get_likelihood(loss)
    device, dtype = model_device_dtype(model)
    wrapped, stream, _ = wrap_for_batches(model, [batch], unpack_batch, logits_fn)
    prepared = prepared_batches(stream, None, device, dtype, unpack_batch, wrapped.spec)
    _, inputs, targets = next(iter(prepared))
    with (
        torch.random.fork_rng(devices=rng_devices(model)),
        torch.no_grad(),
        per_sample_modes(model),
    ):
        logits = wrapped(*inputs)
    likelihood.check_outputs(logits, num_samples(inputs))
    likelihood.prepare_targets(targets, logits)
    return num_samples(inputs), int(logits.shape[1])


def _report(
    curvature: CurvatureEstimate,
    train: StatisticSums,
    val: StatisticSums,
    lam: float,
    n: int,
    structure: str,
    seconds: float,
) -> FlatnessReport:
    summary = curvature.summary
    trace_cov = train.mean("grad_norm_sq")
    trace_fisher = train.mean("fisher_trace")
    ratio_train = _ratio(trace_cov, trace_fisher)
    trace_cov_val = val.mean("grad_norm_sq")
    trace_fisher_val = val.mean("fisher_trace")
    ratio_val = _ratio(trace_cov_val, trace_fisher_val)
    predicted_train = ratio_train * summary.soft_rank / n
    predicted = ratio_val * summary.soft_rank / n if val.count else predicted_train
    train_nll, val_nll = train.mean("loss"), val.mean("loss")
    return FlatnessReport(
        soft_rank=summary.soft_rank,
        soft_rank2=summary.soft_rank2,
        logdet=summary.logdet,
        trace_fisher=trace_fisher,
        max_eig=summary.max_eig,
        trace_cov=trace_cov,
        trace_ratio_train=ratio_train,
        trace_ratio_val=ratio_val,
        predicted_gap=predicted,
        predicted_gap_train=predicted_train,
        thomas_gap=ratio_train / n,
        tic=curvature.tic_trace / n,
        train_nll=train_nll,
        val_nll=val_nll,
        observed_gap=val_nll - train_nll,
        train_accuracy=train.mean("correct"),
        val_accuracy=val.mean("correct"),
        error_uncertainty_train=_ratio(train.mean("error"), train.mean("uncertainty")),
        error_uncertainty_val=_ratio(val.mean("error"), val.mean("uncertainty")),
        relative_flatness=train.mean("relative_flatness"),
        trace_fisher_val=trace_fisher_val,
        trace_cov_val=trace_cov_val,
        num_samples=int(train.count),
        num_val_samples=int(val.count),
        num_train_samples=n,
        lam=lam,
        structure=structure,
        seconds=seconds,
        eigenvalues=curvature.eigenvalues,
        blocks=curvature.blocks,
        coverage=curvature.coverage,
    )
