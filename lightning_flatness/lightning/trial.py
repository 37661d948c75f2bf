"""The fit-start trial's settings: what
:class:`~lightning_flatness.lightning.monitor_checks.FitStart` measures on a few samples before
training, to check that the structure runs on the model and to predict the first exact
measurement's cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from lightning_flatness.core.options import (
    MATRIX_FREE_STRUCTURES,
    MatrixFreeOptions,
    structure_options,
)

__all__ = ["TRIAL_MATRIX_FREE", "TRIAL_SAMPLES", "trial_settings"]

#: the fit-start trial measures at most this many samples, and a matrix-free structure with
#: these options: it checks that the structure runs on the model, not its numbers
TRIAL_SAMPLES = 32
TRIAL_MATRIX_FREE = {"probes": 2, "cg_steps": 2, "lanczos_steps": 2, "power_iterations": 2}


def trial_settings(arguments: Mapping[str, Any]) -> tuple[dict, float]:
    """The fit-start trial's :func:`~lightning_flatness.core.measure` keyword arguments, from
    the ``structure`` (a name or an options object) a real measurement passes: at most
    :data:`TRIAL_SAMPLES` samples, and a matrix-free structure with :data:`TRIAL_MATRIX_FREE`'s
    few probes and steps, since its full run on one batch can cost minutes. Also how many times
    more work a real measurement does per sample (the ratio of steps for the matrix-free ones,
    whose probes run as one block; 1 for the others): the factor that predicts the first exact
    measurement's cost."""
    kwargs = {**arguments, "max_samples": TRIAL_SAMPLES}
    structure = arguments["structure"]
    if isinstance(structure, str) and structure not in MATRIX_FREE_STRUCTURES:
        return kwargs, 1.0  # "auto" before it is resolved, or a structure without steps
    full = structure_options(structure) if isinstance(structure, str) else structure
    if not isinstance(full, MatrixFreeOptions):
        return kwargs, 1.0
    kwargs = {"structure": replace(full, **TRIAL_MATRIX_FREE), "max_samples": TRIAL_SAMPLES}
    key = {"cg": "cg_steps", "lanczos": "lanczos_steps"}.get(full.structure)
    if key is None:  # hutchinson: no steps
        return kwargs, 1.0
    return kwargs, getattr(full, key) / TRIAL_MATRIX_FREE[key]  # probes run as one block
