"""Run a sweep: parallel workers, one JSON line per finished run, resumable, with progress.

Results go to ``<output_dir>/runs.jsonl``, one line per finished run, written by the parent
process only (so lines never interleave) and flushed as each run ends. A rerun reads the file
and skips every run whose key is already recorded with ``status="ok"`` (failed runs are tried
again unless ``retry_failed=False``). Each invocation also appends one line to
``<output_dir>/invocations.jsonl`` (wall time, runs done, workers).

With more than one worker, runs execute in ``spawn`` ed processes, at most ``workers`` at a time,
each limited to ``threads_per_worker`` torch threads. A worker that dies (e.g. killed for
memory) breaks the pool: the runs in flight are recorded as failed with that reason and the
pool is restarted for the remaining runs. With one worker, runs execute in this process.
With ``engine="ray"`` every run is a Ray task instead (:mod:`~lightning_flatness.sweep.ray_engine`);
the records, the resume and the report are the same.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_flatness.sweep.config import ENGINES, SweepConfig
from lightning_flatness.sweep.ray_engine import RayResources, ray_runs
from lightning_flatness.sweep.records import (
    INVOCATIONS_FILE,
    RESULTS_FILE,
    failed_record,
    json_line,
    json_safe,
    read_records,
)
from lightning_flatness.sweep.report import write_report
from lightning_flatness.sweep.run import execute_run, set_threads

__all__ = [
    "RESULTS_FILE",
    "INVOCATIONS_FILE",
    "SweepSummary",
    "json_safe",
    "read_records",
    "run_sweep",
]

CONFIG_FILE = "sweep_config.yaml"


@dataclass
class SweepSummary:
    """What one call of :func:`run_sweep` did.

    Attributes:
        output_dir: The sweep's folder.
        total: Runs in the sweep.
        skipped: Runs already recorded (not run again).
        finished: Runs finished by this call with ``status="ok"``.
        failed: Runs finished by this call with ``status="failed"``.
        wall_seconds: Wall time of this call (report excluded).
    """

    output_dir: Path
    total: int
    skipped: int
    finished: int = 0
    failed: int = 0
    wall_seconds: float = 0.0


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _init_worker(threads: int) -> None:
    set_threads(threads)


def _in_process(runs: Sequence[Mapping[str, Any]], threads: int) -> Iterator[dict[str, Any]]:
    for run in runs:
        yield execute_run(run, threads)


def _in_pool(
    runs: Sequence[Mapping[str, Any]], workers: int, threads: int
) -> Iterator[dict[str, Any]]:
    """Execute runs in a process pool, at most ``workers`` in flight; restart a broken pool."""
    pending = list(runs)[::-1]
    context = multiprocessing.get_context("spawn")
    while pending:
        pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init_worker, initargs=(threads,)
        )
        in_flight: dict[Future, Mapping[str, Any]] = {}
        broken = False
        try:
            while pending or in_flight:
                while pending and len(in_flight) < workers and not broken:
                    run = pending.pop()
                    in_flight[pool.submit(execute_run, run, threads)] = run
                if not in_flight:
                    break
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    run = in_flight.pop(future)
                    try:
                        yield future.result()
                    except BrokenProcessPool:
                        broken = True
                        yield failed_record(
                            run,
                            "BrokenProcessPool: a worker process died while this run was in "
                            "flight (this run or another one in flight crashed it, e.g. out of "
                            "memory); rerun the sweep to try it again.",
                        )
                    except Exception as error:  # e.g. a run that cannot be pickled
                        yield failed_record(run, f"{type(error).__name__}: {error}")
                if broken and not in_flight:
                    break
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _records(
    config: SweepConfig,
    engine: str,
    address: str | None,
    runs: Sequence[Mapping[str, Any]],
    workers: int,
    threads: int,
) -> Iterator[dict[str, Any]]:
    """The records of ``runs`` as they finish, from the engine asked for."""
    if engine == "ray":
        resources = RayResources(
            address=address or config.address,
            cpus_per_run=config.cpus_per_run,
            gpus_per_run=config.gpus_per_run,
            runtime_env=config.runtime_env,
            max_in_flight=workers or None,
        )
        return ray_runs(runs, threads, resources)
    if workers == 1:
        return _in_process(runs, threads)
    return _in_pool(runs, workers, threads)


def _progress(total: int, skipped: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=f"sweep ({skipped} already done)" if skipped else "sweep",
        unit="run",
        disable=not enabled,
        dynamic_ncols=True,
    )


def run_sweep(
    config: SweepConfig,
    *,
    output_dir: str | Path | None = None,
    workers: int | None = None,
    threads_per_worker: int | None = None,
    retry_failed: bool = True,
    progress: bool = True,
    report: bool = True,
    engine: str | None = None,
    address: str | None = None,
) -> SweepSummary:
    """Run every run of ``config`` not yet recorded in ``output_dir``, then write the report.

    Args:
        config: The sweep.
        output_dir: The sweep's folder (default: ``config.output_dir``, else ``runs/sweep``).
        workers: Parallel runs (default: ``config.workers``, else one per core). With 1, runs
            execute in this process (which then has its global seed and thread count changed).
            With the Ray engine: the cap on tasks in flight (default: none, Ray's scheduler
            runs as many as the cluster's resources allow; ``config.workers`` is not read).
        threads_per_worker: Torch threads per run (default: ``config.threads_per_worker``, else
            ``cores // workers``, at least 1).
        retry_failed: Run again the runs recorded as failed.
        progress: Show a progress bar with ETA (tqdm) on stderr.
        report: Write the report (:func:`~lightning_flatness.sweep.report.write_report`) at the
            end.
        engine: ``"process"`` or ``"ray"`` (default: ``config.engine``).
        address: The Ray cluster's address (default: ``config.address``; ``None``: a local
            Ray instance unless Ray is initialized in this process already).

    Returns:
        A :class:`SweepSummary`.
    """
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    out = Path(output_dir or config.output_dir or "runs/sweep")
    out.mkdir(parents=True, exist_ok=True)
    runs = config.runs(config.structures)
    engine = engine or config.engine
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}.")
    cores = _default_workers()
    if engine == "ray":
        workers = int(workers or 0)  # the config's `workers` sizes the local pool only
        threads = int(threads_per_worker or config.threads_per_worker or config.cpus_per_run)
    else:
        workers = int(workers or config.workers or cores)
        threads = int(threads_per_worker or config.threads_per_worker or max(1, cores // workers))
    if (engine == "process" and workers < 1) or workers < 0 or threads < 1:
        raise ValueError(
            f"workers and threads_per_worker must be ≥ 1, got workers={workers}, "
            f"threads_per_worker={threads}."
        )

    results = out / RESULTS_FILE
    done = {
        record["key"]
        for record in read_records(results)
        if record.get("status") == "ok" or (not retry_failed and "key" in record)
    }
    logs = Path(config.logs_dir or out / "lightning").resolve()  # workers may run elsewhere
    # one folder per run: runs in flight at once never share a logger's version counter
    todo = [dict(run, root_dir=str(logs / run["key"])) for run in runs if run["key"] not in done]
    summary = SweepSummary(out, total=len(runs), skipped=len(runs) - len(todo))
    with (out / CONFIG_FILE).open("w", encoding="utf-8") as handle:
        yaml.safe_dump(config.to_dict(), handle, sort_keys=False, allow_unicode=True)

    bar = _progress(len(todo), summary.skipped, progress)
    try:
        with results.open("a", encoding="utf-8") as handle:
            for record in _records(config, engine, address, todo, workers, threads):
                handle.write(json_line(record) + "\n")
                handle.flush()
                if record["status"] == "ok":
                    summary.finished += 1
                else:
                    summary.failed += 1
                    bar.write(f"run failed ({record['label']}): {record['error']}")
                bar.set_postfix(failed=summary.failed, refresh=False)
                bar.update(1)
    finally:
        bar.close()
        summary.wall_seconds = time.perf_counter() - start
        invocation = {
            "started": started,
            "wall_seconds": summary.wall_seconds,
            "total": summary.total,
            "skipped": summary.skipped,
            "finished": summary.finished,
            "failed": summary.failed,
            "engine": engine,
            "workers": workers,
            "threads_per_worker": threads,
            "structures": list(config.structures),
        }
        with (out / INVOCATIONS_FILE).open("a", encoding="utf-8") as handle:
            handle.write(json_line(invocation) + "\n")
    if report:
        write_report(out)
    return summary
