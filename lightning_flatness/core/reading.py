"""How a batch and the model's outputs are read: one settings object shared by the monitor, the
regularizer, the ``measure`` subcommand and the sweep.

``loss`` names the likelihood whose Fisher is measured (:mod:`lightning_flatness.core.likelihoods`),
``unpack_batch`` splits a batch into inputs and targets
(:func:`~lightning_flatness.core.batches.default_unpack_batch` when None) and ``logits_fn``
reads the logits from the model (:func:`~lightning_flatness.core.batches.default_logits_fn`
when None). :func:`~lightning_flatness.core.measure` takes this object as ``reading=``, the one
way to say the three, and hands it on unchanged to the pipeline and the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_flatness.core.batches import LogitsFn, UnpackBatch
from lightning_flatness.core.likelihoods import LOSSES

__all__ = ["BatchReading"]


@dataclass(frozen=True)
class BatchReading:
    """How batches and outputs are read.

    Args:
        loss: the likelihood of the model's outputs: ``"cross_entropy"`` (softmax
            classification, integer labels), ``"bce"`` (independent sigmoid outputs:
            multi-label 0/1 targets, or binary with a single logit) or ``"mse"`` (regression).
            F is the Fisher of that likelihood; label smoothing or loss weights in the user's
            training loss are not part of it.
        unpack_batch: ``batch -> (inputs, targets)``; default: ``(x, y, *rest)`` sequences and
            mappings with a ``labels``/``label``/``targets``/``target``/``y`` key (the rest of
            the mapping are the inputs, passed to the model as keywords).
        logits_fn: ``(module, inputs) -> logits``; default: call the module and read a tensor,
            ``.logits``, ``["logits"]`` or the first element of a tuple. Needed when the module
            has no ``forward`` (e.g. ``lambda module, x: module.model(x)``).
    """

    loss: str = "cross_entropy"
    unpack_batch: UnpackBatch | None = None
    logits_fn: LogitsFn | None = None

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"`loss` must be one of {LOSSES}, got {self.loss!r}.")
        for name in ("unpack_batch", "logits_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"`{name}` must be a callable or None, got {value!r}.")

    def as_kwargs(self) -> dict[str, Any]:
        """``loss``, ``unpack_batch`` and ``logits_fn`` as keyword arguments (of
        :func:`~lightning_flatness.core.training_nll.mean_nll`)."""
        return {"loss": self.loss, "unpack_batch": self.unpack_batch, "logits_fn": self.logits_fn}
