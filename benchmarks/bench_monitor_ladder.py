"""``FlatnessMonitor()`` at its defaults in a 30-epoch fit of the ladder's first rung (a
three-stage BatchNorm ResNet of 14,514 parameters on n = 5,000 three-channel 16×16 images,
``benchmarks/_ladder.py``): what it logs at each epoch (exact or fill-in), the last logged soft
rank against the exact soft rank of the final weights (the dense Fisher: every output's row,
summed as P × P in float64), and the fit's time with and without the monitor, side by side.

    python benchmarks/bench_monitor_ladder.py --decays 5e-4 5e-3 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import markdown_table
from _ladder import LadderClassifier, LadderResNet, colour16, ladder_trainer, quiet_start
from lightning import seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_flatness as lf
from lightning_flatness import FlatnessMonitor
from lightning_flatness.lightning.log_options import LogOptions


def _fit(data, widths, decay: float, epochs: int, monitor: FlatnessMonitor | None):
    x, y = data
    seed_everything(0)
    module = LadderClassifier(LadderResNet(widths), decay)
    trainer = ladder_trainer(epochs, [monitor] if monitor else [])
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    started = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - started, module.model.eval()


def _exact_soft_rank(model, x, y, decay: float) -> float:
    """The dense Fisher's soft rank at λ = the weight decay: every output's row (probes =
    classes), summed as P × P in float64."""
    rows = lf.KernelOptions(probes=10, groups=1, side="parameters", max_parameters=10**6)
    report = lf.measure(
        model,
        [(x[i : i + 256], y[i : i + 256]) for i in range(0, x.shape[0], 256)],
        lam=decay,
        num_train_samples=x.shape[0],
        structure=rows,
    )
    return report.soft_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decays", type=float, nargs="+", default=[5e-4, 5e-3])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--widths", default="8,16,24")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=1, help="fits without and with the monitor, alternated"
    )
    args = parser.parse_args()
    quiet_start(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    x, y, _, _ = colour16(args.n, 0)
    rows = []
    for decay in args.decays:
        plains, watches, ratios = [], [], []
        for _ in range(args.repeats):  # alternated, so that a slow spell of the machine is shared
            plain, _ = _fit((x, y), widths, decay, args.epochs, None)
            monitor = FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))
            watched, model = _fit((x, y), widths, decay, args.epochs, monitor)
            plains.append(plain)
            watches.append(watched)
            ratios.append(f"{watched / plain:.2f}")
        plain, watched = statistics.median(plains), statistics.median(watches)
        exact = _exact_soft_rank(model, x, y, decay)
        history = monitor.history
        kinds = " ".join(f"{int(r['epoch'])}{'f' if r.get('fill_in') else 'e'}" for r in history)
        last = history[-1] if history else {}
        rows.append(
            [
                f"{decay:g} (c = {decay * args.n:g})",
                f"{plain:.1f}",
                f"{watched:.1f}",
                f"{watched / plain:.2f} ({', '.join(ratios)})",
                f"{monitor.budget.spent:.1f}",
                f"{len(history)} of {args.epochs}: {kinds}",
                f"{last.get('soft_rank', float('nan')):,.1f}",
                "fill-in" if last.get("fill_in") else "exact",
                f"{last.get('trusted', float('nan')):g}",
                f"{last.get('rank_bound', float('nan')):,.0f}",
                f"{exact:,.1f}",
                f"{last.get('soft_rank', float('nan')) / exact:.3f}",
            ]
        )
        print(markdown_table(HEADER, rows[-1:]), flush=True)
    print()
    print(markdown_table(HEADER, rows))


HEADER = [
    "weight decay",
    "fit without, s (median)",
    "fit with, s (median)",
    "ratio of medians (each repeat's)",
    "monitor's own account, s (last fit)",
    "epochs logged (epoch, e exact or f fill-in)",
    "last logged soft rank",
    "last value",
    "trusted",
    "rank bound",
    "exact soft rank, final weights",
    "last ÷ exact",
]


if __name__ == "__main__":
    main()
