"""Cost of a training step regularized by the soft-rank penalty, relative to a plain step.

For each model (the paper's MLP and CNN and the effect study's BatchNorm ResNet on 7×7 inputs,
and a wider ResNet, 32 channels on 28×28 inputs, whose step is compute-bound; 10 classes) and
each option combination
of :class:`lightning_flatness.regularizer.SoftRankPenalty` (estimator × function × labels ×
params; the compositional estimator's rows are one Rademacher probe per step), one step is:
forward, ``cross_entropy + β · penalty``, backward, Adam step. The plain step drops the
penalty. Plain and regularized steps are interleaved in one run (same threads, same data) and
the table reports medians over ``--steps`` steps after ``--warmup`` steps, as markdown, plus
the ratio of the fastest steps (robust when other processes share the cores).

Usage::

    python benchmarks/bench_regularizer.py --steps 30
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _resnet import SmallResNet
from torch import Tensor, nn

from lightning_flatness.core.models import build_model
from lightning_flatness.regularizer import (
    BACKENDS,
    ESTIMATORS,
    FUNCTIONS,
    LABELS,
    PenaltyOptions,
    SoftRankPenalty,
)
from lightning_flatness.regularizer.modes import penalty_modes

#: model name → (builder, input side length)
MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "mlp": (lambda: build_model("mlp"), 7),
    "cnn": (lambda: build_model("cnn"), 7),
    "resnet": (lambda: SmallResNet(width=8), 7),
    "resnet_wide": (lambda: SmallResNet(width=32), 28),
}


def _step_fn(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    penalty: SoftRankPenalty | None,
    beta: float,
    every_n_steps: int = 1,
) -> Callable[[], None]:
    """One training step; the penalty (weight ``every_n_steps · β``) on every n-th call, as
    ``SoftRankRegularizer(every_n_steps=n, strength=n·β)`` schedules it."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = [0]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        if penalty is not None and calls[0] % every_n_steps == 0:
            loss = loss + every_n_steps * beta * penalty(model, inputs)
        calls[0] += 1
        loss.backward()
        optimizer.step()

    return step


def _floor_step_fn(
    model: nn.Module, inputs: Tensor, targets: Tensor, samples: int, batch_norm: str
) -> Callable[[], None]:
    """A training step plus the autograd passes a penalty on ``samples`` samples cannot do
    without, and nothing else: a forward pass in the penalty's modes, the gradient of a random
    cotangent (weighted by √p, so it depends on θ as the penalty's does) with its graph, and
    the backward pass of a fixed linear function of that gradient. What any estimator of this
    kind adds beyond that is its own bookkeeping."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    directions = [torch.randn_like(p) for p in params]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        with penalty_modes(model, batch_norm):
            logits = model(inputs[:samples])
        cotangent = torch.randn_like(logits) * logits.softmax(-1).sqrt()
        gradients = torch.autograd.grad(logits, params, grad_outputs=cotangent, create_graph=True)
        pairing = sum((d * g).sum() for d, g in zip(directions, gradients, strict=True))
        (loss + 1e-12 * pairing).backward()
        optimizer.step()

    return step


@dataclass(frozen=True)
class Timing:
    """Per-step seconds of the plain and regularized steps, measured alternately."""

    plain: list[float]
    regularized: list[float]

    @property
    def median_ratio(self) -> float:
        """Median over steps of regularized / plain (the headline number)."""
        pairs = zip(self.plain, self.regularized, strict=True)
        return statistics.median(r / p for p, r in pairs)

    @property
    def mean_ratio(self) -> float:
        """Mean regularized step over mean plain step (the number to read when the penalty is
        added on every n-th step only)."""
        return statistics.fmean(self.regularized) / statistics.fmean(self.plain)

    @property
    def min_ratio(self) -> float:
        """Ratio of the fastest steps: robust when other processes share the cores."""
        return min(self.regularized) / min(self.plain)


def _interleaved(
    plain: Callable[[], None], regularized: Callable[[], None], steps: int, warmup: int
) -> Timing:
    """Time ``steps`` alternating plain/regularized steps after ``warmup`` untimed pairs.

    Alternating makes a change of machine load affect both alike.
    """
    for _ in range(warmup):
        plain()
        regularized()
    timing = Timing([], [])
    for _ in range(steps):
        start = time.perf_counter()
        plain()
        middle = time.perf_counter()
        regularized()
        end = time.perf_counter()
        timing.plain.append(middle - start)
        timing.regularized.append(end - middle)
    return timing


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row first")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--labels", nargs="+", default=list(LABELS), choices=LABELS)
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument(
        "--every-n-steps",
        type=int,
        default=1,
        help="add the penalty (with n·β) on every n-th step only; read the mean ratio then",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add per model the passes alone (no estimator work) on the compositional "
        "estimator's 32 samples and on the whole batch, the batched bound's",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(args.seed)
    images = {
        side: torch.randn(args.batch_size, 1, side, side, generator=generator)
        for side in sorted({side for _, side in MODELS.values()})
    }
    targets = torch.randint(0, 10, (args.batch_size,), generator=generator)
    num_train = 10_000
    lam = 1e-2 / num_train

    print(
        f"B = {args.batch_size}, n = {num_train}, λ = {lam:g}, backend = {args.backend}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; plain and regularized "
        f"steps alternate, medians of {args.steps} steps after {args.warmup} warm-up steps; "
        "ratio (median) = median of the per-step ratios, ratio (mean) = mean regularized / mean "
        "plain step, ratio (min) = fastest regularized / fastest plain step; penalty on every "
        f"{args.every_n_steps}. step\n"
    )
    print(
        "| model | estimator | function | labels | params | plain (ms) | regularized (ms) | "
        "ratio (median) | ratio (mean) | ratio (min) |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
    rows = [("batched", labels) for labels in args.labels if "batched" in args.estimators]
    if "compositional" in args.estimators:
        rows.append(("compositional", "sampled"))
    for architecture in args.models:
        build, side = MODELS[architecture]
        inputs = images[side]
        floors = [("compositional", 32, "batch"), ("batched", args.batch_size, "running")]
        for estimator, samples, batch_norm in floors if args.floor else []:
            torch.manual_seed(args.seed)
            plain = _step_fn(build(), inputs, targets, None, 0.0)
            torch.manual_seed(args.seed)
            passes = _floor_step_fn(build(), inputs, targets, samples, batch_norm)
            timing = _interleaved(plain, passes, args.steps, args.warmup)
            print(
                f"| {architecture} | passes only ({estimator}: {samples} samples) | – | – | "
                f"all | {statistics.median(timing.plain) * 1e3:.2f} | "
                f"{statistics.median(timing.regularized) * 1e3:.2f} | "
                f"{timing.median_ratio:.1f}× | {timing.mean_ratio:.1f}× | "
                f"{timing.min_ratio:.1f}× |",
                flush=True,
            )
        for (estimator, labels), function, params in itertools.product(
            rows, FUNCTIONS, ("all", "last_layer")
        ):
            if labels == "exact" and architecture.startswith("resnet"):
                continue  # a BC × BC float64 kernel per step: minutes per row, see the MLP
            torch.manual_seed(args.seed)
            model = build()
            torch.manual_seed(args.seed)
            plain = _step_fn(build(), inputs, targets, None, 0.0)
            penalty = SoftRankPenalty(
                lam=lam,
                num_train_samples=num_train,
                seed=args.seed,
                options=PenaltyOptions(
                    function=function,
                    labels=labels,
                    params=params,
                    backend=args.backend,
                    estimator=estimator,
                ),
            )
            regularized = _step_fn(
                model, inputs, targets, penalty, beta=1.0, every_n_steps=args.every_n_steps
            )
            timing = _interleaved(plain, regularized, args.steps, args.warmup)
            shown = "probe" if estimator == "compositional" else labels
            print(
                f"| {architecture} | {estimator} | {function} | {shown} | {params} | "
                f"{statistics.median(timing.plain) * 1e3:.2f} | "
                f"{statistics.median(timing.regularized) * 1e3:.2f} | "
                f"{timing.median_ratio:.1f}× | {timing.mean_ratio:.1f}× | "
                f"{timing.min_ratio:.1f}× |",
                flush=True,
            )


if __name__ == "__main__":
    main()
