"""The settled test read on fewer samples: the training NLL's relative drop over each epoch
(``nll_drop``, :func:`~lightning_flatness.core.trust.nll_drop`) on the monitor's nested fixed
subsets of 128, 256 and 1,024 training samples and on the whole training set, epoch by epoch,
and whether each subset's verdict (drop ≤ ``SETTLED_DROP``) is the whole set's.

Fits: the ladder's first rung (14,514 parameters, n = 5,000, SGD, 30 epochs) and the paper's
MLP on 7×7 digits (n = 4,000, Adam, 50 epochs), each at the weight decays given. The monitor
reads its subset once per epoch to untrust a model still descending; each read is a forward
pass over its samples, at every epoch of every fit, so its size is paid 30–50 times.

    python benchmarks/bench_settled_subsets.py --model ladder --decays 5e-4 5e-3
    python benchmarks/bench_settled_subsets.py --model mlp --decays 2.5e-4 2.5e-2 --epochs 50
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
from _common import markdown_table, mnist7
from _ladder import LadderClassifier, LadderResNet, colour16, ladder_trainer, quiet_start
from lightning import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness.core.models import build_model
from lightning_flatness.core.training_nll import mean_nll
from lightning_flatness.core.trust import SETTLED_DROP, nll_drop
from lightning_flatness.lightning.trainer_facts import fixed_subset_batches

#: the subset sizes read (nested: the monitor draws every subset as a prefix of one
#: permutation); None is the whole training set
SIZES = (128, 256, 1024, None)
BATCH_SIZE = 256


class NllBySubset(Callback):
    """The training NLL on each of :data:`SIZES` before the first epoch and after every one,
    and the seconds each read took."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.nll: dict[int | None, list[float]] = {size: [] for size in SIZES}
        self.seconds: dict[int | None, list[float]] = {size: [] for size in SIZES}

    def _read(self, module: LightningModule) -> None:
        for size in SIZES:
            batches = list(fixed_subset_batches(self.loader, size, BATCH_SIZE, seed=0))
            started = time.perf_counter()
            self.nll[size].append(mean_nll(module, batches))
            self.seconds[size].append(time.perf_counter() - started)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(pl_module)


def _settled(drop: float) -> bool:
    return math.isfinite(drop) and drop <= SETTLED_DROP


def _row(model_name: str, c: float, reads: NllBySubset) -> list[str]:
    """One fit's row: per subset, the epochs whose verdict is the whole set's, the largest
    |drop − whole set's drop|, and one read's median seconds."""
    drops = {
        size: [nll_drop(a, b) for a, b in itertools.pairwise(values)]
        for size, values in reads.nll.items()
    }
    whole = drops[None]
    settled = sum(_settled(d) for d in whole)
    row = [model_name, f"{c:g}", f"{len(whole)}", f"{settled}"]
    for size in SIZES:
        agree = sum(_settled(a) == _settled(b) for a, b in zip(drops[size], whole, strict=True))
        worst = max(abs(a - b) for a, b in zip(drops[size], whole, strict=True))
        seconds = sorted(reads.seconds[size])[len(reads.seconds[size]) // 2]
        row.append(f"{agree} ({worst:.3f}; {seconds * 1000:.0f} ms)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("ladder", "mlp"), default="ladder")
    parser.add_argument("--decays", type=float, nargs="+", default=[5e-4, 5e-3])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    quiet_start(args.threads)
    x, y = (colour16(5000, 0) if args.model == "ladder" else mnist7(4000))[:2]
    header = ["model", "c", "epochs", "settled epochs (whole set)"]
    header += [
        f"verdict = whole set's, m = {size or 'n'} (largest drop difference; one read)"
        for size in SIZES
    ]
    rows = []
    for decay in args.decays:
        seed_everything(0)
        dataset = TensorDataset(x, y)
        reads = NllBySubset(DataLoader(dataset, batch_size=BATCH_SIZE))
        model = LadderResNet((8, 16, 24)) if args.model == "ladder" else build_model("mlp")
        module = LadderClassifier(model, decay, adam=args.model == "mlp")
        with torch.random.fork_rng():
            ladder_trainer(args.epochs, [reads]).fit(
                module, DataLoader(dataset, batch_size=64, shuffle=True)
            )
        rows.append(_row(args.model, decay * len(dataset), reads))
        print(markdown_table(header, rows[-1:]), flush=True)
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
