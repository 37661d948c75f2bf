"""The penalty: ``h(F_b)/B`` of Theorem 6.5 as a function, and a configured object that
computes it or the compositional estimate (:mod:`~lightning_flatness.regularizer.compositional`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    LogitsFn,
    LogitsModule,
    num_samples,
    take_rows,
)
from lightning_flatness.core.checks import check_count
from lightning_flatness.core.decay import ParameterDecay, resolve_decay
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import original_module
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.regularizer.arguments import (
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
from lightning_flatness.regularizer.compositional import (
    CompositionalSettings,
    compositional_penalty,
    compositional_surrogate,
)
from lightning_flatness.regularizer.kernel import batch_gram
from lightning_flatness.regularizer.options import PenaltyOptions
from lightning_flatness.regularizer.parameters import select_parameters
from lightning_flatness.regularizer.running_fisher import RunningFisher
from lightning_flatness.regularizer.trace_function import gram_trace_function

__all__ = ["SoftRankPenalty", "penalty_decay", "soft_rank_penalty"]


def penalty_decay(lam: float | Mapping[str, float]) -> tuple[float, ParameterDecay | None]:
    """``(λ, None)`` for one λ; ``(λ*, decay)`` for per-group decays, λ* the largest λ_j."""
    decay = resolve_decay(lam)
    if isinstance(decay, ParameterDecay):
        return decay.representative, decay
    return check_lam(decay), None


def soft_rank_penalty(
    model: nn.Module,
    inputs: object,
    *,
    lam: float | Mapping[str, float],
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
        lam: λ > 0, the coupled L2 weight decay (docs/math.md, "Setting"); or
            ``{parameter name: λ_j ≥ 0}`` for per-group decay, penalising
            ``rank_D(F_b) = Tr(F_b(F_b+D)⁻¹)`` (docs/math.md, "Per-group weight decay"; a
            selected parameter missing from the mapping takes the largest λ_j).
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
    lam, decay = penalty_decay(lam)
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
        decay=decay,
    )
    value = gram_trace_function(gram, lam=lam, scale=1.0 / num_train_samples, function=function)
    return (value / batch_size).to(gram.dtype)


class SoftRankPenalty:
    """The soft-rank (or log-det) penalty of a minibatch, configured once.

    ``estimator="batched"`` is :func:`soft_rank_penalty`, ``h(F_b)/B``: the Theorem 6.5 upper
    bound, stateless. ``estimator="compositional"`` is
    :func:`~lightning_flatness.regularizer.compositional.compositional_penalty`: its value is
    ``h(F̂)/n`` for a running estimate ``F̂`` of the training Fisher (Kronecker factors kept
    as moving averages, :class:`~lightning_flatness.regularizer.running_fisher.RunningFisher`)
    and its gradient an estimate of ``∂h(F)/n`` at ``F̂``; every call updates ``F̂``.

    Example::

        penalty = SoftRankPenalty(lam=1e-4, num_train_samples=50_000, seed=0)
        loss = cross_entropy(model(x), y) + beta * penalty(model, x)

    Args:
        lam: λ > 0, the coupled L2 weight decay, or ``{parameter name: λ_j ≥ 0}`` (per-group
            decay, as in :func:`soft_rank_penalty`; the compositional estimator gives each
            parameter's block of ``F̂`` its own λ_j).
        num_train_samples: n, the training-set size.
        options: what the penalty computes (the trace function, the estimator, its rows,
            parameters, kernel assembly, ...; :class:`PenaltyOptions`, default: its defaults).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).
        generator: generator for the sampled labels or the probes; default: a new CPU
            generator seeded with ``seed``. Never the global one, so enabling the penalty
            leaves the training RNG stream (shuffling, dropout, initialisation) unchanged.
        seed: seed of the default generator.
    """

    def __init__(
        self,
        *,
        lam: float | Mapping[str, float],
        num_train_samples: int,
        options: PenaltyOptions | None = None,
        loss: str = "cross_entropy",
        logits_fn: LogitsFn | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> None:
        #: λ (per-group decay: the largest λ_j) and the per-group decays, if any
        self.lam, self.parameter_decay = penalty_decay(lam)
        self.loss = get_likelihood(loss).name
        self.logits_fn = logits_fn
        self.num_train_samples = check_count(
            "num_train_samples", num_train_samples, meaning="the training-set size n"
        )
        options = PenaltyOptions() if options is None else options
        if not isinstance(options, PenaltyOptions):
            raise ValueError(f"`options` must be a PenaltyOptions or None, got {options!r}.")
        self.options = options
        self.function = options.function
        self.labels = options.labels
        self.backend = options.backend
        self.estimator = options.estimator
        self.probes = options.probes
        self.max_samples = options.max_samples
        self.batch_norm = options.batch_norm
        self.decay = options.decay
        self.params: ParamSpec = options.params
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
        self.generator = generator
        #: ``(rank, world_size)`` under data parallelism (the callbacks set it): every process
        #: then draws from its own generator (:meth:`_draws`)
        self.process: tuple[int, int] | None = None
        #: the compositional estimator's F̂ (built at the first call, for the selected params)
        self.running_fisher: RunningFisher | None = None
        self._restored_running_fisher: dict[str, Tensor] | None = None

    def state_dict(self) -> dict[str, object]:
        """The generator state (so a resumed run draws the same labels or probes) and, for the
        compositional estimator, the running Fisher."""
        state: dict[str, object] = {"generator": self.generator.get_state()}
        if self.running_fisher is not None:
            state["running_fisher"] = self.running_fisher.state_dict()
        elif self._restored_running_fisher is not None:
            state["running_fisher"] = self._restored_running_fisher
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        generator = state["generator"]
        assert isinstance(generator, Tensor)
        self.generator.set_state(generator)
        running = state.get("running_fisher")
        if running is None:
            return
        if self.running_fisher is not None:
            self.running_fisher.load_state_dict(running)  # type: ignore[arg-type]
        else:
            self._restored_running_fisher = running  # type: ignore[assignment]

    def _running_fisher_for(self, selected: dict[str, nn.Parameter]) -> RunningFisher:
        shapes = {name: p.shape for name, p in selected.items()}
        if self.running_fisher is None:
            device = next(iter(selected.values())).device if selected else None
            self.running_fisher = RunningFisher(shapes, decay=self.decay, device=device)
            if self._restored_running_fisher is not None:
                self.running_fisher.load_state_dict(self._restored_running_fisher)
                self._restored_running_fisher = None
        elif {name: block.shape for name, block in self.running_fisher.blocks.items()} != shapes:
            raise ValueError(
                "This compositional penalty keeps a running Fisher of another model's parameters "
                "(names or shapes differ); use one SoftRankPenalty per model."
            )
        return self.running_fisher

    def _draws(self) -> torch.Generator:
        """The generator of this call's labels or probes. One process: :attr:`generator`.
        Under data parallelism each process gets a generator seeded from one draw of the shared
        :attr:`generator` and its rank: the processes' draws are independent (the same draws
        on different samples would not average out across processes), while the shared
        generator advances alike on every process, so a checkpoint (written by rank 0)
        resumes every process where it was."""
        if self.process is None or self.process[1] <= 1:
            return self.generator
        device = self.generator.device
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=device))
        rank = self.process[0]
        return torch.Generator(device=device).manual_seed((seed + 1_000_003 * rank) % 2**63)

    def __call__(self, model: nn.Module, inputs: object) -> Tensor:
        """The penalty for the minibatch ``inputs``: ``h(F_b)/B`` (batched, see
        :func:`soft_rank_penalty`) or the compositional estimate (which updates ``F̂``)."""
        if self.estimator == "batched":
            decay = self.parameter_decay
            return soft_rank_penalty(
                model,
                inputs,
                lam=self.lam if decay is None else decay.decays,
                num_train_samples=self.num_train_samples,
                function=self.function,  # type: ignore[arg-type]
                labels=self.labels,  # type: ignore[arg-type]
                params=self.params,
                generator=self._draws() if self.labels == "sampled" else None,
                backend=self.backend,  # type: ignore[arg-type]
                loss=self.loss,
                logits_fn=self.logits_fn,
            )
        return compositional_penalty(*self._compositional_arguments(model, inputs))

    def surrogate(self, model: nn.Module, inputs: object) -> Tensor:
        """The compositional estimator's ``q/n`` for ``inputs`` at the current ``F̂``, which is
        left unchanged: the function of θ whose gradient the penalty returns
        (:func:`~lightning_flatness.regularizer.compositional.compositional_surrogate`)."""
        if self.estimator != "compositional":
            raise ValueError('surrogate() belongs to estimator="compositional".')
        return compositional_surrogate(*self._compositional_arguments(model, inputs))

    def _compositional_arguments(self, model: nn.Module, inputs: object) -> tuple:
        """The arguments of the compositional functions for this batch and these options."""
        spec, leaves = check_inputs(inputs)
        batch_size = num_samples(leaves)
        check_num_train_samples(self.num_train_samples, batch_size)
        if self.max_samples is not None and batch_size > self.max_samples:
            leaves = take_rows(leaves, slice(0, self.max_samples))
        module = original_module(model)
        selected = select_parameters(module, self.params)
        running = self._running_fisher_for(selected)
        settings = CompositionalSettings(
            lam=self.lam,
            decay=self.parameter_decay,
            num_train_samples=self.num_train_samples,
            function=self.function,
            likelihood=get_likelihood(self.loss),
            probes=self.probes,
            batch_norm=self.batch_norm,
        )
        wrapped = LogitsModule(module, spec, self.logits_fn)
        return wrapped, leaves, selected, running, self._draws(), settings

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lam={self.lam!r}, num_train_samples="
            f"{self.num_train_samples}, function={self.function!r}, labels={self.labels!r}, "
            f"params={self.params!r}, backend={self.backend!r}, loss={self.loss!r}, "
            f"estimator={self.estimator!r})"
        )
