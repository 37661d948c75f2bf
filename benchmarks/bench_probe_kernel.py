"""The default structure at the main job's size: probe-kernel cost and accuracy against exact.

Trains the paper's MLP (one hidden layer of 70, P = 4,210) and CNN on the bundled 7×7 MNIST
(n = 4,000, c = λ·n = 1, Adam, 20 epochs, the README main job's setting), then measures, side
by side in one run, on the first m ∈ {1,000, 2,048, 4,000} training images:

- one training epoch over the same m images (Adam, batch 64);
- ``probe_kernel`` (the default: 4 probes in 2 jackknife groups), its seconds, its peak state
  (P × P sums, or kept rows) and its soft rank ÷ the exact (``dense``) one at m = 4,000;
- ``kfac`` with one probe row per input (the previous default), the same numbers.

The probe kernel's cost at larger m is extrapolated from the measured ones, and says so: the
P × P sums cost a fixed amount per sample and the eigendecompositions do not grow with m once
m·probes > P. Usage::

    python benchmarks/bench_probe_kernel.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import markdown_table, median, mnist7, print_header, set_threads, train_epoch
from torch import nn

from lightning_flatness import measure
from lightning_flatness.core.models import build_model

SIZES = (1000, 2048, 4000)
EXTRAPOLATED = (10_000, 50_000)


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
    print_header(f"probe_kernel at the main job's size ({args.threads} threads)")
    for architecture in ("mlp", "cnn"):
        model, lam = _train(architecture, x, y, args.epochs)
        parameters = sum(p.numel() for p in model.parameters())
        exact = measure(
            model, _batches(x, y), lam=lam, num_train_samples=4000, structure="dense"
        ).soft_rank
        rows, per_sample = [], []
        for m in SIZES:
            xm, ym = x[:m], y[:m]
            epoch = _epoch_seconds(architecture, lam, xm, ym)
            kernel = measure(
                model,
                _batches(xm, ym),
                lam=lam,
                num_train_samples=4000,
                structure="probe_kernel",
                trace_estimator="probe",
            )
            kfac = measure(
                model,
                _batches(xm, ym),
                lam=lam,
                num_train_samples=4000,
                structure="kfac",
                kfac_mode="probe",
                trace_estimator="probe",
            )
            side = "P × P" if 4 * m > parameters else "kernel"
            state = 2 * parameters**2 * 8 if side == "P × P" else 4 * m * parameters * 4
            per_sample.append((m, kernel.seconds))
            ratio = f"{kernel.soft_rank / exact:.3f}" if m == 4000 else "—"
            kfac_ratio = f"{kfac.soft_rank / exact:.2f}" if m == 4000 else "—"
            rows.append(
                [
                    str(m),
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
        (m1, t1), (m2, t2) = per_sample[-2:]
        slope = (t2 - t1) / (m2 - m1)
        for m in EXTRAPOLATED:
            rows.append(
                [
                    f"{m:,} (extrapolated)",
                    "—",
                    f"{t2 + slope * (m - m2):.1f}",
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
            f"{exact:.1f} (dense, m = 4,000)\n"
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
