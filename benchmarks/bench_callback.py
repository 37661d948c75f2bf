"""Overhead of :class:`~lightning_flatness.FlatnessMonitor` in real Lightning fits.

For the MLP and CNN configs (``configs/mlp.yaml``, ``configs/cnn.yaml``: 7×7 MNIST, n = 4,000,
Adam, λ = c/n, TensorBoard logger) one run fits each model with and without a default
``FlatnessMonitor()`` at its defaults (measuring at every epoch end with ``structure="auto"``,
every training sample and up to 1,024 held-out samples), alternating the order over
``--repeats``, and reports:

(a) wall time of the fit with the callback ÷ the same fit without it, and how the extra time
    splits into ``measure()`` itself, drawing the spectrum histogram and gap figure for
    TensorBoard, and the rest of the callback (subset loaders, logging);
(b) time of one measurement per measured sample (training + held-out) ÷ training time per
    sample (the timed training steps of the fit without the callback);
(c) the mean and median time of the training steps (``on_train_batch_start`` →
    ``on_train_batch_end``: forward, backward, optimizer step) with and without the callback,
    and of the first step after each measurement — equal within noise when no BackPACK hook is
    left on the live model; the number of hooks found on the live model after the fit is
    printed too.

Usage::

    python benchmarks/bench_callback.py             # 10 epochs, 2 repeats
    python benchmarks/bench_callback.py --quick     # 3 epochs, 1 repeat
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from _common import load_config, markdown_table, median, print_header, set_threads
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, LogOptions, MNIST7DataModule


class StepTimer(Callback):
    """Timestamps every training step (``on_train_batch_start`` → ``on_train_batch_end``)."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.epochs: list[int] = []
        self.batch_indices: list[int] = []
        self._start = 0.0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.durations.append(time.perf_counter() - self._start)
        self.epochs.append(trainer.current_epoch)
        self.batch_indices.append(batch_idx)

    def steps(self, first_of_epoch: bool | None = None) -> list[float]:
        """Step times after the first epoch (warm-up); ``first_of_epoch`` selects batch 0 only
        (``True``), all others (``False``) or all (``None``)."""
        return [
            d
            for d, e, b in zip(self.durations, self.epochs, self.batch_indices, strict=True)
            if e >= 1 and (first_of_epoch is None or (b == 0) == first_of_epoch)
        ]


class TimedMonitor(FlatnessMonitor):
    """``FlatnessMonitor`` that also records the wall time spent in its epoch and fit hooks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_seconds = 0.0
        self.draw_seconds = 0.0

    def _draw(self, trainer: Trainer) -> None:
        # the TensorBoard spectrum histogram and gap figure (a private hook of the callback)
        start = time.perf_counter()
        super()._draw(trainer)
        self.draw_seconds += time.perf_counter() - start

    def _timed(self, hook: Any, *args: Any) -> None:
        start = time.perf_counter()
        hook(*args)
        self.hook_seconds += time.perf_counter() - start

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._timed(super().on_validation_epoch_end, trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._timed(super().on_train_epoch_end, trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._timed(super().on_fit_end, trainer, pl_module)


@dataclass
class FitResult:
    """Timings of one fit."""

    seconds: float
    timer: StepTimer
    monitor: TimedMonitor | None
    hooks_left: int


@dataclass
class Collected:
    """All fits of one model."""

    plain: list[FitResult] = field(default_factory=list)
    monitored: list[FitResult] = field(default_factory=list)


def _hooks_on(module: LightningModule) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(getattr(m, "_backward_pre_hooks", {}))
        for m in module.modules()
    )


def fit(architecture: str, epochs: int, with_monitor: bool, root: str) -> FitResult:
    """One fit of the config's model and data for ``epochs`` epochs."""
    config = load_config(architecture)
    seed_everything(int(config.get("seed_everything", 0)), verbose=False)
    model = FlatnessClassifier(**config["model"]["init_args"])
    data = MNIST7DataModule(**config["data"]["init_args"])
    timer = StepTimer()
    monitor = TimedMonitor(log_options=LogOptions(summary=False)) if with_monitor else None
    trainer_args = config["trainer"]
    trainer = Trainer(
        max_epochs=epochs,
        deterministic=trainer_args.get("deterministic", False),
        log_every_n_steps=trainer_args.get("log_every_n_steps", 50),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=TensorBoardLogger(root, name=f"{architecture}-{with_monitor}"),
        default_root_dir=root,
        callbacks=[timer] + ([monitor] if monitor else []),
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    return FitResult(seconds, timer, monitor, _hooks_on(model))


def _ms(values: list[float]) -> str:
    return f"{1e3 * median(values):.2f}" if values else "–"


def _mean_ms(values: list[float]) -> str:
    return f"{1e3 * sum(values) / len(values):.2f}" if values else "–"


def report(results: dict[str, Collected], train_size: int) -> None:
    """Print the three tables."""
    rows_a, rows_b, rows_c = [], [], []
    for architecture, collected in results.items():
        plain = median([r.seconds for r in collected.plain])
        monitored = median([r.seconds for r in collected.monitored])
        monitors = [r.monitor for r in collected.monitored if r.monitor is not None]
        measure_s = median([sum(rec["seconds"] for rec in m.history) for m in monitors])
        hook_s = median([m.hook_seconds for m in monitors])
        draw_s = median([m.draw_seconds for m in monitors])
        count = len(monitors[0].history)
        rows_a.append(
            [
                architecture,
                f"{plain:.1f}",
                f"{monitored:.1f}",
                f"{monitored / plain:.2f}",
                count,
                f"{measure_s:.1f}",
                f"{draw_s:.1f}",
                f"{hook_s - measure_s - draw_s:.1f}",
                f"{monitored - plain - hook_s:.1f}",
            ]
        )
        records = [rec for m in monitors for rec in m.history]
        per_measure = median([rec["seconds"] for rec in records])
        samples = records[0]["num_samples"] + records[0]["num_val_samples"]
        plain_steps = [d for r in collected.plain for d in r.timer.durations]
        step_time = sum(plain_steps) / len(plain_steps)
        epochs = sum(max(r.timer.epochs) + 1 for r in collected.plain)
        train_per_sample = sum(plain_steps) / (epochs * train_size)
        rows_b.append(
            [
                architecture,
                f"{int(records[0]['num_samples'])} + {int(records[0]['num_val_samples'])}",
                f"{per_measure:.3f}",
                f"{1e6 * per_measure / samples:.1f}",
                f"{1e6 * train_per_sample:.1f}",
                f"{per_measure / samples / train_per_sample:.1f}",
                f"{1e3 * step_time:.2f}",
            ]
        )
        for label, runs in (("without", collected.plain), ("with", collected.monitored)):
            steps = [d for r in runs for d in r.timer.steps()]
            firsts = [d for r in runs for d in r.timer.steps(first_of_epoch=True)]
            rest = [d for r in runs for d in r.timer.steps(first_of_epoch=False)]
            rows_c.append(
                [
                    architecture,
                    label,
                    len(steps),
                    _mean_ms(steps),
                    _ms(steps),
                    _ms(rest),
                    _mean_ms(firsts),
                    max(r.hooks_left for r in runs),
                ]
            )
    print("\n### (a) Fit wall time with ÷ without the callback\n")
    print(
        markdown_table(
            [
                "model",
                "fit without (s)",
                "fit with (s)",
                "ratio",
                "measurements",
                "in measure() (s)",
                "drawing for TensorBoard (s)",
                "rest of callback (s)",
                "unaccounted (s)",
            ],
            rows_a,
        )
    )
    print("\n### (b) One measurement per measured sample ÷ training time per sample\n")
    print(
        markdown_table(
            [
                "model",
                "samples measured (train + held-out)",
                "s / measurement",
                "µs / measured sample",
                "µs / training sample",
                "ratio",
                "ms / training step (batch 64)",
            ],
            rows_b,
        )
    )
    print("\n### (c) Training steps between measurements (epochs ≥ 2)\n")
    print(
        markdown_table(
            [
                "model",
                "callback",
                "steps",
                "mean ms",
                "median ms",
                "median ms, not first of epoch",
                "mean ms, first step after a measurement",
                "hooks on live model after fit",
            ],
            rows_c,
        )
    )


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the fits and print markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated configs")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per fit")
    parser.add_argument("--repeats", type=int, default=2, help="fits per model and setting")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="3 epochs, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.repeats = 3, 1
    set_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print_header(f"FlatnessMonitor overhead, {args.epochs} epochs per fit")
    results: dict[str, Collected] = {}
    train_size = 0
    with tempfile.TemporaryDirectory() as root:
        for architecture in args.models.split(","):  # warm-up: imports, data, first-call costs
            fit(architecture, 1, True, root)
        for repeat in range(args.repeats):
            for architecture in args.models.split(","):
                collected = results.setdefault(architecture, Collected())
                train_size = load_config(architecture)["data"]["init_args"]["train_size"]
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for with_monitor in order:
                    result = fit(architecture, args.epochs, with_monitor, root)
                    target = collected.monitored if with_monitor else collected.plain
                    target.append(result)
                    print(
                        f"<!-- {architecture} with_monitor={with_monitor}: "
                        f"{result.seconds:.1f} s -->",
                        flush=True,
                    )
    report(results, train_size)


if __name__ == "__main__":
    main()
