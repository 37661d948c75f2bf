"""Kendall's rank correlation τ-b, the statistic of Table 4 of "Flatness After All?".

For paired observations ``(x_i, y_i)`` every pair ``i < j`` is *concordant* when
``x_i − x_j`` and ``y_i − y_j`` have the same sign and *discordant* when they have opposite
signs; a pair with ``x_i = x_j`` (or ``y_i = y_j``) is tied in ``x`` (or ``y``). With ``n₀`` the
number of pairs, ``n₁`` (``n₂``) the number of pairs tied in ``x`` (``y``), ``C`` and ``D`` the
concordant and discordant counts,

    τ_b = (C − D) / √((n₀ − n₁)(n₀ − n₂)),

which is the plain τ-a = (C − D)/n₀ when there are no ties. This is the variant
``scipy.stats.kendalltau`` computes by default; the implementation here needs only NumPy and
``O(n)`` memory (``O(n²)`` time, fine for the few thousand runs of a sweep).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["kendall_tau_b"]


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
    xs = np.asarray(x, dtype=np.float64).reshape(-1)
    ys = np.asarray(y, dtype=np.float64).reshape(-1)
    if xs.shape != ys.shape:
        raise ValueError(f"x and y must have the same length, got {xs.size} and {ys.size}.")
    keep = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[keep], ys[keep]
    count = int(xs.size)
    if count < 2:
        return math.nan, count
    score = 0  # C − D
    tied_x = tied_y = 0
    for i in range(count - 1):
        sign_x = np.sign(xs[i + 1 :] - xs[i])
        sign_y = np.sign(ys[i + 1 :] - ys[i])
        score += int(np.dot(sign_x, sign_y))
        tied_x += int(np.count_nonzero(sign_x == 0))
        tied_y += int(np.count_nonzero(sign_y == 0))
    pairs = count * (count - 1) // 2
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    if denominator == 0:
        return math.nan, count
    return score / denominator, count
