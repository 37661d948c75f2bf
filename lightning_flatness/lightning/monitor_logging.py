"""What ``FlatnessMonitor`` writes: each record through ``pl_module.log_dict`` (so every logger,
``EarlyStopping`` and ``ModelCheckpoint`` see it), the two gaps on the progress bar, and with a
``TensorBoardLogger`` the Fisher spectrum and the predicted-vs-observed gap figure.
"""

from __future__ import annotations

import math
import warnings

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_flatness.lightning.figures import gap_figure, log10_spectrum

__all__ = ["MonitorLogging"]

#: metrics also shown on the progress bar (or, without one, in a line per measurement)
_PROGRESS_BAR_KEYS = ("predicted_gap", "observed_gap")


class MonitorLogging:
    """The logging of :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` (a part of it:
    these methods read the monitor's settings and state)."""

    def _log_record(
        self, trainer: Trainer, pl_module: LightningModule, record: dict[str, float]
    ) -> None:
        record["epoch"] = float(trainer.current_epoch)
        self.history.append(record)
        metrics = {self.log_prefix + k: v for k, v in record.items() if k != "epoch"}
        # what the monitor has added to the training time so far, this measurement included
        # (not in history: it depends on the machine's speed, the history does not)
        seconds = record["seconds"] if math.isfinite(record["seconds"]) else 0.0
        metrics[self.log_prefix + "overhead"] = self.budget.overhead(pending=seconds)
        on_bar = {key: metrics.pop(self.log_prefix + key) for key in _PROGRESS_BAR_KEYS}
        # The values are already the same on every process (reduced before any eigenvalue);
        # syncing them (a mean of equal numbers) keeps Lightning's sync_dist advice quiet.
        sync = trainer.world_size > 1
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync)
        pl_module.log_dict(
            {self.log_prefix + key: value for key, value in on_bar.items()},
            on_step=False,
            on_epoch=True,
            batch_size=1,
            prog_bar=True,
            sync_dist=sync,
        )
        fill_in = bool(record.get("fill_in"))
        structure = self._calibration.describe() if fill_in else self._active_structure
        if trainer.progress_bar_callback is None:  # no bar to show them: one line instead
            rank_zero_info(
                f"FlatnessMonitor, epoch {trainer.current_epoch}: predicted gap "
                f"{on_bar['predicted_gap']:.4g} ({structure}), observed gap "
                f"{on_bar['observed_gap']:.4g}, soft rank {record['soft_rank']:.4g}"
            )
        if not fill_in:  # the spectrum and figure are the exact measurement's
            self._draw(trainer)

    def _tensorboard_writers(self, trainer: Trainer) -> list:
        if not trainer.is_global_zero or not self.log_options.spectrum:
            return []
        return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]

    def _draw(self, trainer: Trainer) -> None:
        """Spectrum histogram, and now and then the gap figure (TensorBoard loggers only)."""
        eigenvalues = self._last_report.eigenvalues if self._last_report else None
        spectrum = log10_spectrum(eigenvalues) if eigenvalues is not None else None
        for writer in self._tensorboard_writers(trainer):
            if spectrum is not None and spectrum.numel():
                writer.add_histogram(
                    f"{self.log_prefix}spectrum_log10", spectrum.float(), trainer.global_step
                )
        if (len(self.history) - 1) % self.log_options.figure_every_n_measurements == 0:
            self._draw_gap_figure(trainer)

    def _draw_gap_figure(self, trainer: Trainer) -> None:
        writers = self._tensorboard_writers(trainer)
        if not writers or not self.history or self._figure_drawn_at == len(self.history):
            return
        for writer in writers:
            try:
                figure = gap_figure(self.history, self._active_structure)
            except Exception as error:  # drawing must never stop training either
                warnings.warn(
                    f"FlatnessMonitor could not draw the gap figure: {error}", stacklevel=2
                )
                return
            writer.add_figure(f"{self.log_prefix}gap", figure, trainer.global_step, close=True)
        self._figure_drawn_at = len(self.history)
