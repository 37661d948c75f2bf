"""Measurement cost per sample ÷ training cost per sample, on the models users train.

For the paper's MLP and CNN (on the bundled 7×7 MNIST), a mid-size CNN (three 3×3 convolutions
of 32, 64 and 64 channels on 1×28×28 inputs) and every model of the test zoo at a realistic size
(random inputs of the right kind; nothing is downloaded), one run times,
interleaved and repeated:

- a training pass over m samples (train mode, forward, cross-entropy, backward, SGD step with
  weight decay) at the measurement's batch size;
- the Kronecker measurement's passes alone (an eval-mode forward and two backward passes to
  the layers' outputs, no factor or norm work): the floor of the hooked pass with two rows;
- ``measure()`` over the same m samples for the default structure ``kfac`` (layer hooks) with
  exact Fisher rows and exact Tr(F) (``measure()``'s defaults), with one sampled label per
  input for the factors and the trace, and with one Rademacher probe per input
  (``FlatnessMonitor``'s defaults), the same in the monitor's batches (the fill-in reads up to
  1,024 samples per batch and the hooks split them into passes of the size they run fastest
  at; still ÷ the training pass at the batch size above), the same with every convolution's
  patches unfolded (no
  input factor or norms from the input's shifted overlaps: the code before those), the exact
  diagonal
  ``diag``, ``hutchinson``, and (``--lanczos``) ``lanczos`` at its default options;
- with ``--regularizer``, one regularized step (``SoftRankPenalty`` added to the loss) ÷ one
  plain step.

Every ratio divides two medians measured side by side in one run. Usage::

    python benchmarks/bench_models.py                 # 3 repeats, m = 2048, batch 128
    python benchmarks/bench_models.py --quick         # 1 repeat, m = 256
    python benchmarks/bench_models.py --models resnet,transformer --lanczos --regularizer
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from _common import markdown_table, median, mid_cnn, mnist7, print_header, set_threads, timed
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo

from lightning_flatness import measure
from lightning_flatness.core import layer_rules
from lightning_flatness.core.batches import call_model, read_logits
from lightning_flatness.core.models import build_model
from lightning_flatness.core.options import structure_options
from lightning_flatness.lightning.budget import FILL_IN_SAMPLES

LAM = 1e-3
#: the monitor's default with every convolution unfolded (as before the overlap factor)
UNFOLDED = "kfac probe, unfolded patches"
#: the column of :func:`_passes_only`
PASSES_ONLY = "forward + 2 backward only"
#: the monitor's default as the monitor runs its fill-in: the samples in batches of
#: FILL_IN_SAMPLES, which the hooks split into passes by their own size rule
MONITOR_BATCHES = "kfac probe, the monitor's batches"

#: variant → (structure, fields of its options object)
VARIANTS: dict[str, tuple[str, dict]] = {
    "kfac exact (measure() default)": ("kfac", {}),
    "kfac sampled": (
        "kfac",
        {"kfac_mode": "sampled", "trace_estimator": "sampled"},
    ),
    "kfac probe (monitor default)": (
        "kfac",
        {"kfac_mode": "probe", "trace_estimator": "probe"},
    ),
    MONITOR_BATCHES: (
        "kfac",
        {"kfac_mode": "probe", "trace_estimator": "probe"},
    ),
    "kfac probe, unfolded patches": (
        "kfac",
        {"kfac_mode": "probe", "trace_estimator": "probe"},
    ),
    "diag": ("diag", {}),
    "hutchinson": ("hutchinson", {}),
    "lanczos": ("lanczos", {}),
}


def _images(m: int, size: int, channels: int = 1, seed: int = 0) -> Tensor:
    return torch.randn(m, channels, size, size, generator=torch.Generator().manual_seed(seed))


def _tokens(m: int, length: int, vocab: int, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (m, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (m,), generator=generator)
    return ids.masked_fill(torch.arange(length) >= lengths.unsqueeze(1), 0)


def model_and_data(name: str, m: int) -> tuple[nn.Module, object, Tensor]:
    """A realistic-size instance (float32) and m samples of its inputs and labels."""
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (m,), generator=torch.Generator().manual_seed(1))
    if name in ("mlp", "cnn"):
        x, y, _, _ = mnist7(train_size=max(m, 100), val_size=100)
        return build_model(name), x[:m], y[:m]
    if name == "mid_cnn":
        return mid_cnn(), _images(m, 28), labels
    if name == "functional_cnn":
        model = zoo.FunctionalCNN()
        model.conv1, model.conv2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3)
        model.fc = nn.Linear(32 * 6 * 6, 10)
        return model, _images(m, 16), labels
    if name == "resnet":
        return zoo.ResNet(width=24, classes=10), _images(m, 16), labels
    if name == "transformer":
        model = zoo.TextTransformer(vocab=1000, dim=64, max_len=32, classes=10)
        model.encoder = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        return model, {"input_ids": _tokens(m, 32, 1000)}, labels
    if name == "vit":
        model = zoo.TinyViT(dim=64, patch=4, classes=10)
        model.pos = nn.Parameter(0.1 * torch.randn(1, 17, 64))
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0)
        model.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        return model, _images(m, 16), labels
    if name == "tied_mlp":
        return zoo.TiedMLP(features=256, hidden=128, classes=10), torch.randn(m, 256), labels
    if name == "compiled":
        model = zoo.TiedMLP(features=256, hidden=128, classes=10)
        return torch.compile(model), torch.randn(m, 256), labels
    raise ValueError(f"unknown model {name!r}")


def _rows(inputs: object, start: int, stop: int) -> object:
    if isinstance(inputs, dict):
        return {k: v[start:stop] for k, v in inputs.items()}
    return inputs[start:stop]


def _batches(inputs: object, targets: Tensor, batch_size: int) -> list:
    return [
        (_rows(inputs, i, i + batch_size), targets[i : i + batch_size])
        for i in range(0, targets.shape[0], batch_size)
    ]


def _training_pass(model: nn.Module, batches: list) -> Callable[[], None]:
    compiled = hasattr(model, "_orig_mod")

    def run() -> None:
        # a compiled module trains in place (a copy would compile again)
        clone = model.train() if compiled else copy.deepcopy(model).train()
        optimizer = torch.optim.SGD(clone.parameters(), lr=1e-2, weight_decay=LAM)
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            logits = read_logits(call_model(clone, x))
            nn.functional.cross_entropy(logits, y).backward()
            optimizer.step()

    return run


def _passes_only(model: nn.Module, batches: list) -> Callable[[], None]:
    """The hooked pass of the Kronecker measurement with two rows without any of its factor
    or norm work: an eval-mode forward recording the output of every module that owns
    parameters, and two backward passes (for the residual and the probe row) to those outputs
    only (no weight gradients). What the measurement cannot go below."""
    model = getattr(model, "_orig_mod", model)  # as measure(), the module a compile wraps
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]

    outputs: list[Tensor] = []

    def record(module: nn.Module, args: tuple, output: object) -> None:
        found = output if isinstance(output, Tensor) else output[0]
        if found.requires_grad:
            outputs.append(found)

    def run() -> None:
        model.eval()
        for x, _ in batches:
            outputs.clear()
            handles = [m.register_forward_hook(record) for m in owners]
            try:
                logits = read_logits(call_model(model, x))
            finally:
                for handle in handles:
                    handle.remove()
            for row in range(2):
                torch.autograd.grad(
                    logits,
                    outputs,
                    torch.randn_like(logits),
                    retain_graph=row == 0,
                    allow_unused=True,
                )

    return run


def _measurement(model: nn.Module, batches: list, variant: str) -> Callable[[], object]:
    structure, kwargs = VARIANTS[variant]
    unfolded = variant == UNFOLDED

    def run() -> object:
        kept = layer_rules.overlap_pays
        if unfolded:  # no convolution's input factor or norms from overlaps
            layer_rules.overlap_pays = lambda *args, **kwargs: False
        try:
            options = structure_options(structure, kwargs)
            return measure(model, batches, lam=LAM, num_train_samples=10_000, structure=options)
        finally:
            layer_rules.overlap_pays = kept

    return run


def _regularized_steps(model: nn.Module, batches: list) -> tuple[Callable, Callable]:
    from lightning_flatness.regularizer import SoftRankPenalty

    def plain() -> None:
        _training_pass(model, batches)()

    def regularized() -> None:
        clone = copy.deepcopy(model).train()
        optimizer = torch.optim.SGD(clone.parameters(), lr=1e-2, weight_decay=LAM)
        penalty = SoftRankPenalty(lam=LAM, num_train_samples=10_000)
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            logits = read_logits(call_model(clone, x))
            loss = nn.functional.cross_entropy(logits, y) + 0.1 * penalty(clone, x)
            loss.backward()
            optimizer.step()

    return plain, regularized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = "mlp,cnn,mid_cnn,functional_cnn,resnet,transformer,vit,tied_mlp,compiled"
    parser.add_argument("--models", default=models)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lanczos", action="store_true", help="also time lanczos (slow)")
    parser.add_argument("--regularizer", action="store_true", help="also time the penalty")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 256 samples")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.samples = 1, 256
    set_threads(args.threads)
    print_header("Measurement ÷ training pass over the same samples")
    print(f"m = {args.samples} samples, batch {args.batch_size}, {args.repeats} repeat(s)\n")
    variants = [v for v in VARIANTS if v != "lanczos" or args.lanczos]
    rows = []
    for name in args.models.split(","):
        model, inputs, targets = model_and_data(name, args.samples)
        batches = _batches(inputs, targets, args.batch_size)
        tasks: dict[str, Callable] = {"train": _training_pass(model, batches)}
        if name == "compiled":
            tasks["train"]()  # compile once, outside the timings
        tasks[PASSES_ONLY] = _passes_only(model, batches)
        monitor_batches = _batches(inputs, targets, FILL_IN_SAMPLES)
        for variant in variants:
            chosen = monitor_batches if variant == MONITOR_BATCHES else batches
            tasks[variant] = _measurement(model, chosen, variant)
        # the first measurement of a model checks its rules against autograd once (remembered
        # for the others): outside the timings, so that no variant pays it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measure(model, batches[:1], lam=LAM, num_train_samples=10_000, structure="kfac")
        if args.regularizer:
            tasks["plain step"], tasks["regularized step"] = _regularized_steps(model, batches)
        seconds: dict[str, list[float]] = {}
        failures: dict[str, str] = {}
        for _ in range(args.repeats):
            order = list(tasks)
            random.Random(len(seconds)).shuffle(order)
            for task in order:
                if task in failures:
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        elapsed, _ = timed(tasks[task])
                except Exception as error:  # a structure that cannot run on this model
                    failures[task] = type(error).__name__
                    continue
                seconds.setdefault(task, []).append(elapsed)
        train = median(seconds["train"])
        row = [name, f"{train / args.samples * 1e3:.3f}"]
        for variant in [PASSES_ONLY, *variants]:
            if variant in failures:
                row.append(f"fails ({failures[variant]})")
            else:
                row.append(f"{median(seconds[variant]) / train:.2f}×")
        if args.regularizer:
            if "regularized step" in failures:
                row.append(f"fails ({failures['regularized step']})")
            else:
                ratio = median(seconds["regularized step"]) / median(seconds["plain step"])
                row.append(f"{ratio:.2f}×")
        rows.append(row)
        print(" | ".join(row), flush=True)
    header = ["model", "train ms/sample", PASSES_ONLY, *variants]
    if args.regularizer:
        header.append("regularized ÷ plain step")
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
