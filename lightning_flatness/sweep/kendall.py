"""Kendall's rank correlation τ-b, the statistic of Table 4 of "Flatness After All?".

For paired observations ``(x_i, y_i)`` every pair ``i < j`` is *concordant* when
``x_i − x_j`` and ``y_i − y_j`` have the same sign and *discordant* when they have opposite
signs; a pair with ``x_i = x_j`` (or ``y_i = y_j``) is tied in ``x`` (or ``y``). With ``n₀`` the
number of pairs, ``n₁`` (``n₂``) the number of pairs tied in ``x`` (``y``), ``C`` and ``D`` the
concordant and discordant counts,

    τ_b = (C − D) / √((n₀ − n₁)(n₀ − n₂)),

which is the plain τ-a = (C − D)/n₀ when there are no ties. This is the variant
``scipy.stats.kendalltau`` computes by default. The statistic is torchmetrics'
``kendall_rank_corrcoef(..., variant="b")``; what is this module's own is the sweep's
bookkeeping around it: pairs with a non-finite value left out, their count, NaN where τ is
undefined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torchmetrics.functional.regression import kendall_rank_corrcoef

__all__ = ["bootstrap_interval", "format_tau", "kendall_tau_b"]


def _finite_pairs(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(x_i, y_i)`` whose two values are finite, as two float64 arrays; a length
    mismatch is a ``ValueError``."""
    xs = np.asarray(x, dtype=np.float64).reshape(-1)
    ys = np.asarray(y, dtype=np.float64).reshape(-1)
    if xs.shape != ys.shape:
        raise ValueError(f"x and y must have the same length, got {xs.size} and {ys.size}.")
    keep = np.isfinite(xs) & np.isfinite(ys)
    return xs[keep], ys[keep]


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> tuple[float, int]:
    """Kendall's τ-b of the pairs ``(x_i, y_i)`` whose two values are both finite.

    Pairs with a NaN or infinite value on either side are left out (a failed measurement must
    not count as a rank).

    Args:
        x: First variable (e.g. a flatness measure per run).
        y: Second variable (e.g. the measured generalization gap per run), same length.

    Returns:
        ``(tau, count)``: τ-b in ``[-1, 1]`` and the number of pairs ``(x_i, y_i)`` used. ``tau``
        is NaN when fewer than two pairs remain or when one variable is constant.

    Raises:
        ValueError: If ``x`` and ``y`` differ in length.

    Example:
        >>> kendall_tau_b([1, 2, 3, 4, 5], [3, 1, 2, 5, 4])  # 7 concordant, 3 discordant
        (0.4, 5)
    """
    xs, ys = _finite_pairs(x, y)
    count = int(xs.size)
    if count < 2:
        return math.nan, count
    tau = kendall_rank_corrcoef(torch.from_numpy(xs), torch.from_numpy(ys), variant="b")
    return float(tau), count  # NaN when one variable is constant


def bootstrap_interval(
    x: Sequence[float],
    y: Sequence[float],
    level: float = 0.9,
    draws: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """A percentile bootstrap interval of :func:`kendall_tau_b` over the pairs ``(x_i, y_i)``.

    The pairs (runs) are drawn with replacement ``draws`` times from a generator seeded with
    ``seed``; the interval is the ``(1 − level)/2`` and ``(1 + level)/2`` quantiles of the
    resampled τ. Pairs with a non-finite value are left out first.

    Returns:
        ``(low, high)``; NaN for both when fewer than three finite pairs remain.

    Example:
        >>> low, high = bootstrap_interval(range(30), range(30))
        >>> (low, high)
        (1.0, 1.0)
    """
    xs, ys = _finite_pairs(x, y)
    if xs.size < 3:
        return math.nan, math.nan
    index = np.random.default_rng(seed).integers(0, xs.size, (xs.size, draws))
    # one call for all draws: torchmetrics takes each column as a variable of its own
    taus = kendall_rank_corrcoef(
        torch.from_numpy(xs[index]), torch.from_numpy(ys[index]), variant="b"
    ).numpy()
    taus = taus[np.isfinite(taus)]  # a draw of one repeated pair has no τ
    if not taus.size:
        return math.nan, math.nan
    low, high = np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def format_tau(tau: float | None) -> str:
    """``+0.84``-style, or ``—`` where τ is undefined (None or NaN)."""
    return "—" if tau is None or math.isnan(tau) else f"{tau:+.2f}"
