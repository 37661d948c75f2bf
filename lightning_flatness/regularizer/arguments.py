"""The penalty's options and the checks of its arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor

from lightning_flatness.core.batches import (
    InputSpec,
    Leaves,
    num_samples,
)
from lightning_flatness.core.checks import check_choice
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS

__all__ = [
    "BACKENDS",
    "ESTIMATORS",
    "Backend",
    "EstimatorName",
    "FUNCTIONS",
    "FunctionName",
    "LABELS",
    "LabelMode",
    "LabelSpec",
    "ParamSpec",
    "check_choice",
    "check_inputs",
    "check_num_train_samples",
]


#: the trace functions ``h`` the penalty supports: those with a kernel form
FUNCTIONS = tuple(name for name, h in TRACE_FUNCTIONS.items() if h.kernel is not None)

#: how the rows of ``V_b`` are formed
LABELS = ("sampled", "exact")

#: how the gradient of h(F) is estimated: the Theorem 6.5 bound, or the compositional gradient
#: at a running estimate of F (see the package docstring)
ESTIMATORS = ("batched", "compositional")

#: how the kernel is computed (see the package docstring)
BACKENDS = ("auto", "func", "layerwise", "rules")

FunctionName = Literal["soft_rank", "logdet"]

LabelMode = Literal["sampled", "exact"]

Backend = Literal["auto", "func", "layerwise", "rules"]

EstimatorName = Literal["batched", "compositional"]

ParamSpec = str | Sequence[str]

LabelSpec = Literal["sampled", "exact"] | Tensor


def check_inputs(inputs: object) -> tuple[InputSpec, Leaves]:
    """The spec and leaves of a batch's inputs (a tensor, a tuple or a dict of tensors).

    Integer inputs (token ids) are fine: the penalty differentiates the parameters only.
    """
    if not isinstance(inputs, (Tensor, tuple, list, dict)):
        raise TypeError(
            f"inputs must be a tensor, a tuple or a dict of tensors, got {type(inputs).__name__}."
        )
    spec = InputSpec.of(inputs)
    leaves = spec.flatten(inputs)
    if any(t.ndim == 0 for t in leaves) or num_samples(leaves) == 0:
        raise ValueError(
            f"The penalty needs a non-empty batch (batch dimension first), got inputs of shape "
            f"{[tuple(t.shape) for t in leaves]}."
        )
    return spec, leaves


def check_num_train_samples(num_train_samples: object, batch_size: int) -> int:
    if isinstance(num_train_samples, bool) or not isinstance(num_train_samples, int):
        raise TypeError(
            f"num_train_samples must be an int (the training-set size n), got "
            f"{num_train_samples!r}."
        )
    if num_train_samples < batch_size:
        raise ValueError(
            f"num_train_samples (n = {num_train_samples}) is smaller than the batch size "
            f"(B = {batch_size}). F_b = (1/n) Σ_(i in b) V_iᵀV_i splits the training Fisher over "
            "minibatches of the n training samples, so n ≥ B: pass the size of the whole "
            "training set."
        )
    return num_train_samples
