"""What a sweep measures each of its ``structures`` with, from the config's ``measure`` section.

The section gives each structure's options by its name, as the fields of that structure's
options object (:mod:`lightning_flatness.core.options`), and may give ``loss`` (the
:class:`~lightning_flatness.core.reading.BatchReading` of every measurement), ``max_samples``
and ``max_val_samples`` (keywords of :func:`~lightning_flatness.core.measure`)::

    measure:
      lanczos: {probes: 5, lanczos_steps: 50}
      hutchinson: {probes: 5}
      kfac_sampled: {mc_samples: 4}

A structure the section does not name is measured with its defaults. A pseudo-structure
(:data:`VARIANTS`) is measured as its structure with its own options on top of those the
section gives it; ``exact`` with those given under ``dense`` or ``gram``, whichever it measures.
Each options object is built when the config is read, so a bad key fails there, named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_flatness.core.checks import check_count
from lightning_flatness.core.options import ALL_STRUCTURES, StructureOptions, structure_options
from lightning_flatness.core.reading import BatchReading

__all__ = [
    "EXACT",
    "KEYWORDS",
    "MONITOR_DEFAULT",
    "VARIANTS",
    "check_measure",
    "measure_arguments",
]

#: Pseudo-structure: ``"dense"`` or ``"gram"``, whichever matrix is smaller for the run.
EXACT = "exact"
#: Pseudo-structure: the structure and options ``FlatnessMonitor`` measures with by default.
MONITOR_DEFAULT = "probe_kernel"
#: pseudo-structure → (structure, the fields of its options object that the pseudo-structure
#: sets, over those the sweep's ``measure`` section gives it)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kfac_sampled": ("kfac", {"kfac_mode": "sampled", "trace_estimator": "sampled"}),
    "kfac_probe": ("kfac", {"kfac_mode": "probe", "trace_estimator": "probe"}),
    MONITOR_DEFAULT: ("probe_kernel", {"trace_estimator": "probe"}),
}
#: keywords of ``measure()`` the section may give besides the structures' options
KEYWORDS = ("max_samples", "max_val_samples")
#: the names the section gives options under
_NAMED = tuple(dict.fromkeys((*ALL_STRUCTURES, *VARIANTS)))


def _options(name: str, measured: str, measure: Mapping[str, Any]) -> StructureOptions:
    """The options object of the sweep's structure ``name`` measured as ``measured``."""
    _, own = VARIANTS.get(name, (name, {}))
    given = measure.get(measured if name == EXACT else name) or {}
    return structure_options(measured, {**given, **own})


def check_measure(measure: Mapping[str, Any]) -> None:
    """Build every options object and reading the ``measure`` section gives.

    Raises:
        ValueError: a key that is neither a structure, ``loss`` nor one of :data:`KEYWORDS`
            (naming the form the options take), or a bad option or value (naming it).
    """
    for key, value in measure.items():
        if key in KEYWORDS:
            check_count(f"measure.{key}", value, allow_none=True)
        elif key == "loss":
            BatchReading(loss=value)
        elif key in _NAMED:
            if not isinstance(value, Mapping):
                raise ValueError(
                    f"measure.{key} must be a mapping of the fields of {key}'s options object, "
                    f"e.g. {{probes: 5}}; got {value!r}."
                )
            _options(key, VARIANTS.get(key, (key,))[0], measure)
        else:
            raise ValueError(
                f"Unknown key measure.{key}. The section maps a structure's name "
                f"({', '.join(_NAMED)}) to the fields of its options object (e.g. "
                "`lanczos: {probes: 5, lanczos_steps: 50}`), and may give loss, "
                f"{' and '.join(KEYWORDS)}; measure()'s loose option keywords (kfac_mode, "
                "matrix_free_options, ...) no longer exist."
            )


def measure_arguments(name: str, measured: str, measure: Mapping[str, Any]) -> dict[str, Any]:
    """``measure()``'s keyword arguments for the sweep's structure ``name``, measured as
    ``measured`` (``dense`` or ``gram`` for ``exact``, the structure of a pseudo-structure):
    its options object as ``structure=``, the section's ``loss`` as ``reading=`` and its
    :data:`KEYWORDS`."""
    arguments: dict[str, Any] = {"structure": _options(name, measured, measure)}
    arguments.update({key: measure[key] for key in KEYWORDS if key in measure})
    if "loss" in measure:
        arguments["reading"] = BatchReading(loss=measure["loss"])
    return arguments
