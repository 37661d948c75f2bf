"""A running estimate ``F̂`` of the training Fisher, kept as Kronecker factors per parameter.

The compositional penalty (:mod:`lightning_flatness.regularizer.compositional`) needs
``h'(F̂)`` for a matrix ``F̂`` that follows the whole-data Fisher ``F`` along training
(docs/math.md, "Compositional gradient of h(F)"). Like the KFAC optimizers, it keeps ``F̂``
block-diagonal over the parameters and each block Kronecker-factored, with the factors as
moving averages over the steps. The factors are read off the probe gradients the penalty
computes anyway, so keeping ``F̂`` costs no extra pass through the model.

For a parameter seen as an ``m × k`` matrix (its first axis against the others; a vector is
``m × 1``) and probe gradients ``U`` with ``E[vec U vec Uᵀ] = B · F_block`` (B samples):

    L = E[U Uᵀ]/B  (m × m),   R = E[Uᵀ U]/B  (k × k),   t = E‖U‖²/B = Tr F_block,
    F̂_block = R ⊗ L / t.

``Tr F̂_block = Tr L · Tr R / t = t``: the trace is kept exactly, and when ``F_block`` is itself
a Kronecker product ``A ⊗ G`` (a linear layer seeing one input), ``F̂_block = A ⊗ G``. A side
longer than ``max_factor_dim`` keeps only its diagonal (as Shampoo does for large axes); a
block whose two sides are both that long keeps the elementwise diagonal ``E[U ⊙ U]/B``.
Eigenvalues of ``F̂_block`` are the products ``l_a r_b / t`` of the factors' eigenvalues.

The averages are bias-corrected exponential moving averages with decay ρ: after updates with
increments ``x_1 … x_s``, the factor is ``Σ_j ρ^(s−j) (1−ρ) x_j / (1 − ρ^s)``. As KFAC optimizers
do with their inverses, the eigen-decompositions are refreshed only every ``refresh_every``
updates (after updates 1, 2, 4, … until then), and the penalty uses the latest refreshed
spectrum in between: the factors move by a fraction ``1 − ρ`` per update, and an eigen-solver
call per factor per step would cost more than the model's own step on small layers. Under
``torch.distributed`` the increments are averaged over the processes before they are added, so
every rank holds the same ``F̂``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_flatness.core.checks import check_count

__all__ = ["KroneckerBlock", "RunningFisher", "check_decay"]


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """``(m, k)``: a parameter of ``shape`` seen as its first axis against the others (a
    vector is ``m × 1``, a scalar ``1 × 1``)."""
    rows = shape[0] if len(shape) else 1
    return rows, math.prod(shape[1:]) if len(shape) > 1 else 1


@dataclass
class _Side:
    """One Kronecker factor: a full matrix (``full``) or its diagonal."""

    full: bool
    sum: Tensor

    def eigen(self, weight: float) -> tuple[Tensor, Tensor | None]:
        """Eigenvalues (clamped at 0) and eigenvectors (None for a diagonal side)."""
        mean = self.sum / weight
        if not self.full:
            return mean.clamp_min(0.0), None
        values, vectors = torch.linalg.eigh(0.5 * (mean + mean.mT))
        return values.clamp_min(0.0), vectors


@dataclass
class KroneckerBlock:
    """The running factors of one parameter (see the module docstring).

    Attributes:
        shape: the parameter's shape.
        left: ``L`` (or its diagonal), the factor of the parameter's first axis.
        right: ``R`` (or its diagonal), the factor of the other axes; ``None`` for a block that
            keeps the elementwise diagonal.
        trace: ``t``, the running trace of the block (or the elementwise diagonal ``m × k`` when
            ``right`` is None).
    """

    shape: torch.Size
    left: _Side
    right: _Side | None
    trace: Tensor

    @property
    def rows(self) -> int:
        return matrix_shape(self.shape)[0]

    def as_matrix(self, gradient: Tensor) -> Tensor:
        """The parameter-shaped ``gradient`` (or a stack of them, leading axis) as ``m × k``."""
        extra = gradient.shape[: gradient.ndim - len(self.shape)]
        return gradient.reshape(*extra, self.rows, -1)

    def increments(self, probes: Tensor) -> list[Tensor]:
        """``(Σ U Uᵀ, Σ UᵀU, Σ ‖U‖²)`` over the probe gradients ``probes`` (K, m, k), in the
        gradients' dtype (they are added to the float64 factors, see :meth:`RunningFisher.update`).

        The K probes are laid side by side, so each side is one matrix product: ``Σ_k U_k U_kᵀ``
        is ``[U_1 … U_K][U_1 … U_K]ᵀ`` and ``Σ_k U_kᵀ U_k`` is the same with the probes stacked.
        """
        u = self.as_matrix(probes)
        if self.right is None:
            return [u.square().sum(0)]
        count, rows, cols = u.shape
        if self.left.full:
            side_by_side = u.transpose(0, 1).reshape(rows, count * cols)
            left = side_by_side @ side_by_side.mT
            trace = left.diagonal().sum()
        else:
            left = u.square().sum((0, 2))
            trace = left.sum()
        if self.right.full:
            stacked = u.reshape(count * rows, cols)
            right = stacked.mT @ stacked
        else:
            right = u.square().sum((0, 1))
        return [left, right, trace]

    def tensors(self) -> list[Tensor]:
        if self.right is None:
            return [self.trace]
        return [self.left.sum, self.right.sum, self.trace]

    def spectrum(self, weight: float) -> KroneckerSpectrum:
        """Eigenvalues and eigenvectors of this block of ``F̂`` (factors divided by ``weight``)."""
        if self.right is None:
            return KroneckerSpectrum((self.trace / weight).clamp_min(0.0), None, None)
        left, left_vectors = self.left.eigen(weight)
        right, right_vectors = self.right.eigen(weight)
        trace = float(self.trace) / weight
        values = torch.outer(left, right) / trace if trace > 0 else torch.outer(left, right) * 0
        return KroneckerSpectrum(values, left_vectors, right_vectors)


@dataclass
class KroneckerSpectrum:
    """``F̂_block = (Q_R ⊗ Q_L) diag(vec values) (Q_R ⊗ Q_L)ᵀ`` for an ``m × k`` parameter view.

    Attributes:
        values: the ``m × k`` eigenvalues (``values[a, b] = l_a r_b / t``).
        left / right: the eigenvectors ``Q_L`` (m × m) and ``Q_R`` (k × k); None for a
            diagonal side.
    """

    values: Tensor
    left: Tensor | None
    right: Tensor | None
    #: functions of the values already computed, keyed by what they depend on
    cache: dict[tuple, Tensor] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: tuple, compute: Callable[[Tensor], Tensor]) -> Tensor:
        """``compute(values)``, computed once per ``key`` (the spectrum is never modified)."""
        if key not in self.cache:
            self.cache[key] = compute(self.values)
        return self.cache[key]

    def _basis(self, side: str, like: Tensor) -> Tensor | None:
        """``Q_L`` or ``Q_R`` on ``like``'s device and in its dtype (converted once)."""
        vectors = getattr(self, side)
        if vectors is None or (vectors.device, vectors.dtype) == (like.device, like.dtype):
            return vectors
        key = ("basis", side, like.device, like.dtype)
        return self.cached(key, lambda _: vectors.to(like.device, like.dtype))

    def rotate(self, matrix: Tensor) -> Tensor:
        """``Q_Lᵀ U Q_R``: the coordinates of ``vec U`` in the eigenbasis of the block."""
        left, right = self._basis("left", matrix), self._basis("right", matrix)
        if left is not None:
            matrix = left.mT @ matrix
        if right is not None:
            matrix = matrix @ right
        return matrix

    def rotate_back(self, coordinates: Tensor) -> Tensor:
        """``Q_L M Q_Rᵀ``, the inverse of :meth:`rotate`."""
        left, right = self._basis("left", coordinates), self._basis("right", coordinates)
        if left is not None:
            coordinates = left @ coordinates
        if right is not None:
            coordinates = coordinates @ right.mT
        return coordinates


def check_decay(decay: object) -> float:
    """ρ as a float, if it is a number in [0, 1).

    Raises:
        ValueError: naming the value.
    """
    if not (isinstance(decay, (int, float)) and 0.0 <= float(decay) < 1.0):
        raise ValueError(
            f"decay must be in [0, 1) (ρ of the running Fisher's moving averages), got "
            f"decay={decay!r}."
        )
    return float(decay)


class RunningFisher:
    """Moving-average Kronecker factors of the Fisher of a set of parameters.

    Args:
        shapes: ``{parameter name: shape}`` of the parameters the estimate covers.
        decay: ρ ∈ [0, 1), the decay of the moving averages (0 keeps only the last update).
        max_factor_dim: sides longer than this keep only their diagonal.
        refresh_every: updates between eigen-decompositions of the factors.
        device: where the factors live: the model's device, so that a GPU fit does not copy
            each step's increments to the host. They are float64 on every device: they are
            moving averages of sums over batches whose small eigenvalues set the penalty's
            gradient (h'(μ) = λ/(μ+λ)² is largest at μ ≪ λ), and float32 round-off in
            averages of many updates shifts eigenvalues near λ by more than the penalty can
            tell apart.

    Raises:
        ValueError: for ρ outside [0, 1), ``max_factor_dim < 1`` or ``refresh_every < 1``.
    """

    def __init__(
        self,
        shapes: Mapping[str, torch.Size],
        *,
        decay: float = 0.95,
        max_factor_dim: int = 512,
        refresh_every: int = 10,
        device: torch.device | str | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.decay = check_decay(decay)
        self.max_factor_dim = check_count("max_factor_dim", max_factor_dim)
        self.refresh_every = check_count("refresh_every", refresh_every)
        #: the spectra the penalty uses, and the update count they were computed at
        self._spectra: dict[str, KroneckerSpectrum] = {}
        self.refreshed_at = 0
        self.blocks = {name: self._block(torch.Size(shape)) for name, shape in shapes.items()}
        #: Σ_j ρ^(s−j)(1−ρ) = 1 − ρ^s after s updates: the bias correction
        self.weight = 0.0
        self.updates = 0

    def _block(self, shape: torch.Size) -> KroneckerBlock:
        rows, cols = matrix_shape(shape)
        zeros = {"dtype": torch.float64, "device": self.device}
        # a side of length 1 is its own eigen-decomposition: kept as a "diagonal" of one entry
        left_full = 1 < rows <= self.max_factor_dim
        right_full = 1 < cols <= self.max_factor_dim
        if rows > self.max_factor_dim and cols > self.max_factor_dim:
            diagonal = torch.zeros(rows, cols, **zeros)
            return KroneckerBlock(shape, _Side(False, torch.zeros(rows, **zeros)), None, diagonal)
        left = torch.zeros((rows, rows) if left_full else (rows,), **zeros)
        right = torch.zeros((cols, cols) if right_full else (cols,), **zeros)
        return KroneckerBlock(
            shape, _Side(left_full, left), _Side(right_full, right), torch.zeros((), **zeros)
        )

    @property
    def is_empty(self) -> bool:
        return self.updates == 0

    def update(self, probe_gradients: Mapping[str, Tensor], batch_size: int) -> None:
        """Add one step's probe gradients: ``probe_gradients[name]`` is (K, *shape), K probes of
        ``Σ_{i∈b} V_iᵀ ξ_i`` over a batch of ``batch_size`` samples (detached)."""
        increments = {
            name: block.increments(probe_gradients[name].detach())
            for name, block in self.blocks.items()
        }
        _average_over_processes(increments)
        scale = 1.0 / (batch_size * len(next(iter(probe_gradients.values()))))
        keep = self.decay
        targets = [tensor for block in self.blocks.values() for tensor in block.tensors()]
        added = [increment for pieces in increments.values() for increment in pieces]
        # one call for all factors: F ← ρ F + (1 − ρ) · scale · increment (float64 targets)
        torch._foreach_mul_(targets, keep)
        torch._foreach_add_(
            targets,
            [a.to(t.device) for a, t in zip(added, targets, strict=True)],
            alpha=(1.0 - keep) * scale,
        )
        self.weight = keep * self.weight + (1.0 - keep)
        self.updates += 1

    def _due(self) -> bool:
        since = self.updates - self.refreshed_at
        return not self._spectra or since >= min(self.refresh_every, self.refreshed_at)

    def refresh(self) -> None:
        """Eigen-decompose the current factors now."""
        self._spectra = {name: block.spectrum(self.weight) for name, block in self.blocks.items()}
        self.refreshed_at = self.updates

    def spectra(self) -> Iterator[tuple[str, KroneckerSpectrum]]:
        """Each block's eigen-decomposition (see :class:`KroneckerSpectrum`), refreshed when
        ``refresh_every`` updates old (module docstring)."""
        if self.is_empty:
            raise RuntimeError("The running Fisher has no update yet.")
        if self._due():
            self.refresh()
        yield from self._spectra.items()

    def dense(self) -> Tensor:
        """``F̂`` as a dense float64 matrix over the parameters, flattened in their order (for
        tests on small models)."""
        pieces = []
        for name, spectrum in self.spectra():
            rows, cols = matrix_shape(self.blocks[name].shape)
            eye = torch.eye(rows * cols, dtype=torch.float64).reshape(rows * cols, rows, cols)
            coordinates = spectrum.rotate(eye).reshape(rows * cols, -1)  # rows: basis of vec U
            pieces.append(coordinates @ torch.diag(spectrum.values.reshape(-1)) @ coordinates.mT)
        return torch.block_diag(*pieces)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Tensor]:
        """The factors, the bias correction and the update count (tensors only)."""
        state = {
            "weight": torch.tensor(self.weight, dtype=torch.float64),
            "updates": torch.tensor(self.updates),
            "refreshed_at": torch.tensor(self.refreshed_at),
        }
        for name, block in self.blocks.items():
            for index, tensor in enumerate(block.tensors()):
                state[f"{name}/{index}"] = tensor.clone()
        for name, spectrum in self._spectra.items():
            for part in ("values", "left", "right"):
                tensor = getattr(spectrum, part)
                if tensor is not None:
                    state[f"spectrum:{name}:{part}"] = tensor.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` saved for the same parameters.

        Raises:
            ValueError: the state belongs to other parameters (names or shapes differ).
        """
        expected = {
            f"{name}/{index}": tensor.shape
            for name, block in self.blocks.items()
            for index, tensor in enumerate(block.tensors())
        }
        saved = {
            key: value.shape
            for key, value in state.items()
            if "/" in key and not key.startswith("spectrum:")
        }
        if saved != expected:
            missing = sorted(set(expected) - set(saved))[:3]
            extra = sorted(set(saved) - set(expected))[:3]
            raise ValueError(
                "The saved running Fisher belongs to other parameters (missing "
                f"{missing}, unexpected {extra}, or shapes differ); it cannot be restored "
                "into this model's penalty."
            )
        for name, block in self.blocks.items():
            for index, tensor in enumerate(block.tensors()):
                tensor.copy_(state[f"{name}/{index}"])
        self.weight = float(state["weight"])
        self.updates = int(state["updates"])
        self.refreshed_at = int(state.get("refreshed_at", 0))
        self._spectra = {}
        if f"spectrum:{next(iter(self.blocks), '')}:values" in state:
            self._spectra = {
                name: KroneckerSpectrum(
                    state[f"spectrum:{name}:values"].to(self.device, copy=True),
                    *(
                        state[key].to(self.device, copy=True) if key in state else None
                        for key in (f"spectrum:{name}:left", f"spectrum:{name}:right")
                    ),
                )
                for name in self.blocks
            }


def _average_over_processes(increments: dict[str, list[Tensor]]) -> None:
    """Average the increments over the processes of the default group (no-op without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    flat = [tensor for pieces in increments.values() for tensor in pieces]
    buffer = torch.cat([tensor.reshape(-1) for tensor in flat])
    device = buffer.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        buffer = buffer.cuda()
    dist.all_reduce(buffer)
    buffer = buffer.to(device) / dist.get_world_size()
    offset = 0
    for tensor in flat:
        tensor.copy_(buffer[offset : offset + tensor.numel()].reshape(tensor.shape))
        offset += tensor.numel()
