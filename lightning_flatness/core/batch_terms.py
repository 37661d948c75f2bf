"""What one batch adds to the sums over samples of the layer-hook structures, from the
per-sample gradients of K cotangent rows (:mod:`lightning_flatness.core.hooked_pass`).

Row 0 is the residual of the true labels (``Σ_i ‖g_i‖²`` → ``Tr(C)``); the rows of
:attr:`FisherRows.trace` give ``Tr(F)`` and those of :attr:`FisherRows.curvature` the structure:
Kronecker factors of each linear map's weight, the exact Fisher block of each bias, the
diagonal of everything else (docs/math.md, "Kronecker factors from layer hooks"); with
``structure="diag"`` the exact diagonal of every parameter and the diagonal of C, with
``structure="rows"`` the per-sample gradients of the Fisher rows themselves and the summed
gradient of the true labels (for the Newton decrement, docs/math.md, "The Newton decrement").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.layer_rules import KroneckerRule, Rule
from lightning_flatness.core.linear_map_terms import (
    explicit_gradients_cheaper,
    kronecker_factors,
    weight_batch_gradient,
    weight_rows,
    weight_square_sums,
    weight_squared_norms,
)
from lightning_flatness.core.module_rules import LocalRule

__all__ = [
    "BatchTerms",
    "FisherRows",
    "add_bias",
    "add_explicit",
    "add_rule",
    "add_weight",
    "scale_terms",
]


@dataclass
class BatchTerms:
    """What one batch adds to the sums over samples (all float64).

    Attributes:
        grad_norm_sq: ``Σ_i ‖g_i‖²`` of the true-label gradients (→ Tr(C)).
        fisher_trace: ``Σ_i Tr(J_iᵀ Λ_i J_i)`` (exact, or unbiased with sampled rows).
        kronecker: ``{weight: (Σ_i G_i, Σ_i A_i)}`` (A a vector of counts for embeddings).
        blocks: ``{bias: Σ_i Σ_rows b bᵀ}``, the exact Fisher block of each bias.
        diagonal: ``{parameter: Σ_i Σ_rows g ∘ g}`` for everything else (for every
            parameter with ``structure="diag"``).
        cov_diagonal: ``{parameter: Σ_i g_i ∘ g_i}`` of the true-label gradients (the
            diagonal of C, for the diagonal TIC; ``structure="diag"`` only).
        rows: ``{parameter: (K', N, numel)}``, the per-sample gradients of the K' Fisher rows
            themselves, in the model's dtype (``structure="rows"`` only).
        gradient: ``{parameter: Σ_i g_i}`` flat, the summed true-label gradients of the batch
            (the gradient of its summed NLL; ``structure="rows"`` only).
        bias_factors: ``{bias: (weight, 1.0)}`` for a bias whose exact block is its weight's
            ``G`` factor (:func:`add_bias`), which is then not formed twice; the multiplier
            (1.0 here) becomes ``λ_weight/λ_bias`` when the terms are scaled by per-parameter
            decays.
    """

    grad_norm_sq: float = 0.0
    fisher_trace: float = 0.0
    kronecker: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    blocks: dict[str, Tensor] = field(default_factory=dict)
    diagonal: dict[str, Tensor] = field(default_factory=dict)
    cov_diagonal: dict[str, Tensor] = field(default_factory=dict)
    rows: dict[str, Tensor] = field(default_factory=dict)
    gradient: dict[str, Tensor] = field(default_factory=dict)
    bias_factors: dict[str, tuple[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class FisherRows:
    """Which cotangent rows are the Fisher rows of the curvature and of the trace."""

    curvature: slice | None  # the rows of the Kronecker factors, exact blocks and diagonals
    trace: slice  # the rows of Tr(F)

    @property
    def norms(self) -> list[int]:
        """The rows whose per-sample squared norms are needed: residual (0), then trace."""
        return [0, *range(self.trace.start, self.trace.stop)]


def _f64(value: Tensor) -> Tensor:
    return value.detach().to(torch.float64)


def add_rule(
    terms: BatchTerms,
    rule: Rule,
    grads: list[Tensor],
    rows: FisherRows,
    curvature: bool,
    structure: str,
) -> None:
    """Add the parameters of one layer rule from its calls' output gradients ``grads``: its
    linear maps' weights (:func:`add_weight`) and biases, or its own per-sample gradients."""
    if isinstance(rule, LocalRule) and rule.factored:
        maps = rule.linear_maps(grads)
        if maps is not None:
            weights = {
                rule.factored[attr][0]: name
                for attr, name in rule.names.items()
                if rule.factored[attr][1] != "bias"
            }
            for attr, name in rule.names.items():
                weight, kind = rule.factored[attr]
                a, s = maps[weight]
                if kind == "bias":
                    add_bias(terms, name, s, weights.get(weight), rows, curvature, structure)
                else:
                    add_weight(terms, name, a, s, rows, curvature, structure)
            return
    if not isinstance(rule, KroneckerRule):
        add_explicit(terms, rule.per_sample_gradients(grads), rows, curvature, structure)
        return
    s = rule.output_gradients(grads)
    # a convolution whose input factor comes from overlaps and whose norms come from grouped
    # weight gradients needs no unfolded patches
    grouped = structure == "kfac" and rule.grouped_norms
    a = None if grouped else rule.patches()
    for attr, name in rule.names.items():
        if attr != "weight":
            s_bias = rule.bias_output_gradients(grads, s)
            # its block is the weight's G only where both have the same positions
            weight = rule.names.get("weight") if s_bias is s else None
            add_bias(terms, name, s_bias, weight, rows, curvature, structure)
        else:
            norms = rule.convolution_squared_norms(grads, rows.norms) if grouped else None
            add_weight(terms, name, a, s, rows, curvature, structure, rule, norms)


def add_bias(
    terms: BatchTerms,
    name: str,
    s: Tensor,
    weight: str | None,
    rows: FisherRows,
    curvature: bool,
    structure: str,
) -> None:
    """Add the bias ``name`` of a linear map from its output gradients ``s`` (K, N, T, o):
    per-sample gradients ``Σ_t s_t``, an exact block (a diagonal with ``structure="diag"``).

    With one position per sample (T = 1) and the map's weight ``weight`` Kronecker-factored,
    the bias's block ``Σ_i Σ_rows s sᵀ`` is exactly that weight's ``G`` factor: it is recorded
    as such in :attr:`BatchTerms.bias_factors` instead of being formed per batch and
    eigendecomposed a second time (at a thousand classes, a 1,000 × 1,000 matrix each)."""
    same_as_factor = structure == "kfac" and curvature and weight is not None
    if same_as_factor and s.shape[2] == 1:
        add_explicit(terms, {name: s[:, :, 0]}, rows, False, structure)
        terms.bias_factors[name] = (weight, 1.0)
        return
    block = structure != "diag"
    add_explicit(terms, {name: s.sum(2)}, rows, curvature, structure, block=block)


def add_weight(
    terms: BatchTerms,
    name: str,
    a: Tensor | None,
    s: Tensor,
    rows: FisherRows,
    curvature: bool,
    structure: str,
    rule: KroneckerRule | None = None,
    norms: Tensor | None = None,
) -> None:
    """Add a linear map's weight from its patches ``a`` (N, T, d) and output gradients
    ``s`` (K, N, T, o): norms, traces, and its rows, diagonal or Kronecker factors. A
    :class:`KroneckerRule` gives the layout (an embedding, a weight stored (in, out));
    without one the weight is (o, d). ``norms``, the per-sample gradients' squared norms of
    the rows :attr:`FisherRows.norms` summed over samples, when they are known already (a
    convolution's under ``kfac`` with its input factor from overlaps, which then has no
    patches: ``a`` is None)."""
    embedding = rule is not None and rule.is_embedding
    shape = rule.weight_shape if rule is not None else torch.Size((s.shape[-1], a.shape[-1]))
    found = None
    if norms is None and curvature and structure == "rows" and _rows_give_norms(a, s, embedding):
        # every row's per-sample gradients at once: the norms and the curvature's rows from
        # one product, not two (the probe kernel's rows of a convolution over many positions)
        wanted = sorted({*rows.norms, *range(rows.curvature.start, rows.curvature.stop)})
        every = weight_rows(a, s[wanted], embedding, shape).detach()
        norms = torch.linalg.vecdot(every, every).sum(1)[[wanted.index(k) for k in rows.norms]]
        first = wanted.index(rows.curvature.start)  # the curvature's rows are consecutive
        found = every[first : first + rows.curvature.stop - rows.curvature.start]
    if norms is None:
        norms = weight_squared_norms(a, s[rows.norms], embedding)
    terms.grad_norm_sq += float(norms[0])
    terms.fisher_trace += float(norms[1:].sum())
    if not curvature:
        return
    layout = rule.to_weight_layout if rule is not None else (lambda values: values)
    if structure == "rows":
        if found is None:
            found = weight_rows(a, s[rows.curvature], embedding, shape).detach()
        if rule is not None and rule.transposed:
            found = layout(found.unflatten(-1, shape)).flatten(2)
        terms.rows[name] = found
        summed = weight_batch_gradient(a, s[0], embedding, shape)
        terms.gradient[name] = _f64(layout(summed)).reshape(-1)
    elif structure == "diag":
        chosen = [0, *range(rows.curvature.start, rows.curvature.stop)]
        squares = layout(weight_square_sums(a, s[chosen], embedding, shape[0]))
        terms.cov_diagonal[name] = _f64(squares[0])
        terms.diagonal[name] = _f64(squares[1:].sum(0))
    else:
        from_overlaps = rule.input_factor() if rule is not None else None
        g, factor = kronecker_factors(a, s[rows.curvature], embedding, shape[0], from_overlaps)
        terms.kronecker[name] = (_f64(g), _f64(factor))


def _rows_give_norms(a: Tensor | None, s: Tensor, embedding: bool) -> bool:
    """Whether the squared norms are best read off the explicit per-sample gradients that the
    ``"rows"`` structure forms anyway: a map over several positions where
    :func:`weight_squared_norms` would form them too (not the position Gram matrices)."""
    if a is None or embedding or s.shape[2] == 1:
        return False
    return explicit_gradients_cheaper(s.shape[-1], a.shape[-1], s.shape[2])


def add_explicit(
    terms: BatchTerms,
    per_sample: dict[str, Tensor],
    rows: FisherRows,
    curvature: bool,
    structure: str,
    block: bool = False,
) -> None:
    """Add per-sample gradients ``(K, N, *shape)``: norms, traces, diagonal or block."""
    for name, grads in per_sample.items():
        flat = grads.reshape(grads.shape[0], grads.shape[1], -1)
        terms.grad_norm_sq += float(flat[0].square().sum())
        terms.fisher_trace += float(flat[rows.trace].square().sum())
        if not curvature:
            continue
        if structure == "rows":
            terms.rows[name] = flat[rows.curvature].detach()
            terms.gradient[name] = _f64(flat[0].sum(0))
            continue
        fisher_rows = flat[rows.curvature].reshape(-1, flat.shape[-1])
        if structure == "diag":
            terms.cov_diagonal[name] = _f64(flat[0].square().sum(0))
        if block:
            terms.blocks[name] = _f64(fisher_rows.T @ fisher_rows)
        else:
            terms.diagonal[name] = _f64(fisher_rows.square().sum(0))


def scale_terms(terms: BatchTerms, decay: ParameterDecay | None) -> BatchTerms:
    """``terms`` scaled, in place, to those of ``D^{-1/2} F D^{-1/2}`` (per-group decay,
    :mod:`~lightning_flatness.core.decay`): rows by ``λ_j^{-1/2}``, blocks, diagonals and the
    Kronecker ``G`` factor by ``1/λ_j`` (and the diagonal of C alike, so the diagonal TIC
    ``Σ C_kk/(F_kk + λ_k)`` is unchanged); as they are without ``decay``. The true-label
    ``gradient`` is left as it is."""
    if decay is None:
        return terms
    for name, rows in terms.rows.items():
        terms.rows[name] = decay.scale_rows(name, rows)
    for name, (g, a) in terms.kronecker.items():
        terms.kronecker[name] = (g * decay.scale(name), a)
    for name, (weight, multiplier) in terms.bias_factors.items():
        terms.bias_factors[name] = (weight, multiplier * decay.scale(name) / decay.scale(weight))
    for table in (terms.blocks, terms.diagonal, terms.cov_diagonal):
        for name, value in table.items():
            table[name] = value * decay.scale(name)
    return terms
