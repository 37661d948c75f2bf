"""The probe kernel's bias near its probe rows, and the exact rows that replace it there: on the
trust study's trained models (``benchmarks/study_trust.py``: the paper's MLP and CNN on 7×7
images, Adam, weight decay λ = c/n), the soft rank of the dense Fisher, of ``measure()`` at its
defaults (which measures again with the exact output rows where the soft rank is at least
``PROBE_BIAS_SHARE`` of the probe rows), and of the default probes alone (one pass: an
iterator of the same batches, which cannot be read twice), each with its time.

    python benchmarks/bench_probe_bias.py
"""

from __future__ import annotations

import argparse
import time

from _common import environment_note, markdown_table, set_threads
from study_trust import GRIDS, train, untrained

from lightning_flatness import measure

#: (grid, n, c) of the trained models measured, learning rate 1e-3
CASES = (
    ("mlp7", 1000, 0.01),
    ("mlp7", 2000, 0.01),
    ("cnn7", 1000, 0.01),
    ("cnn7", 1000, 1),
    ("mlp7", 2000, 1),
    ("mlp7", 2000, 100),
)


def _measured(model, batches, lam: float, n: int, **options):
    """``measure()``'s report and its seconds."""
    started = time.perf_counter()
    report = measure(model, batches, lam=lam, num_train_samples=n, **options)
    return report, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment_note())
    rows = []
    for grid, n, c in CASES:
        run = next(r for r in GRIDS[grid].runs() if (r["n"], r["c"], r["lr"]) == (n, c, 1e-3))
        model, x, y, _, _ = untrained(run)
        train(model, x, y, run)
        data = [(x[i : i + 500], y[i : i + 500]) for i in range(0, n, 500)]
        lam = run["lam"]
        dense, dense_s = _measured(model, data, lam, n, structure="dense")
        default, default_s = _measured(model, data, lam, n)
        once, once_s = _measured(model, iter(data), lam, n)
        rows.append(
            [
                f"{run['architecture']}, n = {n:,}, c = {c:g}",
                f"{once.soft_rank / (4 * n):.2f}",
                f"{dense.soft_rank:,.1f} ({dense_s:.1f} s)",
                f"{once.soft_rank / dense.soft_rank:.4f} ({once_s:.1f} s)",
                f"{default.soft_rank / dense.soft_rank:.4f} ({default_s:.1f} s)",
            ]
        )
        print(markdown_table(HEADER, rows[-1:]), flush=True)
    print()
    print(markdown_table(HEADER, rows))


HEADER = [
    "model",
    "soft rank ÷ probe rows 4n",
    "dense Fisher",
    "default probes alone ÷ dense",
    "measure() default ÷ dense",
]


if __name__ == "__main__":
    main()
