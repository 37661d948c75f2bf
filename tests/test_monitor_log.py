"""The monitor's writer is a plain object: it logs a record under the prefix with the overhead,
puts the two gaps on the progress bar, draws an exact record's spectrum and now and then the gap
figure, and never a fill-in's — all without a Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.monitor_logging import MonitorLog


class _Experiment:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_histogram(self, tag, values, step) -> None:
        self.calls.append(tag)

    def add_figure(self, tag, figure, step, close=True) -> None:
        self.calls.append(tag)


def _trainer(experiment: _Experiment) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=1,
        progress_bar_callback=object(),
        current_epoch=3,
        is_global_zero=True,
        loggers=[SimpleNamespace(experiment=experiment)],
        global_step=12,
    )


class _Module:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, bool]] = []

    def log_dict(self, metrics, prog_bar=False, **kwargs) -> None:
        self.logged.append((dict(metrics), prog_bar))


def _record(epoch: float, fill_in: float) -> dict[str, float]:
    return {
        "soft_rank": 10.0,
        "predicted_gap": 0.2,
        "observed_gap": 0.1,
        "seconds": 1.0,
        "fill_in": fill_in,
        "epoch": epoch,
    }


def test_a_record_is_logged_under_the_prefix_with_the_gaps_on_the_bar(monkeypatch):
    experiment = _Experiment()
    # the writer draws on TensorBoard loggers only: these stand-in loggers count as ones
    monkeypatch.setattr(
        "lightning_flatness.lightning.monitor_logging.TensorBoardLogger", SimpleNamespace
    )
    writer = MonitorLog(LogOptions(prefix="f/", figure_every_n_measurements=1))
    module, trainer = _Module(), _trainer(experiment)
    history = [_record(0.0, 0.0)]
    writer.write(
        trainer,
        module,
        history,
        overhead=0.25,
        how="probe_kernel",
        eigenvalues=torch.tensor([1.0, 0.1]),
    )
    (metrics, bar), (on_bar, is_bar) = module.logged
    assert not bar and is_bar
    assert metrics["f/overhead"] == 0.25 and metrics["f/soft_rank"] == 10.0
    assert "f/epoch" not in metrics and "f/predicted_gap" not in metrics
    assert on_bar == {"f/predicted_gap": 0.2, "f/observed_gap": 0.1}
    assert experiment.calls == ["f/spectrum_log10", "f/gap"]  # the first exact record
    history.append(_record(1.0, 1.0))  # a fill-in: no spectrum, no figure
    writer.write(
        trainer, module, history, overhead=0.3, how="kfac × 0.5", eigenvalues=torch.ones(2)
    )
    assert experiment.calls == ["f/spectrum_log10", "f/gap"]
    history.append(_record(2.0, 0.0))  # exact again: the spectrum and the figure
    writer.write(
        trainer, module, history, overhead=0.3, how="probe_kernel", eigenvalues=torch.tensor([1.0])
    )
    assert experiment.calls[2:] == ["f/spectrum_log10", "f/gap"]
    writer.draw_gap_figure(trainer, history, "probe_kernel")  # drawn for these records already
    assert len(experiment.calls) == 4
