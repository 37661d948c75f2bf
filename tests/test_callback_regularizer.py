"""``FlatnessMonitor(regularize=True)`` equals writing ``loss + β·penalty`` in training_step."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_flatness import BatchReading, FlatnessClassifier, FlatnessMonitor, MNIST7DataModule
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty

BETA = 50.0
LAM = 1e-3
N = 128


class HandWritten(FlatnessClassifier):
    """The user's own version: the penalty added in training_step."""

    def __init__(
        self,
        function: str = "soft_rank",
        labels: str = "sampled",
        estimator: str = "batched",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.penalty = SoftRankPenalty(
            lam=LAM,
            num_train_samples=N,
            seed=0,
            options=PenaltyOptions(function=function, labels=labels, estimator=estimator),
        )

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + BETA * self.penalty(self, batch[0])


def fit(tmp_path, model, callbacks=(), max_steps=3, **trainer_kwargs):
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(model, MNIST7DataModule(train_size=N, val_size=64, batch_size=32))
    return trainer


def monitor(penalty: PenaltyOptions | None = None, **schedule) -> FlatnessMonitor:
    """A monitor that regularizes (β = BETA) and, within these few steps, never measures."""
    return FlatnessMonitor(
        lam=LAM,
        every_n_epochs=1000,
        measure_on_fit_end=False,
        log_options=LogOptions(summary=False),
        regularize=SoftRankRegularizer(strength=BETA, penalty=penalty, **schedule),
    )


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("function", "labels", "estimator", "trainer_kwargs"),
    [
        ("soft_rank", "sampled", "batched", {}),
        ("logdet", "exact", "batched", {}),
        (
            "soft_rank",
            "sampled",
            "batched",
            {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        ),
        ("soft_rank", "exact", "batched", {"precision": "bf16-mixed"}),
        ("soft_rank", "sampled", "compositional", {}),
        ("logdet", "sampled", "compositional", {"accumulate_grad_batches": 2}),
    ],
)
def test_regularized_fit_equals_hand_written_penalty(
    tmp_path, function, labels, estimator, trainer_kwargs
):
    seed_everything(0)
    reference = HandWritten(
        function=function, labels=labels, estimator=estimator, weight_decay=LAM, lr=1e-2
    )
    fit(tmp_path / "hand", reference, **trainer_kwargs)

    seed_everything(0)
    plain = FlatnessClassifier(weight_decay=LAM, lr=1e-2)
    callback = monitor(PenaltyOptions(function=function, labels=labels, estimator=estimator))
    fit(tmp_path / "callback", plain, [callback], **trainer_kwargs)

    seed_everything(0)
    unregularized = FlatnessClassifier(weight_decay=LAM, lr=1e-2)
    fit(tmp_path / "plain", unregularized, **trainer_kwargs)

    for got, expected in zip(weights(plain), weights(reference), strict=True):
        assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    pairs = zip(weights(plain), weights(unregularized), strict=True)
    moved = sum(float((a - b).abs().max()) for a, b in pairs)
    assert moved > 1e-4  # the penalty really changed the trajectory


def test_penalty_is_logged_and_warmup_and_schedule_are_respected(tmp_path):
    seed_everything(0)
    callback = monitor(warmup_steps=2, every_n_steps=2)
    calls = []
    original = SoftRankPenalty.__call__

    def counting(self, model, inputs):
        calls.append(1)
        return original(self, model, inputs)

    SoftRankPenalty.__call__ = counting
    try:
        trainer = fit(tmp_path, FlatnessClassifier(weight_decay=LAM), [callback], max_steps=7)
    finally:
        SoftRankPenalty.__call__ = original
    assert len(calls) == 3  # steps 2, 4, 6 of 0..6
    assert "flatness/penalty_step" in trainer.callback_metrics


class ManualStep(FlatnessClassifier):
    """Manual optimization: the user adds the monitor's penalty themselves."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        (monitor_cb,) = [c for c in self.trainer.callbacks if isinstance(c, FlatnessMonitor)]
        loss = self._step(batch, "train", self.train_acc)
        if monitor_cb.regularize:
            loss = loss + BETA * monitor_cb.penalty(self, batch[0])
        self.manual_backward(loss)
        optimizer.step()


def test_manual_optimization_uses_the_penalty_once(tmp_path):
    """With manual optimization the monitor never adds the penalty behind the user's back."""
    seed_everything(0)
    manual = ManualStep(weight_decay=LAM, lr=1e-2)
    fit(tmp_path / "manual", manual, [monitor()])
    seed_everything(0)
    automatic = FlatnessClassifier(weight_decay=LAM, lr=1e-2)
    fit(tmp_path / "automatic", automatic, [monitor()])
    for got, expected in zip(weights(manual), weights(automatic), strict=True):
        assert torch.allclose(got, expected, atol=1e-6)


def test_the_regularizer_callback_alone_equals_the_monitor_flag(tmp_path):
    """``SoftRankRegularizer`` beside a watching monitor trains as ``regularize=True`` does,
    and the flag adds exactly one regularizer callback for the user."""
    seed_everything(0)
    flagged = FlatnessClassifier(weight_decay=LAM, lr=1e-2)
    trainer = fit(tmp_path / "flag", flagged, [monitor()])
    added = [c for c in trainer.callbacks if isinstance(c, SoftRankRegularizer)]
    assert len(added) == 1

    seed_everything(0)
    separate = FlatnessClassifier(weight_decay=LAM, lr=1e-2)
    watcher = FlatnessMonitor(
        lam=LAM,
        every_n_epochs=1000,
        measure_on_fit_end=False,
        log_options=LogOptions(summary=False),
    )
    fit(tmp_path / "separate", separate, [watcher, SoftRankRegularizer(strength=BETA, lam=LAM)])
    for got, expected in zip(weights(separate), weights(flagged), strict=True):
        assert torch.equal(got, expected)


def test_two_regularizers_are_refused_at_fit_start(tmp_path):
    with pytest.raises(ValueError, match="added twice"):
        fit(
            tmp_path,
            FlatnessClassifier(weight_decay=LAM),
            [monitor(), SoftRankRegularizer(strength=BETA, lam=LAM)],
        )


def test_regularizer_state_restores_its_label_generator_and_step_count(tmp_path):
    seed_everything(0)
    regularizer = SoftRankRegularizer(strength=BETA, lam=LAM, warmup_steps=1)
    fit(tmp_path, FlatnessClassifier(weight_decay=LAM), [regularizer], max_steps=3)
    state = regularizer.state_dict()
    assert state["penalty_calls"] == 3
    resumed = SoftRankRegularizer(strength=BETA, lam=LAM, warmup_steps=1)
    resumed.load_state_dict(state)
    resumed.resolved_lam, resumed.resolved_num_train_samples = LAM, N
    assert resumed._calls == 3
    assert torch.equal(resumed.make_penalty().generator.get_state(), state["penalty_generator"])
    fresh = torch.Generator().manual_seed(0).get_state()
    assert not torch.equal(fresh, state["penalty_generator"])  # two penalties drew labels


def test_regularizer_callback_arguments_are_validated():
    for kwargs, match in (
        ({"strength": -1.0}, "strength"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"warmup_steps": -2}, "warmup_steps"),
        ({"lam": 0.0}, "lam"),
        ({"penalty": {"function": "trace"}}, "PenaltyOptions"),
        ({"reading": "bce"}, "BatchReading"),
    ):
        with pytest.raises(ValueError, match=match):
            SoftRankRegularizer(**kwargs)
    for kwargs, match in (
        ({"function": "trace"}, "'trace'"),
        ({"labels": "some"}, "'some'"),
        ({"params": []}, "params"),
        ({"estimator": "compositional", "labels": "exact"}, "labels='exact'"),
        ({"estimator": "scgd"}, "estimator"),
        ({"decay": 1.5}, "decay"),
    ):
        with pytest.raises(ValueError, match=match):
            PenaltyOptions(**kwargs)


def test_the_monitor_shares_what_the_regularizer_leaves_unset():
    """regularize=SoftRankRegularizer(...) takes the monitor's λ, n, reading, seed and prefix
    wherever the regularizer was given none, and keeps what it was given."""
    reading = BatchReading(loss="bce")
    given = SoftRankRegularizer(strength=0.5, lam=2e-3, seed=7)
    monitor = FlatnessMonitor(
        lam=LAM,
        num_train_samples=N,
        reading=reading,
        seed=3,
        log_options=LogOptions(prefix="watch/"),
        regularize=given,
    )
    assert monitor.regularizer is given
    assert (given.lam, given.seed, given.num_train_samples) == (2e-3, 7, N)
    assert given.reading is reading and given.log_prefix == "watch/"
    assert FlatnessMonitor(regularize=True).regularizer.strength == 1.0
    assert FlatnessMonitor().regularizer is None


def test_compositional_state_checkpoints_the_running_fisher(tmp_path):
    """The running Fisher goes into the Trainer checkpoint (loadable with weights_only) and a
    restored callback's penalty continues from it."""
    seed_everything(0)
    regularizer = SoftRankRegularizer(
        strength=BETA, lam=LAM, penalty=PenaltyOptions(estimator="compositional")
    )
    trainer = fit(tmp_path, FlatnessClassifier(weight_decay=LAM), [regularizer], max_steps=3)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "SoftRankRegularizer" in k]
    running = regularizer._penalty.running_fisher
    assert int(state["running_fisher"]["updates"]) == 3 == running.updates
    resumed = SoftRankRegularizer(
        strength=BETA, lam=LAM, penalty=PenaltyOptions(estimator="compositional")
    )
    resumed.load_state_dict(state)
    resumed.resolved_lam, resumed.resolved_num_train_samples = LAM, N
    model = trainer.lightning_module
    inputs = next(iter(trainer.train_dataloader))[0]
    assert torch.equal(resumed.penalty(model, inputs), regularizer.penalty(model, inputs))
    assert torch.equal(resumed._penalty.running_fisher.dense(), running.dense())
