"""The monitor's overhead budget: which scheduled measurement runs, so that the monitor adds at
most ``overhead_budget`` (a fraction: 0.3 is 30%) to the fit's training time — or, in a short
fit, so much that the fit with it lasts at most :data:`ALLOWANCE_SECONDS`.

An exact-quality measurement (the probe kernel, ``cg``) costs tens of training epochs of a small
model: its sums grow like m·P² while an epoch costs m·P. So the monitor does not run it at every
scheduled epoch. It may spend, over the whole fit,

    allowed = max((1 − u) · budget · T, A − T),   T = projected training seconds of the fit

(the training seconds so far scaled to ``max_epochs``; u = :data:`UNTIMED_SHARE`, the part of
the budget left for what the monitor's clock does not see; A = :data:`ALLOWANCE_SECONDS`, the
seconds a fit with the monitor may always last, so that a fit of a few seconds is not left
without a number to save two of them, while a fit of 20 s of training keeps the share). At each
scheduled epoch it runs, in this order of preference, whatever keeps

    monitor seconds so far + this measurement + the fit-end measurement still to come
        + the per-epoch work still to come ≤ allowed

(the per-epoch work: the settled test's read of the training NLL at each epoch's end):

1. the exact-quality measurement;
2. else the cheap one, :data:`FILL_IN` (the Kronecker factors of the layer hooks on at most
   :data:`FILL_IN_SAMPLES` training samples — :data:`FILL_IN_MIN_SAMPLES` where a fill-in on
   those at every epoch would take more than half of what the fit may spend per epoch
   (:meth:`OverheadBudget.choose_fill_in_samples`): 1–4 training epochs of its samples,
   its cost predicted at fit start and checked once against the first fill-in's,
   :meth:`OverheadBudget.fill_in_too_dear`), its soft rank scaled by the ratio
   exact ÷ cheap of the last exact measurement (both are measured then) and logged with
   ``fill_in = 1``. Before any exact measurement of the whole set has run, the ratio is taken
   on a subset of :data:`FILL_IN_SAMPLES` (the exact structure on it and on its first half,
   extrapolated to the whole set: the soft rank grows with the samples measured,
   :mod:`~lightning_flatness.core.sample_growth`) whenever that fits, and taken again so at the
   last epoch and, where it fits, wherever the fill-in's own value has moved by more than
   :data:`~lightning_flatness.lightning.calibration.RECALIBRATE_DRIFT` since its ratio was
   taken (the ratio drifts over a fit). The reserve for the fit-end measurement counts against
   a fill-in only while that measurement can still fit; once it cannot, the reserve is that
   last calibration's while it fits, and once a calibration has run, it may lie within the
   untimed part of the budget, where the last one may then run, while the fill-ins and the
   calibrations before it are paid from the rest (:meth:`OverheadBudget._room`). So a fit whose
   one exact measurement alone exceeds what it may spend still gets its curves. Fill-ins are
   paced: when what is left (after the reserve) pays for fewer fill-ins than epochs remain, one
   runs only once as many epochs have passed since the last value as the remaining epochs per
   affordable fill-in, so the values spread evenly over the fit instead of stopping where the
   money runs out; the last epoch's fill-in runs even over the budget (one fill-in: the
   summary's number is never missing);
3. else nothing — unless another callback reads the values every scheduled epoch
   (``EarlyStopping`` or ``ModelCheckpoint`` monitoring one of them): then the cheapest one runs,
   over the budget if need be.

A fill-in is never logged above its rank bound
(:func:`~lightning_flatness.lightning.calibration.fill_in_record`). The fit's last epoch (or the
fit end) gets the exact-quality measurement whenever what the fit may spend allows it,
and whenever that measurement alone costs at most what A leaves beside the training, A − T, in a
fit that has spent at most that (so a measurement earlier in the fit that took longer than
predicted does not take the last number's place; a fit spends at most 2(A − T) beyond its
share):
it is the number the summary reports, so its cost is reserved from the start (the intermediate
measurements must leave room for it). When even that one does not fit — one exact measurement of
a large model can cost a hundred epochs of a short fit — the last value is the fill-in, and the
monitor says so once, with the cost and the two ways to get the exact number
(``overhead_budget=None``, or :func:`~lightning_flatness.core.measure` on the trained model);
only a measured structure without a fill-in can leave the last epoch with nothing, and that is
said too. Before the first exact measurement its cost is predicted from the fit-start trial
(:func:`~lightning_flatness.lightning.trial.trial_settings`: a few samples, and few steps for
the matrix-free structures, timed on two sample counts); afterwards it is the last one's. This
module has no Lightning import.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "ALLOWANCE_SECONDS",
    "CALIBRATION_PROBES",
    "CHEAP",
    "EXACT",
    "FILL_IN",
    "FILL_IN_MIN_SAMPLES",
    "FILL_IN_SAMPLES",
    "SKIP",
    "OverheadBudget",
    "UNTIMED_SHARE",
    "YIELD_SHARE",
    "fills_in",
]

#: the structure that fills in between exact-quality measurements
FILL_IN = "kfac"
#: the fill-in measures at most this many training samples (a fixed random subset): its soft
#: rank on 1,024 samples is 0.97–0.99 of its value on 4,000 at every stage of training
#: (docs/RESULTS.md, "The overhead budget"), the calibration by the exact ratio absorbs the
#: rest, and its cost stops growing with n
FILL_IN_SAMPLES = 1024
#: the fewest samples the fill-in measures (:meth:`OverheadBudget.choose_fill_in_samples`): a
#: tracker scaled by the exact ratio, it is as good on 128 as on 1,024 (on the ladder's ResNet
#: the ratio moves alike on both over a fit; docs/RESULTS.md, "The fill-in on fewer samples")
FILL_IN_MIN_SAMPLES = 128
#: the probe rows per sample (in as many jackknife groups) of the probe kernel's calibration of
#: the fill-in on its samples: the calibration's value is the subset's soft rank extrapolated
#: to the whole set, whose own error (up to 10–20%) is what decides its quality, and two rows
#: cost 0.4 of four (on the ladder's ResNet, 1,024 samples: 1.8 s against 4.5 s, the
#: extrapolated value 0.97–1.03 of the dense Fisher's against 1.02–1.07; docs/RESULTS.md, "The
#: budget counted in the fit's time")
CALIBRATION_PROBES = 2
#: the fill-ins still to come are counted at this many times the last one's cost when a
#: calibration is taken again mid-fit (:meth:`OverheadBudget.affords_recalibration`): a fill-in
#: of the ladder's ResNet on 128 samples took 0.10–0.15 s from one epoch to the next of one fit
FILL_IN_SPREAD = 1.5
#: the part of the budget the decisions leave unspent. The monitor times its own work, but a fit
#: with it also pays for what that clock does not see: Lightning calling its hooks at every step,
#: its set-up before the training clock starts, training epochs a few percent slower for a while
#: after a measurement. On the 2–25 s fits of ``benchmarks/bench_overhead.py`` that
#: was up to 10% of the training time beyond the monitor's own account (docs/RESULTS.md, "The
#: budget's untimed share"); a fifth of a 30% budget covers it
UNTIMED_SHARE = 0.2
#: the seconds a fit with the monitor may always last, training included: about three times
#: what importing torch and Lightning takes on a two-core machine (6 s), so a short fit pays for
#: its numbers about what it pays to start; enough for an exact measurement of the zoo's models on
#: 1,000 samples (1–6 s) at each epoch of a 3-epoch fit (docs/RESULTS.md, "The budget's
#: allowance"). Counted in the fit's time, not added to it: a fit of 21 s of training is not made
#: 41 s by it. At the default share it decides fits of under 20 s ÷ (1 + (1 − u) · 0.3) ≈ 16 s of
#: training; longer fits keep the share
ALLOWANCE_SECONDS = 20.0
#: in a fit the allowance decides, the fit-end exact measurement's reserve gives way to a fill-in
#: at every epoch still to come when those cost at most this share of what the allowance leaves
#: beside the training (:meth:`OverheadBudget._yields`): the last epoch still takes that
#: measurement, and a fit whose reserve was predicted right then lasts at most this share of
#: the allowance's seconds longer. Paced around a predicted reserve several times the
#: measurement's cost, the zoo's ResNet skipped up to 7 of its 10 epochs (docs/RESULTS.md, "The
#: trial's prediction of the exact cost, and values at every epoch")
YIELD_SHARE = 0.25
#: the decisions of :meth:`OverheadBudget.decide`
EXACT, CHEAP, SKIP = "exact", "cheap", "skip"


@dataclass
class OverheadBudget:
    """Wall-time bookkeeping of one fit (module docstring).

    Args:
        share: the most the monitor may add to the fit's training time, as a fraction of it
            (> 0; 0.3: 30% more); None: no budget (every scheduled measurement is exact).
        clock: seconds (``time.perf_counter``; a test may pass its own).
        untimed: the part of the budget left for work the clock does not see
            (:data:`UNTIMED_SHARE`); the decisions spend at most ``(1 − untimed) · share``.
        allowance: the seconds any fit may spend (:data:`ALLOWANCE_SECONDS`), whatever its
            share of the training time.
    """

    share: float | None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    untimed: float = UNTIMED_SHARE
    allowance: float = ALLOWANCE_SECONDS
    started: float | None = None
    #: monitor seconds charged so far
    spent: float = 0.0
    #: the last exact-quality measurement's seconds (or a prediction), and the cheap one's
    exact_seconds: float | None = None
    cheap_seconds: float | None = None
    #: the last calibration's on the fill-in's samples (the exact structure on them)
    subset_seconds: float | None = None
    #: the fill-in's predicted cost on one process: (fixed seconds, seconds per sample of the
    #: fill-in's subset), from the fit-start trial
    fill_in_line: tuple[float, float] | None = None
    #: the samples the fill-in measures in this fit (None: not chosen yet)
    fill_in_samples: int | None = None
    #: whether the first fill-in's cost was set against its part (:meth:`fill_in_too_dear`)
    fill_in_checked: bool = False
    #: whether the fill-in has been calibrated on its subset in this fit (then the last
    #: epoch's calibration keeps its reserve within the untimed part too: :meth:`_live_reserve`)
    calibrated: bool = False
    #: whether the calibration has been taken again mid-fit in this fit (a later one then
    #: counts the last calibration's reserve in the timed part: :meth:`affords_recalibration`)
    recalibrated: bool = False
    #: what the monitor spends at every epoch's end whatever is decided (the settled test's
    #: read of the training NLL: its last time), kept for the epochs still to come
    per_epoch_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.share is not None and not (
            isinstance(self.share, int | float) and math.isfinite(self.share) and self.share > 0
        ):
            raise ValueError(
                "`overhead_budget` must be a positive fraction of the training time (0.3: the "
                f"monitor adds at most 30%) or None (no budget), got {self.share!r}."
            )

    def start(self) -> None:
        """The fit's clock starts (training start)."""
        self.started = self.clock()
        self.spent = 0.0
        self.fill_in_samples = None
        self.fill_in_checked = False
        self.calibrated = False
        self.recalibrated = False

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of monitor work."""
        self.spent += float(seconds)

    def elapsed(self) -> float:
        return 0.0 if self.started is None else max(self.clock() - self.started, 0.0)

    def training_seconds(self) -> float:
        """The fit's wall time so far without the monitor's."""
        return max(self.elapsed() - self.spent, 0.0)

    def overhead(self, pending: float = 0.0) -> float:
        """The monitor's seconds so far (and ``pending`` ones not yet charged) ÷ the training
        seconds: what it has added to the fit, as a fraction."""
        training = self.training_seconds() - pending
        return (self.spent + pending) / training if training > 0 else math.inf

    def predict_exact(self, seconds: float) -> None:
        """The exact measurement's cost before one has run (a prediction from the fit-start
        trial; the first real one replaces it)."""
        if self.exact_seconds is None:
            self.exact_seconds = float(seconds)

    def _projected_training(self, epochs_done: int, max_epochs: int | None) -> float:
        training = self.training_seconds()
        if max_epochs is not None and max_epochs > epochs_done > 0:
            return training * max_epochs / epochs_done
        return training

    def allowed(self, projected: float, untimed_too: bool = False) -> float:
        """The monitor seconds a fit of ``projected`` training seconds may spend: its share
        (less the untimed part, unless ``untimed_too``), or what brings the whole fit to the
        allowance when that is more."""
        kept = 0.0 if untimed_too else self.untimed
        share = (1.0 - kept) * float(self.share) * projected
        return max(share, self.allowance - projected)

    def _fits(
        self, cost: float, reserve: float, projected: float, untimed_too: bool = False
    ) -> bool:
        return self.spent + cost + reserve <= self.allowed(projected, untimed_too)

    def _horizon(
        self, epochs_done: int, max_epochs: int | None, last: bool
    ) -> tuple[float, float, float]:
        """The training seconds a decision weighs against (the whole fit projected from the
        epochs so far; at the last epoch the fit's own), the exact measurement still to come
        at the fit's end (none at the last epoch), and the per-epoch work still to come."""
        if last:  # the summary's number: exact if the whole fit's allowance takes it
            return self.training_seconds(), 0.0, 0.0
        remaining = max(max_epochs - epochs_done, 0) if max_epochs is not None else 0
        projected = self._projected_training(epochs_done, max_epochs)
        return projected, self.exact_seconds or 0.0, self.per_epoch_seconds * remaining

    def _fill_in_seconds(self, epochs_done: int) -> float:
        """The fill-in's cost; before it has run or been predicted, about one training epoch."""
        if self.cheap_seconds is not None:
            return self.cheap_seconds
        return self.training_seconds() / max(epochs_done, 1)

    def choose_fill_in_samples(
        self, epochs_done: int, max_epochs: int | None, available: int
    ) -> int:
        """The fill-in's samples for the rest of the fit, chosen once (at the first scheduled
        epoch, when an epoch's time is known): :data:`FILL_IN_SAMPLES`, or, where a fill-in on
        them at every epoch would take more than half of what the fit may spend per epoch
        (``allowed ÷ max_epochs ÷ 2``: the other half pays for the exact measurements and
        calibrations) on :attr:`fill_in_line`, :data:`FILL_IN_MIN_SAMPLES` (nothing between:
        the line, timed on a few samples, predicts a count in between too loosely, and the
        fill-in tracks alike on both); never more than the ``available`` samples (0: unknown).
        Sets :attr:`cheap_seconds` to the chosen count's predicted cost."""
        cap = min(FILL_IN_SAMPLES, available) if available > 0 else FILL_IN_SAMPLES
        chosen = cap
        if self.share is not None and self.fill_in_line is not None and max_epochs:
            fixed, per_sample = self.fill_in_line
            if fixed + per_sample * cap > self._fill_in_part(epochs_done, max_epochs):
                chosen = min(FILL_IN_MIN_SAMPLES, cap)
            self.cheap_seconds = fixed + per_sample * chosen
        self.fill_in_samples = chosen
        return chosen

    def _fill_in_part(self, epochs_done: int, max_epochs: int) -> float:
        """A fill-in's part: half of what the fit may spend per epoch (half for the rest)."""
        projected = self._projected_training(epochs_done, max_epochs)
        return self.allowed(projected) / max_epochs / 2

    def fill_in_too_dear(self, seconds: float, epochs_done: int, max_epochs: int | None) -> bool:
        """Once per fit, after the first fill-in has run (in ``seconds``): whether it measured
        more than :data:`FILL_IN_MIN_SAMPLES` and cost more than its part (the rule of
        :meth:`choose_fill_in_samples` on the measured cost: the trial's line, timed on a few
        samples, can predict it several times too low). Not without a budget or a length."""
        if self.fill_in_checked:
            return False
        self.fill_in_checked = True
        fewest = (self.fill_in_samples or FILL_IN_SAMPLES) <= FILL_IN_MIN_SAMPLES
        if self.share is None or not max_epochs or fewest:
            return False
        return seconds > self._fill_in_part(epochs_done, max_epochs)

    def use_fewest_fill_in_samples(self, seconds: float) -> None:
        """The fill-in measures :data:`FILL_IN_MIN_SAMPLES` from now on; until measured on
        them, its cost is ``seconds`` (on its samples so far) scaled along the trial's line."""
        before = self.fill_in_samples or FILL_IN_SAMPLES
        after = min(FILL_IN_MIN_SAMPLES, before)
        if self.fill_in_line is not None:
            fixed, per_sample = self.fill_in_line
            share = (fixed + per_sample * after) / (fixed + per_sample * before)
        else:
            share = after / before
        self.fill_in_samples = after
        self.cheap_seconds = seconds * share

    def fits_beside_fill_in(
        self, seconds: float, epochs_done: int, max_epochs: int | None, last: bool
    ) -> bool:
        """Whether ``seconds`` more work (the fill-in's calibration on its own samples) fits
        beside a fill-in, with the reserve for the fit-end exact measurement while it can still
        run (the rule of :meth:`decide` for the fill-in); at the last epoch of a fit calibrated
        before, within the untimed part too (:meth:`_live_reserve` kept its cost so far)."""
        if self.share is None:
            return True
        projected, reserve, upcoming = self._horizon(epochs_done, max_epochs, last)
        fill_in = self._fill_in_seconds(epochs_done)
        cost = fill_in + seconds
        if last:
            live, _ = self._live_reserve(reserve, upcoming, projected)
            return self._fits(cost, live, projected, untimed_too=self.calibrated)
        to_come = fill_in * _epochs_to_come(epochs_done, max_epochs)
        return cost <= self._room(projected, reserve, upcoming, to_come)

    def affords_recalibration(
        self, seconds: float, epochs_done: int, max_epochs: int | None
    ) -> bool:
        """Whether the fill-in's calibration taken again mid-fit (``seconds``, where the
        fill-in has drifted) fits with this epoch's fill-in (already run) and one at every epoch
        still to come, counted at :data:`FILL_IN_SPREAD` times its cost, and the reserve
        :meth:`fits_beside_fill_in` keeps: values at every epoch come first, a fresher ratio
        second. The first time in a fit, the last calibration's reserve may lie within the
        untimed part (:meth:`_room`: the ratio moves most early in a fit); after that, within
        the timed part (on the ladder's ResNet at c = 2.5 a second one moved the ratio by 2%
        and took the fit to 1.3–1.4× its time). Never in a fit of unknown length."""
        if self.share is None:
            return True
        if max_epochs is None:
            return False
        projected, reserve, upcoming = self._horizon(epochs_done, max_epochs, False)
        remaining = max(max_epochs - epochs_done, 0)
        fill_ins = self._fill_in_seconds(epochs_done) * (1 + FILL_IN_SPREAD * remaining)
        room = self._room(projected, reserve, upcoming, fill_ins, timed=self.recalibrated)
        return fill_ins + seconds <= room

    def _last_within_allowance(self) -> bool:
        """The fit's last exact measurement runs whenever it alone fits in what the allowance
        leaves beside the training and the fit has spent no more than that before it: a short
        fit's last number is exact even when an earlier measurement took longer than predicted
        (at most twice what the allowance leaves, in all)."""
        left = self.allowance - self.training_seconds()
        exact = self.exact_seconds or 0.0
        return exact <= left and self.spent <= left

    def _live_reserve(
        self, reserve: float, upcoming: float, projected: float, fill_ins: float = 0.0
    ) -> tuple[float, bool]:
        """The fit-end reserve while the exact measurement can still fit; else the cost of
        the fill-in's calibration on its own samples (the last value is calibrated again) while
        it can still fit — once one has run, within the untimed part too (the ratio drifts over
        a fit, so the last calibration decides the last value: a fit near the edge keeps it,
        and it may then run in that part); else none (so that a fit whose one exact
        measurement or calibration exceeds what it may spend still gets fill-ins); each with
        the ``upcoming`` per-epoch work, which is spent whatever is decided. And whether the
        reserve is that last calibration's, kept within the untimed part (:meth:`_room`). The
        exact measurement's reserve gives way to the ``fill_ins`` still to come where the
        allowance decides the fit and they are cheap (:meth:`_yields`)."""
        if self._fits(reserve, upcoming, projected) and not self._yields(
            reserve, upcoming, projected, fill_ins
        ):
            return reserve + upcoming, False
        if not self.subset_seconds:
            return upcoming, False
        again = self.subset_seconds + (self.cheap_seconds or 0.0)  # it runs the fill-in too
        # once calibrated, a calibration that fits only within the untimed part is still kept
        if self._fits(again, upcoming, projected, untimed_too=self.calibrated):
            return again + upcoming, self.calibrated
        return upcoming, False

    def _yields(self, reserve: float, upcoming: float, projected: float, fill_ins: float) -> bool:
        """Whether the fit-end exact measurement's ``reserve`` gives way to the ``fill_ins``
        still to come (one at this and every later epoch): in a fit the allowance decides,
        where that measurement alone fits in what the allowance leaves beside the training (so
        the last epoch takes it whatever the fill-ins spent: :meth:`_last_within_allowance`)
        but not beside them, and they cost at most :data:`YIELD_SHARE` of what the allowance
        leaves. Values at every epoch come first; the reserve is a prediction until the
        measurement has run, and the fit-start trial's, on a few samples, can be several times
        its cost."""
        left = self.allowance - projected
        if left < (1.0 - self.untimed) * float(self.share) * projected:
            return False  # the share decides: the reserve stands
        cheap = fill_ins <= YIELD_SHARE * left
        return cheap and reserve <= left and not self._fits(reserve, upcoming + fill_ins, projected)

    def _room(
        self,
        projected: float,
        reserve: float,
        upcoming: float,
        fill_ins: float = 0.0,
        timed: bool = False,
    ) -> float:
        """The seconds left for this epoch's work and the fill-ins and calibrations before the
        fit's end: what the fit may spend less what it has spent and the live reserve
        (:meth:`_live_reserve`); where that reserve is the last calibration's of a fit
        calibrated before, it may lie within the untimed part (where it may run), and the
        timed part keeps only the per-epoch work (unless ``timed``). ``fill_ins``: those still
        to come (:meth:`_yields`)."""
        live, untimed_too = self._live_reserve(reserve, upcoming, projected, fill_ins)
        room = self.allowed(projected) - self.spent - live
        if untimed_too and not timed:
            whole = self.allowed(projected, untimed_too=True) - self.spent - live
            room = min(self.allowed(projected) - self.spent - upcoming, whole)
        return room

    def decide(
        self,
        epochs_done: int,
        max_epochs: int | None,
        last: bool,
        cheap: bool,
        required: bool = False,
        since_last: int | None = None,
    ) -> str:
        """:data:`EXACT`, :data:`CHEAP` or :data:`SKIP` for a scheduled measurement after
        ``epochs_done`` epochs; ``last``: the fit's last epoch or its end (exact when the fit's
        allowance takes it, no reserve left to keep); ``cheap``: a
        fill-in structure exists (the measured structure is not cheap itself); ``required``:
        another callback reads the values every scheduled epoch (EarlyStopping,
        ModelCheckpoint), so the cheapest measurement runs even over the budget, never none;
        ``since_last``: the epochs since the last logged value (None: none yet), which paces
        the fill-ins (:meth:`_paced`)."""
        if self.share is None:
            return EXACT
        exact = self.exact_seconds or 0.0
        projected, reserve, upcoming = self._horizon(epochs_done, max_epochs, last)
        fill_in = self._fill_in_seconds(epochs_done)
        to_come = fill_in * _epochs_to_come(epochs_done, max_epochs)
        # mid-fit, an exact measurement runs the fill-in too (for its ratio) and leaves one for
        # every later epoch before the last: values at every epoch come first
        mid_fit = cheap and not last
        later = max(to_come - 2 * fill_in, 0.0) if mid_fit else 0.0
        with_fill_in = exact + (fill_in if mid_fit else 0.0)
        fits_exact = self._fits(with_fill_in, reserve + upcoming + later, projected)
        if fits_exact or (last and self._last_within_allowance()):
            return EXACT
        if cheap and (required or last):  # the summary's number is never missing
            return CHEAP
        room = self._room(projected, reserve, upcoming, to_come)
        horizon = (epochs_done, max_epochs)
        if cheap and fill_in <= room and self._paced(fill_in, room, horizon, since_last):
            return CHEAP
        return EXACT if required else SKIP

    def _paced(
        self,
        fill_in: float,
        room: float,
        horizon: tuple[int, int | None],
        since_last: int | None,
    ) -> bool:
        """Whether a fill-in that fits runs now: always for the fit's first value, in a fit of
        unknown length (no ``max_epochs``), or while the ``room`` left (:meth:`_room`) pays for
        one at every epoch still to come before the last (this one included); else once
        ``since_last`` epochs since the last value reach the spacing that spreads the
        affordable ones evenly over those epochs."""
        epochs_done, max_epochs = horizon
        if since_last is None or max_epochs is None or fill_in <= 0:
            return True
        remaining = max(max_epochs - epochs_done, 1)
        affordable = room // fill_in
        return affordable >= remaining or since_last * max(affordable, 1.0) >= remaining


def _epochs_to_come(epochs_done: int, max_epochs: int | None) -> int:
    """This epoch and those still to come before the fit's end (1 in a fit of unknown
    length)."""
    return max(max_epochs - epochs_done, 0) + 1 if max_epochs is not None else 1


def fills_in(structure: str) -> bool:
    """Whether the fill-in stands in for ``structure`` between its measurements (not for
    itself, nor for the diagonals, which cost less than it)."""
    return structure not in (FILL_IN, "diag", "diag_mc")
