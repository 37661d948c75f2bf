"""Sketched probe rows: the block-orthogonal projection, the stored-row estimate on sketched rows
against the same rows unsketched (float64, tiny models) and the probe kernel's switch to them."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch
from conftest import batches, probe_kernel_report, random_data, tiny_model

from lightning_flatness import FlatnessMonitor
from lightning_flatness.core.batch_terms import BatchTerms
from lightning_flatness.core.curvature.base import CurvatureBatch
from lightning_flatness.core.curvature.probe_kernel import ProbeKernelFisher
from lightning_flatness.core.curvature.row_sketch import RowSketch, SketchPlan, kept_width
from lightning_flatness.core.curvature.row_store import RowStore
from lightning_flatness.core.curvature.stored_rows import QuadratureBudget, stored_rows_estimate
from lightning_flatness.core.defaults import choose_structure
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import KernelOptions
from lightning_flatness.lightning.monitor_measurement import monitor_options

LAM = 1e-3
#: past a formed kernel of 10 rows, no P × P side, every P sketched: the sketched stored rows
SKETCHED = {"max_kernel_size": 10, "max_parameters": 10, "sketch_from_parameters": 1}
FIELDS = ("soft_rank", "soft_rank2", "logdet", "trace", "max_eig")


def _projection(sketch: RowSketch) -> torch.Tensor:
    """Sᵀ, (P, k): the sketch of each coordinate's unit row."""
    return sketch.project(torch.eye(sketch.width, dtype=torch.float64))


@pytest.mark.parametrize("width", [300, 1300])
def test_the_projection_is_a_rotation_at_factor_one_and_unbiased_below(width):
    """Factor 1: SᵀS = I exactly (the kernel of the sketched rows is the rows' kernel). Factor
    4: E[SᵀS] = I over seeds, each group a quarter of its columns; the width is kept_width's."""
    exact = RowSketch(width, 1, 2, dtype=torch.float64)
    projection = _projection(exact)
    assert torch.allclose(projection @ projection.T, torch.eye(width, dtype=torch.float64))
    mean = torch.zeros(width, width, dtype=torch.float64)
    seeds = 200
    for seed in range(seeds):
        sketch = RowSketch(width, 4, 2, seed=seed, dtype=torch.float64)
        projection = _projection(sketch)
        mean += projection @ projection.T / seeds
        assert sketch.sketched_width == kept_width(width, 4, 2) < width / 3
    assert mean.diagonal().mean() == pytest.approx(1.0, abs=1e-9)  # each seed's trace is P
    assert (mean.diagonal() - 1).abs().max() < 0.35
    off = mean - torch.diag(mean.diagonal())
    assert off.abs().max() < 0.35 and off.abs().mean() < 0.03
    groups = sketch.group_of_columns()
    assert torch.equal(torch.bincount(groups), torch.full((2,), sketch.sketched_width // 2))


def _random_store(probes: int = 4, samples: int = 40, width: int = 700) -> RowStore:
    """Rows of a decaying spectrum, as probe rows of a trained model have."""
    generator = torch.Generator().manual_seed(3)
    scales = torch.logspace(0, -3, width, dtype=torch.float64)
    rows = torch.randn(probes, samples, width, generator=generator, dtype=torch.float64) * scales
    store = RowStore(probes, width)
    for start in range(0, samples, 8):
        store.append(rows[:, start : start + 8])
    return store


def test_rows_sketched_at_factor_one_give_the_rows_estimate():
    """An exact rotation of the rows in each of 4 groups (factor 1): every trace function of the
    jackknifed estimate, its standard error and its plain value are the unsketched rows'."""
    budget = QuadratureBudget(probes=8, steps=40, tolerance=1e-6)
    plain = stored_rows_estimate(_random_store(), 2, 40, LAM, budget=budget)
    sketch = RowSketch(700, 1, 4, dtype=torch.float64)
    rotated = _random_store().sketched(sketch)
    assert rotated.width == kept_width(700, 1, 4)  # the last block zero-padded
    sketched = stored_rows_estimate(rotated, 2, 40, LAM, budget=budget, sketch=sketch)
    for block in (None, "stderr", "uncorrected"):
        first = plain.summary if block is None else plain.blocks[block]
        second = sketched.summary if block is None else sketched.blocks[block]
        for field in FIELDS[:4]:
            # the sketch's leave-outs widen the soft rank's quadrature bracket, in its stderr
            loose = block == "stderr" and field == "soft_rank"
            expected = pytest.approx(getattr(first, field), rel=0.1 if loose else 1e-8)
            assert getattr(second, field) == expected, (block, field)
    assert sketched.summary.max_eig == pytest.approx(plain.summary.max_eig, rel=1e-8)


def _measure(model, inputs, targets, batch_size: int, **options):
    budget = {"probes": 4, "groups": 2, "slq_probes": 64, "slq_steps": 100}
    return probe_kernel_report(model, inputs, targets, batch_size, **{**budget, **options})


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_sketched_rows_meet_the_rows_kernel(architecture, one_thread):
    """The paper's MLP and CNN, 10 samples × 4 probe rows, rows kept 2 and 4 times shorter:
    the jackknifed soft rank within 3% and its error bars of the formed kernel of the same rows
    unsketched, the jackknife removing most of the sketch's bias (the plain values are lower),
    the trace exact, no Newton decrement, and nothing depends on the batch size."""
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(10)
    formed = _measure(model, inputs, targets, 5, side="samples")
    unsketched = _measure(model, inputs, targets, 5, **{**SKETCHED, "sketch_factor": 1})
    assert math.isfinite(unsketched.newton_decrement)
    for factor in (2, 4):
        report = _measure(model, inputs, targets, 5, **SKETCHED, sketch_factor=factor)
        stderr = report.blocks["stderr"].soft_rank
        assert abs(report.soft_rank - formed.soft_rank) < max(4 * stderr, 0.03 * formed.soft_rank)
        assert report.soft_rank == pytest.approx(formed.soft_rank, rel=0.03)
        assert report.blocks["uncorrected"].soft_rank < report.soft_rank
        assert report.trace_fisher == pytest.approx(formed.trace_fisher, rel=1e-9)
        assert math.isnan(report.newton_decrement)
        other = _measure(model, inputs, targets, 1, **SKETCHED, sketch_factor=factor)
        assert other.soft_rank == pytest.approx(report.soft_rank, rel=1e-9)


def _fisher(**options) -> ProbeKernelFisher:
    settings = {
        "probes": 2,
        "groups": 2,
        "max_parameters": 10,
        "max_kernel_size": 8,
        "max_row_elements": 10**9,
        "sketching": SketchPlan(factor=4, groups=2, from_parameters=100),
    }
    return ProbeKernelFisher(600, **{**settings, **options})


def _batch(rows: torch.Tensor) -> CurvatureBatch:
    """One batch of probe rows ``(s, N, P)``, as the layer-hook backend hands them."""
    return CurvatureBatch(rows.shape[1], terms=BatchTerms(rows={"w": rows}))


def test_the_probe_kernel_sketches_once_its_rows_pass_the_formed_kernel_or_their_memory():
    """Rows are kept whole up to the formed kernel's size, then sketched (the kept ones too);
    the same once they pass their memory first; never below sketch_from_parameters, with one
    sketch group, at factor 1 or without a plan."""
    rows = torch.randn(2, 3, 600, dtype=torch.float64)
    fisher = _fisher()
    fisher.add(_batch(rows))
    assert fisher.sketch is None and fisher.store.width == 600
    fisher.add(_batch(rows))  # 12 rows > 8
    assert fisher.sketch is not None and fisher.store.width == kept_width(600, 4, 2)
    assert fisher.store.samples == 6
    assert fisher.store.squared_norms.sum() == pytest.approx(2 * float(rows.square().sum()))
    fisher.add(_batch(rows))
    assert fisher.store.samples == 9
    by_memory = _fisher(max_kernel_size=100, max_row_elements=7 * 600)
    by_memory.add(_batch(rows))
    by_memory.add(_batch(rows))
    assert by_memory.sketch is not None
    for never in (SketchPlan(4, 2, 601), SketchPlan(1, 2, 100), SketchPlan(4, 1, 100), None):
        fisher = _fisher(sketching=never)
        fisher.add(_batch(rows))
        fisher.add(_batch(rows))
        assert fisher.sketch is None, never


def test_auto_sketches_shorter_where_the_rows_would_not_fit_otherwise(one_thread, monkeypatch):
    """Rows that fit their memory 8× shorter, not 4×: the choice names sketch_factor=8, which
    measures, where 2 would not fit; structure='auto' measures with the factor it chose."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(10)
    # 40 rows of 730 parameters: 256 numbers each at factor 4 (10,240), 128 at 8 (5,120)
    memory = {"max_row_elements": 6_000, "max_parameters": 10, "max_kernel_size": 10}
    options = KernelOptions(**memory, sketch_from_parameters=1, probes=4, groups=2)
    choice = choose_structure(730, 10, options)
    assert (choice.structure, choice.sketch_factor) == ("probe_kernel", 8)

    def report(structure):
        return measure(
            model,
            batches(inputs, targets, 2),  # a batch's whole rows fit: 5,840 numbers
            lam=LAM,
            num_train_samples=10,
            structure=structure,
        )

    assert math.isfinite(report(replace(options, sketch_factor=8)).soft_rank)
    with pytest.raises(StructureTooLargeError, match="sketch_factor=2"):
        report(replace(options, sketch_factor=2))
    measure_module = sys.modules["lightning_flatness.core.measure"]
    measured = []
    monkeypatch.setattr(measure_module, "auto_choice", lambda *args, **kwargs: choice)
    monkeypatch.setattr(
        measure_module,
        "curvature_and_sums",
        lambda model, batches, options, *args, **kwargs: measured.append(options) or 1 / 0,
    )
    with pytest.raises(ZeroDivisionError):
        report("auto")
    assert measured == [KernelOptions(probes=4, groups=2, sketch_factor=8)]


def test_the_monitor_measures_with_the_factor_auto_chose():
    """Where structure='auto' found the rows fit only sketched shorter, the monitor's exact
    measurements name that factor; its fill-in and the default factor are left alone."""
    monitor = FlatnessMonitor()
    default = KernelOptions().sketch_factor
    assert monitor.measurer.arguments("probe_kernel")["structure"].sketch_factor == default
    monitor.state.sketch_factor = 8
    arguments = monitor.measurer.arguments("probe_kernel")
    assert arguments["structure"] == KernelOptions(trace_estimator="probe", sketch_factor=8)
    assert monitor.measurer.arguments("kfac")["structure"] == monitor_options("kfac")
