"""Sweep configuration: a YAML file with a base run and a grid, expanded into keyed runs.

A sweep file has the sections of a ``lightning-flatness fit`` config (``model``, ``data``,
``trainer``, in the ``class_path`` + ``init_args`` style of LightningCLI) plus:

``steps``
    The fixed step budget of every run (``Trainer(max_steps=steps)``).
``grid``
    ``{dotted.path: [values, ...]}``; the runs are the Cartesian product, in file order.
    ``model.lr`` is short for ``model.init_args.lr`` (likewise for ``data``); ``trainer.X``,
    ``measure.X`` (e.g. ``measure.lanczos.probes``) and the top-level ``seed``, ``steps``,
    ``lam`` can be varied as well.
``structures``
    The :func:`~lightning_flatness.core.measure` structures measured at the end of every run;
    ``"exact"`` is ``"dense"`` when the model has at most ``n·C`` parameters and ``"gram"``
    otherwise (both give the exact spectrum; the smaller matrix is cheaper);
    ``"kfac_sampled"`` is ``kfac`` with one sampled label per input for the factors and for
    Tr(F), ``"kfac_probe"`` the same with one Rademacher probe per input (``FlatnessMonitor``'s
    default before ``probe_kernel``); ``"probe_kernel"`` is measured with Tr(F) from its probes,
    as the monitor measures it.
``seed``
    ``seed_everything`` seed of every run (vary it through the grid).
``lam``
    λ of the soft rank; ``null`` reads the coupled weight decay from the optimizer.
``measure``, ``measure_batch_size``
    What each structure is measured with and the batch size of the measurement's passes:
    ``measure`` maps a structure's name to the fields of its options object (e.g.
    ``lanczos: {probes: 5, lanczos_steps: 50}``) and may give ``loss``, ``max_samples`` and
    ``max_val_samples`` (:mod:`~lightning_flatness.sweep.measured`).
``sample``, ``sample_seed``
    Run only a seeded random subset of ``sample`` grid points.
``output_dir``, ``workers``, ``threads_per_worker``
    Where the results go, how many worker processes run at once (``null``: one per core) and
    how many threads each uses (``null``: cores // workers).
``logs_dir``
    Where the runs' Lightning logs go, one folder per run key (``null``:
    ``<output_dir>/lightning``); made absolute on the driver, so on a cluster it must be storage
    every worker sees.
``engine``
    ``process`` (the default: a local process pool of ``workers``) or ``ray`` (every run a Ray
    task: :mod:`~lightning_flatness.sweep.ray_engine`).
``address``, ``cpus_per_run``, ``gpus_per_run``, ``runtime_env``
    For ``engine: ray``: the cluster (``auto``, ``ray://head:10001``; ``null``: a local Ray
    instance), the CPUs and GPUs each run reserves (``cpus_per_run`` is also its thread count
    unless ``threads_per_worker`` is set) and Ray's ``runtime_env`` of the job. ``workers``
    sizes the local pool only; under Ray, ``--workers`` on the command line caps the tasks in
    flight. None of these change a run's record or key.

Every run has a stable *key*: a hash of everything that determines its record (model, data,
trainer, seed, steps, λ, structures and measurement options), so a rerun skips the runs already
recorded and changing any of these starts new runs.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, STRUCTURES
from lightning_flatness.lightning.class_paths import DEFAULT_DATA, DEFAULT_MODEL
from lightning_flatness.sweep.measured import EXACT, MONITOR_DEFAULT, VARIANTS, check_measure

__all__ = [
    "ENGINES",
    "EXACT",
    "MONITOR_DEFAULT",
    "SWEEP_STRUCTURES",
    "VARIANTS",
    "SweepConfig",
    "load_config",
    "run_key",
]

#: Structures a sweep accepts (the pseudo-structures :data:`EXACT` and :data:`VARIANTS`
#: among them).
SWEEP_STRUCTURES = (
    EXACT,
    *STRUCTURES[:3],
    "kfac_sampled",
    "kfac_probe",
    *STRUCTURES[3:],
    *MATRIX_FREE_STRUCTURES,
)

_KEYS = {
    "model",
    "data",
    "trainer",
    "steps",
    "grid",
    "structures",
    "seed",
    "lam",
    "measure",
    "measure_batch_size",
    "sample",
    "sample_seed",
    "output_dir",
    "workers",
    "threads_per_worker",
    "logs_dir",
    "engine",
    "address",
    "cpus_per_run",
    "gpus_per_run",
    "runtime_env",
}
#: The sweep's engines: a local process pool (the default) or Ray tasks.
ENGINES = ("process", "ray")
_SCALAR_GRID_KEYS = ("seed", "steps", "lam", "measure_batch_size")
#: The fields of a run that make up its key.
_KEYED_FIELDS = (
    "model",
    "data",
    "trainer",
    "seed",
    "steps",
    "lam",
    "structures",
    "measure",
    "measure_batch_size",
)


def _class_spec(value: Any, default: str | None, name: str) -> dict[str, Any] | None:
    """``{"class_path", "init_args"}`` from a spec, a bare class path or ``None``."""
    if value is None:
        return None if default is None else {"class_path": default, "init_args": {}}
    if isinstance(value, str):
        return {"class_path": value, "init_args": {}}
    if not isinstance(value, Mapping):
        raise ValueError(f"`{name}` must be a mapping with class_path/init_args, got {value!r}.")
    spec = dict(value)
    unknown = set(spec) - {"class_path", "init_args"}
    if unknown:
        raise ValueError(
            f"`{name}` accepts only class_path and init_args, got {sorted(unknown)}; put "
            f"constructor arguments under `{name}.init_args`."
        )
    spec.setdefault("class_path", default)
    if spec["class_path"] is None:
        raise ValueError(f"`{name}` needs a class_path.")
    spec["init_args"] = dict(spec.get("init_args") or {})
    return spec


def _set_path(run: dict[str, Any], path: str, value: Any) -> None:
    """Set ``run[a][b]...`` for ``path = "a.b..."``; ``model.x`` means ``model.init_args.x``."""
    parts = path.split(".")
    head = parts[0]
    if len(parts) == 1:
        if head not in _SCALAR_GRID_KEYS:
            raise ValueError(
                f"grid key {path!r} is not a run field; use one of {_SCALAR_GRID_KEYS} or a "
                f"dotted path under model., data., trainer. or measure."
            )
        run[head] = value
        return
    if head in ("model", "data"):
        if run[head] is None:
            raise ValueError(f"grid key {path!r} sets an argument of `{head}`, which is null.")
        if parts[1] not in ("class_path", "init_args"):
            parts.insert(1, "init_args")
    elif head not in ("trainer", "measure"):
        raise ValueError(
            f"grid key {path!r} must start with model., data., trainer. or measure. (or be one "
            f"of {_SCALAR_GRID_KEYS})."
        )
    node = run
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"grid key {path!r}: {part!r} is not a mapping.")
        node = child
    node[parts[-1]] = value


def run_key(run: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit key of a run: a hash of the fields that determine its record."""
    keyed = {name: run.get(name) for name in _KEYED_FIELDS}
    text = json.dumps(keyed, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _label(params: Mapping[str, Any]) -> str:
    """``architecture=mlp train_size=500 ...`` from the grid values of a run."""
    return " ".join(f"{path.split('.')[-1]}={value}" for path, value in params.items())


@dataclass
class SweepConfig:
    """A parsed sweep file; see the module docstring for the fields.

    Attributes:
        model: Base model spec (``class_path``, ``init_args``).
        data: Base datamodule spec, or ``None`` when the model brings its own loaders.
        trainer: Keyword arguments of ``lightning.Trainer`` (``class_path`` specs inside, e.g.
            callbacks, are instantiated).
        steps: Step budget of every run.
        grid: ``{dotted path: values}``.
        structures: Structures measured after every run.
        seed: Base ``seed_everything`` seed.
        lam: λ of the soft rank, or ``None`` (read from the optimizer).
        measure: Each structure's options by its name, and ``loss``, ``max_samples``,
            ``max_val_samples`` (:mod:`~lightning_flatness.sweep.measured`).
        measure_batch_size: Batch size of the measurement passes.
        sample: If set, run only this many grid points (a seeded random subset).
        sample_seed: Seed of that subset.
        output_dir: Default output folder.
        workers: Worker processes (``None``: one per core).
        threads_per_worker: Torch threads per worker (``None``: cores // workers).
        logs_dir: Folder of the runs' Lightning logs (``None``: ``<output_dir>/lightning``).
        engine: ``"process"`` or ``"ray"``.
        address: The Ray cluster's address (``None``: a local Ray instance).
        cpus_per_run: CPUs each Ray task reserves.
        gpus_per_run: GPUs each Ray task reserves.
        runtime_env: Ray's ``runtime_env`` of the job.
        source: The file the config came from, if any.
    """

    model: dict[str, Any]
    data: dict[str, Any] | None
    trainer: dict[str, Any]
    steps: int
    grid: dict[str, list[Any]] = field(default_factory=dict)
    structures: list[str] = field(default_factory=lambda: [EXACT, "kfac", "diag", "diag_mc"])
    seed: int = 0
    lam: float | None = None
    measure: dict[str, Any] = field(default_factory=dict)
    measure_batch_size: int = 512
    sample: int | None = None
    sample_seed: int = 0
    output_dir: str | None = None
    workers: int | None = None
    threads_per_worker: int | None = None
    logs_dir: str | None = None
    engine: str = "process"
    address: str | None = None
    cpus_per_run: int = 1
    gpus_per_run: float = 0.0
    runtime_env: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str | None = None) -> SweepConfig:
        """Validate a mapping (e.g. a parsed YAML file) and build a config.

        Raises:
            ValueError: An unknown key, a missing ``steps``, an empty grid axis, an unknown
                structure, or a malformed model/data spec; the message names the value.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"A sweep config must be a mapping, got {type(raw).__name__}.")
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(
                f"Unknown sweep config keys {sorted(unknown)}; known: {sorted(_KEYS)}."
            )
        trainer = dict(raw.get("trainer") or {})
        if "max_steps" in trainer:
            raise ValueError(
                "Set the step budget with the top-level `steps`, not trainer.max_steps "
                f"(got trainer.max_steps={trainer['max_steps']})."
            )
        steps = raw.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` (the step budget of every run) must be ≥ 1, got {steps!r}.")
        grid = dict(raw.get("grid") or {})
        for path, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"grid[{path!r}] must be a non-empty list, got {values!r}.")
        structures = list(raw.get("structures") or [EXACT, "kfac", "diag", "diag_mc"])
        bad = [s for s in structures if s not in SWEEP_STRUCTURES]
        if bad or len(set(structures)) != len(structures):
            raise ValueError(
                f"`structures` must be distinct values of {SWEEP_STRUCTURES}, got {structures}."
            )
        sample = raw.get("sample")
        if sample is not None and (isinstance(sample, bool) or int(sample) < 1):
            raise ValueError(f"`sample` must be a positive number of runs or null, got {sample!r}.")
        for name in ("workers", "threads_per_worker", "measure_batch_size", "cpus_per_run"):
            value = raw.get(name)
            if value is not None and (isinstance(value, bool) or int(value) < 1):
                raise ValueError(f"`{name}` must be a positive integer or null, got {value!r}.")
        engine = raw.get("engine") or "process"
        if engine not in ENGINES:
            raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}.")
        gpus = raw.get("gpus_per_run") or 0.0
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 0:
            raise ValueError(f"`gpus_per_run` must be a number ≥ 0, got {gpus!r}.")
        if gpus and trainer.get("accelerator", "cpu") == "cpu":
            raise ValueError(
                f"`gpus_per_run` is {gpus}, but the runs train on the CPU (the sweep's default "
                "accelerator); set trainer.accelerator: gpu to use the GPUs each run reserves."
            )
        runtime_env = raw.get("runtime_env") or {}
        if not isinstance(runtime_env, Mapping):
            raise ValueError(f"`runtime_env` must be a mapping (Ray's), got {runtime_env!r}.")
        config = cls(
            model=_class_spec(raw.get("model"), DEFAULT_MODEL, "model"),
            data=None
            if "data" in raw and raw["data"] is None
            else _class_spec(raw.get("data"), DEFAULT_DATA, "data"),
            trainer=trainer,
            steps=steps,
            grid=grid,
            structures=structures,
            seed=int(raw.get("seed", 0)),
            lam=None if raw.get("lam") is None else float(raw["lam"]),
            measure=dict(raw.get("measure") or {}),
            measure_batch_size=int(raw.get("measure_batch_size") or 512),
            sample=None if sample is None else int(sample),
            sample_seed=int(raw.get("sample_seed", 0)),
            output_dir=raw.get("output_dir"),
            workers=raw.get("workers"),
            threads_per_worker=raw.get("threads_per_worker"),
            logs_dir=raw.get("logs_dir"),
            engine=engine,
            address=raw.get("address"),
            cpus_per_run=int(raw.get("cpus_per_run") or 1),
            gpus_per_run=float(gpus),
            runtime_env=dict(runtime_env),
            source=source,
        )
        config.runs()  # fail now, not in a worker, on a grid path that cannot be set
        return config

    def base_run(self, structures: list[str] | None = None) -> dict[str, Any]:
        """The run every grid point starts from (a deep copy)."""
        return copy.deepcopy(
            {
                "model": self.model,
                "data": self.data,
                "trainer": self.trainer,
                "seed": self.seed,
                "steps": self.steps,
                "lam": self.lam,
                "structures": list(structures if structures is not None else self.structures),
                "measure": self.measure,
                "measure_batch_size": self.measure_batch_size,
            }
        )

    def num_grid_points(self) -> int:
        """Size of the full grid (before ``sample``)."""
        size = 1
        for values in self.grid.values():
            size *= len(values)
        return size

    def runs(self, structures: list[str] | None = None) -> list[dict[str, Any]]:
        """All runs of the sweep, each a plain dict with ``key``, ``label`` and ``params``.

        Args:
            structures: Overrides :attr:`structures` (e.g. without unavailable ones).

        Returns:
            The runs in grid order (a seeded subset of it when :attr:`sample` is set), each
            key once.
        """
        paths = list(self.grid)
        points = list(itertools.product(*(self.grid[p] for p in paths)))
        if self.sample is not None and self.sample < len(points):
            chosen = random.Random(self.sample_seed).sample(range(len(points)), self.sample)
            points = [points[i] for i in sorted(chosen)]
        runs, keys = [], set()
        for values in points:
            run = self.base_run(structures)
            params = dict(zip(paths, values, strict=True))
            for path, value in params.items():
                _set_path(run, path, copy.deepcopy(value))
            check_measure(run["measure"])
            run["key"] = run_key(run)
            if run["key"] in keys:  # e.g. a grid value listed twice: run it once
                continue
            keys.add(run["key"])
            run["params"] = params
            run["label"] = _label(params)
            runs.append(run)
        return runs

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain mapping (what :meth:`from_dict` accepts)."""
        return {
            "model": self.model,
            "data": self.data,
            "trainer": self.trainer,
            "steps": self.steps,
            "grid": self.grid,
            "structures": self.structures,
            "seed": self.seed,
            "lam": self.lam,
            "measure": self.measure,
            "measure_batch_size": self.measure_batch_size,
            "sample": self.sample,
            "sample_seed": self.sample_seed,
            "output_dir": self.output_dir,
            "workers": self.workers,
            "threads_per_worker": self.threads_per_worker,
            "logs_dir": self.logs_dir,
            "engine": self.engine,
            "address": self.address,
            "cpus_per_run": self.cpus_per_run,
            "gpus_per_run": self.gpus_per_run,
            "runtime_env": self.runtime_env,
        }


def load_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not a valid sweep config.
    """
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    return SweepConfig.from_dict(raw or {}, source=str(path))
