"""The default structure at the main job's size: probe-kernel cost and accuracy against exact.

Trains the paper's MLP (one hidden layer of 70, P = 4,210) and CNN on the bundled 7×7 MNIST
(n = 4,000, c = λ·n = 1, Adam, 20 epochs, the README main job's setting), then measures, side
by side in one run, on the first m ∈ {1,000, 2,048, 4,000, 10,000} training images (the 6,000
beyond the bundled 4,000 are noisy copies of them, ``x + 0.5·N(0, 1)``, so that m = 10,000 is
measured, not extrapolated):

- one training epoch over the same m images (Adam, batch 64);
- ``probe_kernel`` at its defaults (4 probes in 2 jackknife groups; 2 probes from 8,192
  samples), its seconds, its peak state (P × P sums, or kept rows) and its soft rank ÷ the
  exact (``dense``) one at m = 4,000 and 10,000;
- ``kfac`` with one probe row per input (the previous default), the same numbers.

The cost at m = 50,000 is extrapolated, and says so: 5× the cost at m = 10,000, an upper bound
(the P × P sums cost a fixed amount per sample; the factorisations do not grow with m once
m·probes > P). Usage::

    python benchmarks/bench_probe_kernel.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import markdown_table, median, mnist7, print_header, set_threads, train_epoch
from torch import nn

from lightning_flatness import KernelOptions, KFACOptions, measure
from lightning_flatness.core.defaults import default_probes
from lightning_flatness.core.models import build_model

SIZES = (1000, 2048, 4000, 10_000)
EXACT_AT = (4000, 10_000)
EXTRAPOLATED = (50_000,)


def _train(architecture: str, x, y, epochs: int) -> tuple[nn.Module, float]:
    lam = 1.0 / x.shape[0]
    torch.manual_seed(0)
    model = build_model(architecture, (1, 7, 7), 10, 70)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=lam)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        train_epoch(model, optimizer, x, y, 64, generator)
    return model.eval(), lam


def _epoch_seconds(architecture: str, lam: float, x, y) -> float:
    times = []
    for _ in range(3):
        model = build_model(architecture, (1, 7, 7), 10, 70)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=lam)
        start = time.perf_counter()
        train_epoch(model, optimizer, x, y, 64)
        times.append(time.perf_counter() - start)
    return median(times)


def _batches(x, y, size: int = 256) -> list:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    set_threads(args.threads)
    x, y, _, _ = mnist7(train_size=4000, val_size=1000)
    noisy = torch.Generator().manual_seed(1)
    extra = x[torch.arange(SIZES[-1] - x.shape[0]) % x.shape[0]]
    extra = extra + 0.5 * torch.randn(extra.shape, generator=noisy)
    x_all, y_all = torch.cat([x, extra]), y[torch.arange(SIZES[-1]) % y.shape[0]]
    print_header(f"probe_kernel at the main job's size ({args.threads} threads)")
    for architecture in ("mlp", "cnn"):
        model, lam = _train(architecture, x, y, args.epochs)
        parameters = sum(p.numel() for p in model.parameters())
        exact = {
            m: measure(
                model,
                _batches(x_all[:m], y_all[:m]),
                lam=lam,
                num_train_samples=m,
                structure="dense",
            ).soft_rank
            for m in EXACT_AT
        }
        rows, per_sample = [], []
        for m in SIZES:
            xm, ym = x_all[:m], y_all[:m]
            epoch = _epoch_seconds(architecture, lam, xm, ym)
            kernel = measure(
                model,
                _batches(xm, ym),
                lam=lam,
                num_train_samples=m,
                structure=KernelOptions(trace_estimator="probe"),
            )
            kfac = measure(
                model,
                _batches(xm, ym),
                lam=lam,
                num_train_samples=m,
                structure=KFACOptions(kfac_mode="probe", trace_estimator="probe"),
            )
            probes = default_probes(m)
            side = "P × P" if probes * m > parameters else "kernel"
            state = 2 * parameters**2 * 8 if side == "P × P" else probes * m * parameters * 4
            per_sample.append((m, kernel.seconds))
            ratio = f"{kernel.soft_rank / exact[m]:.3f}" if m in exact else "—"
            kfac_ratio = f"{kfac.soft_rank / exact[m]:.2f}" if m in exact else "—"
            rows.append(
                [
                    f"{m:,} ({probes} probes)",
                    f"{epoch:.3f}",
                    f"{kernel.seconds:.2f}",
                    f"{kernel.seconds / epoch:.0f}",
                    side,
                    f"{state / 2**20:.0f} MiB",
                    ratio,
                    f"{kfac.seconds:.2f}",
                    kfac_ratio,
                ]
            )
        last, seconds = per_sample[-1]
        for m in EXTRAPOLATED:  # linear from zero: an upper bound (the fixed costs scale too)
            rows.append(
                [
                    f"{m:,} (extrapolated, ≤)",
                    "—",
                    f"{seconds * m / last:.0f}",
                    "—",
                    "P × P",
                    f"{2 * parameters**2 * 8 / 2**20:.0f} MiB",
                    "—",
                    "—",
                    "—",
                ]
            )
        print(
            f"\n### {architecture}: P = {parameters}, λ = {lam:.1e}, exact soft rank "
            + ", ".join(f"{value:.1f} at m = {m:,}" for m, value in exact.items())
            + " (dense)\n"
        )
        header = [
            "m",
            "epoch s",
            "probe_kernel s",
            "÷ epoch",
            "side",
            "state",
            "÷ exact",
            "kfac (probe) s",
            "kfac ÷ exact",
        ]
        print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
