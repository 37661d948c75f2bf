"""What the soft-rank penalty computes: one settings object, shared by
:class:`~lightning_flatness.regularizer.SoftRankPenalty`, the ``SoftRankRegularizer`` callback,
the monitor's ``regularize=`` and the configs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_flatness.core.checks import check_choice, check_count
from lightning_flatness.regularizer.arguments import BACKENDS, ESTIMATORS, FUNCTIONS, LABELS
from lightning_flatness.regularizer.running_fisher import check_decay

__all__ = ["PenaltyOptions"]


@dataclass(frozen=True)
class PenaltyOptions:
    """The penalty's options, validated when built.

    Args:
        function: ``"soft_rank"`` or ``"logdet"`` (log-det complexity with the ½).
        estimator: ``"batched"`` (``h(F_b)/B``, the Theorem 6.5 bound) or ``"compositional"``
            (the gradient of ``h(F)/n`` at a running estimate ``F̂``).
        labels: rows of the batched estimator: ``"sampled"`` (one label drawn from the model
            per input; B × B kernel) or ``"exact"`` (all classes; BC × BC kernel). The
            compositional estimator draws Rademacher probes of the output Fisher instead and
            accepts only the default.
        params: ``"all"``, ``"last_layer"`` or module names.
        backend: ``"auto"``, ``"func"``, ``"layerwise"`` or ``"rules"`` (the batched kernel's
            assembly; :mod:`lightning_flatness.regularizer`).
        decay: ρ, the moving-average decay of the compositional estimator's ``F̂``.
        probes: Rademacher probes per call of the compositional estimator.
        max_samples: the compositional estimator uses the first ``max_samples`` samples of
            each batch (all when None). The estimate stays unbiased (batches are random subsets
            of the training set) and its noise grows more slowly than 1/√(samples), while the
            cost falls with the samples.
        batch_norm: how BatchNorm is evaluated inside the penalty: ``"running"`` (eval mode,
            the only choice of the batched estimator, whose per-sample rows need it) or
            ``"batch"`` (modules in training mode on the batch's statistics, as the training
            step computes them, running statistics untouched). None: ``"batch"`` for the
            compositional estimator, ``"running"`` for the batched one.
    """

    function: str = "soft_rank"
    estimator: str = "batched"
    labels: str = "sampled"
    params: str | Sequence[str] = "all"
    backend: str = "auto"
    decay: float = 0.95
    probes: int = 1
    max_samples: int | None = 32
    batch_norm: str | None = None

    def __post_init__(self) -> None:
        check_choice("function", self.function, FUNCTIONS)
        check_choice("labels", self.labels, LABELS)
        check_choice("backend", self.backend, BACKENDS)
        check_choice("estimator", self.estimator, ESTIMATORS)
        if self.estimator == "compositional" and self.labels != "sampled":
            raise ValueError(
                f"labels={self.labels!r} chooses the rows of the batched estimator; "
                'estimator="compositional" draws Rademacher probes of the output Fisher '
                "(probes=K per step). Leave labels at its default, or use "
                'estimator="batched".'
            )
        check_count("probes", self.probes)
        check_count("max_samples", self.max_samples, allow_none=True)
        batch_norm = self.batch_norm
        if batch_norm is None:
            batch_norm = "batch" if self.estimator == "compositional" else "running"
        check_choice("batch_norm", batch_norm, ("running", "batch"))
        if self.estimator == "batched" and batch_norm == "batch":
            raise ValueError(
                'batch_norm="batch" needs estimator="compositional": the batched estimator '
                "differentiates per-sample rows V_i, which batch statistics leave undefined."
            )
        object.__setattr__(self, "batch_norm", batch_norm)
        object.__setattr__(self, "decay", check_decay(self.decay))
        params = self.params
        if isinstance(params, str):
            pass
        elif isinstance(params, Sequence) and params and all(isinstance(p, str) for p in params):
            params = tuple(params)
        else:
            raise ValueError(
                f'params must be "all", "last_layer" or module names, got params={params!r}.'
            )
        object.__setattr__(self, "params", params)
