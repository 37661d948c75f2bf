"""Progress lines of long measurements: reported inside ``reporting_progress`` only, throttled."""

from __future__ import annotations

from conftest import batches, random_data, tiny_model

from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import MatrixFreeOptions
from lightning_flatness.core.progress import progress, reporting_progress


def _lanczos(model, data):
    return measure(
        model,
        data,
        lam=1e-3,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="lanczos", probes=2, lanczos_steps=4),
    )


def test_a_measurement_reports_its_stages_to_a_listener(one_thread):
    model = tiny_model("mlp").eval()
    data = batches(*random_data(16), 4)
    lines: list[str] = []
    with reporting_progress(lines.append, every_seconds=0.0):
        _lanczos(model, data)
    assert any(line.startswith("pass over the training data: ") for line in lines)
    assert any(line.startswith("lanczos: 4 of at most 4 steps") for line in lines)
    with reporting_progress(lines.append, every_seconds=0.0):
        measure(
            model,
            data,
            lam=1e-3,
            num_train_samples=100,
            structure=MatrixFreeOptions(probes=2, cg_steps=3, cg_tol=1e-12),
        )
    assert any(line.startswith("cg: 3 of at most 3 Fisher-vector products") for line in lines)


def test_nobody_listens_by_default_and_lines_are_throttled(one_thread):
    lines: list[str] = []
    progress("stage", 1, 2)  # no listener: nothing happens
    with reporting_progress(lines.append, every_seconds=3600.0):
        for step in range(100):
            progress("stage", step, 100)
    assert lines == []  # the first hour has not passed
    _lanczos(tiny_model("mlp").eval(), batches(*random_data(8), 4))
    assert lines == []  # outside the block, nobody is told
