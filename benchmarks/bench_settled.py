"""Short fits under the settled test (docs/RESULTS.md, "The settled test: short fits").

A 2-epoch fit of every model of the test zoo (``tests/zoo.py``, trained as
``tests/test_zoo.py``'s ``_zoo_fit`` trains it: SGD lr 0.05, weight decay 1e-3, 32 samples) and
of the paper's MLP on 7×7 MNIST (``configs/mlp.yaml``'s settings, 4,000 images; and the 400
images at Adam lr 1e-2 of ``tests/test_settled.py``), each with ``FlatnessMonitor`` at its
defaults, and one row per fit from its last record: ``trusted``, ``nll_drop``, α_train, the
Newton decrement (± its standard error), the predicted and observed gap and their ratio, and
whether that record was the exact measurement.

Usage::

    python benchmarks/bench_settled.py
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_zoo import _zoo_fit
from zoo import ZOO

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule
from lightning_flatness.lightning.log_options import LogOptions

#: the columns of the table, as (header, record key or None for the ratio)
COLUMNS = (
    *("model", "NLL before → after", "trusted", "nll_drop", "α_train", "decrement"),
    *("predicted", "observed", "pred ÷ obs"),
)


def _monitor() -> FlatnessMonitor:
    """The monitor at its defaults, without the fit-end summary and TensorBoard drawings."""
    return FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))


def _mlp_fit(data: MNIST7DataModule, model: FlatnessClassifier) -> FlatnessMonitor:
    """``model`` (the paper's MLP) fitted for 2 epochs on ``data``."""
    monitor = _monitor()
    trainer = Trainer(
        max_epochs=2,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, data)
    return monitor


def _configured_mlp() -> FlatnessMonitor:
    """``configs/mlp.yaml``: 4,000 images, batch 64, Adam lr 1e-3, λ = 1/n."""
    seed_everything(0)
    data = MNIST7DataModule(train_size=4000, val_size=1000, batch_size=64)
    return _mlp_fit(data, FlatnessClassifier(lr=1e-3, weight_decay_c=1.0))


def _test_mlp() -> FlatnessMonitor:
    """``tests/test_settled.py``: 400 images, batch 32, Adam lr 1e-2, λ = 1e-3."""
    seed_everything(0)
    data = MNIST7DataModule(train_size=400, val_size=200, batch_size=32)
    return _mlp_fit(data, FlatnessClassifier(lr=1e-2, weight_decay=1e-3))


def _zoo_monitor(name: str) -> FlatnessMonitor:
    monitor = _monitor()
    _zoo_fit(name, monitor)
    return monitor


def _fits() -> list[tuple[str, Callable[[], FlatnessMonitor]]]:
    """The fits of the table, by row name."""
    fits = [(name, lambda name=name: _zoo_monitor(name)) for name in ZOO]
    fits.append(("paper MLP, n = 4,000 (configs/mlp.yaml)", _configured_mlp))
    fits.append(("paper MLP, n = 400, lr 1e-2 (tests/test_settled.py)", _test_mlp))
    return fits


def _row(name: str, monitor: FlatnessMonitor) -> str:
    """The table row of a fit's last record."""
    if not monitor.history:
        return f"| {name} | " + " | ".join(["no record"] * (len(COLUMNS) - 1)) + " |"
    last = monitor.history[-1]
    nll = monitor.nll.by_epoch
    before, after = nll.get(-1, math.nan), nll.get(int(last["epoch"]), math.nan)
    predicted, observed = last["predicted_gap"], last["observed_gap"]
    ratio = predicted / observed if observed > 0 else math.nan
    kind = "" if not last.get("fill_in") else " (fill-in)"
    cells = (
        f"{name}{kind}",
        f"{before:.3f} → {after:.3f}",
        f"{last['trusted']:g}",
        f"{last['nll_drop']:.3f}",
        f"{last['trust_score']:.2f}",
        _decrement(last),
        f"{predicted:.4g}",
        f"{observed:.4g}",
        "—" if math.isnan(ratio) else f"{ratio:.3g}",
    )
    return "| " + " | ".join(cells) + " |"


def _decrement(record: dict[str, float]) -> str:
    """The Newton decrement, ± its standard error where it has one."""
    value, stderr = record["newton_decrement"], record.get("newton_decrement_stderr", math.nan)
    return f"{value:.3g}" + (f" ± {stderr:.2g}" if math.isfinite(stderr) else "")


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for name, fit in _fits():
        print(_row(name, fit()), flush=True)


if __name__ == "__main__":
    main()
