"""The one measurement pipeline every structure runs through, and the interface of its backends.

:func:`run_pipeline` makes one loop over the batches of both splits, one cross-process failure
check, one reduction of every sum across processes, then asks the backend for its estimate. A
:class:`Backend` turns one batch into its :class:`~lightning_flatness.core.statistics.StatisticSums`
(loss, per-sample gradient norms for Tr(C), Tr(F), accuracy-like scores, relative flatness) and
accumulates what its structure needs as summable states (Kronecker factors, diagonals, Gram
sums, Hutchinson probes, cached inputs for Lanczos): sums over samples, reduced across
processes *before* any eigenvalue is taken (averaging per-process soft ranks would be wrong:
the soft rank is not linear; the probe kernel's sample side keeps its rows instead, each
process its own, :mod:`~lightning_flatness.core.curvature.spread_rows`). Three backends exist:
layer hooks (``probe_kernel``, ``kfac``, ``diag``, ``diag_mc``,
:mod:`lightning_flatness.core.backends.hooks`), BackPACK (``dense``, ``gram``,
:mod:`lightning_flatness.core.backpack.backend`) and ``torch.func`` (``cg``, ``lanczos``,
``hutchinson``, :mod:`lightning_flatness.core.backends.matrix_free`). The structure's options
object and the :class:`~lightning_flatness.core.reading.BatchReading` reach the backend and this
loop unchanged (:func:`~lightning_flatness.core.backends.make_backend`): no layer spells out
their fields as keyword arguments of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule, prepared_batches
from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.failures import (
    MeasurementError,
    NonFiniteLossError,
    TrainingSplitError,
    agreed,
)
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.progress import progress
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["SPLITS", "Backend", "model_device_dtype", "run_pipeline"]

AllReduce = Callable[[Tensor], Tensor]

#: the two splits, in the order they are streamed
SPLITS = ("training", "validation")


class Backend(ABC):
    """Turns batches into statistic sums and summable curvature states (module docstring).

    Attributes:
        likelihood: the measured loss's likelihood (its Fisher's rank bound).
    """

    likelihood: Likelihood

    @abstractmethod
    def session(self) -> AbstractContextManager[None]:
        """The context of a whole measurement: set-up (a private copy, hooks, eval mode, forked
        RNG) on entry, everything as found on exit."""

    @abstractmethod
    def batch(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        """The statistic sums of one batch (``split`` is one of :data:`SPLITS`); a training
        batch also feeds the curvature states.

        Raises:
            MeasurementError: a non-finite loss (naming ``split`` and ``index``).
        """

    def summable_states(self) -> list[Tensor]:
        """The curvature states, in a fixed order, to be summed across processes in place: its
        :class:`~lightning_flatness.core.curvature.base.CurvatureAccumulator`'s sums (and any
        sums of its own, such as a preconditioner's)."""
        return []

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The finished curvature estimate of the Fisher averaged over ``num_samples`` samples
        (all processes' states already summed), the same step for every backend: the structure's
        own estimate (:meth:`curvature`) at ``lam``, or at λ = 1 where the structure works in the
        coordinates ``D^{-1/2}`` of per-group decay (:meth:`scales_by_decay`); the largest rank
        the Fisher of the measured samples can have (``rank_bound``, from the likelihood and
        :meth:`rank_shape`); and, where the backend knows it, which parameters the structure's
        blocks cover (:meth:`coverage`)."""
        curvature = self.curvature(num_samples, 1.0 if self.scales_by_decay() else lam)
        parameters, outputs = self.rank_shape()
        curvature.rank_bound = self.likelihood.fisher_rank_bound(parameters, num_samples, outputs)
        coverage = self.coverage()
        if coverage is not None:
            curvature.coverage = coverage
        return curvature

    @abstractmethod
    def curvature(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The structure's estimate of the Fisher averaged over ``num_samples`` samples at
        ``lam`` (may make further passes, e.g. Lanczos steps or conjugate gradients)."""

    @abstractmethod
    def rank_shape(self) -> tuple[int, int]:
        """The measured model's parameters and outputs (all processes'), after
        :meth:`curvature`: what bounds the Fisher's rank."""

    def scales_by_decay(self) -> bool:
        """Whether the structure measures ``D^{-1/2} F D^{-1/2}`` at λ = 1 (per-group decay)."""
        return False

    def coverage(self) -> dict[str, str] | None:
        """Which parameters the structure's blocks cover, where the backend records it."""
        return None


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where and in which floating dtype the model's parameters live."""
    for p in model.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def run_pipeline(
    backend: Backend,
    model: LogitsModule,
    train_batches: Iterable,
    val_batches: Iterable | None,
    reading: BatchReading,
    *,
    lam: float,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[CurvatureEstimate, StatisticSums, StatisticSums]:
    """Stream both splits through ``backend``, agree on failures, reduce, estimate; batches are
    split into inputs and targets by ``reading.unpack_batch``.

    Returns:
        ``(curvature, train_sums, val_sums)``, the sums reduced across processes.

    Raises:
        TrainingSplitError: a training batch with a non-finite loss (on any process); it
            carries the held-out split's sums, which are still measured.
        MeasurementError: no training samples (on any process, under data parallelism), a
            non-finite held-out loss, or a failure on another process.
    """
    device, dtype = model_device_dtype(model)
    sums = dict.fromkeys(SPLITS, StatisticSums())
    splits = [("training", train_batches, max_samples)]
    if val_batches is not None:
        splits.append(("validation", val_batches, max_val_samples))
    with backend.session():
        training_failure: list[NonFiniteLossError] = []

        def stream() -> None:
            for split, batches, limit in splits:
                unpack = reading.unpack_batch
                prepared = prepared_batches(batches, limit, device, dtype, unpack, model.spec)
                for index, inputs, targets in prepared:
                    progress(f"pass over the {split} data", index, None, "batches")
                    try:
                        sums[split] = sums[split] + backend.batch(inputs, targets, split, index)
                    except NonFiniteLossError as error:
                        if split != "training":
                            raise
                        training_failure.append(error)  # the held-out split is still measured
                        break

        agreed(all_reduce, stream)
        train, val = sums["training"], sums["validation"]
        failed = bool(training_failure)
        if all_reduce is not None:
            failed = float(all_reduce(torch.tensor([float(failed)]))[0]) > 0
            val = StatisticSums.from_tensor(all_reduce(val.as_tensor()))
        if failed:
            reason = (
                str(training_failure[0])
                if training_failure
                else ("A training batch of another process has a non-finite loss.")
            )
            raise TrainingSplitError(reason, val)
        if all_reduce is not None:
            _every_process_measured(train, all_reduce)
            train = StatisticSums.from_tensor(all_reduce(train.as_tensor()))
            for state in backend.summable_states():
                all_reduce(state)
        if train.count == 0:
            raise MeasurementError(
                "train_batches yielded no samples; pass a non-empty iterable of (inputs, targets)."
            )
        return backend.estimate(int(train.count), lam), train, val


def _every_process_measured(train: StatisticSums, all_reduce: AllReduce) -> None:
    """Raise on every process when any measured no training sample: its curvature states were
    never made, so they cannot be summed with the others' (every process calls this
    together)."""
    empty = all_reduce(torch.tensor([float(train.count == 0), 1.0]))
    if float(empty[0]) > 0:
        raise MeasurementError(
            f"{float(empty[0]):.0f} of {float(empty[1]):.0f} processes measured no training "
            "samples; under data parallelism every process must measure at least one. Give "
            "each process a share of the batches (e.g. a DistributedSampler, or slices "
            "[rank::world] with shard=(rank, world))."
        )
