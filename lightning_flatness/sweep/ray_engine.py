"""The sweep's Ray engine: every run a Ray task, on a running cluster or a local Ray instance.

The driver (the process calling :func:`~lightning_flatness.sweep.runner.run_sweep`) submits the
runs, at most ``max_in_flight`` at a time (``None``: all, and Ray's scheduler runs as many as the
cluster's resources allow), and yields each record as its task finishes, so it stays the only
writer of ``runs.jsonl``. A task runs :func:`~lightning_flatness.sweep.run.execute_run`, the same
function the process pool runs, with the same seed and thread count: on CPU its record equals
the pool's bit for bit.

A task whose worker dies (killed for memory, node lost) is not retried by Ray: it is recorded as
failed with Ray's reason, and the next invocation of the sweep runs it again (the process
pool's behaviour). Ctrl-C stops submitting, cancels the tasks in flight and re-raises; what
finished is already recorded.

Ray is an optional dependency (``pip install "lightning-flatness[ray]"``). Every worker needs
this package (and the modules of any ``class_path`` the config names) importable: install it on
the cluster's nodes, or ship modules with ``runtime_env`` (``py_modules``, ``env_vars``, ...).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from lightning_flatness.sweep.records import failed_record
from lightning_flatness.sweep.run import execute_run

__all__ = ["RayResources", "ray_runs", "relative_paths"]

#: Constructor arguments taken for paths by their names (read on the workers, not the driver)
_PATH_NAMES = ("dir", "path", "root", "file")


@dataclass(frozen=True)
class RayResources:
    """Where the Ray tasks run and what each asks for.

    Attributes:
        address: A running cluster (``"auto"``, ``"ray://head:10001"``, ...); ``None`` starts a
            local Ray instance when Ray is not initialized in this process yet.
        cpus_per_run: CPUs each task reserves.
        gpus_per_run: GPUs each task reserves (fractions allowed).
        runtime_env: Ray's ``runtime_env`` of the job (e.g. ``py_modules`` for a user's own
            model modules); ignored when Ray is already initialized by the caller.
        max_in_flight: Tasks submitted at once (``None``: all runs).
    """

    address: str | None = None
    cpus_per_run: int = 1
    gpus_per_run: float = 0.0
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    max_in_flight: int | None = None


def relative_paths(run: Mapping[str, Any]) -> list[str]:
    """The ``model``/``data`` constructor arguments of ``run`` that look like relative paths
    (named ``*dir``, ``*path``, ``*root``, ``*file``): a worker elsewhere resolves them against
    its own working directory, not the driver's."""
    found = []
    for section in ("model", "data"):
        arguments = (run.get(section) or {}).get("init_args") or {}
        for name, value in arguments.items():
            looks_like_path = name.lower().endswith(_PATH_NAMES) and isinstance(value, str)
            if looks_like_path and value and not PurePath(value).is_absolute():
                found.append(f"{section}.init_args.{name}={value!r}")
    return found


def _warn_relative(runs: Sequence[Mapping[str, Any]]) -> None:
    paths = sorted({path for run in runs for path in relative_paths(run)})
    if paths:
        warnings.warn(
            f"The sweep runs on a Ray cluster, and {', '.join(paths)} "
            f"{'is a relative path' if len(paths) == 1 else 'are relative paths'}: each worker "
            "reads it from its own working directory, not this one. Give absolute paths on "
            "storage every node sees.",
            stacklevel=3,
        )


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            "The sweep's engine 'ray' needs Ray, which is not installed: "
            'pip install "lightning-flatness[ray]" (or use engine: process, the default).'
        ) from error
    return ray


def _died(error: BaseException) -> str:
    """The failed record's message for a task that raised ``error`` instead of returning."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"{type(error).__name__}: the Ray task of this run died ({reason}); rerun the sweep "
        "to try it again."
    )


def _connect(ray: Any, resources: RayResources) -> bool:
    """Initialize Ray unless the caller did; whether this call started it (and must stop it)."""
    if ray.is_initialized():
        return False
    ray.init(
        address=resources.address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env=dict(resources.runtime_env) or None,
    )
    return True


def ray_runs(
    runs: Sequence[Mapping[str, Any]], threads: int, resources: RayResources
) -> Iterator[dict[str, Any]]:
    """Execute ``runs`` as Ray tasks; yield each record as its task finishes.

    Args:
        runs: Runs of :meth:`~lightning_flatness.sweep.config.SweepConfig.runs`.
        threads: Torch threads of each run.
        resources: Cluster address and per-task resources.

    Raises:
        ImportError: Ray is not installed.
    """
    if not runs:
        return
    ray = _import_ray()
    if resources.address is not None:
        _warn_relative(runs)
    started = _connect(ray, resources)
    task = ray.remote(execute_run).options(
        num_cpus=resources.cpus_per_run, num_gpus=resources.gpus_per_run, max_retries=0
    )
    limit = resources.max_in_flight or len(runs) or 1
    pending = list(runs)[::-1]
    in_flight: dict[Any, Mapping[str, Any]] = {}
    try:
        while pending or in_flight:
            while pending and len(in_flight) < limit:
                run = pending.pop()
                in_flight[task.remote(dict(run), threads)] = run
            # a timeout returns control to Python every second, so Ctrl-C is seen at once
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
            for ref in done:
                run = in_flight.pop(ref)
                try:
                    yield ray.get(ref)
                except ray.exceptions.RayError as error:
                    yield failed_record(run, _died(error))
    finally:
        for ref in in_flight:  # Ctrl-C or the caller stopped: do not leave tasks running
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
