"""``measure()``: the one entry point from a model and its data to a :class:`FlatnessReport`.

It streams over *all* batches it is given (up to ``max_samples``): the soft rank of a Fisher
averaged over m samples is a concave function of a sample mean and so is biased low for small m
(docs/math.md, "Sample size"). Every structure runs through one pipeline
(:func:`~lightning_flatness.core.pipeline.run_pipeline`: one loop over the batches, one
cross-process failure check, one reduction, one report) with one of three backends
(:mod:`lightning_flatness.core.backends`): layer hooks on the live model for ``probe_kernel``
(the default wherever it fits, docs/guide.md), ``kfac``, ``diag`` and ``diag_mc``; ``torch.func``
for the matrix-free ``cg`` (the default past the probe kernel's memory), ``lanczos`` and
``hutchinson``; and BackPACK on a private extended copy for ``dense`` and ``gram``. Every one
evaluates the model in eval mode; the user's model, its gradients, its mode, its BatchNorm
statistics and the global RNG state are left exactly as found, and a ``torch.compile`` wrapper
is measured as the module it compiles.

The report combines (docs/math.md, "Generalization gap"):

- ``predicted_gap``, the headline: ``Tr(C)/Tr(F) · rank_λ(F)/(n + rank_λ(F))`` with the
  held-out trace ratio (the training one without validation batches), the form that orders runs
  as their gaps (:mod:`~lightning_flatness.core.predicted_gap`; docs/RESULTS.md, "The headline
  that ranks"), and ``predicted_test_nll`` = ``train_nll + predicted_gap``;
- ``predicted_gap_train``, ``predicted_gap_val`` = Eq. (13): ``(1/n) · Tr(C)/Tr(F) ·
  rank_λ(F)`` with the training and the held-out trace ratio (NaN without validation batches);
- ``thomas_gap`` = Eq. (11): ``(1/n) · Tr(C)/Tr(F)`` (training data);
- ``tic`` = ``(1/n) · Tr(C (F+λI)⁻¹)`` where the structure supports it (dense, gram: exact;
  diag/diag_mc/hutchinson: the diagonal formula; kfac, lanczos: NaN);
- ``newton_decrement`` = ``½ gᵀ(F+λI)⁻¹g`` with g the gradient of the regularized objective
  over the measured training samples (``dense``, ``gram``: exact; ``probe_kernel``: jackknifed,
  ``cg``: bracketed by one more solve, each with a standard error; the other structures: NaN),
  which ``trusted`` requires to be at most
  0.1 nat (docs/math.md, "The Newton decrement");
- ``observed_gap`` = ``val_nll − train_nll``: the negative log-likelihood of the model's own
  likelihood on each split (plain: no label smoothing, no regularizer, whatever the user's
  training loss adds; docs/math.md, "Label smoothing").

There is one way to say each thing: what to measure is ``structure=``, a structure's name
(measured with its defaults) or its options object (:mod:`lightning_flatness.core.options`,
the only place a structure's options are set); how batches, model calls and outputs are read is
``reading=``, a :class:`~lightning_flatness.core.reading.BatchReading` (``loss``,
``unpack_batch``, ``logits_fn``; read by :mod:`lightning_flatness.core.batches` and
:mod:`lightning_flatness.core.likelihoods`). Both objects go unchanged to the pipeline and the
backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from lightning_flatness.core.backends import make_backend
from lightning_flatness.core.batches import num_samples, prepared_batches, wrap_for_batches
from lightning_flatness.core.decay import ParameterDecay, resolve_decay
from lightning_flatness.core.defaults import AUTO, auto_choice, kernel_rows
from lightning_flatness.core.failures import MeasurementError, UnsupportedModelError
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import per_sample_modes, rng_devices, uncompiled
from lightning_flatness.core.options import (
    ALL_STRUCTURES,
    OPTION_CLASSES,
    KernelOptions,
    StructureOptions,
    structure_options,
)
from lightning_flatness.core.pipeline import model_device_dtype, run_pipeline
from lightning_flatness.core.probe_bias import exact_rows_options
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.report import FlatnessReport, build_report
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["check_batch", "checked_reading", "checked_structure", "curvature_and_sums", "measure"]

AllReduce = Callable[[Tensor], Tensor]


def measure(
    model: nn.Module,
    train_batches: Iterable,
    *,
    lam: float | Mapping[str, float],
    num_train_samples: int,
    structure: str | StructureOptions = AUTO,
    reading: BatchReading | None = None,
    val_batches: Iterable | None = None,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    seed: int = 0,
    all_reduce: AllReduce | None = None,
    shard: tuple[int, int] | None = None,
) -> FlatnessReport:
    """Measure the flatness of ``model`` on ``train_batches`` and predict its generalization gap.

    Example::

        report = measure(model, batches, lam=1e-3, num_train_samples=50_000)
        report = measure(
            model,
            batches,
            lam=1e-3,
            num_train_samples=50_000,
            structure=KFACOptions(kfac_mode="probe"),
            reading=BatchReading(loss="bce"),
        )

    Args:
        model: a classifier (or a regressor with ``BatchReading(loss="mse")``); its logits are
            read with ``reading.logits_fn``.
        train_batches: iterable of training batches, ``(inputs, targets, ...)`` or mappings
            (see ``reading.unpack_batch``); all are used (up to ``max_samples``), since the soft
            rank is biased low on subsets. Inputs may be a tensor, a tuple or a dict of tensors.
        lam: the coupled L2 weight decay λ > 0 of the objective ``mean loss + ½λ‖θ‖²``; or
            ``{parameter name: λ_j ≥ 0}`` for per-group decay (objective
            ``mean loss + ½ Σ_j λ_j‖θ_j‖²``, soft rank ``Tr(F(F+D)⁻¹)``;
            :mod:`lightning_flatness.core.decay`), measured by ``probe_kernel``, ``kfac``,
            ``diag`` and ``diag_mc``; the report's ``lam`` is then the largest λ_j.
        num_train_samples: n, the size of the training set (scales the predicted gap).
        structure: what to measure, by name with that structure's defaults, or as its options
            object (:mod:`lightning_flatness.core.options`), the one way to set its options.
            Names: ``"auto"`` (default: ``"probe_kernel"`` where it fits, else ``"cg"``;
            :mod:`lightning_flatness.core.defaults`); ``"probe_kernel"`` (the whole Fisher's
            spectrum from Rademacher probe rows per sample, jackknifed: within a few percent of
            exact; :class:`~lightning_flatness.core.options.KernelOptions`, whose default
            ``probes`` and ``groups`` take 4 probes in 2 groups, 2 probes from 8,192 measured
            samples on, measured again with the exact output rows where the soft rank nears the
            probe rows, :mod:`~lightning_flatness.core.probe_bias`); ``"kfac"`` (block-diagonal
            with Kronecker-factored layers, from layer hooks, any differentiable model; see
            ``report.coverage``; :class:`~lightning_flatness.core.options.KFACOptions`);
            ``"diag"``, ``"diag_mc"`` (the exact or sampled-label diagonal, same hooks;
            :class:`~lightning_flatness.core.options.DiagOptions`); ``"dense"``, ``"gram"``
            (BackPACK; :class:`~lightning_flatness.core.options.DenseOptions`,
            :class:`~lightning_flatness.core.options.GramOptions`); and, matrix-free for any
            differentiable model, ``"cg"`` (preconditioned conjugate gradients on
            Fisher-vector products), ``"lanczos"`` (stochastic Lanczos quadrature of the exact
            F) and ``"hutchinson"`` (Hutchinson diagonal with its Eq. 8/9 bounds)
            (:class:`~lightning_flatness.core.options.MatrixFreeOptions`, whose default
            ``trace_estimator="auto"`` takes the exact Tr(F) only when the per-sample Jacobians
            are small, ``C·P ≤ 2²⁵``).
        reading: how batches, model calls and outputs are read
            (:class:`~lightning_flatness.core.reading.BatchReading`: ``loss`` of
            ``"cross_entropy"``, ``"bce"`` or ``"mse"``, ``unpack_batch``, ``logits_fn``);
            None: ``BatchReading()``, cross-entropy on ``(inputs, targets, ...)`` batches or
            mappings with a ``labels``/``label``/``targets``/``target``/``y`` key, logits read
            from a tensor, ``.logits``, ``["logits"]`` or a tuple's first element.
        val_batches: held-out batches for the trace ratio, validation loss and observed gap.
        max_samples / max_val_samples: stop after this many training / validation samples.
        seed: seeds the Monte-Carlo structures in a forked RNG (global RNG left untouched).
        all_reduce: sums a tensor across processes in place and returns it (data parallelism);
            every sum is reduced before any eigenvalue or ratio is taken.
        shard: ``(rank, world_size)`` when this process's batches hold the samples at positions
            ``rank, rank + world_size, …`` of the set all processes measure together: the probe
            rows of the layer-hook structures are then drawn by global position, and the
            processes together compute exactly what one process would on the whole set.

    Returns:
        A :class:`FlatnessReport`.

    Raises:
        ValueError: bad arguments (the message names the value and the fix), among them a
            ``structure`` that is neither a name nor an options object and a ``reading`` that
            is not a ``BatchReading``.
        BatchError: a batch, call or output that cannot be read (names the ``BatchReading``
            field, ``unpack_batch`` or ``logits_fn``, that fixes it).
        TargetError: targets that do not fit ``reading.loss`` (names the loss that fits them).
        MeasurementError: no samples, or a non-finite loss.
        UnsupportedModelError: a layer BackPACK cannot handle, for ``dense`` and ``gram``
            (names the module type); a recurrent layer on a ``PackedSequence``, for the
            matrix-free structures (names the structures that measure it).
    """
    decay = resolve_decay(lam)
    lam = decay.representative if isinstance(decay, ParameterDecay) else check_lam(decay)
    if int(num_train_samples) < 1:
        raise ValueError(
            f"num_train_samples (n, the training-set size) must be ≥ 1, got {num_train_samples!r}."
        )
    for name, value in (("max_samples", max_samples), ("max_val_samples", max_val_samples)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be ≥ 1 or None (all samples), got {value!r}.")
    options, reading = checked_structure(structure), checked_reading(reading)
    seen = min(int(num_train_samples), int(max_samples or num_train_samples))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if options is None:  # "auto"
        choice = auto_choice(model, seen, all_reduce=all_reduce, shard=shard)
        options = structure_options(choice.structure)
        if isinstance(options, KernelOptions) and choice.sketch_factor is not None:
            options = replace(options, sketch_factor=choice.sketch_factor)  # fits sketched shorter
    default_rows = isinstance(options, KernelOptions) and options.default_rows
    if isinstance(options, KernelOptions):
        options = kernel_rows(options, seen)
    start = time.perf_counter()

    def measured(options: StructureOptions) -> tuple[object, StatisticSums, StatisticSums | None]:
        return curvature_and_sums(
            model,
            train_batches,
            options,
            reading,
            lam=lam,
            decay=decay if isinstance(decay, ParameterDecay) else None,
            val_batches=val_batches,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            all_reduce=all_reduce,
            shard=shard,
        )

    curvature, train_sums, val_sums = measured(options)
    batches = (train_batches, val_batches)
    exact_rows = default_rows and exact_rows_options(
        options, curvature, int(train_sums.count), trainable, batches
    )
    if exact_rows:  # the default probes' bias near m·s: the exact rows instead
        curvature, train_sums, val_sums = measured(exact_rows)
    return build_report(
        curvature,
        train_sums,
        val_sums,
        lam,
        int(num_train_samples),
        options.structure,
        time.perf_counter() - start,
    )


def checked_structure(structure: object) -> StructureOptions | None:
    """``measure()``'s ``structure``: an options object as it is, a name as its default options
    object (:func:`~lightning_flatness.core.options.structure_options`), None for ``"auto"``.

    Raises:
        ValueError: an unknown name, or anything that is neither a name nor an options object
            (naming what was passed and how to set a structure's options).
    """
    if isinstance(structure, OPTION_CLASSES):
        return structure
    if isinstance(structure, str):
        return None if structure == AUTO else structure_options(structure)
    classes = ", ".join(kind.__name__ for kind in OPTION_CLASSES)
    raise ValueError(
        f"structure must be a structure's name ({AUTO!r}, {', '.join(map(repr, ALL_STRUCTURES))})"
        f" or a structure's options object ({classes}), got {type(structure).__name__} "
        f"{structure!r}. A structure's options are set only through its options object, e.g. "
        "structure=KernelOptions(probes=8) or structure=KFACOptions(kfac_mode='probe'); "
        "structure_options(name, mapping) builds one from a mapping of its fields."
    )


def checked_reading(reading: object) -> BatchReading:
    """``measure()``'s ``reading``: a :class:`BatchReading` as it is, None as ``BatchReading()``.

    Raises:
        ValueError: anything else (naming it and the fix).
    """
    if reading is None:
        return BatchReading()
    if not isinstance(reading, BatchReading):
        raise ValueError(
            f"reading must be a BatchReading or None, got {type(reading).__name__} {reading!r}. "
            "Say the loss and how batches and outputs are read with "
            "reading=BatchReading(loss=..., unpack_batch=..., logits_fn=...)."
        )
    return reading


def curvature_and_sums(
    model: nn.Module,
    train_batches: Iterable,
    options: StructureOptions,
    reading: BatchReading,
    *,
    lam: float,
    decay: ParameterDecay | None = None,
    val_batches: Iterable | None = None,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    seed: int = 0,
    all_reduce: AllReduce | None = None,
    shard: tuple[int, int] | None = None,
) -> tuple[object, StatisticSums, StatisticSums | None]:
    """The one pass :func:`measure` makes: ``options``' backend fed every batch by the pipeline,
    returning the curvature estimate and the summed training (and held-out) statistics before
    they become a report. Arguments as for :func:`measure` (``options`` and ``reading`` already
    checked, the probe kernel's rows settled), handed on unchanged to
    :func:`~lightning_flatness.core.backends.make_backend` and
    :func:`~lightning_flatness.core.pipeline.run_pipeline`.

    Raises:
        MeasurementError: no training samples (on a single process).
        UnsupportedModelError: a recurrent layer on a ``PackedSequence`` for ``torch.func``.
    """
    structure = options.structure
    wrapped, first_pass, found = wrap_for_batches(
        model, train_batches, reading.unpack_batch, reading.logits_fn
    )
    if not found and all_reduce is None:
        raise MeasurementError(
            "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
        )
    with uncompiled(wrapped):
        backend = make_backend(
            wrapped,
            options,
            reading,
            seed=seed,
            all_reduce=all_reduce,
            repeatable_train_batches=train_batches,
            max_samples=max_samples,
            shard=shard,
            decay=decay,
        )
        try:
            return run_pipeline(
                backend,
                wrapped,
                first_pass,
                val_batches,
                reading,
                lam=lam,
                max_samples=max_samples,
                max_val_samples=max_val_samples,
                all_reduce=all_reduce,
            )
        except RuntimeError as error:
            if _packed_recurrent_failure(error, model):
                raise UnsupportedModelError(
                    f"structure={structure!r} differentiates the model with torch.func, which "
                    "cannot run a recurrent layer on a PackedSequence (PyTorch: "
                    f"{str(error).splitlines()[0]}). Use structure='probe_kernel' (exact), "
                    "'kfac' or 'diag', which take a recurrent layer's rows from its own rule, "
                    "or pass padded batches."
                ) from error
            raise


def check_batch(
    model: nn.Module, batch: object, reading: BatchReading | None = None
) -> tuple[int, int]:
    """Read one real batch the way :func:`measure` will with the same ``reading`` (None:
    ``BatchReading()``), and fail now if it cannot.

    Unpacks the batch, calls the model (eval mode, no gradient, forked RNG; every module's mode
    restored), reads the logits (refusing probabilities where logits are due) and checks the
    targets against ``reading.loss``. Nothing of the model's state changes.

    Returns:
        ``(batch size, number of outputs)``.

    Raises:
        BatchError / TargetError: with a message naming the argument that fixes the problem.
    """
    reading = checked_reading(reading)
    likelihood = get_likelihood(reading.loss)
    device, dtype = model_device_dtype(model)
    wrapped, stream, _ = wrap_for_batches(model, [batch], reading.unpack_batch, reading.logits_fn)
    prepared = prepared_batches(stream, None, device, dtype, reading.unpack_batch, wrapped.spec)
    _, inputs, targets = next(iter(prepared))
    with (
        torch.random.fork_rng(devices=rng_devices(model)),
        torch.no_grad(),
        per_sample_modes(model),
    ):
        logits = wrapped(*inputs)
    likelihood.check_outputs(logits, num_samples(inputs))
    likelihood.check_not_transformed(logits)
    likelihood.prepare_targets(targets, logits)
    return num_samples(inputs), int(logits.shape[1])


def _packed_recurrent_failure(error: RuntimeError, model: nn.Module) -> bool:
    """``torch.func`` failing inside a recurrent layer fed a ``PackedSequence`` (its fused
    kernel reads the packed data's storage, which functorch's wrappers have none of)."""
    recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
    return recurrent and "doesn't have storage" in str(error)
