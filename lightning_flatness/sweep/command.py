"""``lightning-flatness sweep``: run a sweep from a YAML file, or rewrite a sweep's report.

::

    lightning-flatness sweep --config configs/sweep_quick.yaml [--output DIR] [--workers N]
    lightning-flatness sweep --config configs/sweep_paper.yaml --engine ray --address auto
    lightning-flatness sweep report DIR
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]

_EPILOG = (
    "Results: DIR/runs.jsonl (one JSON line per finished run; a rerun skips recorded runs), "
    "DIR/report.md (Kendall tau tables), DIR/kendall.json and DIR/scatter_*.png. "
    "'lightning-flatness sweep report DIR' rewrites the report of an existing sweep."
)


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-flatness sweep",
        description=(
            "Train a grid of models for a fixed step budget, measure the flatness of each on "
            "its whole training set with every structure, and report the Kendall rank "
            "correlation of each measure with the measured generalization gap."
        ),
        epilog=_EPILOG,
    )
    parser.add_argument("--config", required=True, help="sweep YAML file")
    parser.add_argument("--output", help="output folder (default: the config's output_dir)")
    parser.add_argument(
        "--workers", type=int, help="parallel runs (default: config, else one per core)"
    )
    parser.add_argument(
        "--threads-per-worker", type=int, help="torch threads per run (default: cores // workers)"
    )
    parser.add_argument(
        "--engine",
        choices=("process", "ray"),
        help="where runs execute: a local process pool or Ray tasks (default: the config's, "
        "else process)",
    )
    parser.add_argument(
        "--address",
        help="with --engine ray: the cluster (auto, ray://head:10001; default: the config's, "
        "else a local Ray instance)",
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        help="with the config's sample: which seeded subset of the grid (default: the config's "
        "sample_seed)",
    )
    parser.add_argument(
        "--skip-failed", action="store_true", help="do not rerun runs recorded as failed"
    )
    parser.add_argument("--no-report", action="store_true", help="do not write the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the runs and their keys, run nothing"
    )
    return parser


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-flatness sweep report",
        description="Write report.md, kendall.json and the scatter plots of a sweep's folder.",
    )
    parser.add_argument("output", help="the sweep's output folder (holding runs.jsonl)")
    return parser


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-flatness sweep``.

    Args:
        args: Arguments after ``sweep`` (``None``: ``sys.argv[2:]``).

    Returns:
        0 when every run finished, 1 when some failed (they are recorded and skipped).
    """
    import dataclasses
    import sys

    argv = list(sys.argv[2:] if args is None else args)
    if argv and argv[0] == "report":
        from lightning_flatness.sweep.report import write_report

        options = _report_parser().parse_args(argv[1:])
        path = write_report(options.output)
        print(path.read_text(encoding="utf-8"))
        print(f"Report written to {path}")
        return 0

    from lightning_flatness.sweep.config import load_config
    from lightning_flatness.sweep.runner import run_sweep

    options = _run_parser().parse_args(argv)
    try:
        config = load_config(options.config)
    except (OSError, ValueError) as error:
        raise SystemExit(f"lightning-flatness sweep: {error}") from error
    if options.sample_seed is not None:
        config = dataclasses.replace(config, sample_seed=options.sample_seed)
    if options.dry_run:
        for run in config.runs():
            print(f"{run['key']}  {run['label']}")
        print(f"{len(config.runs())} runs of a {config.num_grid_points()}-point grid.")
        return 0
    summary = run_sweep(
        config,
        output_dir=options.output,
        workers=options.workers,
        threads_per_worker=options.threads_per_worker,
        retry_failed=not options.skip_failed,
        progress=not options.no_progress,
        report=not options.no_report,
        engine=options.engine,
        address=options.address,
    )
    print(
        f"Sweep: {summary.finished} runs finished, {summary.failed} failed, {summary.skipped} "
        f"already done, in {summary.wall_seconds:.0f} s; results in {summary.output_dir}."
    )
    if not options.no_report:
        print(f"Report: {summary.output_dir / 'report.md'}")
    return 1 if summary.failed else 0
