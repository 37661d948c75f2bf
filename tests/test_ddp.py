"""FlatnessMonitor under Lightning's ``strategy="ddp"`` with two CPU processes on gloo."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_records_equal

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule, measure
from lightning_flatness.core.defaults import AUTO, auto_choice
from lightning_flatness.core.options import structure_options
from lightning_flatness.core.trust import SETTLED_DROP
from lightning_flatness.lightning.monitor import DEFAULT_MAX_VAL_SAMPLES
from lightning_flatness.lightning.monitor_measurement import (
    MEASUREMENT_BATCH_SIZE,
    monitor_options,
)
from lightning_flatness.lightning.trainer_facts import fixed_subset_batches

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fit.py"
#: the probe kernel's options of the script's ``spread`` mode (sketched rows, split runs)
SPREAD = {"max_parameters": 1000, "sketch_from_parameters": 2000, "max_kernel_size": 512}


def rows_options(structure: str, rows: str):
    """The options object the script's monitor is given (tests/scripts/ddp_fit.py): Tr(F),
    and kfac's output rows, from ``rows``."""
    values = {"trace_estimator": rows}
    if structure == "kfac":
        values["kfac_mode"] = rows
    return structure_options(structure, values)


def run_ddp(tmp_path: Path, *args: str, timeout: float = 600) -> list[dict]:
    env = {**os.environ, "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # the package's values are reduced before they are logged: no advice to sync them
    assert "sync_dist" not in completed.stderr, completed.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.ddp
@pytest.mark.parametrize(
    ("structure", "mode"),
    [
        ("kfac", ""),
        ("kfac", "sampled"),
        ("dense", ""),
        ("probe_kernel", ""),
        ("cg", ""),
        ("lanczos", ""),
    ],
)
def test_ranks_agree_and_equal_one_process_on_the_union(tmp_path, structure, mode):
    """probe_kernel, cg and lanczos draw their probes, and kfac its sampled labels, by the
    samples' global positions: two processes log what one process computes on the union."""
    rank0, rank1 = run_ddp(tmp_path, structure, mode)
    assert_records_equal(rank0, rank1)  # every rank logs the same values
    weights = torch.load(tmp_path / "weights0.pt", weights_only=True)
    model = FlatnessClassifier(architecture="mlp", weight_decay=1e-3)
    model.load_state_dict(weights)
    data = MNIST7DataModule(train_size=256, val_size=128, batch_size=32)
    data.setup("fit")
    union = fixed_subset_batches(data.train_dataloader(), 200, 256, seed=0)
    val_union = fixed_subset_batches(data.val_dataloader(), 100, 256, seed=0)
    # the options object the ranks' monitor was given (tests/scripts/ddp_fit.py)
    single = measure(
        model,
        union,
        lam=1e-3,
        num_train_samples=256,
        structure=rows_options(structure, "sampled" if mode else "exact"),
        val_batches=val_union,
    ).as_dict()
    assert rank0["num_samples"] == 200 and rank0["num_val_samples"] == 100
    # float32 model: the probe kernel factorises in float32, where a last-bit difference in the
    # summed P × P matrix moves the soft rank by up to ~1e-4 (spectral.factorisation_dtype)
    keys = ("soft_rank", "logdet", "trace_fisher", "trace_cov", "predicted_gap", "val_nll")
    for key in (*keys, "newton_decrement"):
        if structure == "cg" and key == "logdet":  # cg estimates the soft rank only
            assert math.isnan(rank0[key]) and math.isnan(single[key])
            continue
        # cg's float32 products, summed in another order, move its stopping step: ~1e-3
        moved = ("soft_rank", "predicted_gap", "newton_decrement")
        tolerance = 2e-3 if structure == "cg" and key in moved else 1e-4
        assert rank0[key] == pytest.approx(single[key], rel=tolerance, nan_ok=True), key


#: the record's entries that are no measured quantity, or that one process does not report
NOT_MEASURED = ("epoch", "seconds", "fill_in", "calibration", "nll_drop", "trusted")
#: the jackknife's standard errors: half the difference of two leave-one-group-out soft ranks
#: (log-dets), each factorised in float32, so a last-bit difference in the summed P × P matrix
#: moves them by ~1e-4 relative (the same on one process between the kernel's two sides)
STANDARD_ERRORS = ("soft_rank_stderr", "logdet_stderr")


def union_measurement(weights: dict, structure, all_reduce=None, hidden: int = 70) -> dict:
    """What one process measures, with the monitor's arguments for ``structure`` (a name or an
    options object), on the union of the two ranks' samples (the whole training set, the
    held-out set) at ``weights`` of the MLP of ``hidden`` units."""
    model = FlatnessClassifier(architecture="mlp", weight_decay=1e-3, hidden=hidden)
    model.load_state_dict(weights)
    data = MNIST7DataModule(train_size=256, val_size=128, batch_size=32)
    data.setup("fit")
    size = MEASUREMENT_BATCH_SIZE
    if structure == AUTO:  # resolved as one process resolves it, with the monitor's options
        choice = auto_choice(model, 256)
        arguments = {"structure": monitor_options(choice.structure, choice.sketch_factor)}
    else:
        arguments = FlatnessMonitor(structure=structure).measurer.arguments(
            structure if isinstance(structure, str) else structure.structure
        )
    return measure(
        model,
        fixed_subset_batches(data.train_dataloader(), None, size, seed=0),
        lam=1e-3,
        num_train_samples=256,
        val_batches=fixed_subset_batches(data.val_dataloader(), DEFAULT_MAX_VAL_SAMPLES, size, 0),
        all_reduce=all_reduce,
        **arguments,
    ).as_dict()


@pytest.mark.ddp
@pytest.mark.parametrize(("mode", "hidden"), [("defaults", 70), ("wide", 200)])
def test_the_default_monitor_over_two_processes_equals_one_process(tmp_path, mode, hidden):
    """``FlatnessMonitor()`` (auto: the probe kernel, Tr(F) from its probe rows, the held-out
    set): every number of the last record equals one process's on the union to 1e-5, on the
    paper's MLP (P × P sums) and on one of 12,010 parameters, above that guard (each process
    keeps its rows, gathered for the formed kernel)."""
    rank0, rank1 = run_ddp(tmp_path, "auto", mode)
    assert_records_equal(rank0, rank1)
    weights = torch.load(tmp_path / "weights0.pt", weights_only=True)
    single = union_measurement(weights, "auto", hidden=hidden)
    assert single["structure"] == "probe_kernel"
    assert (rank0["fill_in"], rank0["calibration"]) == (0.0, 1.0)  # the exact measurement
    assert rank0["num_samples"] == 256 and rank0["num_val_samples"] == 128
    measured = [key for key in rank0 if key not in NOT_MEASURED]
    assert {"trace_fisher", "trace_fisher_val", "predicted_gap"} <= set(measured) <= set(single)
    for key in measured:
        if math.isnan(single[key]):
            assert math.isnan(rank0[key]), key
            continue
        tolerance = 1e-3 if key in STANDARD_ERRORS else 1e-5
        assert rank0[key] == pytest.approx(single[key], rel=tolerance, abs=1e-12), key
    # the monitor's settled test (the NLL over the last epoch, the same on both ranks) may only
    # take trust away from what one process's measurement says
    settled = rank0["nll_drop"] <= SETTLED_DROP
    assert rank0["trusted"] == (single["trusted"] if settled else 0.0)


@pytest.mark.ddp
def test_rows_kept_by_each_process_equal_one_process(tmp_path):
    """The probe kernel above its P × P guard: each process keeps its probe rows (sketched) and
    the quadrature's vectors are split across the processes; every number of the last record
    equals one process's with the same estimate on the union."""
    rank0, rank1 = run_ddp(tmp_path, "probe_kernel", "spread")
    assert_records_equal(rank0, rank1)
    weights = torch.load(tmp_path / "weights0.pt", weights_only=True)
    options = structure_options("probe_kernel", SPREAD)
    single = union_measurement(weights, options, all_reduce=lambda tensor: tensor)
    assert rank0["num_samples"] == 256 and rank0["num_val_samples"] == 128
    assert math.isnan(single["newton_decrement"])  # sketched rows: no decrement
    for key in (key for key in rank0 if key not in NOT_MEASURED):
        if math.isnan(single[key]):
            assert math.isnan(rank0[key]), key
            continue
        tolerance = 1e-3 if key in STANDARD_ERRORS else 1e-5  # float32 rows summed in two orders
        assert rank0[key] == pytest.approx(single[key], rel=tolerance, abs=1e-12), key


@pytest.mark.ddp
@pytest.mark.parametrize("estimator", ["batched", "compositional"])
def test_regularized_fit_keeps_ranks_identical(tmp_path, estimator):
    mode = "regularize" if estimator == "batched" else "compositional"
    rank0, rank1 = run_ddp(tmp_path, "kfac", mode)
    assert_records_equal(rank0, rank1)
    logged = [json.loads((tmp_path / f"logged{r}.json").read_text()) for r in range(2)]
    assert logged[0]["flatness/penalty_epoch"] == logged[1]["flatness/penalty_epoch"]  # mean
    first = torch.load(tmp_path / "weights0.pt", weights_only=True)
    second = torch.load(tmp_path / "weights1.pt", weights_only=True)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    if estimator == "compositional":  # every rank holds the same running Fisher
        states = [
            torch.load(tmp_path / f"regularizer{r}.pt", weights_only=True)["running_fisher"]
            for r in range(2)
        ]
        assert int(states[0]["updates"]) == 4  # 256 samples / 2 ranks / batch 32
        assert states[0].keys() == states[1].keys()
        for key, value in states[0].items():
            assert torch.equal(value, states[1][key]), key


@pytest.mark.ddp
@pytest.mark.parametrize("structure", ["kfac", "diag", "lanczos", "hutchinson"])
def test_a_measurement_failing_on_one_rank_fails_on_every_rank(tmp_path, structure):
    """Rank 1's measurements see NaN logits: both ranks record NaN, neither waits forever
    in a collective, and the fit completes."""
    rank0, rank1 = run_ddp(tmp_path, structure, "fail", timeout=240)
    for record in (rank0, rank1):
        assert math.isnan(record["soft_rank"]) and math.isnan(record["trace_fisher"])
