"""The sweep's files: one strict JSON line per run (``runs.jsonl``) and per invocation
(``invocations.jsonl``), written by :mod:`lightning_flatness.sweep.runner` and read by
:mod:`lightning_flatness.sweep.report`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "INVOCATIONS_FILE",
    "RESULTS_FILE",
    "TIMINGS",
    "failed_record",
    "json_line",
    "json_safe",
    "read_records",
    "without_timings",
]

RESULTS_FILE = "runs.jsonl"
INVOCATIONS_FILE = "invocations.jsonl"
#: the wall-clock fields of a record and of its measures (they differ between any two runs)
TIMINGS = frozenset({"seconds", "train_seconds"})


def failed_record(run: Mapping[str, Any], error: str) -> dict[str, Any]:
    """The record of a run that did not return one of its own (its worker or task died)."""
    return {
        "key": run["key"],
        "label": run.get("label", ""),
        "params": dict(run.get("params") or {}),
        "seed": run.get("seed"),
        "status": "failed",
        "error": error,
        "seconds": float("nan"),
    }


def without_timings(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` without its wall-clock fields: what two runs of the same key agree on."""
    measures = {
        structure: {k: v for k, v in values.items() if k not in TIMINGS}
        for structure, values in (record.get("measures") or {}).items()
    }
    return {**{k: v for k, v in record.items() if k not in TIMINGS}, "measures": measures}


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``runs.jsonl`` file, in file order; a torn last line is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a run interrupted while its line was written
                continue
    return records


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or ±inf float (at any depth) replaced by ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def json_line(record: Mapping[str, Any]) -> str:
    """One strict JSON line (NaN and ±inf written as ``null``)."""
    return json.dumps(json_safe(record), allow_nan=False, default=repr)
