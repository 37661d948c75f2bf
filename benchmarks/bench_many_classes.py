"""A thousand classes: one measurement against one training epoch, side by side in one run.

A linear probe (256-d features → 1,000 classes, P = 257,000) trained for a few epochs on 2,000
synthetic samples (class means plus noise), then measured with the default structure and with
``kfac`` (probe rows, and the C exact rows); printed per structure: seconds of one measurement
(the median of ``--repeats`` for those under 5 s), ÷ one training epoch over the same samples
(the median of five), and the process's peak resident memory after it
(the relative-flatness baseline and the exact-trace path used to build batch × C × C tensors).
Usage::

    python benchmarks/bench_many_classes.py [--threads 2] [--classes 1000] [--n 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from _common import markdown_table, print_header, set_threads
from torch import nn

from lightning_flatness import KFACOptions, measure


def _data(n: int, classes: int, features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    inputs = means[labels] + 2.0 * torch.randn(n, features, generator=generator)
    return inputs, labels


def _epoch(model: nn.Module, optimizer, inputs, labels, batch_size: int = 64) -> float:
    start = time.perf_counter()
    for i in range(0, inputs.shape[0], batch_size):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(
            model(inputs[i : i + batch_size]), labels[i : i + batch_size]
        )
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats of measurements under 5 s (median)"
    )
    args = parser.parse_args()
    set_threads(args.threads)
    print_header("A thousand classes: one measurement ÷ one epoch")
    inputs, labels = _data(args.n, args.classes, args.features)
    torch.manual_seed(0)
    model = nn.Linear(args.features, args.classes)
    lam = 1e-4
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=lam)
    epochs = [_epoch(model, optimizer, inputs, labels) for _ in range(5)]
    epoch = sorted(epochs)[len(epochs) // 2]
    model.eval()
    batches = [(inputs[i : i + 256], labels[i : i + 256]) for i in range(0, args.n, 256)]
    rows = []
    variants = [
        ("auto", {"structure": "auto"}),
        (
            "the monitor's fill-in: kfac, probe rows and probe Tr(F)",
            {"structure": KFACOptions(kfac_mode="probe", trace_estimator="probe")},
        ),
        ("kfac, 4 probe rows", {"structure": KFACOptions(kfac_mode="probe", mc_samples=4)}),
        ("kfac, exact rows (C backward passes)", {"structure": KFACOptions(kfac_mode="exact")}),
    ]
    for label, kwargs in variants:
        times = []
        for _ in range(args.repeats):  # only measurements under 5 s are repeated
            start = time.perf_counter()
            report = measure(model, batches, lam=lam, num_train_samples=args.n, **kwargs)
            times.append(time.perf_counter() - start)
            if times[0] >= 5.0:
                break
        seconds = sorted(times)[len(times) // 2]
        rows.append(
            [
                f"{label} ({report.structure})",
                f"{seconds:.2f}",
                f"{seconds / epoch:.1f}",
                f"{report.soft_rank:,.1f}",
                f"{report.relative_flatness:.4g}",
                f"{_peak_mib():,.0f}",
            ]
        )
    print(
        f"P = {sum(p.numel() for p in model.parameters()):,}, C = {args.classes}, "
        f"n = {args.n}, one training epoch (batch 64) {epoch:.3f} s\n"
    )
    print(
        markdown_table(
            [
                "structure",
                "measurement, s",
                "÷ epoch",
                "soft rank",
                "relative flatness",
                "peak RSS so far, MiB",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
