"""The probe kernel past its formed-kernel guard: error against cost of the stored-row estimate
(stochastic Lanczos quadrature on the kept probe rows), the formed kernel of the same rows, and
``cg`` (the default past the guard before), on trained BatchNorm ResNets past both of the
probe kernel's old guards (P > 8,192 and m·s > 8,192).

Each model is trained with SGD and weight decay λ = c/n: a SmallResNet on the bundled 7×7
MNIST (rung ``width:n``), or a three-stage LadderResNet on three-channel 16×16 images (rung
``w1,w2,w3:n``, ``benchmarks/_ladder.py``); every structure then measures the whole training
set. The reference is the first structure listed: the dense Fisher (every output's row,
summed as P × P in float64) with ``--exact``, else stored rows of 4 probes per sample with a
±0.2% quadrature bracket with ``--certified``, else the formed kernel of the default's own
probe rows (jackknifed, within 3% of dense on the held-out grids). Costs are in training
epochs of the same model measured in the same run, with the peak resident memory growth of
each measurement.

    python benchmarks/bench_stored_rows.py --rungs 12:3000 --c 2.5
    python benchmarks/bench_stored_rows.py --rungs 16:4000 --c 2.5 25 --skip-cg
    python benchmarks/bench_stored_rows.py --rungs 8,16,24:5000 --c 2.5 25 --exact --skip-cg \
        --skip-formed
    python benchmarks/bench_stored_rows.py --rungs 16,32,64:10000 --c 5 --certified --skip-cg \
        --skip-formed
    python benchmarks/bench_stored_rows.py --rungs 16,32,64:10000 --c 5 --skip-cg --skip-formed \
        --epochs 5 --tolerances 0.05 0.1
    python benchmarks/bench_stored_rows.py --rungs 16,32,64:10000 --c 5 --certified --skip-cg \
        --skip-formed --epochs 5 --unsketched --sketch-factors 8 16
    python benchmarks/bench_stored_rows.py --rungs 8,16,24:5000 --c 2.5 --exact --skip-cg \
        --skip-formed --across-processes
    python benchmarks/bench_stored_rows.py --rungs 8,16,24:5000 --c 1 --epochs 3 --certified \
        --skip-cg --skip-formed --slq-extensions 1
    python benchmarks/bench_stored_rows.py --rungs 8,16,24:5000 --c 2.5 --exact --skip-formed \
        --structures kfac diag lanczos hutchinson
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace

import torch
from _common import environment_note, markdown_table, mnist7, set_threads, train_epoch
from _ladder import LadderResNet, colour16
from _resnet import SmallResNet

import lightning_flatness as lf
from lightning_flatness.core.defaults import auto_choice
from lightning_flatness.core.options import (
    HOOK_STRUCTURES,
    MATRIX_FREE_STRUCTURES,
    structure_options,
)


def _trained(rung: str, n: int, c: float, epochs: int) -> tuple[torch.nn.Module, float, tuple]:
    """The rung's model trained ``epochs`` epochs; its seconds per epoch and the data. A rung
    ``"12"`` is a SmallResNet of width 12 on 7×7 MNIST; ``"8,16,24"`` a LadderResNet of those
    stage widths on the three-channel 16×16 images."""
    ladder = "," in rung
    data = colour16(n, 1000 if n < 10_000 else 0) if ladder else mnist7(n, 1000)
    x, y = data[0], data[1]
    torch.manual_seed(0)
    widths = tuple(int(w) for w in rung.split(","))
    model = LadderResNet(widths) if ladder else SmallResNet(width=widths[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=c / n)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(epochs):
        train_epoch(model, optimizer, x, y, 64, generator)
    return model.eval(), (time.perf_counter() - started) / epochs, data


def _options(model, n: int, structure: str, fields: dict, all_reduce=None):
    """The options object of ``structure`` with these fields (``"auto"``: of the structure it
    chooses, sketched as it sketches unless the fields name a factor; the fields are the probe
    kernel's), Tr(F) from probe rows: ``"probe"`` for the layer-hook structures, the
    matrix-free structures' ``"sampled"`` (the same probes)."""
    if structure == "auto":
        choice = auto_choice(model, n, all_reduce=all_reduce)
        structure = choice.structure
        if structure != "probe_kernel":
            fields = {}
        elif choice.sketch_factor is not None:
            fields = {"sketch_factor": choice.sketch_factor, **fields}
    options = structure_options(structure, fields)
    if structure in MATRIX_FREE_STRUCTURES:
        return replace(options, trace_estimator="sampled")
    return replace(options, trace_estimator="probe") if structure in HOOK_STRUCTURES else options


def _measure(model, data, lam: float, structure: str, fields: dict, all_reduce=None) -> tuple:
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
        structure=_options(model, n, structure, fields, all_reduce),
        all_reduce=all_reduce,
    )
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return report, seconds, grown


#: the structures ``--structures`` adds, at their defaults, by the name they get in the table
OTHER_STRUCTURES = {
    "kfac": "kfac (the monitor's fill-in, unscaled)",
    "diag": "diag",
    "lanczos": "lanczos",
    "hutchinson": "hutchinson (diagonal)",
}


def _one_process(tensor: torch.Tensor) -> torch.Tensor:
    """The sum across a world of one process."""
    return tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rungs",
        nargs="+",
        default=["12:3000", "16:4000"],
        help="width:n (SmallResNet on 7×7 MNIST) or w1,w2,w3:n (LadderResNet, 3×16×16)",
    )
    parser.add_argument("--c", type=float, nargs="+", default=[2.5], help="c = λn")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs")
    parser.add_argument("--exact", action="store_true", help="exact output rows reference")
    parser.add_argument("--skip-cg", action="store_true", help="leave out cg (slow)")
    parser.add_argument(
        "--skip-formed", action="store_true", help="leave out the formed kernel (slow)"
    )
    parser.add_argument(
        "--certified",
        action="store_true",
        help="reference: stored rows of 4 probes with a ±0.2%% quadrature bracket (past dense)",
    )
    parser.add_argument(
        "--tolerances",
        type=float,
        nargs="*",
        default=[],
        help="also the default with these slq_tolerance brackets (e.g. 0.05 0.1)",
    )
    parser.add_argument(
        "--unsketched", action="store_true", help="also the default's rows kept whole"
    )
    parser.add_argument(
        "--sketch-factors",
        type=int,
        nargs="*",
        default=[],
        help="also the rows sketched this many times shorter, whatever P (e.g. 4 16)",
    )
    parser.add_argument(
        "--sketch-groups",
        type=int,
        nargs="*",
        default=[],
        help="also the rows sketched 8× shorter in this many jackknife groups (e.g. 4 8)",
    )
    parser.add_argument(
        "--reference-factor",
        type=int,
        default=None,
        help="reference: rows sketched this many times shorter, 16 × ≤ 150 steps, ±0.2%% "
        "(past the memory of whole rows)",
    )
    parser.add_argument(
        "--structures",
        nargs="*",
        default=[],
        choices=sorted(OTHER_STRUCTURES),
        help="also these structures at their defaults (the fill-in's kfac, diag, the "
        "matrix-free ones)",
    )
    parser.add_argument(
        "--across-processes",
        action="store_true",
        help="also the estimate rows kept by several processes take, on a world of one",
    )
    parser.add_argument(
        "--slq-extensions",
        type=int,
        nargs="*",
        default=[],
        help="also the default with these slq_extension (1: stop at slq_steps whatever the "
        "bracket)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment_note())
    rows = []
    for rung in args.rungs:
        width, n = rung.split(":")[0], int(rung.split(":")[1])
        for c in args.c:
            model, epoch, data = _trained(width, n, c, args.epochs)
            lam = c / n
            parameters = sum(p.numel() for p in model.parameters())
            runs = {}
            if args.exact:  # every output's row: the dense Fisher, summed as P × P in float64
                exact_rows = {"probes": 10, "groups": 1, "side": "parameters"}
                runs["dense (exact output rows, P × P)"] = (
                    "probe_kernel",
                    {**exact_rows, "max_parameters": 10**6},
                )
            if args.certified:  # twice the default's probe rows where it takes 2, a tight bracket
                certified = {
                    "probes": 4,
                    "slq_probes": 16,
                    "slq_steps": 150,
                    "slq_tolerance": 0.002,
                    "max_row_elements": 2**34,
                    "sketch_factor": 1,
                }
                runs["stored rows, 4 probes, 16 × ≤ 150 steps, bracket ±0.2%"] = (
                    "probe_kernel",
                    certified,
                )
            if args.reference_factor is not None:
                sketched = {
                    "slq_probes": 16,
                    "slq_steps": 150,
                    "slq_tolerance": 0.002,
                    "max_row_elements": 2**34,
                    "sketch_factor": args.reference_factor,
                }
                runs[f"rows {args.reference_factor}× shorter, 16 × ≤ 150 steps, ±0.2%"] = (
                    "probe_kernel",
                    sketched,
                )
            if not args.skip_formed:
                runs["formed kernel, default's rows"] = (
                    "probe_kernel",
                    {"side": "samples", "max_kernel_size": 10**6},
                )
            runs["stored rows (the default)"] = ("auto", {})
            if args.across_processes:  # a world of one: what each of several processes runs
                runs["stored rows, split runs (across processes)"] = ("auto", {}, _one_process)
            if args.unsketched:
                runs["stored rows kept whole"] = ("auto", {"sketch_factor": 1})
            for groups in args.sketch_groups:
                sketched = {"sketch_factor": 8, "sketch_groups": groups}
                sketched["sketch_from_parameters"] = 1
                runs[f"stored rows 8× shorter, {groups} sketch groups"] = (
                    "auto",
                    sketched,
                )
            for factor in args.sketch_factors:
                sketched = {"sketch_factor": factor, "sketch_from_parameters": 1}
                runs[f"stored rows sketched {factor}× shorter"] = (
                    "auto",
                    sketched,
                )
            for extension in args.slq_extensions:
                runs[f"stored rows, at most {extension}× slq_steps"] = (
                    "auto",
                    {"slq_extension": extension},
                )
            for tolerance in args.tolerances:
                runs[f"stored rows, bracket ±{tolerance:.0%}"] = (
                    "auto",
                    {"slq_tolerance": tolerance},
                )
            if not args.skip_cg:
                runs["cg (the default before)"] = ("cg", {})
            for structure in args.structures:
                runs[OTHER_STRUCTURES[structure]] = (structure, {})
            results = {name: _measure(model, data, lam, *run) for name, run in runs.items()}
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
