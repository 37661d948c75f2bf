"""A fit whose first epoch-end measurement (``lanczos``, many steps) runs for minutes; it
prints ``measuring`` as each measurement starts, so that a test can interrupt one."""

from __future__ import annotations

from lightning.pytorch import Trainer, seed_everything

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule
from lightning_flatness.core.options import MatrixFreeOptions
from lightning_flatness.lightning.monitor_measurement import Measurer

_run_measure = Measurer.run


def _announced(self, *args, **kwargs):
    print("measuring", flush=True)
    return _run_measure(self, *args, **kwargs)


def main() -> None:
    Measurer.run = _announced
    seed_everything(0)
    monitor = FlatnessMonitor(
        structure=MatrixFreeOptions(
            structure="lanczos", probes=50, lanczos_steps=400, trace_estimator="sampled"
        ),
        overhead_budget=None,
    )
    trainer = Trainer(
        max_epochs=1,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = MNIST7DataModule(train_size=512, val_size=64, batch_size=64)
    trainer.fit(FlatnessClassifier(weight_decay=1e-3), data)
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
