"""Progress of a long measurement, told to whoever asked for it.

A measurement of a big model or many samples can take minutes: passes over the data, Lanczos
steps, conjugate-gradient products. Its loops call :func:`progress` at each unit of work; by
default nobody listens and the call costs a lookup. Inside :func:`reporting_progress` (the
monitor opens one around a measurement it expects to be long) the listener gets one line per
stage at most every ``every_seconds``, e.g. ``cg: 20 of at most 60 products (41 s)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["progress", "reporting_progress"]


@dataclass
class _Listener:
    report: Callable[[str], None]
    every_seconds: float
    started: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)


_LISTENER: ContextVar[_Listener | None] = ContextVar("lightning_flatness_progress", default=None)


@contextmanager
def reporting_progress(report: Callable[[str], None], every_seconds: float = 5.0) -> Iterator[None]:
    """Within the block, :func:`progress` calls reach ``report`` as one line each, at most every
    ``every_seconds`` seconds."""
    token = _LISTENER.set(_Listener(report, float(every_seconds)))
    try:
        yield
    finally:
        _LISTENER.reset(token)


def progress(stage: str, done: int, total: int | None = None, unit: str = "steps") -> None:
    """Tell the listener, if any and if it is time, that ``stage`` has done ``done`` of
    ``total`` (an upper bound, or None) ``unit``."""
    listener = _LISTENER.get()
    if listener is None:
        return
    now = time.perf_counter()
    if now - listener.last < listener.every_seconds:
        return
    listener.last = now
    of = "" if total is None else f" of at most {total}"
    listener.report(f"{stage}: {done}{of} {unit} ({now - listener.started:.0f} s)")
