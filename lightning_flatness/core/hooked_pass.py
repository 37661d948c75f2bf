"""One forward and one backward per cotangent row, read by hooks on the layers: the backend of
``structure="kfac"`` for any differentiable model.

No graph conversion is needed: forward hooks on the modules that own parameters record their
inputs, and ordinary autograd differentiates K cotangents on the logits with respect to the
recorded layer outputs, one backward pass per cotangent through the graph of one forward pass,
through functional ops, residual connections, attention and anything else autograd follows.
The K rows are (:mod:`lightning_flatness.core.cotangent_rows`; docs/math.md, "The three
matrices", "Kronecker factors from layer hooks"):

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
Kronecker block whose calls are its positions, and so is an ``nn.Linear`` weight also applied
by ``F.linear`` outside its layer (:mod:`lightning_flatness.core.outside_calls`: looked for on
the first batch, and later only for a model that has such calls). A parameter of shape ``(1, ...)``
that a module with children uses (a class token, a positional embedding) is *tapped*: the
forward pass uses N stacked copies of it, and the gradient of copy i is sample i's. Whatever is
left (a parameter used outside its module's ``forward`` some other way, shared by layers of
different types) gets per-sample gradients from ``torch.func`` (``vmap`` of a vector-Jacobian
product of the whole model, restricted to those parameters: the costly fallback, reported as
"diagonal (whole model)").

Which parameters the rules and taps cover is decided once, on the first batch: with cotangents
on single samples, each rule's per-sample gradients must sum to autograd's gradient and their
squared norms to its squared norm (:mod:`lightning_flatness.core.coverage_check`); a parameter
that fails moves to the fallback, so the numbers are exact whatever the model does. The
decision is remembered for later measurements of the same model
(:mod:`lightning_flatness.core.remembered_plan`). What each batch adds to the sums is
:class:`~lightning_flatness.core.batch_terms.BatchTerms`.

The user's model is used in eval mode with gradients that are never written to ``.grad``; the
hooks are removed when the pass is closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_flatness.core.attention import ProjectionCalls
from lightning_flatness.core.batch_terms import BatchTerms, add_explicit, add_rule
from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.cotangent_rows import fisher_cotangents
from lightning_flatness.core.coverage_check import check_coverage
from lightning_flatness.core.hook_recorder import HookRecorder
from lightning_flatness.core.last_layer import last_layer
from lightning_flatness.core.layer_rules import KroneckerRule, Rule
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.module_rules import AttentionRule, LocalRule
from lightning_flatness.core.outside_calls import outside_calls_where_found
from lightning_flatness.core.remembered_plan import apply_plan, remember_plan
from lightning_flatness.core.row_gradients import (
    call_gradients,
    output_gradients,
    recorded_outputs,
    whole_model_gradients,
)
from lightning_flatness.core.rule_assignment import assign_rules, record_call

# BatchTerms, what a pass returns, is importable from here too
__all__ = ["COVERAGE", "BatchTerms", "HookedPass"]

#: how a parameter enters the block-diagonal Fisher; "diagonal (whole model)" is the exact
#: diagonal from per-sample backward passes through the whole model (the costly fallback)
COVERAGE = ("kronecker", "exact block", "diagonal", "diagonal (whole model)")


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
        self.structure = structure
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
        self._recording = False
        #: the samples of the batch being recorded
        self._batch = 0
        plan = apply_plan(model, self.rules)
        self._checked = plan is not None
        if plan is not None:
            self.rules = [rule for rule in self.rules if rule.names]
            self.tapped, self.fallback = list(plan.tapped), list(plan.fallback)
        self._hooks = HookRecorder()
        modules = self._hooks.record_calls(self.rules, self._hook)
        #: per attention module (by ``id``), the recorder of its projections' calls while its
        #: forward runs (:class:`~lightning_flatness.core.attention.ProjectionCalls`)
        self._projections: dict[int, ProjectionCalls] = {}
        for module, rules in modules:
            if any(isinstance(rule, AttentionRule) for rule in rules):
                self._hooks.around(module, self._enter_projections, self._leave_projections)
        self._features = self._hooks.last_layer_inputs(self.last_layer, lambda: self._recording)

    def _hook(self, rules: list[Rule]):
        def record(module: nn.Module, args: tuple, kwargs: dict, output):
            if not self._recording:
                return None
            returned = record_call(rules, module, args, kwargs, output, self._batch)
            projections = self._projections.get(id(module))
            if projections is not None and returned is not None:
                rules[0].calls[-1].inner = projections.complete()
            return returned

        return record

    def _enter_projections(self, module: nn.Module, args: tuple) -> None:
        if self._recording:
            projections = self._projections[id(module)] = ProjectionCalls(module)
            projections.__enter__()

    def _leave_projections(self, module: nn.Module, args: tuple, output: object) -> None:
        projections = self._projections.pop(id(module), None)
        if projections is not None:
            projections.__exit__(None, None, None)

    def close(self) -> None:
        """Remove every hook; the model is as it was before."""
        self._hooks.close()

    def coverage(self) -> dict[str, str]:
        """How each parameter is measured (one of :data:`COVERAGE`), in parameter order."""
        kinds = {}
        diagonal_only = self.structure == "diag"
        for rule in self.rules:
            for attr, name in rule.names.items():
                if isinstance(rule, KroneckerRule) and not diagonal_only:
                    kinds[name] = "kronecker" if attr == "weight" else "exact block"
                elif isinstance(rule, LocalRule) and rule.factored and not diagonal_only:
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

    @contextmanager
    def _recorded(self) -> Iterator[None]:
        for rule in self.rules:
            rule.calls.clear()
        self._features.clear()
        self._recording = True
        try:
            with outside_calls_where_found(self.rules, self.model.model):
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

    def recorded_numbers(self) -> int:
        """How many numbers the latest :meth:`forward` recorded as layer outputs (what the
        backward rows and the terms then read, about in proportion to the batch)."""
        return sum(output.numel() for output in recorded_outputs(self.rules).values())

    def features(self) -> Tensor | None:
        """The input of :attr:`last_layer` in the latest :meth:`forward` (its last call)."""
        return self._features[-1] if self._features else None

    def terms(self, logits: Tensor, targets: Tensor, inputs: Leaves, curvature: bool) -> BatchTerms:
        """The batch's :class:`BatchTerms` after :meth:`forward` gave ``logits``; with
        ``curvature=False`` only the two traces (validation data)."""
        rank, world_size = self.shard
        first = self.positions[curvature]
        positions = torch.arange(first, first + logits.shape[0]) * world_size + rank
        cotangents, rows = fisher_cotangents(
            self.likelihood,
            logits,
            targets,
            positions,
            kfac_mode=self.kfac_mode,
            trace_estimator=self.trace_estimator,
            mc_samples=self.mc_samples,
            seed=self.seed,
            curvature=curvature,
        )
        self.positions[curvature] += logits.shape[0]
        if not self._checked:
            self._check_coverage(logits, cotangents[0], inputs)
        outputs = recorded_outputs(self.rules)
        taps = [self._taps[name] for name in self.tapped]
        grads = output_gradients(logits, list(outputs.values()) + taps, cotangents)
        by_output = dict(zip(outputs, grads[: len(outputs)], strict=True))
        terms = BatchTerms()
        tap_grads = dict(zip(self.tapped, grads[len(outputs) :], strict=True))
        add_explicit(terms, tap_grads, rows, curvature, self.structure)
        by_rule = call_gradients(self.rules, by_output)
        for rule in self.rules:
            if rule.calls:
                add_rule(terms, rule, by_rule[id(rule)], rows, curvature, self.structure)
        if self.fallback:
            fallback_grads = whole_model_gradients(self.model, self.fallback, inputs, cotangents)
            add_explicit(terms, fallback_grads, rows, curvature, self.structure)
        return terms

    def _check_coverage(self, logits: Tensor, residual: Tensor, inputs: Leaves) -> None:
        """Decide once which parameters the rules and taps cover
        (:func:`~lightning_flatness.core.coverage_check.check_coverage`); the others move to
        the fallback, and the decision is remembered for the model."""
        self._checked = True
        verdict = check_coverage(
            self.model, self.rules, self.tapped, self._taps, logits, residual, inputs
        )
        order = {name: i for i, name in enumerate(self.names)}
        self.tapped = verdict.tapped
        self.fallback = sorted(set(self.fallback) | verdict.fallback, key=order.__getitem__)
        if logits.shape[0] > 1:  # one sample cannot tell a layer's samples' dimension
            remember_plan(self.model, self.rules, self.tapped, self.fallback)
