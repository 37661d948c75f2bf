"""``structure="cg"``: Hutchinson's estimate of ``Tr((F+λI)⁻¹F)`` with preconditioned conjugate
gradients on exact Fisher-vector products — the matrix-free soft rank for any model size.

The probe is the Eq. 2 gradient of the Hutchinson-Fisher paper, ``w = Ṽᵀξ = (1/√m) Σ_i V_iᵀ ξ_i``
(ξ Rademacher on every sample's outputs, one backward pass over the data), so ``E wwᵀ = F`` and

    rank_λ(F) = Tr((F+λI)⁻¹ F) = E_ξ wᵀ (F+λI)⁻¹ w

(docs/math.md, "The matrix-free soft rank"). The probes' solves ``(F+λI) x_k = w_k`` run block
conjugate gradients on products ``F v = (1/m) Σ_i J_iᵀ Λ_i J_i v`` over every measured sample (one
pass over the data per iteration, all probes at once, sharing one search space: at equal
products they converge several times faster than independent solves), preconditioned by the
damped Kronecker factors of the layer hooks, ``(G ⊗ A + λI)⁻¹`` per weight, the exact block of
each bias and the diagonal of everything else. Started at x = 0, every iterate ``w_kᵀx_k`` is a
lower bound of ``w_kᵀ(F+λI)⁻¹w_k`` that rises with the steps, and since ``F + λI ⪰ λI`` the rest
is at most ``‖r_k‖²/λ`` (``r_k = w_k − (F+λI)x_k``): the iteration stops when that bound, summed
over the probes, is below ``tol`` times the estimate, or after ``max_steps``. The reported soft
rank is the mean of the probes' values, with the standard error over probes and the remaining
bound of the solves (``blocks["cg_gap"]``). Given the objective's gradient g (the accumulator's
``gradient``), one more solve in the same block gives the Newton decrement ``½ gᵀ(F+λI)⁻¹g``
(:func:`hutchinson_cg`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.curvature.fisher_products import ParameterSpaceFisher
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.functional_stats import FunctionalModel
from lightning_flatness.core.progress import progress
from lightning_flatness.core.spectral import SpectralSummary, check_lam

__all__ = ["CGFisher", "KroneckerPreconditioner", "conjugate_gradients", "hutchinson_cg"]

MatMat = Callable[[Tensor], Tensor]

#: a search direction whose squared length, after the others are projected out, is below this
#: share of the largest is dropped from the block
RANK_TOLERANCE = 1e-12


class KroneckerPreconditioner:
    """``(F̃ + λI)⁻¹`` for the block-diagonal Kronecker approximation ``F̃`` of the layer hooks,
    applied to a block of flat parameter vectors (K, P).

    Each Kronecker weight of shape (o, d) (a convolution's (o, c, k, k) as (o, c·k·k)) gets
    ``(G ⊗ A + λI)⁻¹ v = Q_G [(Q_Gᵀ V Q_A) / (g_i a_j + λ)] Q_Aᵀ`` from the eigenpairs of its
    factors (an embedding's token counts are a diagonal A on the rows); each bias its exact
    block's ``(B + λI)⁻¹``; everything else ``1/(d + λ)`` of its exact diagonal.

    Args:
        kfac: the summed Kronecker factors, bias blocks and diagonals.
        names, shapes: the flat vector's parameters, in order.
        num_samples: m, the samples the sums are over.
        lam: λ, or each parameter's λ_j (per-group decay: ``(G ⊗ A + λ_j I)⁻¹`` per weight).
        dtype: of the eigenvectors and the products (the factors are decomposed in float64):
            the model's, since PCG needs only an approximate inverse — for a float32 model half
            the time of float64 (a 1,000-class head's 1,000 × 1,000 factor dominates the cost).
        transposed: the Kronecker weights stored (in, out) (Hugging Face's ``Conv1D``), whose
            factors are those of the (out, in) map.
    """

    def __init__(
        self,
        kfac: KFACFisher,
        names: list[str],
        shapes: list[torch.Size],
        num_samples: int,
        lam: float | Mapping[str, float],
        dtype: torch.dtype = torch.float64,
        transposed: frozenset[str] = frozenset(),
    ) -> None:
        self.names, self.shapes = names, shapes
        self.transposed = transposed
        self.lams = {
            name: float(lam[name]) if isinstance(lam, Mapping) else float(lam) for name in names
        }
        self.dtype = dtype
        self.sizes = [math.prod(shape) for shape in shapes]
        self.parts: dict[str, tuple] = {}
        for name, (g, a) in kfac.kronecker.items():
            g_values, g_vectors = torch.linalg.eigh(g / num_samples)
            if a.dim() == 1:  # an embedding: token counts on the rows, G on the columns
                self.parts[name] = ("rows", (a / num_samples).clamp_min(0), g_values, g_vectors)
            else:
                a_values, a_vectors = torch.linalg.eigh(a / num_samples)
                parts = (g_values.clamp_min(0), g_vectors, a_values.clamp_min(0), a_vectors)
                self.parts[name] = ("kron", *parts)
        for name, block in kfac.blocks.items():
            values, vectors = torch.linalg.eigh(block / num_samples)
            self.parts[name] = ("block", values.clamp_min(0), vectors)
        for name, (weight, multiplier) in kfac.bias_factors.items():  # multiplier × its G
            _, g_values, g_vectors, *_ = self.parts[weight]
            self.parts[name] = ("block", multiplier * g_values, g_vectors)
        for name, diagonal in kfac.diagonal.items():
            self.parts[name] = ("diag", (diagonal / num_samples).clamp_min(0))
        for name, (kind, *tensors) in self.parts.items():
            self.parts[name] = (kind, *(t.to(dtype) for t in tensors))

    def __call__(self, vectors: Tensor) -> Tensor:
        out = torch.empty_like(vectors)
        pieces = vectors.split(self.sizes, dim=-1)
        outs = out.split(self.sizes, dim=-1)
        for name, shape, piece, target in zip(self.names, self.shapes, pieces, outs, strict=True):
            part = self.parts.get(name)
            lam = self.lams[name]
            v = piece.to(self.dtype)
            if part is None:  # not seen by the hooks: the plain damping
                result = v / lam
            elif part[0] == "kron":
                _, g, q_g, a, q_a = part
                flipped = name in self.transposed
                matrix = v.reshape(v.shape[0], shape[0], -1)
                matrix = matrix.transpose(1, 2) if flipped else matrix
                rotated = q_g.T @ matrix @ q_a
                rotated = rotated / (torch.outer(g, a) + lam)
                result = q_g @ rotated @ q_a.T
                result = (result.transpose(1, 2) if flipped else result).reshape(v.shape)
            elif part[0] == "rows":
                _, counts, g, q_g = part
                matrix = v.reshape(v.shape[0], shape[0], -1)
                rotated = matrix @ q_g / (torch.outer(counts, g) + lam)
                result = (rotated @ q_g.T).reshape(v.shape)
            elif part[0] == "block":
                _, values, q = part
                result = ((v @ q) / (values + lam)) @ q.T
            else:
                result = v / (part[1] + lam)
            target.copy_(result.to(vectors.dtype))
        return out


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a.to(torch.float64) * b.to(torch.float64)).sum(-1)


def _orthonormal_rows(block: Tensor) -> Tensor:
    """An orthonormal basis (rows) of the span of ``block``'s rows (k, P), k ≤ K: directions
    the others already (nearly) span are dropped, so a converged or repeated residual does not
    make the block's small systems singular."""
    gram = block @ block.T
    values, vectors = torch.linalg.eigh(gram)
    keep = values > RANK_TOLERANCE * values.max().clamp_min(1e-300)
    return (vectors[:, keep] / values[keep].sqrt()).T @ block


def conjugate_gradients(
    fisher: MatMat,
    rhs: Tensor,
    lam: float | Tensor,
    *,
    preconditioner: MatMat | None = None,
    max_steps: int,
    tol: float,
    stopping_rows: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Solve ``(F + λI) X = W`` for a block (K, P) of right-hand sides by block preconditioned
    conjugate gradients (O'Leary 1980): the K solves share one search space.

    Each step multiplies the Fisher with one block of at most K search directions (one pass over
    the data, like K independent solves) and every solve takes its best iterate from the whole
    block Krylov space ``span{M⁻¹R₀, (M⁻¹A) M⁻¹R₀, …}`` (A = F + λI, M the preconditioner), K
    times larger than its own. The directions are kept orthonormal and A-conjugate to the
    previous block; rows the others span are dropped (:func:`_orthonormal_rows`). Each iterate
    ``x_k`` is the A-orthogonal projection of ``A⁻¹w_k`` onto that space, so ``w_kᵀx_k`` is
    still a lower bound of ``w_kᵀA⁻¹w_k`` and the rest still ``r_kᵀA⁻¹r_k ≤ ‖r_k‖²/λ``.

    ``lam`` is λ, or the diagonal D (P,) of per-parameter decays: the system is then
    ``(F + D) X = W`` and the bound on what a solve misses uses the smallest λ_j.

    Returns:
        ``(values, gaps, steps)``: ``wᵀx`` of each solve (a lower bound of ``wᵀ(F+λI)⁻¹w``),
        the bound ``‖r‖²/λ`` on what each still misses, and the block products used. Stops when
        ``Σ gaps ≤ tol · Σ values`` over the first ``stopping_rows`` solves (all by default; the
        others share the search space without setting its length) or after ``max_steps``
        products.
    """
    apply = preconditioner or (lambda v: v)
    damping = lam.to(rhs) if isinstance(lam, Tensor) else lam
    smallest = float(lam.min()) if isinstance(lam, Tensor) else lam
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    directions = _orthonormal_rows(apply(r))
    values = torch.zeros(rhs.shape[0], dtype=torch.float64, device=rhs.device)
    gaps = _dot(r, r) / smallest
    steps = 0
    counted = slice(0, stopping_rows)
    while (
        steps < max_steps
        and directions.shape[0] > 0
        and float(gaps[counted].sum()) > tol * max(float(values[counted].sum()), 1e-300)
    ):
        product = fisher(directions) + damping * directions
        steps += 1
        progress("cg", steps, max_steps, "Fisher-vector products")
        curvature = directions @ product.T  # Pᵀ A P, (k, k), eigenvalues ≥ λ
        step = torch.linalg.solve(curvature, directions @ r.T)  # (k, K)
        x += step.T @ directions
        r -= step.T @ product
        values = _dot(rhs, x)
        gaps = _dot(r, r) / smallest
        z = apply(r)
        conjugation = torch.linalg.solve(curvature, product @ z.T)  # (PᵀAP)⁻¹ PᵀA Z
        directions = _orthonormal_rows(z - conjugation.T @ directions)
    return values, gaps, steps


def hutchinson_cg(
    fisher: MatMat,
    probes: Tensor,
    lam: float | Tensor,
    *,
    preconditioner: MatMat | None,
    max_steps: int,
    tol: float,
    gradient: Tensor | None = None,
) -> CurvatureEstimate:
    """The soft rank ``mean_k w_kᵀ(F+λI)⁻¹w_k`` over the probe rows ``w_k`` (K, P), with its
    standard error over probes (``blocks["stderr"]``) and the solves' remaining bound
    (``blocks["cg_gap"]``, in the soft rank's field; ``blocks["cg_steps"]`` the products).
    The other trace functions are not estimated (NaN). ``lam``: λ, or the diagonal D (P,) of
    per-parameter decays (the soft rank ``Tr(F(F+D)⁻¹)``).

    With the objective's ``gradient`` g, the Newton decrement ``½ gᵀ(F+λI)⁻¹g`` from one more
    solve in the same block (no pass over the data of its own; the probes' solves set the
    length): ``gᵀx`` is below the form and ``gᵀx + ‖r‖²/λ`` above it, so the decrement is half
    their midpoint and its standard error half their half-width."""
    if isinstance(lam, Tensor):
        check_lam(float(lam.min()))
    else:
        lam = check_lam(lam)
    count = probes.shape[0]
    finite = gradient is not None and bool(torch.isfinite(gradient).all())
    block = torch.cat([probes, gradient.to(probes)[None]]) if finite else probes
    values, gaps, steps = conjugate_gradients(
        fisher,
        block,
        lam,
        preconditioner=preconditioner,
        max_steps=max_steps,
        tol=tol,
        stopping_rows=count,
    )
    decrement = (math.nan, math.nan)
    if finite:
        decrement = (0.5 * float(values[count] + gaps[count] / 2), 0.25 * float(gaps[count]))
        values, gaps = values[:count], gaps[:count]
    mean = float(values.mean())
    spread = float(values.std() / math.sqrt(count)) if count > 1 else math.nan
    nan = math.nan
    summary = SpectralSummary(mean, nan, nan, nan, nan)
    return CurvatureEstimate(
        summary=summary,
        eigenvalues=torch.zeros(0, dtype=torch.float64),
        blocks={
            "stderr": SpectralSummary(spread, nan, nan, nan, nan),
            "cg_gap": SpectralSummary(float(gaps.mean()), nan, nan, nan, nan),
            "cg_steps": SpectralSummary(float(steps), nan, nan, nan, nan),
        },
        newton_decrement=decrement[0],
        newton_decrement_stderr=decrement[1],
    )


class CGFisher(CurvatureAccumulator):
    """``structure="cg"`` as an accumulator: :meth:`add` keeps each batch's inputs for the
    solves' passes and sums the preconditioner's Kronecker factors (the batch's layer-hook
    ``terms``; its only sums over batches); :meth:`estimate` draws the probes and solves
    (module docstring).

    Args:
        model: the functional view of the classifier (its parameters, in order, are the flat
            vector's).
        source: where :meth:`add` keeps each batch's inputs, re-iterable for the products
            ``F v`` over every sample (all processes;
            :mod:`~lightning_flatness.core.backends.kept_inputs`).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        probes: K, the probe rows ``w``.
        draw_sample_probes: ξ of a shape (K, m_local, C) on this process's samples.
        all_reduce: sums a tensor across processes in place, or None.
        preconditioned: sum the batches' Kronecker factors into the damped preconditioner
            (else none).
        max_steps, tol: the solves' budget and stopping share (:func:`conjugate_gradients`).
        decay: the per-group decays (a zero-decay group at its measured floor): the solves are
            then ``(F + D) x = w`` and the soft rank ``Tr(F(F+D)⁻¹)``; ``lam`` of
            :meth:`estimate` is ignored.
        transposed: the Kronecker weights stored (in, out) (:class:`KroneckerPreconditioner`).
    """

    name = "cg"

    def __init__(
        self,
        model: FunctionalModel,
        source,
        *,
        loss: str,
        probes: int,
        draw_sample_probes: Callable[[tuple[int, int, int]], Tensor],
        all_reduce: MatMat | None,
        preconditioned: bool,
        max_steps: int,
        tol: float,
        decay: ParameterDecay | None = None,
        transposed: frozenset[str] = frozenset(),
    ) -> None:
        self.model, self.source, self.loss, self.probes = model, source, loss, probes
        self.draw_sample_probes, self.all_reduce = draw_sample_probes, all_reduce
        self.decay, self.transposed = decay, transposed
        self.dtype = model.dtype
        self.names = model.names
        self.shapes = [model.params[name].shape for name in self.names]
        #: the preconditioner's running sums (unscaled: the decay damps each block instead)
        self.kfac = KFACFisher() if preconditioned else None
        self.max_steps, self.tol = max_steps, tol
        #: C, the number of outputs (known from the first batch)
        self.classes = 0

    def add(self, batch: CurvatureBatch) -> None:
        """Keep one batch's ``inputs``; add its ``terms`` to the preconditioner's factors."""
        self.source.add(batch.inputs)
        self.classes = batch.outputs
        if self.kfac is not None:
            self.kfac.add(batch)

    def summable_states(self) -> list[Tensor]:
        return self.kfac.summable_states() if self.kfac is not None else []

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        damping: float | Tensor = lam
        block_lams: float | Mapping[str, float] = lam
        if self.decay is not None:
            block_lams = {name: self.decay.of(name) for name in self.names}
            sizes = [math.prod(shape) for shape in self.shapes]
            damping = self.decay.diagonal(self.names, sizes)
        preconditioner = None
        if self.kfac is not None:
            preconditioner = KroneckerPreconditioner(
                self.kfac,
                self.names,
                self.shapes,
                num_samples,
                block_lams,
                self.dtype,
                transposed=self.transposed,
            )
        fisher = ParameterSpaceFisher(
            self.model, self.source, self.loss, num_samples, self.all_reduce
        )
        shape = (self.probes, self.source.num_samples, self.classes)
        probes = fisher.range_start(self.draw_sample_probes(shape)).to(torch.float64)
        if isinstance(damping, Tensor):
            damping = damping.to(probes.device)
        return hutchinson_cg(
            fisher,
            probes,
            damping,
            preconditioner=preconditioner,
            max_steps=self.max_steps,
            tol=self.tol,
            gradient=self.gradient,
        )
