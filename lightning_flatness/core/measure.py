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

- ``predicted_gap`` = Eq. (13): ``(1/n) · Tr(C)/Tr(F) · rank_λ(F)`` with the training trace
  ratio, within 2× of the observed gap far more often than with the held-out one, which grows
  with over-confident wrong answers on held-out data (docs/RESULTS.md, "Predictor and trust
  rule"); ``predicted_gap_val`` uses the held-out ratio (NaN without validation batches);
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

Batches, model calls and outputs are read by :mod:`lightning_flatness.core.batches`
(``unpack_batch=``, ``logits_fn=``), losses by :mod:`lightning_flatness.core.likelihoods`
(``loss=``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from lightning_flatness.core.backends import make_backend
from lightning_flatness.core.batches import (
    LogitsFn,
    UnpackBatch,
    num_samples,
    prepared_batches,
    wrap_for_batches,
)
from lightning_flatness.core.decay import ParameterDecay, resolve_decay
from lightning_flatness.core.defaults import AUTO, choose_across_processes, default_probes
from lightning_flatness.core.failures import MeasurementError, UnsupportedModelError
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import per_sample_modes, rng_devices, uncompiled
from lightning_flatness.core.options import (
    OPTION_CLASSES,
    KernelOptions,
    StructureOptions,
    structure_options,
)
from lightning_flatness.core.pipeline import model_device_dtype, run_pipeline
from lightning_flatness.core.probe_bias import exact_rows_options
from lightning_flatness.core.report import FlatnessReport, build_report
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["check_batch", "curvature_and_sums", "measure"]

AllReduce = Callable[[Tensor], Tensor]


def measure(
    model: nn.Module,
    train_batches: Iterable,
    *,
    lam: float | Mapping[str, float],
    num_train_samples: int,
    structure: str | StructureOptions = "auto",
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
    shard: tuple[int, int] | None = None,
    matrix_free_options: dict | None = None,
    kernel_options: dict | None = None,
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
        lam: the coupled L2 weight decay λ > 0 of the objective ``mean loss + ½λ‖θ‖²``; or
            ``{parameter name: λ_j ≥ 0}`` for per-group decay (objective
            ``mean loss + ½ Σ_j λ_j‖θ_j‖²``, soft rank ``Tr(F(F+D)⁻¹)``;
            :mod:`lightning_flatness.core.decay`), measured by ``probe_kernel``, ``kfac``,
            ``diag`` and ``diag_mc``; the report's ``lam`` is then the largest λ_j.
        num_train_samples: n, the size of the training set (scales the predicted gap).
        structure: ``"auto"`` (default: ``"probe_kernel"`` where it fits, else ``"cg"``;
            :mod:`lightning_flatness.core.defaults`), ``"probe_kernel"`` (the whole Fisher's
            spectrum from ``kernel_options["probes"]`` Rademacher probe rows per sample,
            jackknifed: within a few percent of exact), ``"kfac"`` (block-diagonal with
            Kronecker-factored layers, from layer hooks,
            any differentiable model; see ``report.coverage``), ``"diag"``, ``"diag_mc"``
            (the exact or sampled-label diagonal, same hooks), ``"dense"``, ``"gram"``
            (BackPACK), or ``"lanczos"`` (stochastic Lanczos
            quadrature of the exact F) and
            ``"hutchinson"`` (Hutchinson diagonal with its Eq. 8/9 bounds), matrix-free for any
            differentiable model (options: :mod:`lightning_flatness.core.backends.matrix_free`).
            Or an options object (:mod:`lightning_flatness.core.options`, e.g.
            ``KFACOptions(kfac_mode="probe")``), which names its structure and holds every
            option of it: the keyword arguments below that set options are then not read.
        val_batches: held-out batches for the trace ratio, validation loss and observed gap.
        max_samples / max_val_samples: stop after this many training / validation samples.
        trace_estimator: ``"exact"`` Tr(F), or ``"sampled"`` (unbiased, cheaper); for
            ``kfac``, ``diag`` and ``diag_mc`` also ``"probe"`` (Rademacher probes, unbiased).
            Default: exact; for the matrix-free structures exact only when the per-sample
            Jacobians are small (``C·P ≤ 2²⁵``), else sampled.
        kfac_mode: ``"exact"`` (the C rows of the output Fisher's square root), ``"sampled"``
            (``mc_samples`` labels drawn from the model per input) or ``"probe"``
            (``mc_samples`` Rademacher probes through that square root per input: unbiased like
            drawn labels, and not starved on confident samples; docs/math.md, "Kronecker
            factors from layer hooks").
        mc_samples: labels drawn (or probes) per input for the Monte-Carlo structures.
        loss: ``"cross_entropy"`` (softmax classification), ``"bce"`` (independent sigmoid
            outputs: multi-label, or binary with one logit; ``Λ = diag σ(1−σ)``) or ``"mse"``
            (Gaussian regression, F = JᵀJ); see :mod:`lightning_flatness.core.likelihoods`.
        dense_max_parameters / gram_max_kernel_size: size guards of ``dense`` / ``gram``.
        seed: seeds the Monte-Carlo structures in a forked RNG (global RNG left untouched).
        all_reduce: sums a tensor across processes in place and returns it (data parallelism);
            every sum is reduced before any eigenvalue or ratio is taken.
        shard: ``(rank, world_size)`` when this process's batches hold the samples at positions
            ``rank, rank + world_size, …`` of the set all processes measure together: the probe
            rows of the layer-hook structures are then drawn by global position, and the
            processes together compute exactly what one process would on the whole set.
        matrix_free_options: options of the matrix-free structures (probes, Lanczos steps, ...).
        kernel_options: options of ``probe_kernel`` (``probes``, ``groups``, ``side``, size
            guards; :class:`~lightning_flatness.core.options.KernelOptions`). Without
            ``probes`` or ``groups``: 4 probes in 2 groups, and 2 probes from 8,192 measured
            samples on (:func:`~lightning_flatness.core.defaults.default_probes`), measured
            again with the exact output rows where the soft rank nears the probe rows
            (:mod:`~lightning_flatness.core.probe_bias`).
        unpack_batch: ``batch -> (inputs, targets)``; default
            :func:`~lightning_flatness.core.batches.default_unpack_batch` (sequences and mappings
            with a ``labels``/``label``/``targets``/``target``/``y`` key).
        logits_fn: ``(model, inputs) -> logits``; default
            :func:`~lightning_flatness.core.batches.default_logits_fn` (calls the model, reads a
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
    seen = min(int(num_train_samples), int(max_samples or num_train_samples))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(structure, OPTION_CLASSES):
        options, default_rows = structure, False
    else:
        default_rows = not {"probes", "groups"} & set(kernel_options or {})
        if default_rows:
            kernel_options = {**(kernel_options or {}), "probes": default_probes(seen)}
        if structure == AUTO:
            kernel = KernelOptions.from_dict(kernel_options, "exact")
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            world = shard[1] if shard is not None else 1
            choice = choose_across_processes(
                trainable,
                seen,
                kernel,
                device=device,
                all_reduce=all_reduce,
                world=world,
                sharing=world if device.type == "cpu" else 1,  # as far as can be told
            )
            structure = choice.structure
            named = "sketch_factor" in (kernel_options or {})
            if choice.sketch_factor is not None and not named:  # they fit sketched shorter
                kernel_options = {**(kernel_options or {}), "sketch_factor": choice.sketch_factor}
        options = structure_options(
            structure,
            trace_estimator=trace_estimator,
            kfac_mode=kfac_mode,
            mc_samples=mc_samples,
            dense_max_parameters=dense_max_parameters,
            gram_max_kernel_size=gram_max_kernel_size,
            matrix_free_options=matrix_free_options,
            kernel_options=kernel_options,
        )
    structure = options.structure
    get_likelihood(loss)
    start = time.perf_counter()

    def measured(options: StructureOptions) -> tuple[object, StatisticSums, StatisticSums | None]:
        return curvature_and_sums(
            model,
            train_batches,
            options,
            lam=lam,
            decay=decay if isinstance(decay, ParameterDecay) else None,
            val_batches=val_batches,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            loss=loss,
            seed=seed,
            all_reduce=all_reduce,
            shard=shard,
            unpack_batch=unpack_batch,
            logits_fn=logits_fn,
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
        structure,
        time.perf_counter() - start,
    )


def curvature_and_sums(
    model: nn.Module,
    train_batches: Iterable,
    options: StructureOptions,
    *,
    lam: float,
    decay: ParameterDecay | None = None,
    val_batches: Iterable | None = None,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    loss: str = "cross_entropy",
    seed: int = 0,
    all_reduce: AllReduce | None = None,
    shard: tuple[int, int] | None = None,
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
) -> tuple[object, StatisticSums, StatisticSums | None]:
    """The one pass :func:`measure` makes: ``options``' backend fed every batch by the pipeline,
    returning the curvature estimate and the summed training (and held-out) statistics before
    they become a report. Arguments as for :func:`measure` (``options`` already built).

    Raises:
        MeasurementError: no training samples (on a single process).
        UnsupportedModelError: a recurrent layer on a ``PackedSequence`` for ``torch.func``.
    """
    structure = options.structure
    wrapped, first_pass, found = wrap_for_batches(model, train_batches, unpack_batch, logits_fn)
    if not found and all_reduce is None:
        raise MeasurementError(
            "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
        )
    with uncompiled(wrapped):
        backend = make_backend(
            structure,
            wrapped,
            options,
            loss=loss,
            seed=seed,
            all_reduce=all_reduce,
            unpack_batch=unpack_batch,
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
                lam=lam,
                max_samples=max_samples,
                max_val_samples=max_val_samples,
                all_reduce=all_reduce,
                unpack_batch=unpack_batch,
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
    model: nn.Module,
    batch: object,
    *,
    loss: str = "cross_entropy",
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
) -> tuple[int, int]:
    """Read one real batch the way :func:`measure` will, and fail now if it cannot.

    Unpacks the batch, calls the model (eval mode, no gradient, forked RNG; every module's mode
    restored), reads the logits (refusing probabilities where logits are due) and checks the
    targets against ``loss``. Nothing of the
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
    likelihood.check_not_transformed(logits)
    likelihood.prepare_targets(targets, logits)
    return num_samples(inputs), int(logits.shape[1])


def _packed_recurrent_failure(error: RuntimeError, model: nn.Module) -> bool:
    """``torch.func`` failing inside a recurrent layer fed a ``PackedSequence`` (its fused
    kernel reads the packed data's storage, which functorch's wrappers have none of)."""
    recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
    return recurrent and "doesn't have storage" in str(error)
