"""How far the soft rank measured on a subset of the training set stands from the whole set's,
and how far its extrapolation (docs/math.md, "Sample size": the last doubling's increment
carried to n) does — what the monitor's fill-in is calibrated with before any exact
measurement of the whole set, and again at the last epoch.

At chosen epochs of a fit, the default structure measures the soft rank at λ = the weight decay
on the fixed random subsets of m = ``--subset`` // 2 and ``--subset`` samples the monitor reads
(nested: the first m of one seeded permutation) and on the whole training set. Printed per
epoch: the three values, the subset's ÷ the whole set's, and the extrapolation's ÷ the whole
set's, from the separately measured half and from the first half read off the subset's own
kernel (``blocks["first_half"]``, what the monitor uses where the kernel is formed).

    python benchmarks/bench_calibration.py --model ladder --decays 5e-4 5e-3
    python benchmarks/bench_calibration.py --model mlp --decays 2.5e-4 2.5e-2 --epochs 50
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import markdown_table, mnist7
from _ladder import LadderClassifier, LadderResNet, colour16, ladder_trainer, quiet_start
from lightning import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_flatness as lf
from lightning_flatness.core.curvature.probe_kernel import FIRST_HALF
from lightning_flatness.core.models import build_model
from lightning_flatness.core.sample_growth import extrapolated_soft_rank
from lightning_flatness.lightning.trainer_facts import fixed_subset_batches

BATCH_SIZE = 256


class SubsetSoftRanks(Callback):
    """At the ends of ``epochs``: the default structure's soft rank on the half subset, the
    subset and the whole set (module docstring)."""

    def __init__(self, loader: DataLoader, epochs: set[int], subset: int, decay: float) -> None:
        self.loader, self.epochs, self.subset, self.decay = loader, epochs, subset, decay
        self.rows: list[dict[str, float]] = []

    def _report(self, module: LightningModule, samples: int | None) -> lf.FlatnessReport:
        batches = fixed_subset_batches(self.loader, samples, BATCH_SIZE, seed=0)
        return lf.measure(
            module.model, batches, lam=self.decay, num_train_samples=len(self.loader.dataset)
        )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch not in self.epochs:
            return
        with torch.inference_mode(False), torch.enable_grad():
            half = self._report(pl_module, self.subset // 2)
            subset = self._report(pl_module, self.subset)
            started = time.perf_counter()
            whole = self._report(pl_module, None)
            seconds = time.perf_counter() - started
        in_core = subset.blocks.get(FIRST_HALF)
        self.rows.append(
            {
                "epoch": trainer.current_epoch,
                "half": half.soft_rank,
                "subset": subset.soft_rank,
                "in_core_half": in_core.soft_rank if in_core is not None else float("nan"),
                "whole": whole.soft_rank,
                "samples": subset.num_samples,
                "n": whole.num_samples,
                "seconds": seconds,
            }
        )


def _rows(model_name: str, decay: float, row: dict[str, float]) -> list[str]:
    n, m = int(row["n"]), int(row["samples"])
    whole = row["whole"]
    separate = extrapolated_soft_rank(row["half"], row["subset"], m, n)
    in_core = extrapolated_soft_rank(row["in_core_half"], row["subset"], m, n)
    return [
        model_name,
        f"{decay * n:g}",
        f"{row['epoch']}",
        f"{row['half']:,.0f}",
        f"{row['subset']:,.0f}",
        f"{whole:,.0f}",
        f"{row['subset'] / whole:.3f}",
        f"{separate / whole:.3f}",
        f"{in_core / whole:.3f}",
        f"{row['seconds']:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("ladder", "mlp"), default="ladder")
    parser.add_argument("--decays", type=float, nargs="+", default=[5e-4, 5e-3])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--at", type=int, nargs="+", default=None, help="epochs measured")
    parser.add_argument("--subset", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    quiet_start(args.threads)
    if args.model == "ladder":
        x, y, _, _ = colour16(5000, 0)
    else:
        x, y, _, _ = mnist7(4000)
    last = args.epochs - 1
    at = set(args.at) if args.at else {0, 2, last // 3, 2 * last // 3, last}
    rows = []
    for decay in args.decays:
        seed_everything(0)
        dataset = TensorDataset(x, y)
        measured = SubsetSoftRanks(
            DataLoader(dataset, batch_size=BATCH_SIZE), at, args.subset, decay
        )
        trainer = ladder_trainer(args.epochs, [measured])
        model = LadderResNet((8, 16, 24)) if args.model == "ladder" else build_model("mlp")
        module = LadderClassifier(model, decay, adam=args.model == "mlp")
        trainer.fit(module, DataLoader(dataset, batch_size=64, shuffle=True))
        rows += [_rows(args.model, decay, row) for row in measured.rows]
        print(markdown_table(HEADER, rows[-len(measured.rows) :]), flush=True)
    print()
    print(markdown_table(HEADER, rows))


HEADER = [
    "model",
    "c",
    "epoch",
    "soft rank, m/2",
    "soft rank, m",
    "soft rank, n",
    "m ÷ n",
    "extrapolated ÷ n (measured half)",
    "extrapolated ÷ n (kernel's half)",
    "whole set, s",
]


if __name__ == "__main__":
    main()
