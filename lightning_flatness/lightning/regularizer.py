"""``SoftRankRegularizer``: add a soft-rank penalty to every training loss.

A callback that changes training, as Lightning's ``StochasticWeightAveraging`` does (where
:class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` only watches, as
``LearningRateMonitor`` does). Before each backward pass of automatic optimization it adds
``β · penalty / accumulate_grad_batches`` to the loss Lightning is about to backpropagate,
computed by :class:`~lightning_flatness.regularizer.SoftRankPenalty`: with
``estimator="batched"`` the one-batch estimate ``h(F_b)/B`` of the Theorem 6.5 upper bound
(docs/math.md, "Batched upper bound (Theorem 6.5) — the regularizer"), with
``estimator="compositional"`` the compositional gradient of ``h(F)/n`` at a running estimate
``F̂`` (docs/math.md, "Compositional gradient of h(F)"). That is the same as writing
``loss + β · penalty`` in ``training_step``: DDP's gradient averaging, clipping, accumulation
and mixed precision all see the sum. With manual optimization it adds nothing; call
:meth:`SoftRankRegularizer.penalty` in ``training_step`` instead.

λ is read from the optimizers when fit starts and n from the training dataloader when training
starts: the first hooks at which Lightning has built them. The penalty's private generator,
its step count and the compositional estimator's running Fisher are part of the callback's
checkpoint state, so a resumed fit continues as the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_flatness.core.batches import default_unpack_batch
from lightning_flatness.core.checks import check_count
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.lightning.trainer_facts import resolve_lam, resolve_missing
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty

__all__ = ["SoftRankRegularizer"]


class SoftRankRegularizer(Callback):
    """Add ``strength ·`` the soft-rank penalty of each training batch to its loss.

    Example::

        trainer = Trainer(callbacks=[SoftRankRegularizer(strength=1.0), FlatnessMonitor()])

    Args:
        strength: β, the weight of the penalty (≥ 0; 0 computes nothing).
        penalty: what the penalty computes: the trace function, the estimator (``"batched"``,
            the Theorem 6.5 bound, or ``"compositional"``), its rows, parameters, ...
            (:class:`~lightning_flatness.regularizer.PenaltyOptions`; default: its defaults).
        every_n_steps: add the penalty on every n-th training batch only.
        warmup_steps: no penalty for the first k training batches.
        lam: λ, the coupled L2 weight decay; ``None`` reads it from the optimizer: one λ, or
            each parameter's λ_j when the groups decay differently (no decay on biases and
            norms), which penalises ``Tr(F(F+D)⁻¹)`` (docs/math.md, "Per-group weight decay").
        num_train_samples: n; ``None`` reads ``len(train dataset)``.
        reading: the likelihood whose Fisher is penalised and how batches and logits are read
            (:class:`~lightning_flatness.core.reading.BatchReading`; default: cross-entropy
            on ``(x, y)`` batches and the module's own output).
        seed: seed of the penalty's private generator (the global RNG is never used;
            ``None``: 0, or the monitor's seed when the monitor adds this callback).
        log_prefix: the penalty is logged as ``<log_prefix>penalty`` (``None``:
            ``"flatness/"``, or the monitor's prefix).
    """

    def __init__(
        self,
        strength: float = 1.0,
        penalty: PenaltyOptions | None = None,
        every_n_steps: int = 1,
        warmup_steps: int = 0,
        lam: float | None = None,
        num_train_samples: int | None = None,
        reading: BatchReading | None = None,
        seed: int | None = None,
        log_prefix: str | None = None,
    ) -> None:
        if not math.isfinite(float(strength)) or float(strength) < 0:
            raise ValueError(f"`strength` must be a finite number ≥ 0, got {strength!r}.")
        penalty = PenaltyOptions() if penalty is None else penalty
        for name, value, kind in (("penalty", penalty, PenaltyOptions),) + (
            (("reading", reading, BatchReading),) if reading is not None else ()
        ):
            if not isinstance(value, kind):
                raise ValueError(f"`{name}` must be a {kind.__name__} or None, got {value!r}.")
        self.strength = float(strength)
        self.options = penalty
        self.every_n_steps = check_count("every_n_steps", every_n_steps)
        self.warmup_steps = check_count("warmup_steps", warmup_steps, 0)
        self.lam: float | None = None
        self.num_train_samples: int | None = None
        self.reading = BatchReading()
        self.seed = 0
        self.log_prefix = "flatness/"
        self._set: set[str] = set()
        self.adopt(
            lam=lam,
            num_train_samples=num_train_samples,
            reading=reading,
            seed=seed,
            log_prefix=log_prefix,
        )
        self.resolved_lam: float | ParameterDecay | None = None
        self.resolved_num_train_samples: int | None = None
        self._penalty: SoftRankPenalty | None = None
        self._restored_penalty_state: dict[str, Any] | None = None
        #: ``(rank, world_size)`` of this process, read when the fit starts
        self._process: tuple[int, int] | None = None
        self._calls = 0
        self._batch_inputs: Any = None
        #: set by a monitor that switched itself off: no penalty for this fit
        self.disabled = False

    def adopt(
        self,
        *,
        lam: float | None = None,
        num_train_samples: int | None = None,
        reading: BatchReading | None = None,
        seed: int | None = None,
        log_prefix: str | None = None,
    ) -> None:
        """Take these values for whichever of λ, n, reading, seed and log prefix this callback
        was not given (the monitor shares its own with the regularizer it adds)."""
        if lam is not None:
            check_lam(lam)
        if num_train_samples is not None:
            check_count("num_train_samples", num_train_samples)
        given = {
            "lam": None if lam is None else float(lam),
            "num_train_samples": num_train_samples,
            "reading": reading,
            "seed": None if seed is None else int(seed),
            "log_prefix": log_prefix,
        }
        for name, value in given.items():
            if value is not None and name not in self._set:
                setattr(self, name, value)
                self._set.add(name)

    def _penalty_options(self, **resolved: Any) -> dict[str, Any]:
        return dict(
            options=self.options,
            loss=self.reading.loss,
            logits_fn=self.reading.logits_fn,
            seed=self.seed,
            **resolved,
        )

    # ------------------------------------------------------------------ state
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            function=self.options.function, params=str(self.options.params)
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors only, so checkpoints load with
        ``torch.load(weights_only=True)``."""
        state: dict[str, Any] = {"penalty_calls": self._calls}
        penalty = self._penalty
        penalty_state = penalty.state_dict() if penalty else self._restored_penalty_state
        if penalty_state is not None:
            state["penalty_generator"] = penalty_state["generator"]
            if "running_fisher" in penalty_state:
                state["running_fisher"] = penalty_state["running_fisher"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._calls = int(state_dict.get("penalty_calls", 0))
        generator_state = state_dict.get("penalty_generator")
        if generator_state is None:
            return
        penalty_state = {"generator": generator_state}
        if "running_fisher" in state_dict:
            penalty_state["running_fisher"] = state_dict["running_fisher"]
        if self._penalty is not None:
            self._penalty.load_state_dict(penalty_state)
        else:
            self._restored_penalty_state = penalty_state

    # ------------------------------------------------------------------ λ and n
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolved_lam = resolve_lam(trainer.optimizers, self.lam, pl_module)
        self._process = (trainer.global_rank, trainer.world_size)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolve(trainer)

    def resolve(self, trainer: Trainer) -> None:
        """Read λ (from the optimizers) and n (from the training dataloader) if not yet read."""
        resolve_missing(self, trainer)

    # ------------------------------------------------------------------ the penalty
    def make_penalty(self) -> SoftRankPenalty:
        """A :class:`SoftRankPenalty` with the resolved λ and n and this callback's options."""
        if self.resolved_lam is None or self.resolved_num_train_samples is None:
            raise RuntimeError(
                "SoftRankRegularizer resolves λ and n when fit starts; compute the penalty from "
                "training_step (or later)."
            )
        lam = self.resolved_lam
        penalty = SoftRankPenalty(
            **self._penalty_options(
                lam=lam.decays if isinstance(lam, ParameterDecay) else lam,
                num_train_samples=self.resolved_num_train_samples,
            )
        )
        penalty.process = self._process
        if self._restored_penalty_state is not None:
            penalty.load_state_dict(self._restored_penalty_state)
            self._restored_penalty_state = None
        return penalty

    def penalty(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """The penalty of one batch (without β), for manual optimization::

            loss = loss + beta * regularizer.penalty(self, x)
            self.manual_backward(loss)

        With automatic optimization the callback adds ``β · penalty`` itself; do not add it
        twice.
        """
        if self._penalty is None:
            self._penalty = self.make_penalty()
        return self._penalty(model, inputs)

    def _due(self) -> bool:
        return self._calls >= self.warmup_steps and self._calls % self.every_n_steps == 0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.disabled:
            self._batch_inputs = (self.reading.unpack_batch or default_unpack_batch)(batch)[0]

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        """Add ``β · penalty / accumulate_grad_batches`` to the loss about to be backpropagated.

        Lightning hands this hook the very tensor it backpropagates next (the training-step
        loss already divided by ``accumulate_grad_batches``), so an in-place addition makes the
        backward pass, DDP's gradient averaging, clipping and the optimizer step see
        ``loss + penalty`` — the same as writing it in ``training_step``.
        """
        if self._batch_inputs is None or not pl_module.automatic_optimization:
            return
        due = self._due()
        self._calls += 1
        inputs, self._batch_inputs = self._batch_inputs, None
        if not due or self.strength == 0.0:
            return
        with trainer.precision_plugin.forward_context():
            penalty = self.penalty(pl_module, inputs)
        loss.add_(self.strength / trainer.accumulate_grad_batches * penalty.to(loss.dtype))
        # each process's penalty is its own batch's: logged as the mean over processes
        pl_module.log(
            f"{self.log_prefix}penalty",
            penalty.detach(),
            on_step=True,
            on_epoch=True,
            batch_size=1,
            sync_dist=trainer.world_size > 1,
        )
