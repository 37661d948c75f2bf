"""How the soft rank depends on the number m of measured samples (docs/math.md, "Sample size").

The soft rank of a Fisher averaged over m < n samples is biased low (a concave function of a
sample mean). This benchmark trains the paper's MLP and CNN as ``configs/mlp.yaml`` and
``configs/cnn.yaml`` do (7×7 MNIST, n = 4,000 training images, Adam, coupled weight decay
λ = c/n with c = 1, the configs' learning rates, batch size and epochs), then measures each
structure on the fixed random subsets that :class:`~lightning_flatness.FlatnessMonitor` itself
uses (``fixed_subset_batches``: the first m of a seeded permutation, so subsets are nested) for
m ∈ {256, 512, 1024, 2048, n}. For m < n the cheap structures are measured on ``--seeds``
different subsets. Each row gives the soft rank, its ratio to the full-training-set value
(mean, min and max over subsets) and the time of one ``measure()`` call.

``gram`` is run where its size guard allows (m·C ≤ 8,192, so m ≤ 819) and ``dense`` for every m
(P ≈ 4.2k / 4.7k). ``--math-case`` repeats the example of docs/math.md, "Sample size": the MLP
trained on n = 1,000 with λ = 1e-5, measured at m = 100, 200, 400, 1,000.

The script ends with the smallest m of the grid whose KFAC soft rank is within ``--tolerance``
(5%) of the full-set value on every subset and model: the candidate ``max_samples`` default.

Usage::

    python benchmarks/bench_sample_size.py                # both models, all structures
    python benchmarks/bench_sample_size.py --quick        # fewer epochs, no dense
    python benchmarks/bench_sample_size.py --math-case --models none
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    TrainedModel,
    markdown_table,
    mnist7,
    print_header,
    set_threads,
    train_model,
)
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import measure
from lightning_flatness.core.backpack.gram import DEFAULT_MAX_KERNEL_SIZE
from lightning_flatness.lightning.trainer_facts import fixed_subset_batches

STRUCTURES = ("kfac", "diag", "diag_mc", "gram", "dense")
#: Structures too slow to repeat over several subsets.
SLOW = ("gram", "dense")
NUM_CLASSES = 10
BATCH_SIZE = 256  # FlatnessMonitor's default measurement batch size


@dataclass
class Row:
    """One (model, structure, m) cell: soft ranks over subsets and measurement times."""

    model: str
    structure: str
    m: int
    soft_ranks: list[float]
    seconds: list[float]


def _feasible(structure: str, m: int) -> bool:
    return structure != "gram" or m * NUM_CLASSES <= DEFAULT_MAX_KERNEL_SIZE


def measure_grid(
    trained: TrainedModel,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    sizes: Sequence[int],
    structures: Sequence[str],
    seeds: int,
) -> list[Row]:
    """Soft ranks of ``trained.model`` for every structure and m (all subsets)."""
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=64)
    n = x_train.shape[0]
    rows = []
    for structure in structures:
        for m in sizes:
            if not _feasible(structure, m):
                continue
            subset_seeds = [0] if m >= n or structure in SLOW else list(range(seeds))
            ranks, seconds = [], []
            for seed in subset_seeds:
                batches = fixed_subset_batches(loader, m, BATCH_SIZE, seed)
                report = measure(
                    trained.model,
                    batches,
                    lam=trained.lam,
                    num_train_samples=n,
                    structure=structure,
                    seed=seed,
                )
                ranks.append(report.soft_rank)
                seconds.append(report.seconds)
            rows.append(Row(trained.architecture, structure, min(m, n), ranks, seconds))
            print(
                f"<!-- {trained.architecture} {structure} m={min(m, n)}: "
                f"{[round(r, 1) for r in ranks]} in {sum(seconds):.1f} s -->",
                flush=True,
            )
    return rows


def table(rows: list[Row], n: int) -> str:
    """Markdown table of ``rows``; ratios are to the same structure's value at m = n."""
    full = {(r.model, r.structure): r.soft_ranks[0] for r in rows if r.m == n}
    body = []
    for r in rows:
        # gram cannot reach m = n; both it and dense are the exact Fisher of the m samples
        structure = "dense" if r.structure == "gram" else r.structure
        reference = full.get((r.model, structure), float("nan"))
        ratios = [rank / reference for rank in r.soft_ranks]
        mean_rank = sum(r.soft_ranks) / len(r.soft_ranks)
        mean_ratio = sum(ratios) / len(ratios)
        spread = f"{min(ratios):.3f}–{max(ratios):.3f}" if len(ratios) > 1 else ""
        body.append(
            [
                r.model,
                r.structure,
                r.m,
                len(r.soft_ranks),
                f"{mean_rank:.1f}",
                f"{mean_ratio:.3f}",
                spread,
                f"{sum(r.seconds) / len(r.seconds):.2f}",
            ]
        )
    header = [
        "model",
        "structure",
        "m",
        "subsets",
        "soft rank (mean)",
        "÷ full set (gram: ÷ dense)",
        "range over subsets",
        "s / measure()",
    ]
    return markdown_table(header, body)


def recommendation(rows: list[Row], n: int, tolerance: float) -> str:
    """The smallest m whose KFAC soft rank is within ``tolerance`` of m = n on every subset."""
    kfac = [r for r in rows if r.structure == "kfac"]
    models = sorted({r.model for r in kfac})
    full = {r.model: r.soft_ranks[0] for r in kfac if r.m == n}
    for m in sorted({r.m for r in kfac}):
        cells = [r for r in kfac if r.m == m]
        worst = max(abs(rank / full[r.model] - 1) for r in cells for rank in r.soft_ranks)
        if len(cells) == len(models) and worst <= tolerance:
            return (
                f"Smallest m with every KFAC soft rank within {tolerance:.0%} of its full-set "
                f"value ({', '.join(models)}): m = {m} (worst deviation {worst:.1%})."
            )
    return f"No m below n keeps every KFAC soft rank within {tolerance:.0%}."


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, train, measure and print the markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated configs, or none")
    parser.add_argument("--sizes", default="256,512,1024,2048,4000", help="values of m")
    parser.add_argument("--structures", default=",".join(STRUCTURES), help="comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="subsets per m for cheap structures")
    parser.add_argument("--epochs", type=int, default=None, help="override the configs' epochs")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed KFAC bias")
    parser.add_argument(
        "--math-case", action="store_true", help="also the example of docs/math.md, Sample size"
    )
    parser.add_argument("--math-epochs", type=int, default=100, help="epochs of that MLP")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache-dir", default=None, help="reuse trained weights from here")
    parser.add_argument("--quick", action="store_true", help="10 epochs, no dense, 2 subsets")
    args = parser.parse_args(argv)
    structures = [s.strip() for s in args.structures.split(",") if s.strip()]
    unknown = sorted(set(structures) - set(STRUCTURES))
    if unknown:
        parser.error(f"unknown structures {unknown}; choose among {list(STRUCTURES)}")
    if args.quick:
        args.epochs = args.epochs or 10
        args.seeds = min(args.seeds, 2)
        args.math_epochs = min(args.math_epochs, 30)
        structures = [s for s in structures if s != "dense"]
    set_threads(args.threads)
    models = [] if args.models == "none" else args.models.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as temporary:
        cache = Path(args.cache_dir or temporary)
        print_header("Soft rank vs number of measured samples m")
        data = mnist7(train_size=4000, val_size=1000)
        rows: list[Row] = []
        trained_lines = []
        for architecture in models:
            trained = train_model(architecture, data, epochs=args.epochs, cache_dir=cache)
            trained_lines.append(
                f"- {architecture}: {trained.epochs} epochs, λ = {trained.lam:.3g}, "
                f"train acc {trained.train_accuracy:.3f}, val acc {trained.val_accuracy:.3f}"
            )
            rows += measure_grid(trained, data[0], data[1], sizes, structures, args.seeds)
        if rows:
            print("\n".join(trained_lines) + "\n")
            print(table(rows, 4000))
            print("\n" + recommendation(rows, 4000, args.tolerance))
        if args.math_case:
            small = mnist7(train_size=1000, val_size=1000)
            trained = train_model("mlp", small, epochs=args.math_epochs, lam=1e-5, cache_dir=cache)
            print(
                f"\n### docs/math.md, Sample size case: MLP, n = 1000, λ = 1e-5, "
                f"{trained.epochs} epochs "
                f"(train acc {trained.train_accuracy:.3f}, val acc {trained.val_accuracy:.3f})\n"
            )
            case = measure_grid(
                trained, small[0], small[1], [100, 200, 400, 1000], structures, args.seeds
            )
            print(table(case, 1000))


if __name__ == "__main__":
    main()
