"""What ``FlatnessMonitor()`` at its defaults adds to a fit, on the paper's models, the zoo and a
mid-size CNN, at n = 4,000 and a larger n.

For each setup one run fits the same model ``--repeats`` times each way, alternating, without
and with ``FlatnessMonitor()`` (every default: ``structure="auto"``, every epoch scheduled,
``overhead_budget=0.3``), and prints the fit's median wall time both ways, their ratio, what
the monitor says it added at the end (its seconds ÷ the training seconds, as
``flatness/overhead`` is logged), how many scheduled epochs got the exact-quality measurement,
the scaled fill-in or nothing, and whether the last value is exact. With ``--idle`` a third fit
per repeat has a monitor scheduled past the last epoch (``every_n_epochs`` > ``max_epochs``), so
it measures once, at fit end: the fit time the callback's presence and its fit-start check add
without the measurements.

Setups: the paper's MLP and CNN on the bundled 7×7 MNIST; a mid-size CNN (three 3×3
convolutions of 32, 64 and 64 channels with max pooling, 1×28×28 inputs: the bundled images
upsampled); n = 4,000 (the bundled training set) and, by default, n = 20,000 (the 4,000 and
noisy copies, ``x + 0.5·N(0, 1)``; ``--sizes`` picks others); and, at n = 4,000, the test
zoo's BatchNorm ResNet, ViT, token transformer (dict batches) and LSTM on their synthetic data
(``tests/zoo.py``, in float32).
Adam, lr 1e-3, λ = 1/n, batch 64. Usage::

    python benchmarks/bench_overhead.py [--threads 2] [--repeats 2] [--quick] [--idle]
        [--sizes 4000 20000 50000]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from _common import markdown_table, median, mid_cnn, mnist7, print_header, set_threads
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import FlatnessMonitor
from lightning_flatness.core.models import build_model
from lightning_flatness.lightning.log_options import LogOptions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # the test zoo: its models and synthetic data


class Classifier(LightningModule):
    def __init__(self, model: nn.Module, lam: float) -> None:
        super().__init__()
        self.model, self.lam = model, lam

    def forward(self, x) -> torch.Tensor:
        return self.model(**x) if isinstance(x, dict) else self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, weight_decay=self.lam)


@dataclass
class Setup:
    name: str
    build: object
    size: int | str  # 7 or 28 (MNIST), or the zoo model's name (its synthetic data)
    n: int
    epochs: int


def _zoo_data(name: str, n: int) -> tuple[list, list]:
    inputs, targets = zoo.zoo_data(name, n + 1000)
    if isinstance(inputs, dict):
        rows = [({k: v[i] for k, v in inputs.items()}, targets[i]) for i in range(n + 1000)]
    else:
        inputs = inputs.float() if inputs.is_floating_point() else inputs
        rows = list(zip(inputs, targets, strict=True))
    return rows[:n], rows[n:]


def _data(size: int | str, n: int) -> tuple[TensorDataset, TensorDataset]:
    if isinstance(size, str):
        return _zoo_data(size, n)
    x, y, xv, yv = mnist7(train_size=4000, val_size=1000)
    if n > x.shape[0]:
        noise = torch.Generator().manual_seed(1)
        index = torch.arange(n) % x.shape[0]
        extra = x[index[x.shape[0] :]] + 0.5 * torch.randn(
            (n - x.shape[0], *x.shape[1:]), generator=noise
        )
        x, y = torch.cat([x, extra]), y[index]
    if size != x.shape[-1]:
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        xv = F.interpolate(xv, size=size, mode="bilinear", align_corners=False)
    return TensorDataset(x, y), TensorDataset(xv, yv)


def _fit(setup: Setup, monitor: FlatnessMonitor | None) -> tuple[float, Trainer]:
    train, val = _data(setup.size, setup.n)
    seed_everything(0)
    module = Classifier(setup.build(), 1.0 / setup.n)
    trainer = Trainer(
        max_epochs=setup.epochs,
        callbacks=[monitor] if monitor else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loaders = (
        DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(val, batch_size=256),
    )
    start = time.perf_counter()
    trainer.fit(module, *loaders)
    return time.perf_counter() - start, trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="n = 4,000 only, fewer epochs")
    parser.add_argument(
        "--repeats", type=int, default=2, help="fits each way, alternating; medians reported"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[4000, 20_000],
        help="training-set sizes n (the zoo's fits at n = 4,000 only; 30 epochs at n ≤ 4,000, "
        "else 10)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs of every fit (default: as --sizes says)"
    )
    parser.add_argument(
        "--models", nargs="+", default=None, help="only these rows (e.g. mlp cnn 'zoo vit')"
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="add fits with a monitor that measures only at fit end (its presence's cost)",
    )
    args = parser.parse_args()
    set_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    paper = {"mlp": lambda: build_model("mlp"), "cnn": lambda: build_model("cnn")}
    setups = []
    for n in args.sizes:
        if args.quick and n > 4000:
            continue
        epochs = (10 if args.quick else 30) if n <= 4000 else 10
        setups += [Setup(name, build, 7, n, epochs) for name, build in paper.items()]
        setups.append(Setup("mid-size CNN", mid_cnn, 28, n, max(epochs // 3, 3)))
        if n == 4000:
            setups += [
                Setup(f"zoo {name}", lambda name=name: zoo.build(name).float().train(), name, n, 10)
                for name in ("resnet", "vit", "transformer", "lstm")
            ]
    if args.epochs is not None:
        setups = [replace(setup, epochs=args.epochs) for setup in setups]
    if args.models is not None:
        setups = [setup for setup in setups if setup.name in args.models]
    print_header(f"FlatnessMonitor() at its defaults ({args.threads} threads)")
    rows = []
    for setup in setups:
        plains, watcheds, idles = [], [], []
        for _ in range(args.repeats):  # alternating: drifts of a busy machine hit both alike
            plains.append(_fit(setup, None)[0])
            if args.idle:
                idle = FlatnessMonitor(
                    every_n_epochs=setup.epochs + 1,
                    log_options=LogOptions(summary=False, spectrum=False),
                )
                idles.append(_fit(setup, idle)[0])
            monitor = FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))
            seconds, trainer = _fit(setup, monitor)
            watcheds.append(seconds)
        plain, watched = median(plains), median(watcheds)
        fill_ins = sum(1 for r in monitor.history if r.get("fill_in"))
        exact = len(monitor.history) - fill_ins
        last = monitor.history[-1] if monitor.history else {}
        share = monitor.budget.overhead()
        parameters = sum(p.numel() for p in trainer.lightning_module.parameters())
        rows.append(
            [
                setup.name,
                f"{parameters:,}",
                f"{setup.n:,}",
                str(setup.epochs),
                monitor.state.active_structure,
                f"{plain:.1f}",
                f"{watched:.1f}",
                f"{watched / plain:.2f}",
                *([f"{median(idles) / plain:.2f}"] if args.idle else []),
                f"{share:.0%}",
                f"{exact} / {fill_ins} / {setup.epochs - exact - fill_ins}",
                ("fill-in" if last.get("fill_in") else "exact") if last else "none",
                f"{last.get('soft_rank', float('nan')):,.1f}",
            ]
        )
        print(f"<!-- {setup.name} n={setup.n}: {plain:.1f} s / {watched:.1f} s -->", flush=True)
    header = [
        "model",
        "P",
        "n",
        "epochs",
        "structure",
        "fit without, s",
        "fit with, s",
        "ratio",
        *(["ratio, monitor measuring at fit end only"] if args.idle else []),
        "overhead (the monitor's own account)",
        "epochs exact / fill-in / none",
        "last value",
        "last soft rank",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
