"""One forward and one backward per cotangent row, read by hooks on the layers: the backend of
``structure="kfac"`` for any differentiable model.

No graph conversion is needed: forward hooks on the modules that own parameters record their
inputs, and ordinary autograd differentiates K cotangents on the logits with respect to the
recorded layer outputs, one backward pass per cotangent through the graph of one forward pass,
through functional ops, residual connections, attention and anything else autograd follows.
The K rows are (docs/math.md, "The three matrices", "Kronecker factors from layer hooks"):

- the residual ``∂ℓ_i/∂z_i`` of the true labels (per-sample gradients → ``Tr(C)``);
- the rows of ``A_i`` with ``A_iᵀA_i = Λ_i`` (exact Fisher, ``kfac_mode="exact"``: C rows), or
  ``mc_samples`` scores of labels drawn from the model (``"sampled"``), or ``mc_samples``
  Rademacher probes through the square root, ``A_iᵀξ`` with ``ξ ∈ {±1}^C`` (``"probe"``, the
  Hutchinson estimate of Eq. 2 of the Hutchinson-Fisher paper), each divided by
  ``√mc_samples``; ``Σ_rows g gᵀ`` is then ``J_iᵀ Λ_i J_i`` exactly, or in expectation.
  Probes do not starve on over-confident samples, where a drawn label is almost always the
  predicted one and the rare other draws carry nearly all of the Fisher (docs/math.md,
  "Kronecker factors from layer hooks").

:mod:`lightning_flatness.core.layer_rules` and :mod:`lightning_flatness.core.module_rules` turn
inputs and output gradients into per-sample gradients (which rule covers what:
:mod:`lightning_flatness.core.rule_assignment`); a weight tied across layers of one type is one
Kronecker block whose calls are its positions. A parameter of shape ``(1, ...)`` that a module
with children uses (a class token, a positional embedding) is *tapped*: the forward pass uses N
stacked copies of it, and the gradient of copy i is sample i's. Whatever is left (a parameter
also used outside its module's ``forward``, shared by layers of different types) gets per-sample
gradients from ``torch.func`` (``vmap`` of a vector-Jacobian product of the whole model,
restricted to those parameters: the costly fallback, reported as "diagonal (whole model)").

Which parameters the rules and taps cover is decided once, on the first batch: with cotangents
on single samples, each rule's per-sample gradients must sum to autograd's gradient and their
squared norms to its squared norm (:meth:`HookedPass._check_coverage`); a parameter that fails
moves to the fallback, so the numbers are exact whatever the model does.

The user's model is used in eval mode with gradients that are never written to ``.grad``; the
hooks are removed when the pass is closed.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap

from lightning_flatness.core.batches import (
    Leaves,
    LogitsModule,
    num_samples,
    take_rows,
    unsqueeze_leaves,
)
from lightning_flatness.core.last_layer import last_layer
from lightning_flatness.core.layer_rules import (
    CHUNK_ELEMENTS,
    KroneckerRule,
    Rule,
    kronecker_factors,
    weight_batch_gradient,
    weight_rows,
    weight_square_sums,
    weight_squared_norms,
)
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.module_rules import LocalRule, RecurrentRule
from lightning_flatness.core.per_sample import map_samples
from lightning_flatness.core.positional import position_draws, position_signs
from lightning_flatness.core.rule_assignment import assign_rules, record_call

__all__ = ["COVERAGE", "BatchTerms", "HookedPass"]

#: the position-keyed stream (plus 2·seed, and 1 for the held-out split) of the sampled labels
SAMPLED_LABEL_STREAM = 2**43

#: how a parameter enters the block-diagonal Fisher; "diagonal (whole model)" is the exact
#: diagonal from per-sample backward passes through the whole model (the costly fallback)
COVERAGE = ("kronecker", "exact block", "diagonal", "diagonal (whole model)")


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
    """

    grad_norm_sq: float = 0.0
    fisher_trace: float = 0.0
    kronecker: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    blocks: dict[str, Tensor] = field(default_factory=dict)
    diagonal: dict[str, Tensor] = field(default_factory=dict)
    cov_diagonal: dict[str, Tensor] = field(default_factory=dict)
    rows: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rows:
    """Which cotangent rows are the Fisher rows of the curvature and of the trace."""

    curvature: slice | None  # the rows of the Kronecker factors, exact blocks and diagonals
    trace: slice  # the rows of Tr(F)

    @property
    def norms(self) -> list[int]:
        """The rows whose per-sample squared norms are needed: residual (0), then trace."""
        return [0, *range(self.trace.start, self.trace.stop)]


def _f64(value: Tensor) -> Tensor:
    return value.detach().to(torch.float64)


class HookedPass:
    """Hooks on a :class:`LogitsModule` that turn a batch into :class:`BatchTerms`.

    Args:
        model: the wrapped model (its parameters are read, never changed).
        likelihood: the output likelihood.
        kfac_mode: ``"exact"`` (C rows of ``A_i``), ``"sampled"`` (``mc_samples`` drawn labels)
            or ``"probe"`` (``mc_samples`` Rademacher probes ``A_iᵀξ``).
        trace_estimator: ``"exact"``, ``"sampled"`` or ``"probe"``: which of those rows give
            Tr(F).
        seed: draws each sample's probes and sampled labels from its position in the measured
            stream and this seed (:mod:`~lightning_flatness.core.positional`), so that they do
            not depend on the batch size or on how processes share the samples.
        shard: ``(rank, world_size)`` when this process measures the samples at positions
            ``rank, rank + world_size, …`` of the measured set (data parallelism): its local
            sample j is global position ``j·world_size + rank``, so every process draws the
            probes one process would draw for the same samples.
        structure: ``"kfac"`` (Kronecker weights, exact bias blocks, diagonals for the rest),
            ``"diag"`` (the exact diagonal of every parameter, and the diagonal of C) or
            ``"rows"`` (the per-sample gradients of the Fisher rows themselves, for the
            sample-space kernel).
    """

    def __init__(
        self,
        model: LogitsModule,
        likelihood: Likelihood,
        *,
        kfac_mode: str = "exact",
        mc_samples: int = 1,
        trace_estimator: str = "exact",
        structure: str = "kfac",
        seed: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        if structure not in ("kfac", "diag", "rows"):
            raise ValueError(f"structure must be 'kfac', 'diag' or 'rows', got {structure!r}.")
        self.diagonal_only = structure == "diag"
        self.rows_only = structure == "rows"
        self.model = model
        self.likelihood = likelihood
        self.kfac_mode = kfac_mode
        self.mc_samples = int(mc_samples)
        self.trace_estimator = trace_estimator
        self.seed = seed
        self.shard = shard or (0, 1)
        #: the local position of the next sample in each stream (training, validation)
        self.positions = {True: 0, False: 0}
        self.names, self.rules, self.fallback = assign_rules(model.model)
        params = dict(model.model.named_parameters())
        #: fallback parameters with a leading dimension of one (class tokens, positional
        #: embeddings), tried as per-sample copies ("taps") in the forward pass
        self.tapped = [n for n in self.fallback if params[n].dim() >= 2 and params[n].shape[0] == 1]
        self.fallback = [n for n in self.fallback if n not in self.tapped]
        self._taps: dict[str, Tensor] = {}
        if not self.names:
            raise ValueError(
                "The model has no trainable parameters; there is no Fisher to measure."
            )
        self.last_layer = last_layer(model.model)
        self._features: list[Tensor] = []
        self._recording = False
        #: the samples of the batch being recorded
        self._batch = 0
        self._checked = _apply_plan(self)
        by_module: dict[int, tuple[nn.Module, list[Rule]]] = {}
        for rule in self.rules:
            for module in rule.modules:
                by_module.setdefault(id(module), (module, []))[1].append(rule)
        self._handles = [
            module.register_forward_hook(self._hook(rules), with_kwargs=True)
            for module, rules in by_module.values()
        ]
        if self.last_layer is not None:
            self._handles.append(self.last_layer.register_forward_hook(self._feature_hook))

    def _hook(self, rules: list[Rule]):
        def record(module: nn.Module, args: tuple, kwargs: dict, output):
            if not self._recording:
                return None
            return record_call(rules, module, args, kwargs, output, self._batch)

        return record

    def _feature_hook(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self._recording:
            self._features.append(args[0].detach())

    def close(self) -> None:
        """Remove every hook; the model is as it was before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def coverage(self) -> dict[str, str]:
        """How each parameter is measured (one of :data:`COVERAGE`), in parameter order."""
        kinds = {}
        for rule in self.rules:
            for attr, name in rule.names.items():
                if isinstance(rule, KroneckerRule) and not self.diagonal_only:
                    kinds[name] = "kronecker" if attr == "weight" else "exact block"
                elif isinstance(rule, LocalRule) and rule.factored and not self.diagonal_only:
                    weight = rule.factored[attr][1] == "weight"
                    kinds[name] = "kronecker" if weight else "exact block"
                else:
                    kinds[name] = "diagonal"
        kinds.update({name: "diagonal" for name in self.tapped})
        kinds.update({name: "diagonal (whole model)" for name in self.fallback})
        return {name: kinds[name] for name in self.names if name in kinds}

    def transposed_weights(self) -> frozenset[str]:
        """The Kronecker weights stored (in, out) (Hugging Face's ``Conv1D``): their factors
        are those of the (out, in) map."""
        return frozenset(
            rule.names["weight"]
            for rule in self.rules
            if isinstance(rule, KroneckerRule) and rule.transposed and "weight" in rule.names
        )

    # -- one batch ---------------------------------------------------------------------------

    def _cotangents(self, logits: Tensor, targets: Tensor, curvature: bool) -> tuple[Tensor, _Rows]:
        """The K rows ``(K, N, C)``: residual, then exact, sampled and/or probe Fisher rows
        (only those of the trace when ``curvature`` is False)."""
        z = logits.detach().requires_grad_(True)
        with torch.enable_grad():
            (residual,) = torch.autograd.grad(self.likelihood.nll(z, targets).sum(), z)
        rows = [residual.unsqueeze(0)]
        exact = sampled = None
        factors = self.kfac_mode if curvature else None
        wanted = {factors, self.trace_estimator}
        # the square root A_i of the output Fisher, for the exact rows and the probes
        core = self.likelihood.output_core(logits.detach()) if {"exact", "probe"} & wanted else None
        if "exact" in (factors, self.trace_estimator):
            classes = logits.shape[1]
            identity = torch.eye(classes, dtype=logits.dtype, device=logits.device)
            rows.append(core.sqrt_transpose(identity.unsqueeze(1).expand(-1, z.shape[0], -1)))
            exact = slice(1, 1 + classes)
        rank, world_size = self.shard
        first = self.positions[curvature]
        positions = torch.arange(first, first + z.shape[0]) * world_size + rank
        if "sampled" in (factors, self.trace_estimator):
            start = sum(r.shape[0] for r in rows)
            scores = []
            likelihood = self.likelihood
            outputs = 1 if likelihood.noise_per_sample else z.shape[1]
            stream = SAMPLED_LABEL_STREAM + self.seed * 2 + int(not curvature)
            noise = position_draws(
                stream, positions, self.mc_samples, outputs, likelihood.noise_kind
            )
            if likelihood.noise_per_sample:  # one number per sample: (mc_samples, B)
                noise = noise.squeeze(-1)
            for index in range(self.mc_samples):
                draw = likelihood.draw_from(z.detach(), noise[index])
                with torch.enable_grad():
                    objective = self.likelihood.sampled_score(z, draw).sum()
                    (score,) = torch.autograd.grad(objective, z)
                scores.append(score / math.sqrt(self.mc_samples))
            rows.append(torch.stack(scores))
            sampled = slice(start, start + self.mc_samples)
        probe = None
        if "probe" in (factors, self.trace_estimator):
            start = sum(r.shape[0] for r in rows)
            stream = self.seed * 2 + int(not curvature)
            signs = position_signs(stream, positions, self.mc_samples, z.shape[1])
            signs = signs.to(device=z.device, dtype=z.dtype)
            rows.append(core.sqrt_transpose(signs) / math.sqrt(self.mc_samples))
            probe = slice(start, start + self.mc_samples)
        kinds = {"exact": exact, "sampled": sampled, "probe": probe}
        chosen = kinds[factors] if factors else None
        return torch.cat(rows).detach(), _Rows(chosen, kinds[self.trace_estimator])

    @contextmanager
    def _recorded(self) -> Iterator[None]:
        for rule in self.rules:
            rule.calls.clear()
        self._features.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def forward(self, inputs: Leaves) -> Tensor:
        """The logits of a batch, with every hooked layer's call recorded.

        Each tapped parameter ``p`` (shape ``(1, ...)``) is replaced by ``N`` copies stacked
        as ``(N, ...)``: a model that only broadcasts ``p`` over the batch computes the same
        logits, and the gradient of copy i is sample i's gradient (checked on the first batch).
        """
        with self._recorded():
            batch = self._batch = num_samples(inputs)
            if not self.tapped:
                return self.model(*inputs)
            params = dict(self.model.model.named_parameters())
            self._taps = {
                name: params[name].detach().expand(batch, *params[name].shape[1:]).clone()
                for name in self.tapped
            }
            for tap in self._taps.values():
                tap.requires_grad_(True)
            return self.model.call(self._taps, inputs)

    def features(self) -> Tensor | None:
        """The input of :attr:`last_layer` in the latest :meth:`forward` (its last call)."""
        return self._features[-1] if self._features else None

    def terms(self, logits: Tensor, targets: Tensor, inputs: Leaves, curvature: bool) -> BatchTerms:
        """The batch's :class:`BatchTerms` after :meth:`forward` gave ``logits``; with
        ``curvature=False`` only the two traces (validation data)."""
        cotangents, rows = self._cotangents(logits, targets, curvature)
        self.positions[curvature] += logits.shape[0]
        if not self._checked:
            self._check_coverage(logits, cotangents[0], inputs)
        outputs = self._recorded_outputs()
        taps = [self._taps[name] for name in self.tapped]
        grads = self._output_gradients(logits, list(outputs.values()) + taps, cotangents)
        by_output = dict(zip(outputs, grads[: len(outputs)], strict=True))
        terms = BatchTerms()
        tap_grads = dict(zip(self.tapped, grads[len(outputs) :], strict=True))
        self._add_explicit(terms, tap_grads, rows, curvature)
        for rule in self.rules:
            if rule.calls:
                rule_grads = [by_output[id(call.output)] for call in rule.calls]
                self._add_rule(terms, rule, rule_grads, rows, curvature)
        if self.fallback:
            fallback_grads = self._fallback_gradients(inputs, cotangents)
            self._add_explicit(terms, fallback_grads, rows, curvature)
        return terms

    def _check_taps(
        self,
        logits: Tensor,
        single: Tensor,
        samples: list[int],
        inputs: Leaves,
        tap_grads: list[Tensor],
    ) -> None:
        """Keep the tapped parameters whose copies give per-sample gradients (see
        :meth:`_check_coverage`); the others move to the ``torch.func`` fallback."""
        if not self.tapped:
            return
        params = dict(self.model.model.named_parameters())
        tolerance = 1e-4 if logits.dtype != torch.float64 else 1e-8
        plain = self.model(*inputs)
        same = torch.allclose(
            plain, logits, rtol=tolerance, atol=tolerance * float(logits.detach().abs().max())
        )
        truth = self._output_gradients(plain, [params[n] for n in self.tapped], single)
        kept = []
        for name, got, want in zip(self.tapped, tap_grads, truth, strict=True):
            good = same
            for row, sample in enumerate(samples):
                others = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
                others[sample] = False
                good = good and float(got[row][others].abs().sum()) == 0.0
                facts = (got[row].sum(0).reshape(want[row].shape), float(got[row].square().sum()))
                good = good and _agrees(want[row], facts, tolerance)
            (kept if good else self.fallback).append(name)
        order = {name: i for i, name in enumerate(self.names)}
        self.fallback.sort(key=order.__getitem__)
        self.tapped = kept

    def _recorded_outputs(self) -> dict[int, Tensor]:
        """Every recorded layer output once (a call can belong to two rules), by ``id``."""
        return {id(call.output): call.output for rule in self.rules for call in rule.calls}

    def _output_gradients(
        self,
        logits: Tensor,
        outputs: list[Tensor],
        cotangents: Tensor,
        retain_graph: bool = False,
    ) -> list[Tensor]:
        """``∂⟨u_k, z⟩/∂t`` for every tensor ``t`` of ``outputs`` (recorded layer outputs or
        parameters), ``(K, *t.shape)`` each: one backward pass per row ``u_k``, through the
        graph of one forward pass (measured faster than ``is_grads_batched`` on CPU)."""
        if not outputs:
            return []
        per_row = []
        rows = cotangents.shape[0]
        for k in range(rows):
            grads = torch.autograd.grad(
                logits,
                outputs,
                grad_outputs=cotangents[k].to(logits.dtype),
                retain_graph=retain_graph or k + 1 < rows,
                allow_unused=True,
            )
            per_row.append(
                [
                    g if g is not None else torch.zeros_like(o)
                    for g, o in zip(grads, outputs, strict=True)
                ]
            )
        return [torch.stack(column) for column in zip(*per_row, strict=True)]

    def _add_rule(
        self, terms: BatchTerms, rule: Rule, grads: list[Tensor], rows: _Rows, curvature: bool
    ) -> None:
        block = not self.diagonal_only  # a bias: per-sample gradients Σ_t s_t, an exact block
        if isinstance(rule, LocalRule) and rule.factored:
            maps = rule.linear_maps(grads)
            if maps is not None:
                for attr, name in rule.names.items():
                    weight, kind = rule.factored[attr]
                    a, s = maps[weight]
                    if kind == "bias":
                        self._add_explicit(terms, {name: s.sum(2)}, rows, curvature, block=block)
                    else:
                        self._add_weight(terms, name, a, s, rows, curvature)
                return
        if not isinstance(rule, KroneckerRule):
            self._add_explicit(terms, rule.per_sample_gradients(grads), rows, curvature)
            return
        a = rule.patches()
        s = rule.output_gradients(grads)
        for attr, name in rule.names.items():
            if attr != "weight":
                self._add_explicit(terms, {name: s.sum(2)}, rows, curvature, block=block)
            else:
                self._add_weight(terms, name, a, s, rows, curvature, rule)

    def _add_weight(
        self,
        terms: BatchTerms,
        name: str,
        a: Tensor,
        s: Tensor,
        rows: _Rows,
        curvature: bool,
        rule: KroneckerRule | None = None,
    ) -> None:
        """Add a linear map's weight from its patches ``a`` (N, T, d) and output gradients
        ``s`` (K, N, T, o): norms, traces, and its rows, diagonal or Kronecker factors. A
        :class:`KroneckerRule` gives the layout (an embedding, a weight stored (in, out));
        without one the weight is (o, d)."""
        embedding = rule is not None and rule.is_embedding
        norms = weight_squared_norms(a, s[rows.norms], embedding)
        terms.grad_norm_sq += float(norms[0])
        terms.fisher_trace += float(norms[1:].sum())
        if not curvature:
            return
        shape = rule.weight_shape if rule is not None else torch.Size((s.shape[-1], a.shape[-1]))
        layout = rule.to_weight_layout if rule is not None else (lambda values: values)
        if self.rows_only:
            found = weight_rows(a, s[rows.curvature], embedding, shape).detach()
            if rule is not None and rule.transposed:
                found = layout(found.unflatten(-1, shape)).flatten(2)
            terms.rows[name] = found
        elif self.diagonal_only:
            chosen = [0, *range(rows.curvature.start, rows.curvature.stop)]
            squares = layout(weight_square_sums(a, s[chosen], embedding, shape[0]))
            terms.cov_diagonal[name] = _f64(squares[0])
            terms.diagonal[name] = _f64(squares[1:].sum(0))
        else:
            g, factor = kronecker_factors(a, s[rows.curvature], embedding, shape[0])
            terms.kronecker[name] = (_f64(g), _f64(factor))

    def _add_explicit(
        self,
        terms: BatchTerms,
        per_sample: dict[str, Tensor],
        rows: _Rows,
        curvature: bool,
        block: bool = False,
    ) -> None:
        """Add per-sample gradients ``(K, N, *shape)``: norms, traces, diagonal or block."""
        for name, grads in per_sample.items():
            flat = grads.reshape(grads.shape[0], grads.shape[1], -1)
            terms.grad_norm_sq += float(flat[0].square().sum())
            terms.fisher_trace += float(flat[rows.trace].square().sum())
            if not curvature:
                continue
            if self.rows_only:
                terms.rows[name] = flat[rows.curvature].detach()
                continue
            fisher_rows = flat[rows.curvature].reshape(-1, flat.shape[-1])
            if self.diagonal_only:
                terms.cov_diagonal[name] = _f64(flat[0].square().sum(0))
            if block:
                terms.blocks[name] = _f64(fisher_rows.T @ fisher_rows)
            else:
                terms.diagonal[name] = _f64(fisher_rows.square().sum(0))

    def _fallback_gradients(self, inputs: Leaves, cotangents: Tensor) -> dict[str, Tensor]:
        """Per-sample gradients ``(K, N, *shape)`` of the fallback parameters (module
        docstring), ``torch.func`` through the whole model, a chunk of samples at a time."""
        params = dict(self.model.model.named_parameters())
        chosen = {name: params[name].detach() for name in self.fallback}

        def one_sample(x: Leaves, rows: Tensor) -> dict[str, Tensor]:
            def logits(p: dict[str, Tensor]) -> Tensor:
                return self.model.call(p, unsqueeze_leaves(x)).squeeze(0)

            _, pullback = vjp(logits, chosen)
            return vmap(pullback)(rows.to(next(iter(chosen.values())).dtype))[0]

        size = sum(p.numel() for p in chosen.values()) * cotangents.shape[0]
        per_chunk = max(1, CHUNK_ELEMENTS // max(1, size))
        pieces = []
        with torch.no_grad():
            for start in range(0, cotangents.shape[1], per_chunk):
                rows = slice(start, min(cotangents.shape[1], start + per_chunk))
                batched = map_samples(one_sample, (0, 1), self.model.model, out_dims=1)
                pieces.append(batched(take_rows(inputs, rows), cotangents[:, rows]))
        return {name: torch.cat([p[name] for p in pieces], dim=1) for name in self.fallback}

    # -- the coverage check ------------------------------------------------------------------

    def _rule_gradient_facts(
        self, residual_grads: dict[int, list[Tensor]]
    ) -> dict[str, tuple[Tensor, float]]:
        """``(Σ_i g_i, Σ_i ‖g_i‖²)`` of one cotangent row for every covered parameter."""
        facts: dict[str, tuple[Tensor, float]] = {}
        for rule in self.rules:
            grads = residual_grads.get(id(rule))
            if not grads or not rule.names:
                continue
            if isinstance(rule, KroneckerRule):
                a, s = rule.patches(), rule.output_gradients(grads)
                for attr, name in rule.names.items():
                    if attr == "weight":
                        total = rule.to_weight_layout(
                            weight_batch_gradient(a, s[0], rule.is_embedding, rule.weight_shape)
                        )
                        norms = float(weight_squared_norms(a, s, rule.is_embedding)[0])
                    else:
                        per_sample = s[0].sum(1)
                        total, norms = per_sample.sum(0), float(per_sample.square().sum())
                    facts[name] = (total, norms)
            else:
                for name, per_sample in rule.per_sample_gradients(grads).items():
                    facts[name] = (per_sample[0].sum(0), float(per_sample[0].square().sum()))
        return facts

    def _disagreeing(
        self,
        row_grads: dict[int, list[Tensor]],
        expected: dict[str, Tensor | None],
        names: list[str],
        rows: int,
        tolerance: float,
    ) -> set[str]:
        """The ``names`` whose rule's one-sample gradient facts disagree with autograd's."""
        wrong = set()
        for row in range(rows):
            one_row = {key: [g[row : row + 1] for g in value] for key, value in row_grads.items()}
            try:
                found = self._rule_gradient_facts(one_row)
            except Exception:  # a rule that cannot run on this model: its parameters fall back
                found = {}
            wants = {name: expected[name][row] for name in expected if expected[name] is not None}
            # errors of a parameter with a tiny gradient are judged on the sample's whole one
            floor = 1e-3 * math.sqrt(sum(float(w.square().sum()) for w in wants.values()))
            for name in names:
                if not _agrees(wants.get(name), found.get(name), tolerance, floor):
                    wrong.add(name)
        return wrong

    def _check_coverage(self, logits: Tensor, residual: Tensor, inputs: Leaves) -> None:
        """Decide once which parameters the rules cover (module docstring).

        Two cotangents, each on one sample only (the first and the last), make the per-sample
        gradients of every other sample vanish. The samples' dimension of each layer is the one
        along which its output gradients vanish outside that sample (for both); a rule is
        right when, for both, its gradients sum to autograd's gradient *and* their squared
        norms sum to its squared norm (a rule that splits samples wrongly fails the second
        test). Tapped parameters pass when the plain forward gives the same logits and their
        copies' gradients pass the same tests against the plain forward's gradients. Whatever
        fails falls back to ``torch.func``.
        """
        self._checked = True
        batch = logits.shape[0]
        strongest = residual.norm(dim=1).argsort(descending=True)[:2]
        samples = sorted(int(i) for i in strongest)
        single = torch.zeros(
            len(samples), *residual.shape, dtype=logits.dtype, device=residual.device
        )
        for row, sample in enumerate(samples):
            value = residual[sample]
            single[row, sample] = value if float(value.abs().sum()) > 0 else 1.0
        params = dict(self.model.model.named_parameters())
        covered = [name for rule in self.rules for name in rule.names.values()]
        outputs = self._recorded_outputs()
        taps = [self._taps[name] for name in self.tapped]
        tensors = [params[name] for name in covered] + list(outputs.values()) + taps
        grads = self._output_gradients(logits, tensors, single, retain_graph=True)
        expected = dict(zip(covered, grads[: len(covered)], strict=True))
        by_output = dict(
            zip(outputs, grads[len(covered) : len(covered) + len(outputs)], strict=True)
        )
        self._check_taps(logits, single, samples, inputs, grads[len(covered) + len(outputs) :])
        row_grads = {
            id(rule): [by_output[id(call.output)] for call in rule.calls] for rule in self.rules
        }
        wrong: set[str] = set()
        for rule in self.rules:
            dim = _samples_dimension(rule, row_grads.get(id(rule)), samples, batch)
            if dim is None:  # no dimension of the output holds the samples: shared by them
                wrong.update(rule.names.values())
            rule.batch_dim = dim or 0
        tolerance = 1e-4 if logits.dtype != torch.float64 else 1e-8
        wrong |= self._disagreeing(row_grads, expected, covered, len(samples), tolerance)
        # a module followed through its linear maps that disagrees (a weight also used outside
        # them) keeps the per-sample gradients of its own forward instead, if those agree
        retry = [
            rule
            for rule in self.rules
            if isinstance(rule, LocalRule) and rule.factored and wrong & set(rule.names.values())
        ]
        if retry:
            for rule in retry:
                rule.unfollowed = True
            names = [name for rule in retry for name in rule.names.values()]
            wrong -= set(names)
            wrong |= self._disagreeing(row_grads, expected, names, len(samples), tolerance)
        for rule in self.rules:
            for attr in [a for a, n in rule.names.items() if n in wrong]:
                del rule.names[attr]
        order = {name: i for i, name in enumerate(self.names)}
        self.fallback = sorted(set(self.fallback) | wrong, key=order.__getitem__)
        if batch > 1:  # one sample cannot tell a layer's samples' dimension
            _remember_plan(self)


@dataclass(frozen=True)
class _Plan:
    """What the first batch's check decided for a model, reused by later measurements of it
    (the same assignment every epoch, and the check's cost paid once)."""

    key: tuple
    covered: dict[str, int]  # parameter → its rule's samples' dimension
    tapped: tuple[str, ...]
    fallback: tuple[str, ...]
    #: parameters of modules not followed through their linear maps (the check refused them)
    unfollowed: frozenset[str] = frozenset()


#: the plan of each measured model, by the user's module (dropped with it)
_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan_key(model: LogitsModule) -> tuple:
    """What the plan depends on: the call, the inputs' structure and the parameters."""
    params = tuple((name, id(p)) for name, p in model.model.named_parameters() if p.requires_grad)
    return (model.logits_fn, model.spec, params)


def _remember_plan(hooked: HookedPass) -> None:
    covered = {name: rule.batch_dim for rule in hooked.rules for name in rule.names.values()}
    unfollowed = frozenset(
        name
        for rule in hooked.rules
        if isinstance(rule, LocalRule) and rule.unfollowed
        for name in rule.names.values()
    )
    plan = _Plan(
        _plan_key(hooked.model),
        covered,
        tuple(hooked.tapped),
        tuple(hooked.fallback),
        unfollowed,
    )
    # a module that cannot be weakly referenced is simply checked again next time
    with suppress(TypeError):
        _PLANS[hooked.model.model] = plan


def _apply_plan(hooked: HookedPass) -> bool:
    """Reuse the model's remembered plan; False when there is none (or it is stale)."""
    try:
        plan = _PLANS.get(hooked.model.model)
    except TypeError:  # a module that cannot be weakly referenced
        return False
    if plan is None or plan.key != _plan_key(hooked.model):
        return False
    for rule in hooked.rules:
        for attr in [a for a, n in rule.names.items() if n not in plan.covered]:
            del rule.names[attr]
        for name in rule.names.values():
            rule.batch_dim = plan.covered[name]
            if name in plan.unfollowed and isinstance(rule, LocalRule):
                rule.unfollowed = True
    hooked.rules = [rule for rule in hooked.rules if rule.names]
    hooked.tapped, hooked.fallback = list(plan.tapped), list(plan.fallback)
    return True


def _samples_dimension(
    rule: Rule, grads: list[Tensor] | None, samples: list[int], batch: int
) -> int | None:
    """The dimension (0 or 1) of a layer's output along which the gradients of one-sample
    cotangents vanish outside their sample; 0 when both do (the check decides); None when
    neither does: the layer's output is shared by the samples (position embeddings looked up
    without a batch dimension), and no split of its gradient is a per-sample one."""
    if isinstance(rule, RecurrentRule):  # its recorded output is sample-first (joint)
        return 0
    if isinstance(rule.module, (nn.MultiheadAttention, nn.RNNBase)):
        return 0 if rule.module.batch_first else 1
    if not grads:
        return 0
    grad = grads[0]
    candidates = []
    for dim in (0, 1):
        if grad.dim() <= dim + 1 or grad.shape[dim + 1] != batch:
            continue
        vanishes = True
        for row, sample in enumerate(samples):
            others = torch.ones(batch, dtype=torch.bool, device=grad.device)
            others[sample] = False
            if bool(grad[row].index_select(dim, others.nonzero().squeeze(1)).abs().sum() > 0):
                vanishes = False
        if vanishes:
            candidates.append(dim)
    if not candidates:
        return None
    return candidates[0] if len(candidates) == 1 else 0


def _agrees(
    expected: Tensor | None,
    found: tuple[Tensor, float] | None,
    tolerance: float,
    floor: float = 0.0,
) -> bool:
    """A rule's ``(Σ_i g_i, Σ_i ‖g_i‖²)`` against autograd's one-sample gradient, to a
    relative ``tolerance`` of the larger of their norms and ``floor``."""
    if found is None:
        return expected is None
    total, norms = found
    if expected is None:
        expected = torch.zeros_like(total)
    if total.shape != expected.shape:
        return False
    scale = max(float(expected.norm()) + float(total.norm()), floor, 1e-30)
    if float((total - expected).norm()) > tolerance * scale:
        return False
    squared = float(expected.square().sum())
    return abs(norms - squared) <= tolerance * max(squared + norms, floor**2, 1e-30)
