"""Per-group weight decay: the soft rank ``Tr(F(F+D)⁻¹)`` with ``D = diag(λ_j)``.

Optimizers usually decay some parameter groups and not others (no decay on biases and norm
weights, as Hugging Face and timm scripts do). The objective is then
``mean loss + ½ Σ_j λ_j‖θ_j‖²``, its Hessian at a minimum is ``F + D`` and the soft rank is
``Tr(F(F+D)⁻¹)`` (docs/math.md, "Per-group weight decay"). With ``S = D^{-1/2}``,

    Tr(F(F+D)⁻¹) = Tr(F̃(F̃+I)⁻¹),   F̃ = S F S,

the soft rank at λ = 1 of the Fisher whose per-sample gradient rows are scaled by
``λ_j^{-1/2}`` — the Fisher of the model in the coordinates ``φ_j = √λ_j θ_j``. So every
layer-hook structure (and BackPACK's ``dense`` and ``gram``) measures it by scaling its rows
(its Kronecker ``G`` factors, blocks and diagonals by ``1/λ_j``) and estimating at λ = 1;
rank⁽²⁾ and the log-det ``½ log det(I + F D⁻¹)`` follow the same way. ``cg`` solves
``(F + D) x = w`` directly (``Tr(F(F+D)⁻¹) = E wᵀ(F+D)⁻¹w`` for E wwᵀ = F), preconditioned
per weight by ``(G ⊗ A + λ_j I)⁻¹``.

A trainable group without decay (λ_j = 0) counts each Fisher direction it carries (the limit
λ_j → 0); it is measured at ``λ_j = ZERO_DECAY_FRACTION × (the smallest positive λ)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = [
    "ZERO_DECAY_FRACTION",
    "ParameterDecay",
    "resolve_decay",
]

#: a trainable group without decay is measured at this fraction of the smallest positive λ
ZERO_DECAY_FRACTION = 1e-6


class ParameterDecay:
    """``λ_j`` of each measured parameter (by its name in ``model.named_parameters()``).

    Args:
        decays: ``{parameter name: λ ≥ 0}``, at least one positive.
    """

    def __init__(self, decays: Mapping[str, float]) -> None:
        values = {name: float(value) for name, value in decays.items()}
        bad = {n: v for n, v in values.items() if not (math.isfinite(v) and v >= 0.0)}
        if bad:
            raise ValueError(
                f"Per-parameter weight decays must be finite and ≥ 0; got {bad}. Pass the "
                "coupled L2 decay of each parameter group (0 for groups without decay)."
            )
        positive = [v for v in values.values() if v > 0]
        if not positive:
            raise ValueError(
                "Every parameter group has weight_decay 0: the soft rank needs λ > 0 on at "
                "least one group (with λ = 0 everywhere it is the plain rank of F). Pass lam=... "
                "with the coupled L2 weight decay of your objective."
            )
        self.decays = values
        floor = ZERO_DECAY_FRACTION * min(positive)
        self.effective = {n: (v if v > 0 else floor) for n, v in values.items()}

    @property
    def representative(self) -> float:
        """The largest λ_j: the report's ``lam`` (the decay of the decayed groups in the usual
        decay / no-decay split)."""
        return max(self.decays.values())

    def describe(self) -> str:
        """The groups, e.g. ``λ = 0.01 on 12 parameters, 0 on 8``."""
        counts: dict[float, int] = {}
        for value in self.decays.values():
            counts[value] = counts.get(value, 0) + 1
        parts = [f"{value:g} on {count}" for value, count in sorted(counts.items(), reverse=True)]
        return "λ = " + ", ".join(parts) + " parameter tensors"

    def of(self, name: str) -> float:
        """``λ_j`` as measured for the parameter ``name`` (a zero-decay group at its floor; a
        measured parameter missing here: λ_max)."""
        return self.effective.get(name, self.representative)

    def scale(self, name: str) -> float:
        """``1/λ_j`` for the parameter ``name`` (:meth:`of`)."""
        return 1.0 / self.of(name)

    def diagonal(self, names: list[str], sizes: list[int]) -> Tensor:
        """``D``: ``λ_j`` (:meth:`of`) for every entry of a flat vector of the parameters
        ``names`` (with ``sizes`` entries each), float64."""
        return torch.cat(
            [
                torch.full((size,), self.of(name), dtype=torch.float64)
                for name, size in zip(names, sizes, strict=True)
            ]
        )

    def objective_diagonal(self, names: list[str], sizes: list[int]) -> Tensor:
        """The objective's own ``λ_j`` (0 on a group without decay, not its measured floor;
        a measured parameter missing here: λ_max) for every entry of such a flat vector,
        float64: the decay term ``D θ`` of the objective's gradient."""
        return torch.cat(
            [
                torch.full((size,), self.decays.get(name, self.representative), dtype=torch.float64)
                for name, size in zip(names, sizes, strict=True)
            ]
        )

    def column_scale(self, names: list[str], sizes: list[int]) -> Tensor:
        """``D^{-1/2}``: ``λ_j^{-1/2}`` for every entry of such a flat vector, float64."""
        return self.diagonal(names, sizes).rsqrt()

    def scale_rows(self, name: str, rows: Tensor) -> Tensor:
        """Per-sample gradient rows of ``name`` scaled by ``λ_j^{-1/2}``."""
        return rows * math.sqrt(self.scale(name))


def resolve_decay(lam: float | Mapping[str, float]) -> float | ParameterDecay:
    """``lam`` as one λ, or a :class:`ParameterDecay` when the decays differ between
    parameters (a mapping whose values all agree is one λ)."""
    if not isinstance(lam, Mapping):
        return lam
    values = {float(v) for v in lam.values()}
    if len(values) == 1:
        return values.pop()
    return ParameterDecay(lam)
