"""The first batch's autograd check of which parameters the layer rules and taps cover
(:mod:`lightning_flatness.core.hooked_pass`).

With cotangents on single samples, each rule's per-sample gradients must sum to autograd's
gradient and their squared norms to its squared norm; a parameter that fails moves to the
``torch.func`` fallback, so the numbers are exact whatever the model does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule
from lightning_flatness.core.layer_rules import KroneckerRule, Rule
from lightning_flatness.core.linear_map_terms import weight_batch_gradient, weight_squared_norms
from lightning_flatness.core.module_rules import LocalRule, RecurrentRule
from lightning_flatness.core.row_gradients import call_gradients, output_gradients, recorded_outputs

__all__ = ["CoverageVerdict", "check_coverage"]


@dataclass(frozen=True)
class CoverageVerdict:
    """What the check decided, besides the rules it trimmed in place.

    Attributes:
        tapped: the tapped parameters whose copies give per-sample gradients.
        fallback: the parameters that move to the ``torch.func`` fallback (rules' parameters
            that disagree with autograd, and taps that do).
    """

    tapped: list[str]
    fallback: set[str]


def check_coverage(
    model: LogitsModule,
    rules: list[Rule],
    tapped: list[str],
    taps: dict[str, Tensor],
    logits: Tensor,
    residual: Tensor,
    inputs: Leaves,
) -> CoverageVerdict:
    """Decide once which parameters the rules cover, after a recorded forward pass gave
    ``logits`` (with ``taps``, the stacked copies of the ``tapped`` parameters) and
    ``residual`` is its residual row ``(N, C)``.

    Two cotangents, each on one sample only (the two with the largest residuals), make the
    per-sample gradients of every other sample vanish. The samples' dimension of each layer is
    the one along which its output gradients vanish outside that sample (for both); a rule is
    right when, for both, its gradients sum to autograd's gradient *and* their squared norms
    sum to its squared norm (a rule that splits samples wrongly fails the second test). Tapped
    parameters pass when the plain forward gives the same logits and their copies' gradients
    pass the same tests against the plain forward's gradients. Each rule's ``batch_dim`` is
    set, and the parameters that fail are removed from their rule's ``names``.
    """
    batch = logits.shape[0]
    strongest = residual.norm(dim=1).argsort(descending=True)[:2]
    samples = sorted(int(i) for i in strongest)
    single = torch.zeros(len(samples), *residual.shape, dtype=logits.dtype, device=residual.device)
    for row, sample in enumerate(samples):
        value = residual[sample]
        single[row, sample] = value if float(value.abs().sum()) > 0 else 1.0
    params = dict(model.model.named_parameters())
    covered = [name for rule in rules for name in rule.names.values()]
    outputs = recorded_outputs(rules)
    tap_copies = [taps[name] for name in tapped]
    tensors = [params[name] for name in covered] + list(outputs.values()) + tap_copies
    grads = output_gradients(logits, tensors, single, retain_graph=True)
    expected = dict(zip(covered, grads[: len(covered)], strict=True))
    by_output = dict(zip(outputs, grads[len(covered) : len(covered) + len(outputs)], strict=True))
    tap_grads = grads[len(covered) + len(outputs) :]
    kept = _check_taps(model, tapped, logits, single, samples, inputs, tap_grads)
    row_grads = call_gradients(rules, by_output)
    wrong: set[str] = set()
    for rule in rules:
        dim = _samples_dimension(rule, row_grads.get(id(rule)), samples, batch)
        if dim is None:  # no dimension of the output holds the samples: shared by them
            wrong.update(rule.names.values())
        rule.batch_dim = dim or 0
    tolerance = 1e-4 if logits.dtype != torch.float64 else 1e-8
    wrong |= _disagreeing(rules, row_grads, expected, covered, len(samples), tolerance)
    # a module followed through its linear maps that disagrees (a weight also used outside
    # them) keeps the per-sample gradients of its own forward instead, if those agree
    retry = [
        rule
        for rule in rules
        if isinstance(rule, LocalRule) and rule.factored and wrong & set(rule.names.values())
    ]
    if retry:
        for rule in retry:
            rule.unfollowed = True
        names = [name for rule in retry for name in rule.names.values()]
        wrong -= set(names)
        wrong |= _disagreeing(rules, row_grads, expected, names, len(samples), tolerance)
    for rule in rules:
        for attr in [a for a, n in rule.names.items() if n in wrong]:
            del rule.names[attr]
    return CoverageVerdict(kept, wrong | (set(tapped) - set(kept)))


def _check_taps(
    model: LogitsModule,
    tapped: list[str],
    logits: Tensor,
    single: Tensor,
    samples: list[int],
    inputs: Leaves,
    tap_grads: list[Tensor],
) -> list[str]:
    """The tapped parameters whose copies give per-sample gradients (see
    :func:`check_coverage`); the others move to the ``torch.func`` fallback."""
    if not tapped:
        return []
    params = dict(model.model.named_parameters())
    tolerance = 1e-4 if logits.dtype != torch.float64 else 1e-8
    plain = model(*inputs)
    same = torch.allclose(
        plain, logits, rtol=tolerance, atol=tolerance * float(logits.detach().abs().max())
    )
    truth = output_gradients(plain, [params[n] for n in tapped], single)
    kept = []
    for name, got, want in zip(tapped, tap_grads, truth, strict=True):
        good = same
        for row, sample in enumerate(samples):
            others = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
            others[sample] = False
            good = good and float(got[row][others].abs().sum()) == 0.0
            facts = (got[row].sum(0).reshape(want[row].shape), float(got[row].square().sum()))
            good = good and _agrees(want[row], facts, tolerance)
        if good:
            kept.append(name)
    return kept


def _rule_gradient_facts(
    rules: list[Rule], residual_grads: dict[int, list[Tensor]]
) -> dict[str, tuple[Tensor, float]]:
    """``(Σ_i g_i, Σ_i ‖g_i‖²)`` of one cotangent row for every covered parameter."""
    facts: dict[str, tuple[Tensor, float]] = {}
    for rule in rules:
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
                    per_sample = rule.bias_output_gradients(grads, s)[0].sum(1)
                    total, norms = per_sample.sum(0), float(per_sample.square().sum())
                facts[name] = (total, norms)
        else:
            for name, per_sample in rule.per_sample_gradients(grads).items():
                facts[name] = (per_sample[0].sum(0), float(per_sample[0].square().sum()))
    return facts


def _disagreeing(
    rules: list[Rule],
    row_grads: dict[int, list[Tensor]],
    expected: dict[str, Tensor | None],
    names: list[str],
    rows: int,
    tolerance: float,
) -> set[str]:
    """The ``names`` whose rule's one-sample gradient facts disagree with autograd's."""
    wrong = set()
    calls = {id(call): call for rule in rules for call in rule.calls}
    inner = {key: dict(call.inner_grads) for key, call in calls.items()}
    for row in range(rows):
        one_row = {key: [g[row : row + 1] for g in value] for key, value in row_grads.items()}
        for key, call in calls.items():  # the same row of the maps recorded inside a call
            call.inner_grads = {name: g[row : row + 1] for name, g in inner[key].items()}
        try:
            found = _rule_gradient_facts(rules, one_row)
        except Exception:  # a rule that cannot run on this model: its parameters fall back
            found = {}
        wants = {name: expected[name][row] for name in expected if expected[name] is not None}
        # errors of a parameter with a tiny gradient are judged on the sample's whole one
        floor = 1e-3 * math.sqrt(sum(float(w.square().sum()) for w in wants.values()))
        for name in names:
            if not _agrees(wants.get(name), found.get(name), tolerance, floor):
                wrong.add(name)
    return wrong


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
