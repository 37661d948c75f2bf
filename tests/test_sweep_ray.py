"""The sweep on Ray: records equal to the process pool's, a killed task recorded and retried.

A local Ray instance with 2 CPUs and no dashboard is started once for the module; the workers
import this file's modules through ``PYTHONPATH`` in the job's ``runtime_env``, as a cluster's
workers would import a user's own modules.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import ray
import torch

from lightning_flatness.sweep.config import SweepConfig
from lightning_flatness.sweep.ray_engine import relative_paths
from lightning_flatness.sweep.records import without_timings
from lightning_flatness.sweep.runner import read_records, run_sweep

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
]


def _first_to_create(marker: Path) -> bool:
    """Create ``marker`` unless it exists, atomically: of two tasks training at once, only one
    finds it missing (a check, then a write, let both die)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class DiesOnce(L.LightningModule):
    """A classifier whose process is killed (SIGKILL, as an out-of-memory kill) the first time
    it trains; the marker file remembers that it died."""

    def __init__(self, marker: str = "", lr: float = 0.05, weight_decay: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(49, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.hparams.marker and _first_to_create(Path(self.hparams.marker)):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


@pytest.fixture(scope="module")
def local_ray():
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="warning",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


def four_points(**overrides) -> dict:
    """Four 3-step runs of a small MLP on 7×7 MNIST (the bundled images)."""
    raw = {
        "steps": 3,
        "structures": ["exact", "kfac", "probe_kernel"],
        "model": {"init_args": {"hidden": 8, "lr": 0.01, "weight_decay_c": 1.0}},
        "data": {"init_args": {"val_size": 40, "batch_size": 16}},
        "measure_batch_size": 64,
        "grid": {"data.train_size": [30, 50], "seed": [0, 1]},
    }
    raw.update(overrides)
    return raw


def test_ray_records_equal_the_process_pools(tmp_path, local_ray):
    config = SweepConfig.from_dict(four_points(engine="ray", trainer={"logger": True}))
    on_ray = run_sweep(config, output_dir=tmp_path / "ray", progress=False, report=False)
    on_pool = run_sweep(
        config,
        output_dir=tmp_path / "pool",
        engine="process",
        workers=2,
        threads_per_worker=1,
        progress=False,
        report=False,
    )
    assert (on_ray.finished, on_ray.failed) == (4, 0)
    assert (on_pool.finished, on_pool.failed) == (4, 0)
    ray_records = {r["key"]: r for r in read_records(tmp_path / "ray" / "runs.jsonl")}
    pool_records = {r["key"]: r for r in read_records(tmp_path / "pool" / "runs.jsonl")}
    assert set(ray_records) == set(pool_records) == {r["key"] for r in config.runs()}
    for key, record in ray_records.items():
        assert without_timings(record) == without_timings(pool_records[key])
    # Each run's Lightning logs went to its own folder where the driver said.
    for key in ray_records:
        assert (tmp_path / "ray" / "lightning" / key / "lightning_logs" / "version_0").is_dir()
    # A second invocation finds everything recorded and runs nothing.
    again = run_sweep(config, output_dir=tmp_path / "ray", progress=False, report=False)
    assert (again.skipped, again.finished, again.failed) == (4, 0, 0)


def test_a_killed_task_is_recorded_as_failed_and_retried_on_resume(tmp_path, local_ray):
    marker = tmp_path / "killed"
    raw = four_points(
        engine="ray",
        structures=["exact"],
        model={
            "class_path": f"{DiesOnce.__module__}.DiesOnce",
            "init_args": {"marker": str(marker)},
        },
        grid={"seed": [0, 1]},
    )
    raw["data"]["init_args"]["train_size"] = 30
    config = SweepConfig.from_dict(raw)
    first = run_sweep(config, output_dir=tmp_path / "out", progress=False, report=False)
    assert marker.exists()
    records = read_records(tmp_path / "out" / "runs.jsonl")
    failed = [r for r in records if r["status"] == "failed"]
    # The one task whose worker was killed is failed with Ray's reason; the other one finished.
    assert (first.failed, first.finished, len(failed)) == (1, 1, 1)
    assert "died" in failed[0]["error"] and "rerun the sweep" in failed[0]["error"]
    second = run_sweep(config, output_dir=tmp_path / "out", progress=False, report=False)
    assert (second.skipped, second.finished, second.failed) == (1, 1, 0)
    records = read_records(tmp_path / "out" / "runs.jsonl")
    retried = [r for r in records if r["key"] == failed[0]["key"]]
    assert [r["status"] for r in retried] == ["failed", "ok"]


def test_the_ray_engine_names_the_missing_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    config = SweepConfig.from_dict(four_points(engine="ray"))
    with pytest.raises(ImportError, match=r"lightning-flatness\[ray\]"):
        run_sweep(config, output_dir=tmp_path, progress=False, report=False)


def test_engine_settings_are_validated_and_do_not_change_keys():
    plain = SweepConfig.from_dict(four_points())
    on_ray = SweepConfig.from_dict(
        four_points(engine="ray", address="auto", cpus_per_run=2, runtime_env={"pip": []})
    )
    assert [r["key"] for r in plain.runs()] == [r["key"] for r in on_ray.runs()]
    assert (on_ray.cpus_per_run, on_ray.address, on_ray.runtime_env) == (2, "auto", {"pip": []})
    with pytest.raises(ValueError, match="engine"):
        SweepConfig.from_dict(four_points(engine="dask"))
    with pytest.raises(ValueError, match="gpus_per_run"):
        SweepConfig.from_dict(four_points(gpus_per_run=-1))
    with pytest.raises(ValueError, match="cpus_per_run"):
        SweepConfig.from_dict(four_points(cpus_per_run=0))
    with pytest.raises(ValueError, match=r"trainer\.accelerator: gpu"):
        SweepConfig.from_dict(four_points(engine="ray", gpus_per_run=1))
    gpu = four_points(engine="ray", gpus_per_run=1, trainer={"accelerator": "gpu"})
    assert SweepConfig.from_dict(gpu).gpus_per_run == 1.0


def test_relative_paths_read_on_workers_are_named():
    run = SweepConfig.from_dict(
        four_points(data={"init_args": {"data_dir": "data", "train_size": 30}})
    ).runs()[0]
    assert relative_paths(run) == ["data.init_args.data_dir='data'"]
    absolute = four_points(data={"init_args": {"data_dir": "/shared/mnist", "train_size": 30}})
    assert relative_paths(SweepConfig.from_dict(absolute).runs()[0]) == []
