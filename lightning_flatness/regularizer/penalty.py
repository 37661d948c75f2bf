"""The penalty ``h(F_b)/B`` of Theorem 6.5, as a function and as a configured object."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    LogitsFn,
    num_samples,
)
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.regularizer.arguments import (
    BACKENDS,
    FUNCTIONS,
    LABELS,
    Backend,
    FunctionName,
    LabelMode,
    ParamSpec,
    check_choice,
    check_inputs,
    check_num_train_samples,
)
from lightning_flatness.regularizer.kernel import batch_gram
from lightning_flatness.regularizer.trace_function import gram_trace_function

__all__ = ["SoftRankPenalty", "soft_rank_penalty"]


def soft_rank_penalty(
    model: nn.Module,
    inputs: object,
    *,
    lam: float,
    num_train_samples: int,
    function: FunctionName = "soft_rank",
    labels: LabelMode = "sampled",
    params: ParamSpec = "all",
    generator: torch.Generator | None = None,
    backend: Backend = "auto",
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """The one-batch estimate ``h(F_b)/B`` of the Theorem 6.5 bound ``(1/n) Σ_b h(F_b)``.

    ``F_b = (1/n) Σ_{i∈b} V_iᵀ V_i``; ``h(F_b)`` is computed exactly through the kernel
    ``K_b = (1/n) V_b V_bᵀ`` (docs/math.md, "Batched upper bound (Theorem 6.5) — the regularizer").
    Add ``β ·`` this to the training loss; ``.backward()`` reaches the selected parameters.

    Args:
        model: the classifier, returning logits (batch, classes); BatchNorm is evaluated on
            its running statistics and Dropout switched off inside the penalty (said once).
        inputs: the training minibatch (B inputs); targets are not needed.
        lam: λ > 0, the coupled L2 weight decay (docs/math.md, "Setting").
        num_train_samples: n, the training-set size (n ≥ B).
        function: ``"soft_rank"`` (``h(μ) = μ/(μ+λ)``) or ``"logdet"``
            (``h(μ) = ½ log(1 + μ/λ)``, with the ½ of
            :func:`~lightning_flatness.core.spectral.logdet_complexity`).
        labels: ``"sampled"`` (one label per input from the model's ``p``; B × B kernel) or
            ``"exact"`` (all classes weighted by ``√p``, p not detached; BC × BC kernel).
        params: ``"all"``, ``"last_layer"`` or module names (see :func:`select_parameters`);
            the other parameters are constants.
        generator: private generator for ``labels="sampled"`` (required then; the global RNG
            is never used).
        backend: ``"auto"``, ``"func"`` or ``"layerwise"`` (package docstring).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``: the likelihood whose Fisher is
            penalised (rows of ``V_i = A_i J_i``, see :mod:`lightning_flatness.core.likelihoods`).
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        A scalar in the model's dtype, differentiable in the selected parameters.

    Raises:
        ValueError: for λ ≤ 0, n < B, an empty batch, unknown options or module names,
            BatchNorm without running statistics.
        TypeError: for inputs that are not a tensor, a tuple or a dict of tensors.
    """
    lam = check_lam(lam)
    check_choice("function", function, FUNCTIONS)
    check_choice("labels", labels, LABELS)
    _, leaves = check_inputs(inputs)
    batch_size = num_samples(leaves)
    num_train_samples = check_num_train_samples(num_train_samples, batch_size)
    gram = batch_gram(
        model,
        inputs,
        labels=labels,
        params=params,
        generator=generator,
        backend=backend,
        side="smaller",
        loss=loss,
        logits_fn=logits_fn,
    )
    value = gram_trace_function(gram, lam=lam, scale=1.0 / num_train_samples, function=function)
    return (value / batch_size).to(gram.dtype)


class SoftRankPenalty:
    """Configured :func:`soft_rank_penalty`, owning a private generator for sampled labels.

    Example::

        penalty = SoftRankPenalty(lam=1e-4, num_train_samples=50_000, seed=0)
        loss = cross_entropy(model(x), y) + beta * penalty(model, x)

    Args:
        lam: λ > 0, the coupled L2 weight decay.
        num_train_samples: n, the training-set size.
        function: ``"soft_rank"`` or ``"logdet"`` (log-det complexity with the ½).
        labels: ``"sampled"`` (B × B kernel) or ``"exact"`` (BC × BC kernel).
        params: ``"all"``, ``"last_layer"`` or module names.
        backend: ``"auto"``, ``"func"`` or ``"layerwise"``.
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).
        generator: generator for the sampled labels; default: a new CPU generator seeded with
            ``seed``. Never the global one, so enabling the penalty leaves the training RNG
            stream (shuffling, dropout, initialisation) unchanged.
        seed: seed of the default generator.
    """

    def __init__(
        self,
        *,
        lam: float,
        num_train_samples: int,
        function: FunctionName = "soft_rank",
        labels: LabelMode = "sampled",
        params: ParamSpec = "all",
        backend: Backend = "auto",
        loss: str = "cross_entropy",
        logits_fn: LogitsFn | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> None:
        self.lam = check_lam(lam)
        self.loss = get_likelihood(loss).name
        self.logits_fn = logits_fn
        if (
            isinstance(num_train_samples, bool)
            or not isinstance(num_train_samples, int)
            or num_train_samples < 1
        ):
            raise ValueError(
                f"num_train_samples must be a positive int (the training-set size n), got "
                f"{num_train_samples!r}."
            )
        self.num_train_samples = num_train_samples
        self.function = check_choice("function", function, FUNCTIONS)
        self.labels = check_choice("labels", labels, LABELS)
        self.backend = check_choice("backend", backend, BACKENDS)
        if isinstance(params, str):
            self.params: ParamSpec = params
        elif isinstance(params, Sequence) and params and all(isinstance(p, str) for p in params):
            self.params = tuple(params)
        else:
            raise ValueError(
                f'params must be "all", "last_layer" or module names, got params={params!r}.'
            )
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
        self.generator = generator

    def state_dict(self) -> dict[str, Tensor]:
        """The generator state, so that a resumed run draws the same labels."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore the generator state saved by :meth:`state_dict`."""
        self.generator.set_state(state["generator"])

    def __call__(self, model: nn.Module, inputs: object) -> Tensor:
        """``h(F_b)/B`` for the minibatch ``inputs`` (see :func:`soft_rank_penalty`)."""
        return soft_rank_penalty(
            model,
            inputs,
            lam=self.lam,
            num_train_samples=self.num_train_samples,
            function=self.function,  # type: ignore[arg-type]
            labels=self.labels,  # type: ignore[arg-type]
            params=self.params,
            generator=self.generator if self.labels == "sampled" else None,
            backend=self.backend,  # type: ignore[arg-type]
            loss=self.loss,
            logits_fn=self.logits_fn,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lam={self.lam!r}, num_train_samples="
            f"{self.num_train_samples}, function={self.function!r}, labels={self.labels!r}, "
            f"params={self.params!r}, backend={self.backend!r}, loss={self.loss!r})"
        )
