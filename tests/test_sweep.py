"""Tests of ``lightning-flatness sweep``: tiny end-to-end sweeps, resume, failures, the report."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness.core.options import KFACOptions, MatrixFreeOptions
from lightning_flatness.lightning import cli
from lightning_flatness.sweep.config import SweepConfig, load_config, run_key
from lightning_flatness.sweep.measured import measure_arguments
from lightning_flatness.sweep.report import null_standard_deviation, write_report
from lightning_flatness.sweep.run import execute_run, resolve_exact
from lightning_flatness.sweep.runner import read_records, run_sweep

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
]


# ---------------------------------------------------------------------------- a user's own code
class TinyModule(L.LightningModule):
    """A user's classifier: not the package's, with its own loss and optimizer."""

    def __init__(
        self,
        width: int = 6,
        lr: float = 0.05,
        weight_decay: float = 0.01,
        fail: bool = False,
        crash: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(8, width),
            torch.nn.Tanh(),
            torch.nn.Linear(width, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.hparams.fail:
            raise RuntimeError("this module fails on purpose")
        if self.hparams.crash:
            os._exit(3)  # kills the worker process, as an out-of-memory kill would
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


class TinyData(L.LightningDataModule):
    """Random 8-feature, 3-class data with a fixed held-out split."""

    def __init__(self, train_size: int = 30, val_size: int = 20, batch_size: int = 10) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(train_size + val_size, 8, generator=generator)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        self.train_set = TensorDataset(x[:train_size], y[:train_size])
        self.val_set = TensorDataset(x[train_size:], y[train_size:])
        self.batch_size = batch_size

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        return DataLoader(self.train_set, self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self):
        return DataLoader(self.val_set, self.batch_size)


# ---------------------------------------------------------------------------- building blocks
def tiny_mnist_config(**overrides) -> dict:
    """Four 3-step runs of a small MLP on 7×7 MNIST, two with an architecture that is unknown."""
    raw = {
        "steps": 3,
        "structures": ["exact", "kfac", "diag"],
        "model": {"init_args": {"hidden": 8, "lr": 0.01, "weight_decay_c": 1.0}},
        "data": {"init_args": {"val_size": 40, "batch_size": 16}},
        "measure_batch_size": 64,
        "grid": {
            "model.architecture": ["mlp", "no_such_architecture"],
            "data.train_size": [30, 50],
        },
    }
    raw.update(overrides)
    return raw


def user_config(**grid) -> dict:
    return {
        "steps": 4,
        "structures": ["exact", "kfac", "diag_mc"],
        "model": {"class_path": f"{__name__}.TinyModule"},
        "data": {"class_path": f"{__name__}.TinyData", "init_args": {"train_size": 30}},
        "grid": grid or {"seed": [0]},
    }


def numbers(record: dict) -> dict:
    """A record's measurements without timings."""
    return {
        structure: {k: v for k, v in values.items() if k != "seconds"}
        for structure, values in record["measures"].items()
    }


# ---------------------------------------------------------------------------- end to end
def test_sweep_end_to_end_resume_failures_and_determinism(tmp_path):
    raw = tiny_mnist_config()
    config_path = tmp_path / "sweep.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    args = ["sweep", "--config", str(config_path), "--output", str(out), "--no-progress"]

    # Two worker processes. Two runs fail (bad architecture): recorded, not fatal; the exit
    # status says so.
    assert cli.main([*args, "--workers", "2", "--no-report"]) == 1
    records = read_records(out / "runs.jsonl")
    assert len(records) == 4
    ok = [r for r in records if r["status"] == "ok"]
    failed = [r for r in records if r["status"] == "failed"]
    assert len(ok) == 2 and len(failed) == 2
    assert all("no_such_architecture" in r["error"] for r in failed)
    for record in ok:
        assert record["n"] in (30, 50)
        assert record["lam"] == pytest.approx(1.0 / record["n"])  # λ = c / n
        assert set(record["measures"]) == {"exact", "kfac", "diag"}
        # P = 49·8 + 8 + 8·10 + 10 = 490: the Gram kernel (n·C = 300) for n = 30, dense for 50.
        assert record["exact_structure"] == ("dense" if record["n"] == 50 else "gram")
        # the gap is the test half's; the predictions read only the validation half
        assert record["gap"] == pytest.approx(record["test_nll"] - record["train_nll"])
        assert record["gap"] != pytest.approx(record["val_nll"] - record["train_nll"])
        held_out = raw["data"]["init_args"]["val_size"]
        assert record["measures"]["exact"]["num_val_samples"] == (held_out + 1) // 2
        assert record["measures"]["exact"]["num_samples"] == record["n"]  # whole training set
        assert record["global_step"] == 3

    # Deterministic: the same run in this process gives the worker's numbers.
    run = next(r for r in SweepConfig.from_dict(raw).runs() if r["key"] == ok[0]["key"])
    assert numbers(execute_run(run, threads=1)) == numbers(ok[0])

    # A rerun skips the finished runs; failed ones are tried again unless --skip-failed.
    assert cli.main([*args, "--workers", "1", "--no-report", "--skip-failed"]) == 0
    assert len(read_records(out / "runs.jsonl")) == 4
    assert cli.main([*args, "--workers", "1", "--no-report"]) == 1
    records = read_records(out / "runs.jsonl")
    assert len(records) == 6
    assert sorted(r["key"] for r in records[4:]) == sorted(r["key"] for r in failed)

    # `sweep report DIR` writes the report and its figures from the recorded runs.
    assert cli.main(["sweep", "report", str(out)]) == 0
    for name in ("report.md", "kendall.json", "scatter_overview.png", "scatter_exact.png"):
        assert (out / name).exists(), name
    report = (out / "report.md").read_text()
    assert "| measure | exact (dense/gram) | kfac | diag |" in report
    assert "0.84" in report and "no_such_architecture" in report


def test_users_own_module_and_datamodule(tmp_path):
    config = SweepConfig.from_dict(user_config(**{"model.fail": [False, True]}))
    summary = run_sweep(config, output_dir=tmp_path, workers=1, progress=False, report=False)
    assert (summary.finished, summary.failed) == (1, 1)
    ok, failed = sorted(read_records(tmp_path / "runs.jsonl"), key=lambda r: r["status"] != "ok")
    assert ok["n"] == 30 and ok["lam"] == pytest.approx(0.01)  # from Adam's weight_decay
    assert ok["exact_structure"] == "dense"  # P = 8·6 + 6 + 6·3 + 3 = 75 ≤ n·C = 90
    assert ok["num_parameters"] == 75
    assert math.isfinite(ok["measures"]["exact"]["soft_rank"])
    assert ok["measures"]["exact"]["num_val_samples"] == 10  # the validation half of 20
    assert "fails on purpose" in failed["error"] and "Traceback" in failed["traceback"]


@pytest.mark.slow
def test_a_crashing_worker_is_recorded_and_the_pool_restarted(tmp_path):
    config = SweepConfig.from_dict(user_config(**{"model.crash": [True, False], "seed": [0, 1]}))
    summary = run_sweep(config, output_dir=tmp_path, workers=2, progress=False, report=False)
    records = read_records(tmp_path / "runs.jsonl")
    # The two crashing runs are the first two in flight; the pool restarts for the other two.
    assert (summary.failed, summary.finished, len(records)) == (2, 2, 4)
    for record in records:
        crashed = record["params"]["model.crash"]
        assert record["status"] == ("failed" if crashed else "ok")
        assert not crashed or "BrokenProcessPool" in record["error"]


# ---------------------------------------------------------------------------- report
def test_the_command_line_picks_another_sample_of_the_grid(tmp_path, capsys):
    """``--sample-seed`` runs another seeded subset of the config's grid (its dry run lists the
    runs ``sample_seed`` lists in the config)."""
    raw = {**tiny_mnist_config(), "sample": 2}
    config_path = tmp_path / "sweep.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    listed = {}
    for seed in (0, 3):
        assert cli.main(["sweep", "--config", str(config_path), "--dry-run", "--sample-seed",
                         str(seed)]) == 0  # fmt: skip
        listed[seed] = [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
        expected = dataclasses.replace(load_config(config_path), sample_seed=seed).runs()
        assert listed[seed] == [r["key"] for r in expected]
    assert listed[0] != listed[3]


def test_report_kendall_matches_hand_computed_example(tmp_path):
    # Five runs with soft ranks 1..5 and gaps 3 1 2 5 4: τ = 0.4 (see test_kendall.py).
    # Divided by n = 1 1 1 2 2 the soft ranks are 1 2 3 2 2.5. Pairs (i<j) with the gaps:
    # (1,2) D, (1,3) D, (1,4) C, (1,5) C, (2,3) C, (2,4) tied in x, (2,5) C, (3,4) D, (3,5) D,
    # (4,5) D → C = 4, D = 5, n₁ = 1, n₂ = 0: τ_b = (4 − 5) / √((10 − 1) · 10) = −1/√90.
    soft_ranks, gaps, sizes = [1, 2, 3, 4, 5], [3, 1, 2, 5, 4], [1, 1, 1, 2, 2]
    lines = []
    for i, (rank, gap, n) in enumerate(zip(soft_ranks, gaps, sizes, strict=True)):
        measures = {"soft_rank": float(rank), "predicted_gap": float(rank) / n, "seconds": 0.1}
        measures["predicted_gap_train"] = float(gap)  # a headline recorded with both forms
        record = {
            "key": f"k{i}",
            "status": "ok",
            "params": {},
            "n": n,
            "gap": float(gap),
            "c": 1.0,
            "measures": {"kfac": measures, "diag": {"soft_rank": None}},
        }
        lines.append(json.dumps(record))
    lines.append(json.dumps({"key": "k9", "status": "failed", "error": "boom", "params": {}}))
    (tmp_path / "runs.jsonl").write_text("\n".join(lines) + "\n{torn")
    write_report(tmp_path)
    rows = json.loads((tmp_path / "kendall.json").read_text())["rows"]
    tau = {(r["measure"], r["scaled"]): r["tau"] for r in rows}
    assert tau[("soft_rank", False)]["kfac"] == pytest.approx(0.4)
    assert tau[("soft_rank", True)]["kfac"] == pytest.approx(-1 / math.sqrt(90))
    assert tau[("predicted_gap", False)]["kfac"] == pytest.approx(-1 / math.sqrt(90))
    assert tau[("soft_rank", False)]["diag"] is None  # no values: NaN, written as null
    report = (tmp_path / "report.md").read_text()
    assert "| rank_λ(F) | kfac | 0.78 | +0.40 | -0.11 |" in report
    # the report leads with the headline's τ, its interval and the paper's 0.84 beside it
    first_section = report.split("\n## ")[1]
    assert first_section.startswith("The headline")
    assert "| predicted gap (headline" in first_section and "| kfac | -0.11 |" in first_section
    assert "| Eq. 13, training trace ratio (training data only) | kfac | +1.00 |" in first_section
    assert "| the paper's Table 4: rank_λ(F), exact | exact | +0.84 |" in first_section
    headline = json.loads((tmp_path / "kendall.json").read_text())["headline"]
    assert headline[0]["low"] <= headline[0]["tau"] <= headline[0]["high"]
    assert "| k9 | boom |" in report
    # √(2(2·5+5) / (9·5·4)) = √(30/180)
    assert null_standard_deviation(5) == pytest.approx(math.sqrt(1 / 6))
    assert "standard deviation of 0.41" in report


def test_a_run_recorded_before_the_headline_changed_has_no_headline(tmp_path):
    """A record without ``predicted_gap_train`` holds Eq. 13 with the training ratio under
    ``predicted_gap``: the report leaves it out of the headline rather than mislabel it."""
    measures = {"soft_rank": 2.0, "predicted_gap": 0.5, "seconds": 0.1}
    records = [
        {"key": f"k{i}", "status": "ok", "params": {}, "n": 10, "gap": float(i), "c": 1.0,
         "measures": {"probe_kernel": dict(measures, soft_rank=float(i))}}
        for i in range(1, 4)
    ]  # fmt: skip
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path)
    headline = json.loads((tmp_path / "kendall.json").read_text())["headline"]
    assert headline[0]["measure"] == "predicted_gap" and headline[0]["count"] == 0
    assert headline[1]["measure"] == "soft_rank" and headline[1]["tau"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------- config
def test_config_validation_and_keys(tmp_path):
    raw = tiny_mnist_config()
    runs = SweepConfig.from_dict(raw).runs()
    assert [r["key"] for r in runs] == [r["key"] for r in SweepConfig.from_dict(raw).runs()]
    assert len({r["key"] for r in runs}) == 4
    assert runs[0]["model"]["init_args"]["architecture"] == "mlp"
    assert runs[0]["data"]["init_args"]["train_size"] == 30
    assert runs[0]["model"]["class_path"] == cli.DEFAULT_MODEL
    changed = dict(runs[0], model={**runs[0]["model"], "init_args": {"lr": 0.5}})
    assert run_key(changed) != runs[0]["key"]

    assert len(SweepConfig.from_dict({**raw, "grid": {"model.lr": [0.1, 0.1]}}).runs()) == 1

    sampled = SweepConfig.from_dict({**raw, "sample": 3, "sample_seed": 1}).runs()
    assert len(sampled) == 3
    assert [r["key"] for r in sampled] == [
        r["key"] for r in SweepConfig.from_dict({**raw, "sample": 3, "sample_seed": 1}).runs()
    ]

    for bad, match in (
        ({"stpes": 3}, "Unknown sweep config keys"),
        ({"steps": 0}, "steps"),
        ({"trainer": {"max_steps": 5}}, "top-level `steps`"),
        ({"structures": ["kfac", "eigen"]}, "structures"),
        ({"grid": {"model.lr": []}}, "non-empty list"),
        ({"grid": {"optimizer.lr": [1]}}, "must start with"),
        ({"model": {"init_args": {}, "lr": 1}}, "class_path and init_args"),
        ({"measure": {"kfac_mode": "exact"}}, "Unknown key measure.kfac_mode.*loose option"),
        ({"measure": {"kfac": {"probes": 2}}}, r"KFACOptions.*no option \['probes'\]"),
        ({"measure": {"lanczos": 5}}, "measure.lanczos must be a mapping"),
        ({"measure": {"max_samples": 0}}, "measure.max_samples"),
        ({"grid": {"measure.lanczos.probes": [2, 0]}}, "probes"),
    ):
        with pytest.raises(ValueError, match=match):
            SweepConfig.from_dict({**raw, **bad})
    with pytest.raises(ValueError, match="null"):
        SweepConfig.from_dict({**user_config(), "data": None, "grid": {"data.x": [1]}})


def test_shipped_configs_parse():
    root = Path(__file__).resolve().parents[1] / "configs"
    quick = load_config(root / "sweep_quick.yaml")
    arguments = measure_arguments("lanczos", "lanczos", quick.measure)
    assert arguments == {
        "structure": MatrixFreeOptions(structure="lanczos", probes=5, lanczos_steps=50)
    }
    assert 24 <= len(quick.runs()) <= 40
    paper = load_config(root / "sweep_paper.yaml")
    assert len(paper.runs()) == 3 * 3 * 7 * 3 * 3


def test_resolve_exact_picks_the_smaller_matrix():
    assert resolve_exact(4280, 500, 10) == "dense"
    assert resolve_exact(4280, 250, 10) == "gram"


def test_the_monitor_default_is_measured_with_the_monitor_options(monkeypatch):
    """``kfac_sampled`` is kfac with one sampled label per input for the factors and Tr(F)."""
    # the package exports the function measure(), which shadows its module's name
    measure_module = sys.modules["lightning_flatness.core.measure"]
    calls = []
    real = measure_module.measure

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_module, "measure", recording)
    raw = {**user_config(), "structures": ["kfac", "kfac_sampled"]}
    raw["measure"] = {"kfac": {"mc_samples": 2}, "kfac_sampled": {"mc_samples": 3}}
    (run,) = SweepConfig.from_dict(raw).runs()
    record = execute_run(run, threads=1)
    assert record["status"] == "ok", record.get("error")
    plain, sampled = calls
    assert plain["structure"] == KFACOptions(mc_samples=2)
    assert sampled["structure"] == KFACOptions("sampled", 3, trace_estimator="sampled")
    assert set(record["measures"]) == {"kfac", "kfac_sampled"}
