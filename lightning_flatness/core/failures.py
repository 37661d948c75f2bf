"""How a measurement fails: its error types, one non-finite-loss check, and one rule for data
parallelism — when one process fails, every process raises, and none waits in a collective."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "MeasurementError",
    "NonFiniteLossError",
    "StructureTooLargeError",
    "TrainingSplitError",
    "UnsupportedModelError",
    "agreed",
    "check_finite_loss",
]

T = TypeVar("T")
AllReduce = Callable[[Tensor], Tensor]


class MeasurementError(RuntimeError):
    """The data made a measurement impossible (no samples, NaN or inf loss, ...)."""


class NonFiniteLossError(MeasurementError):
    """A batch's summed loss is NaN or inf."""


class TrainingSplitError(MeasurementError):
    """The training split could not be measured (a non-finite loss), the held-out split could:
    ``val_sums`` are its statistics, reduced across processes, so a report can keep them."""

    def __init__(self, message: str, val_sums: object) -> None:
        super().__init__(message)
        self.val_sums = val_sums


class StructureTooLargeError(ValueError):
    """The requested structure would need more memory or time than its size guard allows."""


class UnsupportedModelError(RuntimeError):
    """The model has a layer or graph that BackPACK cannot extend for the requested structure."""


def check_finite_loss(loss: float, split: str, index: int) -> None:
    """Raise :class:`NonFiniteLossError` naming the batch whose summed loss is NaN or inf."""
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"The {split} loss of batch {index} is {loss} (not finite). "
            "The model diverged or the inputs contain NaN/inf; fix training (lower the "
            "learning rate, clip gradients) before measuring."
        )


def agreed(all_reduce: AllReduce | None, run: Callable[[], T]) -> T:
    """``run()``, such that under data parallelism all processes raise if any one fails.

    Every process first learns (one all-reduce of a flag) whether all of them succeeded, then
    all raise or all go on; call this around any work that precedes a collective.
    """
    failure: Exception | None = None
    result = None
    try:
        result = run()
    except Exception as error:
        if all_reduce is None:
            raise
        failure = error
    if all_reduce is not None:
        failed_processes = all_reduce(torch.tensor([float(failure is not None)]))
        if failure is not None:
            raise failure
        if failed_processes.item() > 0:
            raise MeasurementError(
                f"The measurement failed on {int(failed_processes.item())} other process(es); "
                "see their error messages."
            )
    return result  # type: ignore[return-value]
