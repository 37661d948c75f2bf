"""What ``FlatnessMonitor`` writes: each record through ``pl_module.log_dict`` (so every logger,
``EarlyStopping`` and ``ModelCheckpoint`` see it), the two gaps on the progress bar, and with a
``TensorBoardLogger`` the Fisher spectrum and the predicted-vs-observed gap figure.
"""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_flatness.lightning.figures import gap_figure, log10_spectrum
from lightning_flatness.lightning.log_options import LogOptions

__all__ = ["MonitorLog"]

#: metrics also shown on the progress bar (or, without one, in a line per measurement)
_PROGRESS_BAR_KEYS = ("predicted_gap", "observed_gap")


class MonitorLog:
    """The monitor's writer: a plain object that owns one piece of state, how many records the
    last gap figure drew (so a figure is not drawn twice for the same records).

    Args:
        options: the logged names' prefix, whether to draw the spectrum and figure, and how
            often (:class:`~lightning_flatness.lightning.log_options.LogOptions`).
    """

    def __init__(self, options: LogOptions) -> None:
        self.options = options
        self._figure_drawn_at = -1

    def write(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        history: list[dict[str, float]],
        *,
        overhead: float,
        how: str,
        eigenvalues: torch.Tensor | None,
    ) -> None:
        """Log the last record of ``history`` under the prefix, with ``overhead`` (what the
        monitor has added to the training time so far; not in the history: it depends on the
        machine's speed, the history does not); ``how`` names what measured it (the line
        shown where there is no progress bar); an exact record (not a fill-in) also draws
        ``eigenvalues`` as the spectrum and now and then the gap figure."""
        prefix = self.options.prefix
        record = history[-1]
        metrics = {prefix + k: v for k, v in record.items() if k != "epoch"}
        metrics[prefix + "overhead"] = overhead
        on_bar = {key: metrics.pop(prefix + key) for key in _PROGRESS_BAR_KEYS}
        # The values are already the same on every process (reduced before any eigenvalue);
        # syncing them (a mean of equal numbers) keeps Lightning's sync_dist advice quiet.
        sync = trainer.world_size > 1
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync)
        pl_module.log_dict(
            {prefix + key: value for key, value in on_bar.items()},
            on_step=False,
            on_epoch=True,
            batch_size=1,
            prog_bar=True,
            sync_dist=sync,
        )
        if trainer.progress_bar_callback is None:  # no bar to show them: one line instead
            rank_zero_info(
                f"FlatnessMonitor, epoch {trainer.current_epoch}: predicted gap "
                f"{on_bar['predicted_gap']:.4g} ({how}), observed gap "
                f"{on_bar['observed_gap']:.4g}, soft rank {record['soft_rank']:.4g}"
            )
        if not record.get("fill_in"):  # the spectrum and figure are the exact measurement's
            self._draw_spectrum(trainer, eigenvalues)
            if (len(history) - 1) % self.options.figure_every_n_measurements == 0:
                self.draw_gap_figure(trainer, history, how)

    def _tensorboard_writers(self, trainer: Trainer) -> list:
        if not trainer.is_global_zero or not self.options.spectrum:
            return []
        return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]

    def _draw_spectrum(self, trainer: Trainer, eigenvalues: torch.Tensor | None) -> None:
        """The spectrum's histogram (TensorBoard loggers only)."""
        spectrum = log10_spectrum(eigenvalues) if eigenvalues is not None else None
        if spectrum is None or not spectrum.numel():
            return
        for writer in self._tensorboard_writers(trainer):
            writer.add_histogram(
                f"{self.options.prefix}spectrum_log10", spectrum.float(), trainer.global_step
            )

    def draw_gap_figure(
        self, trainer: Trainer, history: list[dict[str, float]], structure: str
    ) -> None:
        """The predicted-vs-observed gap figure of ``history`` (TensorBoard loggers only),
        unless it was drawn for these records already."""
        writers = self._tensorboard_writers(trainer)
        if not writers or not history or self._figure_drawn_at == len(history):
            return
        for writer in writers:
            try:
                figure = gap_figure(history, structure)
            except Exception as error:  # drawing must never stop training either
                warnings.warn(
                    f"FlatnessMonitor could not draw the gap figure: {error}", stacklevel=2
                )
                return
            writer.add_figure(f"{self.options.prefix}gap", figure, trainer.global_step, close=True)
        self._figure_drawn_at = len(history)
