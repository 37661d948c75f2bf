"""What ``FlatnessMonitor``'s parts share, declared: the user's settings (read-only) and what
the fit has found out so far (λ, n, the structure measured, the records). The monitor makes one
of each and hands them to the parts it owns (fit start, measurement, schedule), which read and
write only the fields named here, never one another's attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.options import StructureOptions
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.lightning.log_options import LogOptions

__all__ = ["FitState", "MonitorSettings"]


@dataclass(frozen=True)
class MonitorSettings:
    """The monitor's arguments as its parts read them (the meaning of each:
    :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor`)."""

    #: the structure's name (``"auto"`` until resolved at fit start), or the options object's
    structure: str
    #: the options object passed as ``structure``, if any
    structure_options: StructureOptions | None
    lam: float | None
    num_train_samples: int | None
    every_n_epochs: int
    max_samples: int | None
    max_val_samples: int | None
    #: whether the held-out numbers are measured (``val_dataloader`` not None), and on which
    use_val: bool
    val_dataloader_idx: int
    batch_size: int | None
    reading: BatchReading
    log_options: LogOptions
    measure_on_fit_end: bool
    strict: bool
    seed: int


@dataclass
class FitState:
    """What the fit has found out, shared by the monitor's parts: λ and n (read at fit start by
    :class:`~lightning_flatness.lightning.monitor_checks.FitStart`), the structure measured (set
    there, and switched by :class:`~lightning_flatness.lightning.monitor_measurement.Measurer`
    when BackPACK cannot follow the model), why the monitor is off, and the records
    (:class:`~lightning_flatness.lightning.monitor_schedule.Schedule` writes them)."""

    #: the structure measured: the chosen one for ``"auto"``, or the fallback
    active_structure: str
    resolved_lam: float | ParameterDecay | None = None
    resolved_num_train_samples: int | None = None
    #: the probe kernel's sketch factor that fits the rows in memory, where "auto" chose one
    #: above the option's (None: the option's)
    sketch_factor: int | None = None
    #: the numbers one training sample's batch entry holds (read at fit start)
    sample_numbers: float | None = None
    #: why the monitor switched itself off at fit start (``strict=False``), or None
    disabled_reason: str | None = None
    #: one record per measured epoch
    history: list[dict[str, float]] = field(default_factory=list)
    #: scheduled epochs the budget left without a value
    skipped: list[int] = field(default_factory=list)
    #: the last exact measurement's report (its spectrum is drawn)
    last_report: FlatnessReport | None = None

    def measured_samples(self, max_samples: int | None) -> int:
        """The training samples a measurement of the whole set reads: n, at most
        ``max_samples`` (0 while n is unknown)."""
        return int(min(self.resolved_num_train_samples or 0, max_samples or math.inf))

    def lam_argument(self) -> float | dict[str, float] | None:
        """λ for :func:`~lightning_flatness.core.measure`: one value, or each parameter's
        (per-group decay)."""
        if isinstance(self.resolved_lam, ParameterDecay):
            return self.resolved_lam.decays
        return self.resolved_lam
