"""Curves that move with the gap, and a value to select by (docs/RESULTS.md, "The headline that
ranks": within a fit, and the checkpoint it picks).

Trains classifiers that over-fit (the paper's MLP and CNN on the offline 7×7 or 14×14 MNIST at a
small weight decay, and a BatchNorm ResNet of the zoo) with ``FlatnessMonitor`` at its defaults
and ``ModelCheckpoint(monitor="flatness/predicted_test_nll", mode="min")`` in a Lightning
``Trainer``, as the README's example does — every value the monitor logs, fill-ins included, is
what a user's fit logs, and the checkpoint kept is the one a user would get.
The images not trained on are split in two halves: the *validation* half is the fit's
validation loader (the monitor's held-out data), the *test* half is read after every epoch by a
recorder that changes nothing (eval mode, no gradient, the mode restored) and gives the test
NLL each logged value is judged against.

Per fit it reports:

- the Kendall τ over the epochs between each predicted gap and the measured gap (test NLL −
  training NLL over the whole training set): does the curve rise when the gap rises?
- the epoch each value to select by picks (its minimum, as ``ModelCheckpoint(mode="min")``
  picks it; for ``predicted_test_nll`` the checkpoint ``ModelCheckpoint`` kept) and that epoch's
  test NLL ÷ the best epoch's; against the last epoch and the epoch of the smallest validation
  NLL. A fit counts as over-fitting when its validation NLL passes a
  minimum and rises by at least 10% after it.

Usage::

    python benchmarks/study_selection.py --output runs/selection/records.jsonl
    python benchmarks/study_selection.py --analyse runs/selection/records.jsonl
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import study_trust
import torch
from _common import read_records, run_study, study_parser
from _resnet import SmallResNet
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import FlatnessMonitor
from lightning_flatness.core.models import build_model
from lightning_flatness.core.predicted_gap import headline_gap
from lightning_flatness.sweep.kendall import kendall_tau_b

#: (architecture, hidden, image size): the paper's MLP and CNN and the zoo's BatchNorm ResNet
MODELS = (("mlp", 70, 7), ("cnn", 0, 7), ("resnet", 8, 7), ("mlp", 20, 14))
SIZES = (500, 1500)
CS = (0.01, 1.0)
LRS = (1e-3, 1e-2)
EPOCHS = 40
BATCH_SIZE = 64
#: a fit over-fits when its validation NLL rises by at least this share after its minimum
OVERFIT_RISE = 0.10
#: a pick within this share of the best epoch's test NLL counts as a good pick
WITHIN = 0.05


class Classifier(LightningModule):
    """A user's module: cross-entropy, Adam with coupled weight decay λ, validation NLL."""

    def __init__(self, model: nn.Module, lr: float, lam: float) -> None:
        super().__init__()
        self.model, self.lr, self.lam = model, lr, lam

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_nll", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.lam)


class HeldOutRecorder(Callback):
    """After every training epoch: the test NLL and the whole training set's NLL, in eval mode
    without gradient, the module's mode restored (the fit is left as it was)."""

    def __init__(self, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]) -> None:
        self.train, self.test = train, test
        self.by_epoch: dict[int, dict[str, float]] = {}

    @staticmethod
    def _nll(module: nn.Module, x: Tensor, y: Tensor) -> float:
        return float(nn.functional.cross_entropy(module(x), y))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        with torch.no_grad():
            values = {
                "test_nll": self._nll(pl_module, *self.test),
                "train_nll_all": self._nll(pl_module, *self.train),
            }
        for module, mode in modes.items():
            module.train(mode)
        self.by_epoch[trainer.current_epoch] = values


def fits() -> Iterator[dict]:
    """One dict of settings per fit."""
    for (arch, hidden, size), n, c, lr in itertools.product(MODELS, SIZES, CS, LRS):
        yield dict(architecture=arch, hidden=hidden, image_size=size, n=n, c=c, lam=c / n,
                   lr=lr, epochs=EPOCHS, seed=21)  # fmt: skip


def build(fit: dict, input_shape: tuple[int, ...]) -> nn.Module:
    """The fit's model, seeded."""
    torch.manual_seed(fit["seed"])
    if fit["architecture"] == "resnet":
        return SmallResNet(width=fit["hidden"])
    return build_model(fit["architecture"], input_shape, 10, hidden=fit["hidden"] or 70)


def one_fit(fit: dict) -> dict:
    """Train one fit with the monitor at its defaults; its per-epoch records."""
    x, y, x_held, y_held = study_trust.load_data(fit["image_size"], fit["n"], fit["seed"])
    half = x_held.shape[0] // 2
    val, test = (x_held[:half], y_held[:half]), (x_held[half:], y_held[half:])
    model = build(fit, tuple(x.shape[1:]))
    monitor = FlatnessMonitor()
    recorder = HeldOutRecorder((x, y), test)
    folder = tempfile.TemporaryDirectory()
    checkpoint = ModelCheckpoint(
        dirpath=folder.name, filename="{epoch}", monitor="flatness/predicted_test_nll", mode="min"
    )
    trainer = Trainer(
        max_epochs=fit["epochs"], logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor, checkpoint, recorder],
        num_sanity_val_steps=0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(fit["seed"])
    train_loader = DataLoader(
        TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True, generator=generator
    )
    val_loader = DataLoader(TensorDataset(*val), batch_size=500)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Classifier(model, fit["lr"], fit["lam"]), train_loader, val_loader)
    epochs = []
    for record in monitor.history:
        epoch = int(record["epoch"])
        epochs.append({**record, **recorder.by_epoch.get(epoch, {})})
    kept = re.search(r"epoch=(\d+)", Path(checkpoint.best_model_path).name)
    folder.cleanup()
    return {
        **fit,
        "seconds": time.perf_counter() - started,
        "checkpoint_epoch": int(kept[1]) if kept else None,
        "epochs": epochs,
    }


# ---------------------------------------------------------------------------------------------
# Analysis


def measured_gap(epoch: dict) -> float:
    """Test NLL − the whole training set's NLL."""
    return epoch["test_nll"] - epoch["train_nll_all"]


def training_only(epoch: dict) -> float:
    """The headline a fit without held-out data logs: the training trace ratio times
    ``rank/(n + rank)``."""
    return headline_gap(
        math.nan, epoch["trace_ratio_train"], epoch["soft_rank"], epoch["num_train_samples"]
    )


#: the predicted gaps whose curves are compared with the measured gap: name -> record -> value
GAPS: dict[str, Callable[[dict], float]] = {
    "`predicted_gap` (headline)": lambda e: e["predicted_gap"],
    "headline without held-out data": training_only,
    "Eq. 13, held-out ratio": lambda e: e["predicted_gap_val"],
    "Eq. 13, training ratio": lambda e: e["predicted_gap_train"],
    "soft rank ÷ n": lambda e: e["soft_rank"] / e["num_train_samples"],
    "`observed_gap` (no Fisher)": lambda e: e["observed_gap"],
}

#: the values to select an epoch by (their minimum): name -> record -> value
SELECTORS: dict[str, Callable[[dict], float]] = {
    "`predicted_test_nll` (headline)": lambda e: e["predicted_test_nll"],
    "`predicted_test_nll` without held-out data": lambda e: e["train_nll"] + training_only(e),
    "training NLL + Eq. 13, held-out ratio": lambda e: e["train_nll"] + e["predicted_gap_val"],
    "`val_nll` (baseline)": lambda e: e["val_nll"],
    "last epoch (baseline)": lambda e: -e["epoch"],
}


def overfits(fit: dict) -> bool:
    """The validation NLL passes a minimum and rises by at least :data:`OVERFIT_RISE`."""
    values = [e["val_nll"] for e in fit["epochs"]]
    low = min(range(len(values)), key=values.__getitem__)
    return max(values[low:]) >= (1 + OVERFIT_RISE) * values[low]


def pick_quality(fit: dict, selector: Callable[[dict], float] | None) -> float:
    """Test NLL of the epoch ``selector`` picks ÷ the best epoch's (NaN if it picks none);
    ``None``: the epoch of the checkpoint ``ModelCheckpoint`` kept."""
    best = min(e["test_nll"] for e in fit["epochs"])
    if selector is None:
        kept = [e for e in fit["epochs"] if int(e["epoch"]) == fit.get("checkpoint_epoch")]
        return kept[0]["test_nll"] / best if kept else math.nan
    epochs = [e for e in fit["epochs"] if math.isfinite(selector(e))]
    if not epochs:
        return math.nan
    chosen = min(epochs, key=selector)
    return chosen["test_nll"] / best


def describe(fit: dict) -> str:
    return (
        f"{fit['architecture']} {fit['image_size']}×{fit['image_size']} n={fit['n']} "
        f"c={fit['c']} lr={fit['lr']}"
    )


def analyse(paths: Sequence[Path]) -> None:
    """The within-fit τ per fit, and the selection table."""
    records = read_records(paths)
    over = [f for f in records if overfits(f)]
    print(f"{len(records)} fits, {len(over)} over-fit (validation NLL rises ≥ 10%)\n")
    header = ["fit", "values (fill-ins)", *GAPS]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    taus: dict[str, list[float]] = {name: [] for name in GAPS}
    for fit in over:
        row = [
            describe(fit),
            f"{len(fit['epochs'])} ({sum(e['fill_in'] for e in fit['epochs']):.0f})",
        ]
        for name, gap in GAPS.items():
            values = [gap(e) for e in fit["epochs"]]
            tau = kendall_tau_b(values, [measured_gap(e) for e in fit["epochs"]])[0]
            taus[name].append(tau)
            row.append(f"{tau:+.2f}")
        print("| " + " | ".join(row) + " |")
    medians = [f"{statistics.median(t):+.2f}" if t else "–" for t in taus.values()]
    print("| **median** | | " + " | ".join(medians) + " |\n")
    header = ["selector", "within 5% of the best epoch", "median ÷ best", "worst ÷ best"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    kept = {"the checkpoint `ModelCheckpoint` kept (`predicted_test_nll`)": None}
    for name, selector in {**kept, **SELECTORS}.items():
        ratios = [pick_quality(f, selector) for f in over]
        ratios = [r for r in ratios if math.isfinite(r)]
        if not ratios:
            continue
        good = sum(r <= 1 + WITHIN for r in ratios)
        print(
            f"| {name} | {good} of {len(ratios)} ({good / len(ratios):.0%}) | "
            f"{statistics.median(ratios):.3f} | {max(ratios):.3f} |"
        )


def collect(output: Path, limit: int | None) -> None:
    """Run every fit not yet in ``output`` and append its record."""
    output.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if output.exists():
        done = {describe(json.loads(line)) for line in output.read_text().splitlines()}
    for fit in itertools.islice(fits(), limit):
        if describe(fit) in done:
            continue
        record = one_fit(fit)
        with output.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(f"{describe(fit)}: {len(record['epochs'])} values, {record['seconds']:.0f} s",
              flush=True)  # fmt: skip


def main() -> None:
    parser = study_parser(__doc__, Path("runs/selection/records.jsonl"))
    parser.add_argument("--limit", type=int, help="run only the first fits")
    args = parser.parse_args()
    run_study(args, lambda: collect(args.output, args.limit), analyse)


if __name__ == "__main__":
    sys.exit(main())
