"""The probe kernel past its formed-kernel guard: error against cost of the stored-row estimate
(stochastic Lanczos quadrature on the kept probe rows), the formed kernel of the same rows, and
``cg`` (the default past the guard before), on trained BatchNorm ResNets past both of the
probe kernel's old guards (P > 8,192 and m·s > 8,192).

Each model is trained with SGD and weight decay λ = c/n on the bundled 7×7 MNIST; every
structure then measures the whole training set. The reference is the formed kernel of the
exact output rows (probes = classes: no probe bias, the dense Fisher's spectrum) where
``--exact`` is given and it fits, else the formed kernel of the default's own probe rows
(jackknifed, within 3% of dense on the held-out grids). Costs are in training epochs of the
same model measured in the same run, with the peak resident memory growth of each
measurement.

    python benchmarks/bench_stored_rows.py --rungs 12:3000 --c 2.5
    python benchmarks/bench_stored_rows.py --rungs 16:4000 --c 2.5 25 --skip-cg
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from _common import environment_note, markdown_table, mnist7, set_threads, train_epoch
from _resnet import SmallResNet

import lightning_flatness as lf


def _trained(width: int, n: int, c: float, epochs: int) -> tuple[torch.nn.Module, float, tuple]:
    """A SmallResNet trained ``epochs`` epochs; its seconds per epoch and the data."""
    data = mnist7(n, 1000)
    x, y = data[0], data[1]
    torch.manual_seed(0)
    model = SmallResNet(width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=c / n)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(epochs):
        train_epoch(model, optimizer, x, y, 64, generator)
    return model.eval(), (time.perf_counter() - started) / epochs, data


def _measure(model, data, lam: float, structure: str, **options) -> tuple:
    """One measurement: its report, seconds and peak memory growth (MiB)."""
    x, y = data[0], data[1]
    n = x.shape[0]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    report = lf.measure(
        model,
        [(x[i : i + 256], y[i : i + 256]) for i in range(0, n, 256)],
        lam=lam,
        num_train_samples=n,
        structure=structure,
        trace_estimator="probe",
        **options,
    )
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return report, seconds, grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rungs", nargs="+", default=["12:3000", "16:4000"], help="width:n")
    parser.add_argument("--c", type=float, nargs="+", default=[2.5], help="c = λn")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs")
    parser.add_argument("--exact", action="store_true", help="exact output rows reference")
    parser.add_argument("--skip-cg", action="store_true", help="leave out cg (slow)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment_note())
    rows = []
    for rung in args.rungs:
        width, n = (int(part) for part in rung.split(":"))
        for c in args.c:
            model, epoch, data = _trained(width, n, c, args.epochs)
            lam = c / n
            parameters = sum(p.numel() for p in model.parameters())
            runs = {}
            if args.exact:
                exact_rows = {"probes": 10, "groups": 1, "side": "samples"}
                runs["formed kernel, exact rows"] = (
                    "probe_kernel",
                    {"kernel_options": {**exact_rows, "max_kernel_size": 10**6}},
                )
            runs["formed kernel, default's rows"] = (
                "probe_kernel",
                {"kernel_options": {"side": "samples", "max_kernel_size": 10**6}},
            )
            runs["stored rows (the default)"] = ("auto", {})
            if not args.skip_cg:
                runs["cg (the default before)"] = ("cg", {})
            results = {name: _measure(model, data, lam, s, **o) for name, (s, o) in runs.items()}
            reference = next(iter(results.values()))[0].soft_rank
            for name, (report, seconds, grown) in results.items():
                stderr = report.as_dict().get("soft_rank_stderr", float("nan"))
                rows.append(
                    [
                        f"{width} ({parameters:,})",
                        f"{n:,}",
                        f"{c:g}",
                        name,
                        f"{report.soft_rank:,.1f} ± {stderr:.1f}",
                        f"{report.soft_rank / reference:.3f}",
                        f"{seconds:.1f}",
                        f"{seconds / epoch:.1f}",
                        f"{grown:,.0f}",
                    ]
                )
            print(markdown_table(_HEADER, rows[-len(results) :]), flush=True)
    print()
    print(markdown_table(_HEADER, rows))


_HEADER = [
    "ResNet width (P)",
    "n",
    "c",
    "structure",
    "soft rank ± stderr",
    "÷ reference",
    "s",
    "training epochs",
    "peak memory growth (MiB)",
]


if __name__ == "__main__":
    main()
