"""Which predicted gap to headline, and when to trust it (docs/RESULTS.md, "Predictor and trust
rule (benchmarks/study_trust.py)").

Trains small classifiers on the 5,000 offline MNIST images (7×7 or 14×14) with a plain PyTorch
loop (Adam, coupled weight decay λ = c/n), measures each with :func:`lightning_flatness.measure`
(its default structure, the whole training set, the images not trained on held out) and records,
per run, both predicted gaps (held-out and training trace ratio), the observed gap, the
error/uncertainty ratios, the soft rank and a distance from the minimum of the regularized
objective ``L(θ) = mean training NLL + ½λ‖θ‖²``:

- ``decrement``: the Newton decrement ``½ gᵀ(F+λI)⁻¹g`` with ``g = ∇L`` on the whole training
  set and F its Fisher, by conjugate gradients with exact Fisher-vector products in float64
  (``decrement_residual`` is CG's final relative residual): the loss the objective would still
  lose to one Newton step, to be set against the predicted gap;
- ``decrement_lower``: one CG step, ``½‖g‖⁴ / (gᵀFg + λ‖g‖²)`` (a lower bound, one extra
  Fisher-vector product);
- ``decrement_upper``: ``½‖g‖²/λ`` (an upper bound, no curvature at all);
- ``nll_drop``: the relative drop of the training NLL over the last epoch;
- ``tic_train``, ``tic_train_centered``, ``tic_val``: the regularized TIC
  ``(1/n)·Tr(C (F+λI)⁻¹)`` as a predicted gap, exact in float64 (the Fisher formed from
  per-sample Jacobians), with C the second moment of the per-sample training gradients, their
  covariance, or the second moment of the held-out ones (``--no-tic`` leaves them out).

The grids (``GRIDS``) differ in data, architecture, n and training length; two of them
(``role == "choose"``) are used to choose a rule, the others check it; the ``repeats`` grids
train three settings on six draws of their data each, so the mean observed gap over the draws
can be set against the prediction (``repeat_table``). ``--analyse`` reads the
records and prints, per grid, how often each candidate rule's trusted predictions are within
2× of the observed gap (a run with an observed gap ≤ 0 counts as outside), and where some
observed gaps are within two standard errors of 0 (``observed_gap_stderr``: the held-out mean
NLL's), the same share over the resolved ones alone; in brackets, where the records have
``train_nll_stderr``, the share whose observed gap is *consistent* with a gap within 2× of the
prediction given its noise about the expected gap (:func:`consistent`).

Usage::

    python benchmarks/study_trust.py --grids all --output runs/study_trust/records.jsonl
    python benchmarks/study_trust.py --analyse runs/study_trust/records.jsonl
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap

from lightning_flatness import measure
from lightning_flatness.core.models import build_model
from lightning_flatness.lightning.data import MNIST7DataModule

#: the bundled images: a run holds out every one it does not train on
IMAGES = 5000
BATCH_SIZE = 64


@dataclass(frozen=True)
class Grid:
    """A set of runs: every combination of its architectures, n, c, learning rates, epochs."""

    name: str
    role: str
    image_size: int
    architectures: tuple[tuple[str, int], ...]
    sizes: tuple[int, ...]
    cs: tuple[float, ...]
    lrs: tuple[float, ...]
    epochs: tuple[int, ...]
    seed: int
    #: runs of every setting, each with its own seed (training set, held-out set, initialization)
    repeats: int = 1

    def runs(self) -> Iterator[dict]:
        """One dict of settings per run of the grid."""
        seeds = [self.seed + 100 * k for k in range(self.repeats)]
        combos = itertools.product(
            self.architectures, self.sizes, self.cs, self.lrs, self.epochs, seeds
        )
        for (arch, hidden), n, c, lr, epochs, seed in combos:
            yield dict(
                grid=self.name,
                role=self.role,
                image_size=self.image_size,
                architecture=arch,
                hidden=hidden,
                n=n,
                c=c,
                lam=c / n,
                lr=lr,
                epochs=epochs,
                seed=seed,
            )


GRIDS = {
    grid.name: grid
    for grid in (
        # chosen on: mlp7 (a trained MLP on 7×7 images) and short14 (short fits on 14×14)
        Grid("mlp7", "choose", 7, (("mlp", 70),), (1000, 2000), (0.01, 1, 100), (1e-3, 1e-2),
             (150,), 1),
        Grid("short7", "check", 7, (("mlp", 70), ("cnn", 0)), (500, 2000), (0.01, 1, 100),
             (1e-3,), (1, 3), 2),
        # checked on: other data, models, n, training lengths and seeds
        Grid("mlp14", "check", 14, (("mlp", 20),), (1000, 4000), (0.01, 1, 100), (1e-3, 1e-2),
             (100,), 3),
        Grid("bigmlp7", "check", 7, (("bigmlp", 40),), (1500, 4000), (0.01, 1, 100),
             (1e-3, 3e-3), (100,), 4),
        Grid("short14", "choose", 14, (("mlp", 20), ("resmlp", 20)), (800, 2500), (0.01, 1, 100),
             (1e-3, 1e-2), (2,), 5),
        Grid("cnn7", "check", 7, (("cnn", 0),), (1000, 2000), (0.01, 1, 100), (1e-3, 1e-2),
             (60,), 6),
        # held out from the choice of the geometric-mean predictor (run after it was chosen)
        Grid("resmlp14", "held out", 14, (("resmlp", 20),), (1200, 3000), (0.01, 1, 100),
             (1e-3, 3e-3), (80,), 7),
        Grid("cnn14", "held out", 14, (("cnn", 0),), (1000, 2500), (0.01, 1, 100), (1e-3,),
             (40,), 8),
        Grid("widemlp7", "held out", 7, (("mlp", 120),), (1500, 3000), (0.01, 1, 100),
             (1e-3, 3e-3), (120,), 9),
        # held out from every choice: first run with the draws (benchmarks/study_trust_draws.py)
        Grid("bigmlp14", "held out", 14, (("bigmlp", 40),), (1500, 3000), (0.01, 1, 100),
             (1e-3,), (100,), 12),
        # the settings of the trusted misses, each trained on six draws of its data: is the
        # miss the predictor's or the one observed gap's (its noise about the expected gap)?
        Grid("repeat7", "repeats", 7, (("mlp", 120), ("bigmlp", 40)), (1500,), (100,), (1e-3,),
             (120,), 10, repeats=6),
        Grid("repeatcnn7", "repeats", 7, (("cnn", 0),), (2000,), (100,), (1e-3,), (60,), 11,
             repeats=6),
        # the README's main job (configs/mlp.yaml: the paper's MLP, n = 4,000, c = 1, Adam 1e-3,
        # 50 epochs) on ten draws of its data: its expected gap (benchmarks/study_headline.py)
        Grid("mainjob", "main job", 7, (("mlp", 70),), (4000,), (1,), (1e-3,), (50,), 1000,
             repeats=10),
    )
}  # fmt: skip


def load_data(image_size: int, n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Standardized ``(x_train, y_train, x_val, y_val)``: n training images and the other
    :data:`IMAGES` − n held out (the more held out, the smaller the observed gap's standard
    error: with 1,000, 0.02–0.07 nat on these runs)."""
    val_size = IMAGES - n
    data = MNIST7DataModule(train_size=n, val_size=val_size, image_size=image_size, seed=seed)
    data.setup("fit")
    return (*data.train_set.tensors, *data.val_set.tensors)


def full_nll(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Mean training NLL of the whole set, eval mode, no gradient."""
    return float(sample_nll(model, x, y).mean())


def sample_nll(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Each sample's NLL, eval mode, no gradient."""
    model.eval()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y, reduction="none")


def gap_stderr(model: nn.Module, x_val: Tensor, y_val: Tensor) -> float:
    """The standard error of the mean NLL over ``x_val``: of the held-out mean, or of the
    training mean as a sample of the population (:func:`gap_noise`)."""
    losses = sample_nll(model, x_val, y_val)
    return float(losses.std() / math.sqrt(losses.numel()))


def train(model: nn.Module, x: Tensor, y: Tensor, run: dict) -> list[float]:
    """Adam with coupled weight decay λ for ``run["epochs"]``; the full-set NLL after each epoch
    (the first entry: before training)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=run["lr"], weight_decay=run["lam"])
    generator = torch.Generator().manual_seed(run["seed"])
    history = [full_nll(model, x, y)]
    for _ in range(run["epochs"]):
        model.train()
        order = torch.randperm(x.shape[0], generator=generator)
        for start in range(0, x.shape[0], BATCH_SIZE):
            index = order[start : start + BATCH_SIZE]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        history.append(full_nll(model, x, y))
    return history


class Objective:
    """The regularized objective ``mean NLL + ½λ‖θ‖²`` of a float64 copy of a model, as a
    function of the flat parameter vector, with its gradient and Fisher-vector products."""

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor, lam: float) -> None:
        self.model = copy.deepcopy(model).double().eval()
        self.names = [name for name, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.x, self.y, self.lam = x.double(), y, lam

    def _params(self, flat: Tensor) -> dict[str, Tensor]:
        sizes = [math.prod(shape) for shape in self.shapes]
        parts = torch.split(flat, sizes)
        return {n: p.view(s) for n, p, s in zip(self.names, parts, self.shapes, strict=True)}

    def logits_of(self, x: Tensor) -> Tensor:
        """The model's logits on ``x`` (float64) at its own parameters."""
        return functional_call(self.model, self._params(self.theta), (x,))

    def logits(self, flat: Tensor) -> Tensor:
        """The model's logits on the whole training set at parameters ``flat``."""
        return functional_call(self.model, self._params(flat), (self.x,))

    def gradient(self) -> Tensor:
        """``∇θ (mean NLL + ½λ‖θ‖²)`` at the model's parameters."""
        theta = self.theta.clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(self.logits(theta), self.y)
        loss = loss + 0.5 * self.lam * theta.pow(2).sum()
        return torch.autograd.grad(loss, theta)[0]

    def fisher_vector(self, v: Tensor) -> Tensor:
        """``F v = (1/m) Jᵀ Λ J v`` with ``Λ = diag p − ppᵀ`` per sample (exact, float64)."""
        logits, jv = jvp(self.logits, (self.theta,), (v,))
        p = torch.softmax(logits, dim=-1)
        lam_jv = p * jv - p * (p * jv).sum(dim=-1, keepdim=True)
        _, pullback = vjp(self.logits, self.theta)
        return pullback(lam_jv / self.x.shape[0])[0]


def conjugate_gradient(
    apply: Callable[[Tensor], Tensor],
    b: Tensor,
    tol: float = 1e-8,
    max_steps: int = 3000,
    max_seconds: float = 30.0,
) -> tuple[Tensor, float, int]:
    """Solve ``A x = b`` (A symmetric positive definite); ``(x, relative residual, steps)``.
    Stopped early after ``max_seconds``: ``bᵀx`` is then a lower bound of ``bᵀA⁻¹b`` (it
    increases with every step)."""
    start = time.perf_counter()
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr, norm_b = float(r @ r), float(b.norm())
    steps = 0
    while steps < max_steps:
        steps += 1
        ap = apply(p)
        alpha = rr / float(p @ ap)
        x += alpha * p
        r -= alpha * ap
        rr_new = float(r @ r)
        if math.sqrt(rr_new) <= tol * norm_b or time.perf_counter() - start > max_seconds:
            rr = rr_new
            break
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x, math.sqrt(rr) / norm_b, steps


def decrements(model: nn.Module, x: Tensor, y: Tensor, lam: float) -> dict[str, float]:
    """The Newton decrement of the regularized objective (CG, exact) and its two cheap bounds."""
    objective = Objective(model, x, y, lam)
    g = objective.gradient()
    g2 = float(g @ g)
    fg = objective.fisher_vector(g)

    def shifted(v: Tensor) -> Tensor:
        return objective.fisher_vector(v) + lam * v

    solution, residual, steps = conjugate_gradient(shifted, g)
    return {
        "grad_norm": math.sqrt(g2),
        "decrement": 0.5 * float(g @ solution),
        "decrement_residual": residual,
        "decrement_steps": steps,
        "decrement_lower": 0.5 * g2 * g2 / (float(g @ fg) + lam * g2),
        "decrement_upper": 0.5 * g2 / lam,
    }


def _jacobians(objective: Objective, x: Tensor, chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Per chunk of ``x``: each sample's logit Jacobian ``(b, C, P)`` and probabilities."""

    def one(flat: Tensor, sample: Tensor) -> Tensor:
        return functional_call(objective.model, objective._params(flat), (sample[None],))[0]

    jacobian = vmap(jacrev(one), in_dims=(None, 0))
    for start in range(0, x.shape[0], chunk):
        part = x[start : start + chunk].double()
        with torch.no_grad():
            probabilities = torch.softmax(objective.logits_of(part), dim=-1)
        yield jacobian(objective.theta, part).detach(), probabilities


def _gradient_rows(jacobians: Tensor, probabilities: Tensor, labels: Tensor) -> Tensor:
    """Each sample's NLL gradient ``Jᵢᵀ(pᵢ − yᵢ)``, ``(b, P)``."""
    residual = probabilities - nn.functional.one_hot(labels, probabilities.shape[-1]).double()
    return torch.einsum("bcp,bc->bp", jacobians, residual)


def regularized_tics(
    model: nn.Module, x: Tensor, y: Tensor, x_val: Tensor, y_val: Tensor, lam: float
) -> dict[str, float]:
    """The regularized TIC ``(1/n)·Tr(C (F+λI)⁻¹)`` with the exact float64 Fisher of the
    training set and C the training gradients' second moment, their covariance, or the held-out
    gradients' second moment (the package's ``Tr(C)`` is the second moment's trace)."""
    start = time.perf_counter()
    objective = Objective(model, x, y, lam)
    size, n = objective.theta.numel(), x.shape[0]
    fisher = torch.zeros(size, size, dtype=torch.float64)
    rows = []
    for (jac, p), labels in zip(_jacobians(objective, x, 128), y.split(128), strict=True):
        weighted = p[..., None] * jac - p[..., None] * torch.einsum("bc,bcp->bp", p, jac)[:, None]
        fisher += jac.reshape(-1, size).T @ weighted.reshape(-1, size)
        rows.append(_gradient_rows(jac, p, labels))
    train_rows = torch.cat(rows)
    val_parts = zip(_jacobians(objective, x_val, 128), y_val.split(128), strict=True)
    val_rows = torch.cat([_gradient_rows(jac, p, labels) for (jac, p), labels in val_parts])
    fisher = fisher / n
    fisher.diagonal().add_(lam)
    factor = torch.linalg.cholesky(fisher)

    def trace(rows: Tensor) -> float:
        whitened = torch.linalg.solve_triangular(factor, rows.T, upper=False)
        return float(whitened.square().sum()) / rows.shape[0]

    return {
        "tic_train": trace(train_rows) / n,
        "tic_train_centered": trace(train_rows - train_rows.mean(0)) / n,
        "tic_val": trace(val_rows) / n,
        "tic_seconds": time.perf_counter() - start,
    }


def untrained(run: dict) -> tuple[nn.Module, Tensor, Tensor, Tensor, Tensor]:
    """``run``'s model, seeded and not yet trained, and its data ``(x, y, x_val, y_val)``."""
    x, y, x_val, y_val = load_data(run["image_size"], run["n"], run["seed"])
    torch.manual_seed(run["seed"])
    model = build_model(run["architecture"], tuple(x.shape[1:]), 10, hidden=run["hidden"] or 70)
    return model, x, y, x_val, y_val


def one_run(run: dict, tic: bool = True) -> dict:
    """Train one model of ``run``, measure it and return its record."""
    model, x, y, x_val, y_val = untrained(run)
    start = time.perf_counter()
    history = train(model, x, y, run)
    train_seconds = time.perf_counter() - start
    batches = [(x[i : i + 500], y[i : i + 500]) for i in range(0, x.shape[0], 500)]
    val_batches = [(x_val[i : i + 500], y_val[i : i + 500]) for i in range(0, x_val.shape[0], 500)]
    report = measure(
        model, batches, lam=run["lam"], num_train_samples=run["n"], val_batches=val_batches
    )
    start = time.perf_counter()
    newton = decrements(model, x, y, run["lam"])
    values = report.as_dict()
    keep = [
        *("observed_gap", "error_uncertainty_train", "error_uncertainty_val", "soft_rank"),
        *("trace_ratio_train", "trace_ratio_val", "train_nll", "val_nll", "train_accuracy"),
        *("val_accuracy", "rank_bound", "trusted", "structure", "seconds"),
    ]
    record = {**run, **{k: values[k] for k in keep}, **newton}
    add_predictions(record)
    record.update(
        parameters=sum(p.numel() for p in model.parameters()),
        observed_gap_stderr=gap_stderr(model, x_val, y_val),
        train_nll_stderr=gap_stderr(model, x, y),
        soft_rank_per_n=values["soft_rank"] / run["n"],
        nll_drop=(history[-2] - history[-1]) / max(history[-2], 1e-12),
        train_seconds=train_seconds,
        decrement_seconds=time.perf_counter() - start,
    )
    if tic:
        record.update(regularized_tics(model, x, y, x_val, y_val, run["lam"]))
    return record


# ---------------------------------------------------------------------------------------------
# Analysis: candidate predictors and trust rules against the observed gap.


def add_predictions(record: dict) -> None:
    """Eq. 13 with either trace ratio: ``predicted_gap_train`` (training) and
    ``predicted_gap_val`` (held-out), from the record's soft rank and trace ratios."""
    rank_per_n = record["soft_rank"] / record["n"]
    record["predicted_gap_train"] = record["trace_ratio_train"] * rank_per_n
    record["predicted_gap_val"] = record["trace_ratio_val"] * rank_per_n


#: the regularized TICs, recorded unless ``--no-tic``
TICS = ("tic_train", "tic_train_centered", "tic_val")


def ratio(record: dict, predictor: str) -> float:
    """Predicted ÷ observed gap; +inf when the observed gap is ≤ 0."""
    observed = record["observed_gap"]
    return record[predictor] / observed if observed > 0 else math.inf


def within(record: dict, predictor: str, factor: float = 2.0) -> bool:
    """The prediction is within ``factor`` of a positive observed gap."""
    value = ratio(record, predictor)
    return math.isfinite(value) and 1 / factor <= value <= factor


def resolved(record: dict) -> bool:
    """The observed gap is more than two standard errors from 0 (records without the standard
    error count as resolved)."""
    return record["observed_gap"] > 2 * record.get("observed_gap_stderr", 0.0)


def gap_noise(record: dict) -> float:
    """The observed gap's standard deviation about the *expected* gap Eq. 13 predicts: the
    held-out mean NLL's standard error and the training mean's, ``σ_train/√n`` (one training
    set is a sample too: at given parameters its mean loss fluctuates by that much around the
    population's, on these n as much as the gap itself)."""
    return math.hypot(record.get("observed_gap_stderr", 0.0), record.get("train_nll_stderr", 0.0))


def consistent(record: dict, predictor: str, factor: float = 2.0) -> bool:
    """Some gap within two noise deviations of the observed one is within ``factor`` of the
    prediction: ``[obs − 2s, obs + 2s]`` meets ``[pred/factor, pred·factor]``."""
    observed, spread, predicted = record["observed_gap"], 2 * gap_noise(record), record[predictor]
    return observed + spread >= predicted / factor and observed - spread <= predicted * factor


def decrement_share(record: dict, predictor: str = "predicted_gap_train") -> float:
    """Newton decrement ÷ predicted gap: how much the objective would still fall, in gaps."""
    return record["decrement"] / record[predictor]


def alpha(record: dict) -> float:
    """The training error/uncertainty ratio α_train."""
    return record["error_uncertainty_train"]


#: candidate rules: name -> record -> trusted
RULES: dict[str, Callable[[dict], bool]] = {
    "all runs": lambda r: True,
    "the package's `trusted`": lambda r: r["trusted"] >= 0.5,
    "the package's `trusted`, ratios within 2×": lambda r: (
        r["trusted"] >= 0.5 and r["trace_ratio_val"] <= 2 * r["trace_ratio_train"]
    ),
    "α_train ≥ 0.5 (before)": lambda r: alpha(r) >= 0.5,
    "α_train ≥ 0.3": lambda r: alpha(r) >= 0.3,
    "α_val ≥ 0.5": lambda r: r["error_uncertainty_val"] >= 0.5,
    "soft rank ≤ n/2": lambda r: r["soft_rank_per_n"] <= 0.5,
    "ratios agree (val ÷ train ≤ 1.5)": lambda r: (
        r["trace_ratio_val"] <= 1.5 * r["trace_ratio_train"]
    ),
    "decrement ≤ 0.5 × gap": lambda r: decrement_share(r) <= 0.5,
    "decrement ≤ 0.1 nat": lambda r: r["decrement"] <= 0.1,
    "NLL drop ≤ 5%": lambda r: r["nll_drop"] <= 0.05,
    "α_train ≥ 0.5, decrement ≤ 0.5 × gap": lambda r: alpha(r) >= 0.5 and decrement_share(r) <= 0.5,
    "α_train ≥ 0.3, decrement ≤ 0.1 nat": lambda r: alpha(r) >= 0.3 and r["decrement"] <= 0.1,
    "α_train ≥ 0.3, lower bound ≤ 0.1 nat": lambda r: (
        alpha(r) >= 0.3 and r["decrement_lower"] <= 0.1
    ),
    "α_train ≥ 0.3, NLL drop ≤ 5%": lambda r: alpha(r) >= 0.3 and r["nll_drop"] <= 0.05,
    "α_train ≥ 0.3, soft rank ≤ n/4": lambda r: alpha(r) >= 0.3 and r["soft_rank_per_n"] <= 0.25,
    "α_train ≥ 0.3, α_train ≤ 0.7": lambda r: 0.3 <= alpha(r) <= 0.7,
}


def cell(records: list[dict], predictor: str) -> str:
    """``count, share within 2×, median ratio`` of a set of runs."""
    if not records:
        return "0, –, –"
    share = sum(within(r, predictor) for r in records) / len(records)
    middle = statistics.median(ratio(r, predictor) for r in records)
    clear = [r for r in records if resolved(r)]
    text = f"{len(records)}, {share:.0%}, {middle:.2f}"
    if len(clear) != len(records):
        clear_share = sum(within(r, predictor) for r in clear) / len(clear) if clear else math.nan
        text += f" ({len(clear)} resolved: {clear_share:.0%})"
    if all("train_nll_stderr" in r for r in records):
        text += f" [{sum(consistent(r, predictor) for r in records) / len(records):.0%}]"
    return text


def rule_table(records: list[dict], predictor: str) -> str:
    """Per rule and grid: trusted runs (count, within 2×, median ratio) | untrusted within 2×."""
    grids = list(dict.fromkeys(r["grid"] for r in records))
    header = ["rule"] + [f"{g} ({records_role(records, g)})" for g in grids]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, rule in RULES.items():
        row = [name]
        for grid in grids:
            runs = [r for r in records if r["grid"] == grid]
            trusted = [r for r in runs if rule(r)]
            untrusted = [r for r in runs if not rule(r)]
            inside = sum(within(r, predictor) for r in untrusted)
            row.append(f"{cell(trusted, predictor)} / {inside} of {len(untrusted)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def records_role(records: list[dict], grid: str) -> str:
    """The role of a grid: ``choose`` (the rule was chosen on it) or ``check``."""
    return GRIDS[grid].role if grid in GRIDS else records[0]["role"]


def run_table(records: list[dict]) -> str:
    """One line per run: the signals the rules read."""
    header = [
        *("grid", "arch", "n", "c", "lr", "ep", "train_nll", "obs", "pred_val", "pred_train"),
        *("α_train", "α_val", "rank/n", "dec", "dec/gap", "low", "nll_drop", "cg_res"),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        row = [
            r["grid"], r["architecture"], r["n"], r["c"], r["lr"], r["epochs"],
            f"{r['train_nll']:.3f}",
            f"{r['observed_gap']:.4f} ± {r.get('observed_gap_stderr', math.nan):.4f}",
            f"{r['predicted_gap_val']:.4f}",
            f"{r['predicted_gap_train']:.4f}", f"{r['error_uncertainty_train']:.2f}",
            f"{r['error_uncertainty_val']:.2f}", f"{r['soft_rank_per_n']:.2f}",
            f"{r['decrement']:.3g}", f"{decrement_share(r):.3g}", f"{r['decrement_lower']:.3g}",
            f"{r['nll_drop']:.3g}", f"{r['decrement_residual']:.1e}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def repeat_table(records: list[dict]) -> str:
    """Per setting trained on several draws of its data: the mean observed gap with its
    standard error over the draws, the mean of each prediction and their ratio."""
    header = ["setting", "draws", "observed gap (mean ± se)", "Eq. 13", "÷ observed", "TIC"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    settings: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("role") == "repeats":
            key = (r["grid"], r["architecture"], r["n"], r["c"], r["lr"], r["epochs"])
            settings.setdefault(key, []).append(r)
    for (grid, arch, n, c, lr, epochs), runs in settings.items():
        gaps = [r["observed_gap"] for r in runs]
        mean_gap = statistics.mean(gaps)
        se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else math.nan
        predicted = statistics.mean(r["predicted_gap_train"] for r in runs)
        tic = statistics.mean(r.get("tic_train", math.nan) for r in runs)
        row = [
            f"{grid} {arch} n={n} c={c} lr={lr} {epochs} epochs", len(runs),
            f"{mean_gap:.4f} ± {se:.4f}", f"{predicted:.4f}", f"{predicted / mean_gap:.2f}",
            f"{tic:.4f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def analyse(path: Path) -> None:
    """Print the per-run signals and the rule tables of both predictors."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        add_predictions(record)
    print(f"{len(records)} runs from {path}\n")
    print(run_table(records), "\n")
    if any(r.get("role") == "repeats" for r in records):
        print(repeat_table(records), "\n")
    predictors = ("predicted_gap_train", "predicted_gap_val", *TICS)
    for predictor in [p for p in predictors if all(p in r for r in records)]:
        print(f"### {predictor}: trusted runs, within 2×, median ratio / untrusted within 2×\n")
        print(rule_table(records, predictor), "\n")


def collect(
    grids: Sequence[str], output: Path, cs: Sequence[float] | None = None, tic: bool = True
) -> None:
    """Run every grid's runs not yet in ``output`` (those at ``cs`` only, when given) and
    append their records."""
    done = recorded_keys(output)
    for name in grids:
        for run in GRIDS[name].runs():
            if run_key(run) in done or (cs is not None and run["c"] not in cs):
                continue
            record = record_run(run, output, tic=tic)
            print(
                f"{name} {run['architecture']} n={run['n']} c={run['c']} lr={run['lr']} "
                f"ep={run['epochs']}: pred val {record['predicted_gap_val']:.4f} train "
                f"{record['predicted_gap_train']:.4f} obs {record['observed_gap']:.4f} "
                f"α {record['error_uncertainty_train']:.2f} dec/gap {decrement_share(record):.3g}"
                f" ({record['total_seconds']:.0f} s)",
                flush=True,
            )


def recorded_keys(output: Path) -> set[tuple]:
    """The :func:`run_key` of every run already recorded in ``output`` (none if it is new)."""
    if not output.exists():
        return set()
    return {run_key(json.loads(line)) for line in output.read_text().splitlines()}


def record_run(run: dict, output: Path, tic: bool = True) -> dict:
    """Train and measure one run (:func:`one_run`), append its record, with the seconds it
    took, to ``output`` and return it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    record = one_run(run, tic=tic)
    record["total_seconds"] = time.perf_counter() - start
    with output.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    return record


def run_key(run: dict) -> tuple:
    """What identifies a run within the study."""
    keys = ("grid", "architecture", "hidden", "n", "c", "lr", "epochs", "seed", "image_size")
    return tuple(run[k] for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", default="all", help="comma-separated grid names, or all")
    parser.add_argument("--output", type=Path, default=Path("runs/study_trust/records.jsonl"))
    parser.add_argument("--analyse", type=Path, help="print the tables of a records file")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cs", help="comma-separated values of c to run (default: the grid's)")
    parser.add_argument("--no-tic", action="store_true", help="leave out the regularized TICs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.analyse:
        analyse(args.analyse)
        return
    names = list(GRIDS) if args.grids == "all" else args.grids.split(",")
    cs = [float(c) for c in args.cs.split(",")] if args.cs else None
    collect(names, args.output, cs=cs, tic=not args.no_tic)
    analyse(args.output)


if __name__ == "__main__":
    main()
