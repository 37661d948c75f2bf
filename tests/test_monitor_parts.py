"""The monitor is a composition: its Lightning hooks reach ``measure()`` through named calls on
the parts it owns, and each part is a plain object that works without a ``Trainer``."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
from conftest import quiet_trainer
from lightning.pytorch import Callback, seed_everything

import lightning_flatness.lightning.monitor_measurement as measurement_module
from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule
from lightning_flatness.core.options import KernelOptions
from lightning_flatness.lightning.budget import EXACT, OverheadBudget
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.monitor_measurement import Measurer, monitor_options
from lightning_flatness.lightning.monitor_schedule import Schedule
from lightning_flatness.lightning.monitor_state import FitState


def _calls_to_measure(monkeypatch) -> list[list[str]]:
    """Every call of ``measure()`` by the monitor, as the qualified names of the functions
    on the stack from the Lightning hook down (the package's frames only)."""
    chains: list[list[str]] = []
    original = measurement_module.measure

    def traced(*args, **kwargs):
        frames = [frame for frame in inspect.stack() if "lightning_flatness" in frame.filename]
        chains.append([frame.frame.f_code.co_qualname for frame in reversed(frames)])
        return original(*args, **kwargs)

    monkeypatch.setattr(measurement_module, "measure", traced)
    return chains


@pytest.mark.parametrize(
    "validation, hook",
    [(False, "on_train_epoch_end"), (True, "on_validation_epoch_end")],
    ids=["train-epoch-end", "validation-end"],
)
def test_the_epoch_end_hook_reaches_measure_through_the_parts(
    tmp_path, monkeypatch, validation, hook
):
    """Measured at the training epoch's end, or at validation's end when validation closes the
    epoch (so that checkpointing sees the value): either way through the schedule and the
    measurer, by name."""
    monitor = FlatnessMonitor(overhead_budget=None, log_options=LogOptions(summary=False))
    chains = _calls_to_measure(monkeypatch)
    seed_everything(0)
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=16)
    limit = {} if validation else {"limit_val_batches": 0}
    trainer = quiet_trainer(tmp_path, [monitor], max_epochs=1, **limit)
    trainer.fit(FlatnessClassifier(weight_decay=1e-3), data)
    (record,) = monitor.history
    assert math.isfinite(record["soft_rank"])
    epoch_end = [chain for chain in chains if chain[0] not in ("FlatnessMonitor.on_train_start",)]
    assert epoch_end == [
        [
            f"FlatnessMonitor.{hook}",
            "Schedule.measure_epoch",
            "Schedule._budgeted_record",
            "Measurer.record",
            "Measurer.with_fallback",
            "Measurer.record.<locals>.<lambda>",
            "Measurer.run",
            "Measurer.call",
        ]
    ]
    # the fit-start checks and trial measure through the same measurer
    starts = {chain[1] for chain in chains if chain[0] == "FlatnessMonitor.on_train_start"}
    assert starts == {"FitStart.start"}


def test_the_parts_are_plain_objects():
    monitor = FlatnessMonitor()
    parts = (monitor.measurer, monitor.fit_start, monitor.schedule, monitor.writer, monitor.nll)
    assert not any(isinstance(part, Callback) for part in parts)
    # they share the monitor's declared state and settings, not its attributes
    assert monitor.measurer.state is monitor.state is monitor.schedule.state
    assert monitor.fit_start.settings is monitor.settings is monitor.schedule.settings


def test_the_schedule_decides_due_epochs_without_a_trainer():
    monitor = FlatnessMonitor(every_n_epochs=2)
    schedule: Schedule = monitor.schedule
    due = [schedule.due(SimpleNamespace(current_epoch=epoch)) for epoch in range(4)]
    assert due == [False, True, False, True]
    monitor.state.history.append({"epoch": 1.0})
    monitor.state.skipped.append(3)
    assert [schedule.due(SimpleNamespace(current_epoch=epoch)) for epoch in range(4)] == [
        False,
        False,
        False,
        False,
    ]
    monitor.state.disabled_reason = "switched off"
    assert not schedule.due(SimpleNamespace(current_epoch=5))


def test_the_measurer_builds_its_arguments_from_settings_and_state():
    options = KernelOptions(probes=8)
    monitor = FlatnessMonitor(structure=options)
    measurer: Measurer = monitor.measurer
    assert measurer.arguments("probe_kernel") == {"structure": options}
    calibration = measurer.calibration_arguments()["structure"]
    assert calibration.summary_only and calibration.probes == 8
    state = FitState(active_structure="kfac", resolved_num_train_samples=5000)
    alone = Measurer(monitor.settings, state, OverheadBudget(0.3))
    assert alone.arguments("kfac") == {"structure": monitor_options("kfac")}
    assert alone.measured_samples() == 5000
    assert alone.calibration_arguments() == alone.arguments("kfac")


def test_a_scripted_exact_measurement_is_logged_by_the_schedule(tmp_path):
    """The schedule's decision comes from the budget it was given: scripting the budget's
    decision drives the schedule without touching the monitor."""
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    monitor.schedule.budget.decide = lambda *args, **kwargs: EXACT
    seed_everything(0)
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=16)
    trainer = quiet_trainer(tmp_path, [monitor], max_epochs=2)
    trainer.fit(FlatnessClassifier(weight_decay=1e-3), data)
    assert [r["fill_in"] for r in monitor.history] == [0.0, 0.0]
    assert monitor.schedule.budget is monitor.budget


@pytest.mark.parametrize(
    "structure, message",
    [
        ({"probes": 8}, "options are set only through its options object"),
        ("kernel", "structure must be one of"),
    ],
    ids=["dict", "unknown-name"],
)
def test_the_monitor_refuses_a_structure_as_measure_does(structure, message):
    """A structure the monitor cannot take is refused when it is built, with the message
    ``measure()`` gives for the same value."""
    with pytest.raises(ValueError, match=message):
        FlatnessMonitor(structure=structure)
