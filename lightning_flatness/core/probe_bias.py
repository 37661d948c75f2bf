"""Where the probe kernel's probes leave a bias the jackknife does not remove: the exact rows.

The probe kernel estimates the Fisher from s Rademacher probe rows per sample through the
output Fisher's square root, and the jackknife over probe groups removes the leading, 1/s
part of the soft rank's bias (docs/math.md, "The probe kernel"). What is left grows as the soft
rank approaches the number of probe rows m·s: on the paper's MLP trained at c = 0.01 (soft rank
0.23–0.33 of m·s at s = 4) the jackknifed estimate was 3.4–3.7% above the dense Fisher's, at
c = 1 on the CNN (0.16 of m·s) 0.8% (docs/RESULTS.md, "The probes' bias near m·s"). The C exact
rows of the output Fisher's square root have no such bias. Where the first measurement's soft
rank is at least :data:`PROBE_BIAS_SHARE` of its probe rows, the exact rows fit the formed
matrix's guards, and the batches can be read again, :func:`~lightning_flatness.measure` at its
default probes (the name ``"probe_kernel"``, or its options with ``probes`` and ``groups`` left
None) measures once more with them (C rows per sample, one group): on those models it costs one more
measurement of about the same size, and elsewhere nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.options import KernelOptions, StructureOptions

__all__ = ["PROBE_BIAS_SHARE", "exact_rows_options"]

#: the soft rank ÷ probe rows m·s from which the probe kernel measures again with the exact
#: rows: the jackknifed estimate was within 1% of the dense Fisher at 0.16 and 3.4–3.7% above
#: it at 0.23–0.33 (docs/RESULTS.md, "The probes' bias near m·s")
PROBE_BIAS_SHARE = 0.2


def exact_rows_options(
    options: StructureOptions,
    curvature: CurvatureEstimate,
    num_samples: int,
    num_parameters: int,
    batches: Iterable[Iterable | None],
) -> KernelOptions | None:
    """``options`` with the exact output rows (``probes`` = C, one group) where the probe
    kernel's ``curvature`` of ``num_samples`` samples may carry the probes' bias (module
    docstring), else None: another structure, already exact rows, a soft rank below
    :data:`PROBE_BIAS_SHARE` of the probe rows, exact rows past both formed guards
    (``C·m > max_kernel_size`` and ``P > max_parameters``; across processes ``m`` is every
    process's, whose rows are gathered for a formed kernel), or batches that a second pass
    cannot read (an iterator)."""
    if not isinstance(options, KernelOptions) or curvature.probe_rows is None:
        return None
    probes, outputs = curvature.probe_rows
    if probes >= outputs or num_samples < 1:
        return None
    if not curvature.summary.soft_rank >= PROBE_BIAS_SHARE * num_samples * probes:
        return None
    on_samples = outputs * num_samples <= options.max_kernel_size
    formed = on_samples or num_parameters <= options.max_parameters
    if not formed or any(isinstance(batch, Iterator) for batch in batches if batch is not None):
        return None
    return dataclasses.replace(options, probes=outputs, groups=1)
