"""Cost of one ``measure()`` call relative to one training pass over the same samples.

For the paper's MLP (7×7 input, 70 ReLU, 10 classes) and CNN (``build_model("cnn")``) on m real
7×7 MNIST images (default m = 2,048, the callback's default ``max_samples``), one run times,
interleaved in a shuffled order and repeated:

- a training pass over the m samples (forward, cross-entropy, backward, Adam step) at batch
  sizes 64 and 256 (the measurement's batch size);
- ``measure()`` over the same m samples (batches of 256) for each structure variant.

The table reports the median times and their ratios (measurement ÷ training pass), so changes of
machine load during the run affect numerator and denominator alike. ``gram`` is refused by its
size guard when m·C > 8,192 rows; it is then timed at the largest multiple of the batch size that
fits and compared with a training pass scaled to the same number of samples.

``--breakdown`` adds a table of one forward + BackPACK backward over the m samples with each
BackPACK extension alone (what each structure and statistic pays for); ``--profile`` prints the
top cProfile entries of one ``measure()`` call per structure.

Usage::

    python benchmarks/bench_measure.py                  # all structures, 5 repeats
    python benchmarks/bench_measure.py --quick          # fewer repeats, no dense
    python benchmarks/bench_measure.py --structures kfac,diag_mc --breakdown --profile
    python benchmarks/bench_measure.py --profile kfac,diag_mc_sampled_trace
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from _common import markdown_table, median, mnist7, print_header, set_threads, timed, train_epoch
from backpack.extensions import (
    KFAC,
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SumGradSquared,
)
from torch import Tensor, nn

from lightning_flatness import FlatnessReport, measure
from lightning_flatness.core.backpack.extension import (
    backward_with,
    extended_loss,
    measurement_copy,
)
from lightning_flatness.core.backpack.gram import DEFAULT_MAX_KERNEL_SIZE
from lightning_flatness.core.models import build_model
from lightning_flatness.core.options import structure_options

#: Variant name → (structure, fields of its options object, description).
VARIANTS: dict[str, tuple[str, dict[str, str], str]] = {
    "kfac": ("kfac", {}, "kfac (KFLR factors, exact Tr F)"),
    "kfac_sampled": ("kfac", {"kfac_mode": "sampled"}, "kfac, kfac_mode=sampled"),
    "kfac_sampled_trace": (
        "kfac",
        {"trace_estimator": "sampled"},
        "kfac, trace_estimator=sampled",
    ),
    "diag": ("diag", {}, "diag"),
    "diag_mc": ("diag_mc", {}, "diag_mc (exact Tr F)"),
    "diag_mc_sampled_trace": (
        "diag_mc",
        {"trace_estimator": "sampled"},
        "diag_mc, trace_estimator=sampled",
    ),
    "gram": ("gram", {}, "gram"),
    "dense": ("dense", {}, "dense"),
}
#: Structures that cost far more than a training pass; timed ``--slow-repeats`` times.
SLOW = ("gram", "dense")
NUM_CLASSES = 10
LAM = 2.5e-4  # the configs' λ = c / n = 1 / 4000; the cost does not depend on it


@dataclass
class Timings:
    """Seconds of every repeat, per timed task."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.seconds.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return median(self.seconds.get(name, []))


def _batches(inputs: Tensor, targets: Tensor, batch_size: int) -> list[tuple[Tensor, Tensor]]:
    return [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, inputs.shape[0], batch_size)
    ]


def _prepared_model(architecture: str, inputs: Tensor, targets: Tensor) -> nn.Module:
    """The model after one training epoch on the samples (so predictions are not uniform)."""
    torch.manual_seed(0)
    model = build_model(architecture)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_epoch(model, optimizer, inputs, targets, 64, torch.Generator().manual_seed(0))
    return model.eval()


def _training_pass(
    model: nn.Module, inputs: Tensor, targets: Tensor, batch_size: int
) -> Callable[[], None]:
    """One pass over the samples with a private copy of the model and a fresh Adam."""

    def run() -> None:
        clone = copy.deepcopy(model)
        optimizer = torch.optim.Adam(clone.parameters(), lr=1e-3)
        train_epoch(clone, optimizer, inputs, targets, batch_size)

    return run


def _gram_samples(samples: int, batch_size: int) -> int:
    """Largest m ≤ ``samples`` (a multiple of the batch size if possible) that ``gram`` allows."""
    limit = DEFAULT_MAX_KERNEL_SIZE // NUM_CLASSES
    if samples <= limit:
        return samples
    return (limit // batch_size) * batch_size or limit


def _measurement(
    model: nn.Module, inputs: Tensor, targets: Tensor, variant: str, batch_size: int
) -> Callable[[], object]:
    structure, kwargs, _ = VARIANTS[variant]
    batches = _batches(inputs, targets, batch_size)

    def run() -> object:
        return measure(
            model,
            batches,
            lam=LAM,
            num_train_samples=4000,
            structure=structure_options(structure, kwargs),
        )

    return run


def run_model(
    architecture: str,
    inputs: Tensor,
    targets: Tensor,
    variants: list[str],
    train_batch_sizes: list[int],
    batch_size: int,
    repeats: int,
    slow_repeats: int,
) -> list[list[str]]:
    """Time the training passes and measurements of one model; return the table rows."""
    model = _prepared_model(architecture, inputs, targets)
    samples = inputs.shape[0]
    gram_m = _gram_samples(samples, batch_size)
    tasks: dict[str, Callable[[], object]] = {}
    for size in train_batch_sizes:
        tasks[f"train@{size}"] = _training_pass(model, inputs, targets, size)
    for variant in variants:
        m = gram_m if VARIANTS[variant][0] == "gram" else samples
        tasks[variant] = _measurement(model, inputs[:m], targets[:m], variant, batch_size)
    timings = Timings()
    reports: dict[str, FlatnessReport] = {}
    for name, task in tasks.items():  # warm-up: allocator, imports, LAPACK workspaces
        if name not in SLOW:
            task()
    order_rng = random.Random(0)
    for repeat in range(repeats):
        names = [n for n in tasks if n not in SLOW or repeat < slow_repeats]
        order_rng.shuffle(names)
        for name in names:
            seconds, result = timed(tasks[name])
            timings.add(name, seconds)
            if name in variants:
                reports[name] = result
    rows = []
    num_params = sum(p.numel() for p in model.parameters())
    for size in train_batch_sizes:
        rows.append(
            [
                architecture,
                f"training pass, batch {size}",
                samples,
                f"{timings.median(f'train@{size}'):.3f}",
            ]
            + ["1.0" if s == size else "" for s in train_batch_sizes]
            + ["", ""]
        )
    for variant in variants:
        m = gram_m if VARIANTS[variant][0] == "gram" else samples
        seconds = timings.median(variant)
        ratios = [
            f"{seconds / (timings.median(f'train@{size}') * m / samples):.1f}"
            for size in train_batch_sizes
        ]
        report = reports[variant]
        rows.append(
            [
                architecture,
                VARIANTS[variant][2],
                m,
                f"{seconds:.3f}",
                *ratios,
                f"{report.soft_rank:.1f}",
                f"{report.trace_fisher:.4g}",
            ]
        )
    print(f"<!-- {architecture}: P = {num_params:,}, repeats {repeats} (slow: {slow_repeats}) -->")
    return rows


#: Extensions timed alone by ``--breakdown``; ``None`` is a plain backward through the copy.
EXTENSIONS: dict[str, Callable[[], object] | None] = {
    "none (forward + backward)": None,
    "BatchL2Grad (Tr C, every structure)": BatchL2Grad,
    "DiagGGNExact (diag; exact Tr F)": DiagGGNExact,
    "DiagGGNMC (diag_mc; sampled Tr F)": lambda: DiagGGNMC(mc_samples=1),
    "KFLR (kfac)": KFLR,
    "KFAC (kfac sampled)": lambda: KFAC(mc_samples=1),
    "SqrtGGNExact (dense, gram)": SqrtGGNExact,
    "BatchGrad (dense, gram)": BatchGrad,
    "SumGradSquared (diag, diag_mc)": SumGradSquared,
}


def breakdown(
    architecture: str, inputs: Tensor, targets: Tensor, batch_size: int, repeats: int
) -> list[list[str]]:
    """Median time of a forward + BackPACK backward over the samples with one extension."""
    model = _prepared_model(architecture, inputs, targets)
    extended = measurement_copy(model)
    loss_fn = extended_loss("cross_entropy")
    batches = _batches(inputs, targets, batch_size)

    def task(factory: Callable[[], object] | None) -> Callable[[], None]:
        def run() -> None:
            for x, y in batches:
                loss = loss_fn(extended.module(x), y)
                backward_with(extended, loss, [] if factory is None else [factory()], "bench")
            extended.zero_grad()

        return run

    tasks = {name: task(factory) for name, factory in EXTENSIONS.items()}
    for run in tasks.values():
        run()
    timings = Timings()
    order_rng = random.Random(1)
    for _ in range(repeats):
        names = list(tasks)
        order_rng.shuffle(names)
        for name in names:
            timings.add(name, timed(tasks[name])[0])
    base = timings.median("none (forward + backward)")
    return [
        [architecture, name, f"{timings.median(name):.3f}", f"{timings.median(name) / base:.1f}"]
        for name in EXTENSIONS
    ]


def profile(architecture: str, inputs: Tensor, targets: Tensor, variant: str, top: int) -> str:
    """cProfile of one ``measure()`` call (after a warm-up call): this library's functions and
    BackPACK's per-layer extension rules, by cumulative time."""
    model = _prepared_model(architecture, inputs, targets)
    run = _measurement(model, inputs, targets, variant, 256)
    run()
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats("cumulative")
    # the extension modules (one per BackPACK extension and layer type) and this library
    rules = r"backpack[/\\]extensions[/\\].*(weight|bias|param_function)"
    stats.print_stats(rf"{rules}|lightning_flatness", top)
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    # keep paths relative to the packages (no install location in the output)
    relative = re.compile(r"(\s)\S*?((?:backpack|lightning_flatness)/)")
    return "\n".join(relative.sub(r"\1\2", line) for line in [lines[0], *lines[start:]])


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the benchmark and print markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2048, help="m, measured samples")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of every task")
    parser.add_argument(
        "--slow-repeats", type=int, default=1, help="repeats of the slow structures gram, dense"
    )
    parser.add_argument(
        "--structures",
        default=",".join(VARIANTS),
        help=f"comma-separated variants among {', '.join(VARIANTS)}",
    )
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated architectures")
    parser.add_argument("--batch-size", type=int, default=256, help="measurement batch size")
    parser.add_argument(
        "--train-batch-sizes", default="64,256", help="batch sizes of the reference passes"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--breakdown", action="store_true", help="time each extension alone")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="kfac,diag_mc",
        default=None,
        help="cProfile one call of each of these variants (default: kfac,diag_mc)",
    )
    parser.add_argument("--quick", action="store_true", help="2 repeats, no dense/gram")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.structures.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose among {list(VARIANTS)}")
    if args.quick:
        args.repeats = min(args.repeats, 2)
        variants = [v for v in variants if VARIANTS[v][0] not in SLOW]
    set_threads(args.threads)
    train_batch_sizes = [int(s) for s in args.train_batch_sizes.split(",")]
    x_train, y_train, _, _ = mnist7()
    generator = torch.Generator().manual_seed(0)
    subset = torch.randperm(x_train.shape[0], generator=generator)[: args.samples]
    inputs, targets = x_train[subset], y_train[subset]
    print_header(f"measure() cost ÷ training pass, m = {inputs.shape[0]} samples")
    rows = []
    for architecture in args.models.split(","):
        rows += run_model(
            architecture,
            inputs,
            targets,
            variants,
            train_batch_sizes,
            args.batch_size,
            args.repeats,
            args.slow_repeats,
        )
    header = (
        ["model", "what", "m", "median s"]
        + [f"÷ train pass (batch {size})" for size in train_batch_sizes]
        + ["soft rank", "Tr F"]
    )
    print(markdown_table(header, rows))
    if args.breakdown:
        print("\n### One forward + BackPACK backward over the m samples, one extension at a time\n")
        rows = []
        for architecture in args.models.split(","):
            rows += breakdown(architecture, inputs, targets, args.batch_size, args.repeats)
        print(markdown_table(["model", "extension", "median s", "÷ plain backward"], rows))
    if args.profile:
        for architecture in args.models.split(","):
            for variant in args.profile.split(","):
                if variant not in VARIANTS or VARIANTS[variant][0] in SLOW:
                    parser.error(f"--profile takes variants among {list(VARIANTS)} but dense/gram")
                print(f"\n### cProfile: {architecture}, {VARIANTS[variant][2]}\n")
                print("```\n" + profile(architecture, inputs, targets, variant, 12) + "\n```")


if __name__ == "__main__":
    main()
