"""``FlatnessMonitor()`` at its defaults in a 30-epoch fit of the ladder's first rung (a
three-stage BatchNorm ResNet of 14,514 parameters on n = 5,000 three-channel 16×16 images,
``benchmarks/_ladder.py``): what it logs at each epoch (exact or fill-in), the last logged soft
rank against the exact soft rank of the final weights (the dense Fisher: every output's row,
summed as P × P in float64), and the fit's time with and without the monitor, side by side.

    python benchmarks/bench_monitor_ladder.py --decays 5e-4 5e-3 --repeats 3

With ``--curve``, also the whole curve: the weights after every epoch of the monitored fit are
kept, and after it each is measured with the default structure on the whole training set (within
about 1% of the dense Fisher on this model, docs/RESULTS.md); printed per epoch, the logged value
÷ that exact one.

    python benchmarks/bench_monitor_ladder.py --decays 5e-4 5e-3 --curve
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from _common import markdown_table
from _ladder import LadderClassifier, LadderResNet, colour16, ladder_trainer, quiet_start
from lightning import Callback, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_flatness as lf
from lightning_flatness import FlatnessMonitor
from lightning_flatness.lightning.log_options import LogOptions


class KeepWeights(Callback):
    """The model's weights (and buffers) after every training epoch, by epoch."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.states[trainer.current_epoch] = copy.deepcopy(pl_module.model.state_dict())


def _fit(data, widths, decay: float, epochs: int, monitor: FlatnessMonitor | None, extra=()):
    x, y = data
    seed_everything(0)
    module = LadderClassifier(LadderResNet(widths), decay)
    callbacks = ([monitor] if monitor else []) + list(extra)
    trainer = ladder_trainer(epochs, callbacks)
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


def _curve(history, states, widths, x, y, decay: float) -> list[list[str]]:
    """Each logged value ÷ the default structure's soft rank of that epoch's weights on the
    whole training set."""
    model = LadderResNet(widths)
    rows = []
    for record in history:
        epoch = int(record["epoch"])
        model.load_state_dict(states[epoch])
        report = lf.measure(
            model.eval(),
            [(x[i : i + 256], y[i : i + 256]) for i in range(0, x.shape[0], 256)],
            lam=decay,
            num_train_samples=x.shape[0],
        )
        kind = "fill-in" if record.get("fill_in") else "exact"
        logged = record["soft_rank"]
        rows.append(
            [
                f"{decay * x.shape[0]:g}",
                str(epoch),
                kind,
                f"{record.get('calibration', float('nan')):.3g}",
                f"{record.get('seconds', float('nan')):.2f}",
                f"{logged:,.0f}",
                f"{report.soft_rank:,.0f}",
                f"{logged / report.soft_rank:.3f}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


CURVE_HEADER = [
    "c",
    "epoch",
    "logged",
    "calibration ratio",
    "its seconds",
    "logged soft rank",
    "default on the whole set",
    "logged ÷ whole set",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decays", type=float, nargs="+", default=[5e-4, 5e-3])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--widths", default="8,16,24")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--curve", action="store_true", help="every epoch against exact")
    parser.add_argument(
        "--repeats", type=int, default=1, help="fits without and with the monitor, alternated"
    )
    args = parser.parse_args()
    quiet_start(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    x, y, _, _ = colour16(args.n, 0)
    rows, curve = [], []
    for decay in args.decays:
        plains, watches, ratios = [], [], []
        for _ in range(args.repeats):  # alternated, so that a slow spell of the machine is shared
            plain, _ = _fit((x, y), widths, decay, args.epochs, None)
            monitor = FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))
            keep = KeepWeights()
            extra = [keep] if args.curve else []
            watched, model = _fit((x, y), widths, decay, args.epochs, monitor, extra)
            plains.append(plain)
            watches.append(watched)
            ratios.append(f"{watched / plain:.2f}")
        plain, watched = statistics.median(plains), statistics.median(watches)
        exact = _exact_soft_rank(model, x, y, decay)
        history = monitor.history
        kinds = " ".join(f"{int(r['epoch'])}{'f' if r.get('fill_in') else 'e'}" for r in history)
        ratios_at = [
            f"{int(r['epoch'])} ({r['calibration']:.3g})"
            for i, r in enumerate(history)
            if r.get("fill_in") and (i == 0 or r["calibration"] != history[i - 1]["calibration"])
        ]
        last = history[-1] if history else {}
        rows.append(
            [
                f"{decay:g} (c = {decay * args.n:g})",
                f"{plain:.1f}",
                f"{watched:.1f}",
                f"{watched / plain:.2f} ({', '.join(ratios)})",
                f"{monitor.budget.spent:.1f}",
                f"{len(history)} of {args.epochs}: {kinds}",
                ", ".join(ratios_at) or "–",
                f"{last.get('soft_rank', float('nan')):,.1f}",
                "fill-in" if last.get("fill_in") else "exact",
                f"{last.get('trusted', float('nan')):g}",
                f"{last.get('rank_bound', float('nan')):,.0f}",
                f"{exact:,.1f}",
                f"{last.get('soft_rank', float('nan')) / exact:.3f}",
            ]
        )
        print(markdown_table(HEADER, rows[-1:]), flush=True)
        if args.curve:
            curve += _curve(history, keep.states, widths, x, y, decay)
    print()
    print(markdown_table(HEADER, rows))
    if curve:
        print()
        print(markdown_table(CURVE_HEADER, curve))


HEADER = [
    "weight decay",
    "fit without, s (median)",
    "fit with, s (median)",
    "ratio of medians (each repeat's)",
    "monitor's own account, s (last fit)",
    "epochs logged (epoch, e exact or f fill-in)",
    "fill-in's ratio taken at epochs (ratio)",
    "last logged soft rank",
    "last value",
    "trusted",
    "rank bound",
    "exact soft rank, final weights",
    "last ÷ exact",
]


if __name__ == "__main__":
    main()
