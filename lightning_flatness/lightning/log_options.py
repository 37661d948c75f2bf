"""What ``FlatnessMonitor`` writes besides its metrics: one settings object."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_flatness.core.checks import check_count

__all__ = ["LogOptions"]


@dataclass(frozen=True)
class LogOptions:
    """How the monitor logs.

    Args:
        prefix: prefix of every logged name (``flatness/soft_rank``, ...).
        spectrum: write the log10 eigenvalue histogram (every measurement) and the gap figure
            (every ``figure_every_n_measurements``-th measurement and at fit end) to
            TensorBoard.
        figure_every_n_measurements: drawing the figure costs about as much as measuring a
            small MLP, so it is redrawn only this often.
        summary: print a summary table of the last measurement at fit end.
    """

    prefix: str = "flatness/"
    spectrum: bool = True
    figure_every_n_measurements: int = 5
    summary: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise ValueError(f"`prefix` must be a string, got {self.prefix!r}.")
        check_count("figure_every_n_measurements", self.figure_every_n_measurements)
