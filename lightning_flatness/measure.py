"""``measure()``: the one entry point from a model and its data to a :class:`FlatnessReport`.

It streams over *all* batches it is given (up to ``max_samples``): the soft rank of a Fisher
averaged over m samples is a concave function of a sample mean and so is biased low for small m
(MATH.md, "Sample size"). Three backends serve the structures: layer hooks on the live model
for ``kfac`` (:mod:`lightning_flatness.hooked_pass`), ``torch.func`` for the matrix-free ones
(:mod:`lightning_flatness.matrix_free`), and BackPACK on a private extended copy for ``dense``,
``gram``, ``diag`` and ``diag_mc``. Every one evaluates the model in eval mode; the user's
model, its gradients, its mode, its BatchNorm statistics and the global RNG state are left
exactly as found, and a ``torch.compile`` wrapper is measured as the module it compiles.

The report combines (MATH.md, "Generalization gap"):

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

from lightning_flatness._backpack import (
    ExtendedModel,
    backward_with,
    extended_loss,
    loss_scale,
    measurement_copy,
    support_loss,
)
from lightning_flatness.batches import (
    InputSpec,
    Leaves,
    LogitsFn,
    LogitsModule,
    UnpackBatch,
    num_samples,
    prepared_batches,
    wrap_for_batches,
)
from lightning_flatness.curvature import STRUCTURES, make_estimator
from lightning_flatness.curvature.base import CurvatureEstimate, CurvatureEstimator
from lightning_flatness.curvature.kfac import KFACFisher
from lightning_flatness.failures import MeasurementError, agreed, check_finite_loss
from lightning_flatness.hooked_pass import BatchTerms, HookedPass
from lightning_flatness.likelihoods import Likelihood, get_likelihood
from lightning_flatness.matrix_free import MATRIX_FREE_STRUCTURES, stream_matrix_free
from lightning_flatness.model_state import left_as_found, rng_devices, uncompiled
from lightning_flatness.spectral import SpectralSummary, check_lam
from lightning_flatness.statistics import SampleStatistics, StatisticSums, output_sums

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


def _model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def _stream(
    model: ExtendedModel,
    batches: Iterable,
    statistics: SampleStatistics,
    estimator: CurvatureEstimator | None,
    loss_name: str,
    max_samples: int | None,
    split: str,
    unpack_batch: UnpackBatch | None,
    spec: InputSpec,
) -> None:
    """One forward + BackPACK backward per batch, feeding ``statistics`` and ``estimator``."""
    device, dtype = _model_device_dtype(model.module)
    loss_fn = extended_loss(loss_name)
    likelihood = get_likelihood(loss_name)
    extensions = statistics.extensions() + (estimator.extensions() if estimator else [])
    support_loss(extensions, loss_name)
    stream = prepared_batches(batches, max_samples, device, dtype, unpack_batch, spec)
    for index, inputs, targets in stream:
        logits = model.module(*inputs)
        targets = likelihood.prepare_targets(targets, logits)
        loss = loss_fn(logits, targets)
        check_finite_loss(float(loss.detach()), split, index)
        backward_with(model, loss, extensions, estimator.name if estimator else "statistics")
        if estimator is not None:
            estimator.update(model, num_samples(inputs))
        statistics.update(model, logits, targets)
    model.zero_grad()


def _reduce_statistics(statistics: SampleStatistics, all_reduce: AllReduce | None) -> None:
    if all_reduce is not None:
        statistics.sums = StatisticSums.from_tensor(all_reduce(statistics.sums.as_tensor()))


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
            any differentiable model; see ``report.coverage``), ``"dense"``, ``"gram"``,
            ``"diag"``, ``"diag_mc"`` (BackPACK), or ``"lanczos"`` (stochastic Lanczos
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
        UnsupportedModelError: a layer BackPACK cannot handle, for its structures (names the
            module type).
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
        curvature, train_sums, val_sums = _dispatch(
            structure,
            wrapped,
            first_pass,
            train_batches,
            val_batches,
            lam=lam,
            loss=loss,
            kfac_mode=kfac_mode,
            mc_samples=mc_samples,
            trace_estimator=trace_estimator,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            all_reduce=all_reduce,
            unpack_batch=unpack_batch,
            matrix_free_options=matrix_free_options,
            dense_max_parameters=dense_max_parameters,
            gram_max_kernel_size=gram_max_kernel_size,
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


def _dispatch(
    structure: str,
    wrapped: LogitsModule,
    first_pass: Iterable,
    train_batches: Iterable,
    val_batches: Iterable | None,
    *,
    lam: float,
    loss: str,
    kfac_mode: str,
    mc_samples: int,
    trace_estimator: str | None,
    max_samples: int | None,
    max_val_samples: int | None,
    seed: int,
    all_reduce: AllReduce | None,
    unpack_batch: UnpackBatch | None,
    matrix_free_options: dict | None,
    dense_max_parameters: int | None,
    gram_max_kernel_size: int | None,
) -> tuple[CurvatureEstimate, StatisticSums, StatisticSums]:
    """The backend of ``structure``: torch.func (matrix-free), layer hooks (kfac) or BackPACK."""
    if structure in MATRIX_FREE_STRUCTURES:
        curvature, train_sums, val_sums = stream_matrix_free(
            wrapped,
            first_pass,
            val_batches,
            structure=structure,
            lam=lam,
            loss=loss,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            all_reduce=all_reduce,
            options={
                **({"trace_estimator": trace_estimator} if trace_estimator else {}),
                **(matrix_free_options or {}),
            },
            unpack_batch=unpack_batch,
            repeatable_train_batches=train_batches,
        )
        if train_sums.count == 0:
            raise MeasurementError(
                "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
            )
    elif structure == "kfac":
        curvature, train_sums, val_sums = _stream_layer_hooks(
            wrapped,
            first_pass,
            val_batches,
            kfac_mode=kfac_mode,
            mc_samples=mc_samples,
            trace_estimator=trace_estimator or "exact",
            loss=loss,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            all_reduce=all_reduce,
            unpack_batch=unpack_batch,
            lam=lam,
        )
    else:
        estimator = make_estimator(
            structure,
            ggn_scale=loss_scale(loss),
            mc_samples=mc_samples,
            dense_max_parameters=dense_max_parameters,
            gram_max_kernel_size=gram_max_kernel_size,
        )
        train_sums, val_sums = _stream_backpack(
            wrapped,
            first_pass,
            val_batches,
            estimator,
            trace_estimator or "exact",
            loss,
            max_samples,
            max_val_samples,
            seed,
            all_reduce,
            unpack_batch,
        )
        curvature = estimator.estimate(int(train_sums.count), lam)
    return curvature, train_sums, val_sums


def _stream_backpack(
    model: LogitsModule,
    train_batches: Iterable,
    val_batches: Iterable | None,
    estimator: CurvatureEstimator,
    trace_estimator: str,
    loss: str,
    max_samples: int | None,
    max_val_samples: int | None,
    seed: int,
    all_reduce: AllReduce | None,
    unpack_batch: UnpackBatch | None,
) -> tuple[StatisticSums, StatisticSums]:
    """Stream both splits through one extended copy; reduce every sum across processes
    (after :func:`~lightning_flatness.failures.agreed`: one failing process fails them all)."""
    train_stats = SampleStatistics(trace_estimator, loss, estimator.extensions())
    val_stats = SampleStatistics(trace_estimator, loss)
    split = {"split": "training", "unpack_batch": unpack_batch, "spec": model.spec}

    def run() -> None:
        with torch.random.fork_rng(devices=rng_devices(model)):
            torch.manual_seed(seed)
            extended = measurement_copy(model)
            _stream(extended, train_batches, train_stats, estimator, loss, max_samples, **split)
            if val_batches is not None:
                split["split"] = "validation"
                _stream(extended, val_batches, val_stats, None, loss, max_val_samples, **split)
            del extended
        _require_samples(train_stats.sums)

    agreed(all_reduce, run)
    if all_reduce is not None:
        _reduce_statistics(train_stats, all_reduce)
        _reduce_statistics(val_stats, all_reduce)
        for state in estimator.summable_states():
            all_reduce(state)
    return train_stats.sums, val_stats.sums


def _require_samples(train: StatisticSums) -> None:
    if train.count == 0:
        raise MeasurementError(
            "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
        )


def _stream_layer_hooks(
    model: LogitsModule,
    train_batches: Iterable,
    val_batches: Iterable | None,
    *,
    kfac_mode: str,
    mc_samples: int,
    trace_estimator: str,
    loss: str,
    max_samples: int | None,
    max_val_samples: int | None,
    seed: int,
    all_reduce: AllReduce | None,
    unpack_batch: UnpackBatch | None,
    lam: float,
) -> tuple[CurvatureEstimate, StatisticSums, StatisticSums]:
    """``structure="kfac"`` from layer hooks (:mod:`lightning_flatness.hooked_pass`): one
    forward pass and one backward pass per cotangent row per batch, on the live model (eval
    mode, no gradient written, hooks removed after), for any graph; failures agreed across
    processes (:func:`~lightning_flatness.failures.agreed`)."""
    likelihood = get_likelihood(loss)
    estimator = KFACFisher()
    sums = {"training": StatisticSums(), "validation": StatisticSums()}
    device, dtype = _model_device_dtype(model)
    facts: dict[str, object] = {}

    def run() -> None:
        with left_as_found(model):
            generator = torch.Generator(device=device).manual_seed(int(seed) % (2**63))
            hooked = HookedPass(
                model,
                likelihood,
                kfac_mode=kfac_mode,
                mc_samples=mc_samples,
                trace_estimator=trace_estimator,
                generator=generator,
            )
            try:
                splits = [("training", train_batches, max_samples)]
                if val_batches is not None:
                    splits.append(("validation", val_batches, max_val_samples))
                for split, batches, limit in splits:
                    stream = prepared_batches(
                        batches, limit, device, dtype, unpack_batch, model.spec
                    )
                    for index, inputs, targets in stream:
                        batch = _hooked_batch(hooked, likelihood, inputs, targets, split, index)
                        sums[split] = sums[split] + batch[0]
                        if split == "training":
                            estimator.add(batch[1])
                facts["coverage"] = hooked.coverage()
                facts["names"] = hooked.names
            finally:
                hooked.close()
        _require_samples(sums["training"])

    agreed(all_reduce, run)
    train, val = sums["training"], sums["validation"]
    if all_reduce is not None:
        train = StatisticSums.from_tensor(all_reduce(train.as_tensor()))
        val = StatisticSums.from_tensor(all_reduce(val.as_tensor()))
        for state in estimator.summable_states():
            all_reduce(state)
    curvature = estimator.estimate(int(train.count), lam, facts["names"])
    curvature.coverage = facts["coverage"]
    return curvature, train, val


def _hooked_batch(
    hooked: HookedPass,
    likelihood: Likelihood,
    inputs: Leaves,
    targets: Tensor,
    split: str,
    index: int,
) -> tuple[StatisticSums, BatchTerms]:
    """One batch's statistic sums and curvature terms."""
    logits = hooked.forward(inputs)
    targets = likelihood.prepare_targets(targets, logits)
    sums = output_sums(likelihood, logits, targets, hooked.last_linear, hooked.features())
    check_finite_loss(sums.loss, split, index)
    terms = hooked.terms(logits, targets, inputs, curvature=split == "training")
    sums.grad_norm_sq, sums.fisher_trace = terms.grad_norm_sq, terms.fisher_trace
    return sums, terms


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
    device, dtype = _model_device_dtype(model)
    wrapped, stream, _ = wrap_for_batches(model, [batch], unpack_batch, logits_fn)
    prepared = prepared_batches(stream, None, device, dtype, unpack_batch, wrapped.spec)
    _, inputs, targets = next(iter(prepared))
    modes = [(module, module.training) for module in model.modules()]
    try:
        with torch.random.fork_rng(devices=rng_devices(model)), torch.no_grad():
            model.eval()
            logits = wrapped(*inputs)
    finally:
        for module, mode in modes:
            module.training = mode
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
