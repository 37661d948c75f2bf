"""One sweep under both engines, side by side: the local process pool and Ray tasks.

Runs the same sweep config twice into two fresh folders, first with ``engine: process`` and then
with ``engine: ray`` (a local Ray instance with the machine's cores, unless ``--address`` names
a cluster), and prints the wall time of each, their ratio, and whether every run's record is
the same under both (every field but the timings). Per run it also prints the training time
per step and each structure's measurement time, the numbers a cluster run's cost is estimated
from (docs/RESULTS.md, "The sweep on Ray").

Usage::

    python benchmarks/bench_sweep_engines.py --config configs/sweep_quick.yaml \\
        --output runs/bench_sweep_engines
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from lightning_flatness.sweep.config import load_config
from lightning_flatness.sweep.records import read_records, without_timings
from lightning_flatness.sweep.runner import run_sweep


def sweep_once(config_path: Path, output: Path, engine: str, address: str | None) -> float:
    """Run the whole sweep into an empty ``output``; its wall time in seconds."""
    shutil.rmtree(output, ignore_errors=True)
    config = load_config(config_path)
    start = time.perf_counter()
    run_sweep(config, output_dir=output, engine=engine, address=address, report=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/sweep_quick.yaml"))
    parser.add_argument("--output", type=Path, default=Path("runs/bench_sweep_engines"))
    parser.add_argument("--address", help="a Ray cluster (default: a local Ray instance)")
    args = parser.parse_args()

    seconds = {
        engine: sweep_once(args.config, args.output / engine, engine, args.address)
        for engine in ("process", "ray")
    }
    records = {
        engine: {r["key"]: r for r in read_records(args.output / engine / "runs.jsonl")}
        for engine in seconds
    }
    pool, ray = records["process"], records["ray"]
    same = [
        key
        for key in pool
        if key in ray and without_timings(pool[key]) == without_timings(ray[key])
    ]
    print(f"config: {args.config}, {len(pool)} runs")
    print(
        f"wall time: process pool {seconds['process']:.0f} s, Ray {seconds['ray']:.0f} s, "
        f"Ray ÷ pool {seconds['ray'] / seconds['process']:.2f}"
    )
    print(f"records equal under both engines (timings aside): {len(same)} of {len(pool)}")

    ok = [r for r in pool.values() if r["status"] == "ok"]
    steps = [r["train_seconds"] / max(r["global_step"], 1) for r in ok]
    print(
        f"training: {statistics.median(steps) * 1e3:.2f} ms per step (median over {len(ok)} "
        f"runs, max {max(steps) * 1e3:.2f})"
    )
    structures = sorted({s for r in ok for s in r["measures"]})
    for structure in structures:
        times = [r["measures"][s]["seconds"] for r in ok for s in [structure] if s in r["measures"]]
        print(
            f"measure {structure}: median {statistics.median(times):.2f} s, max {max(times):.2f} s"
        )


if __name__ == "__main__":
    main()
