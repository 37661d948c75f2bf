"""Error against cost: every structure's soft rank ÷ the exact one, next to its cost.

For the paper's MLP and CNN trained on n images of the bundled 7×7 MNIST in two regimes
(c = λ·n = 1, lightly regularized, and c = 0.01, over-fit), one run measures on the whole
training set:

- the exact soft rank and log-det (``dense`` or ``gram``, whichever matrix is smaller);
- ``kfac`` with exact rows, with one sampled label per input and with one Rademacher probe per
  input, ``diag``, ``hutchinson``;
- ``probe_kernel`` at several budgets (probes / jackknife groups);
- ``cg`` (Hutchinson with conjugate gradients) with 4 and 8 probes, with and without the
  Kronecker preconditioner;
- ``lanczos`` at several budgets (probes × Lanczos steps);

and prints each one's soft rank and log-det ÷ exact, and its time ÷ the time of one training
epoch over the same n samples (Adam, batch 64), both measured side by side in this run. The
summary row per structure gives the median and worst ratio over the four cases and the
median cost: the error-vs-cost curve a default is chosen from. Usage::

    python benchmarks/bench_accuracy_cost.py            # n = 1000, 20 epochs
    python benchmarks/bench_accuracy_cost.py --quick    # n = 300, 5 epochs
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import markdown_table, median, mnist7, print_header, set_threads, train_epoch
from torch import nn

from lightning_flatness import KernelOptions, KFACOptions, MatrixFreeOptions, measure
from lightning_flatness.core.models import build_model
from lightning_flatness.core.options import StructureOptions

#: variant → what measure() is given as its structure (a name or an options object)
VARIANTS: dict[str, str | StructureOptions] = {
    "kfac (exact rows)": "kfac",
    "kfac (sampled)": KFACOptions(kfac_mode="sampled", trace_estimator="sampled"),
    "kfac (probe)": KFACOptions(kfac_mode="probe", trace_estimator="probe"),
    "diag": "diag",
    "hutchinson": "hutchinson",
    **{
        f"probe_kernel {probes}/{groups}": KernelOptions(
            probes=probes, groups=groups, trace_estimator="probe"
        )
        for probes, groups in ((2, 2), (4, 2), (4, 4), (8, 2))
    },
    **{
        f"cg {probes} probes, {preconditioner}": MatrixFreeOptions(
            probes=probes, preconditioner=preconditioner
        )
        for probes in (4, 8)
        for preconditioner in ("kfac", "none")
    },
    "cg 4 probes, kfac, 150 products": MatrixFreeOptions(probes=4, cg_steps=150, cg_tol=0.005),
    **{
        f"lanczos {probes}×{steps}": MatrixFreeOptions(
            structure="lanczos", probes=probes, lanczos_steps=steps
        )
        for probes, steps in ((2, 10), (2, 25), (5, 25), (5, 50), (10, 80), (10, 200), (10, 400))
    },
}

REGIMES = {"c = 1": 1.0, "c = 0.01 (over-fit)": 0.01}


def _model(architecture: str) -> nn.Module:
    hidden = 70
    return build_model(architecture, (1, 7, 7), 10, hidden)


def _train(architecture: str, c: float, data, epochs: int, seed: int) -> tuple[nn.Module, float]:
    x, y = data[0], data[1]
    lam = c / x.shape[0]
    torch.manual_seed(seed)
    model = _model(architecture)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=lam)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        train_epoch(model, optimizer, x, y, 64, generator)
    return model.eval(), lam


def _epoch_seconds(model: nn.Module, lam: float, x, y) -> float:
    """One training epoch over (x, y), on a copy, median of three."""
    times = []
    for _ in range(3):
        copy = _model_copy(model)
        optimizer = torch.optim.Adam(copy.parameters(), lr=1e-3, weight_decay=lam)
        start = time.perf_counter()
        train_epoch(copy, optimizer, x, y, 64)
        times.append(time.perf_counter() - start)
    return median(times)


def _model_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _batches(x, y, size: int = 256) -> list:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 300, 5 epochs")
    parser.add_argument("--n", type=int, default=None, help="training samples (default 1000)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 20)")
    parser.add_argument(
        "--variants", nargs="*", default=None, help="measure only these (names as printed)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    n, epochs = (300, 5) if args.quick else (1000, 20)
    n, epochs = args.n or n, args.epochs or epochs
    variants = {v: VARIANTS[v] for v in (args.variants or VARIANTS)}
    data = mnist7(train_size=n, val_size=100)
    x, y = data[0], data[1]
    print_header(f"Soft rank ÷ exact and cost ÷ one training epoch (n = {n}, {epochs} epochs)")
    summary: dict[str, dict[str, list[float]]] = {v: {"rank": [], "cost": []} for v in variants}
    for architecture in ("mlp", "cnn"):
        for regime, c in REGIMES.items():
            model, lam = _train(architecture, c, data, epochs, seed=0)
            parameters = sum(p.numel() for p in model.parameters())
            exact_structure = "dense" if parameters <= n * 10 else "gram"
            epoch = _epoch_seconds(model, lam, x, y)
            exact = measure(
                model, _batches(x, y), lam=lam, num_train_samples=n, structure=exact_structure
            )
            rows = [
                [
                    "exact (" + exact_structure + ")",
                    f"{exact.soft_rank:.1f}",
                    "1.00",
                    "1.00",
                    f"{exact.seconds / epoch:.1f}",
                ]
            ]
            for variant, structure in variants.items():
                report = measure(
                    model, _batches(x, y), lam=lam, num_train_samples=n, structure=structure
                )
                rank_ratio = report.soft_rank / exact.soft_rank
                cost = report.seconds / epoch
                summary[variant]["rank"].append(rank_ratio)
                summary[variant]["cost"].append(cost)
                rows.append(
                    [
                        variant,
                        f"{report.soft_rank:.1f}",
                        f"{rank_ratio:.2f}",
                        f"{report.logdet / exact.logdet:.2f}",
                        f"{cost:.1f}",
                    ]
                )
            print(
                f"\n### {architecture}, {regime}: λ = {lam:.1e}, P = {parameters}, "
                f"one epoch {epoch * 1e3:.0f} ms\n"
            )
            header = ["structure", "soft rank", "÷ exact", "log-det ÷ exact", "s ÷ epoch"]
            print(markdown_table(header, rows))
    print("\n### Summary over the four cases\n")
    rows = []
    for variant, values in summary.items():
        ratios = values["rank"]
        worst = max(ratios, key=lambda r: max(r, 1 / r))
        rows.append(
            [variant, f"{median(ratios):.2f}", f"{worst:.2f}", f"{median(values['cost']):.1f}"]
        )
    print(
        markdown_table(
            ["structure", "soft rank ÷ exact, median", "worst", "s ÷ epoch, median"], rows
        )
    )


if __name__ == "__main__":
    main()
