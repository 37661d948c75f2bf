"""The probe kernel past its formed-kernel guard: stochastic Lanczos quadrature on the stored
probe rows (float64, tiny models), against the formed kernel of the same rows and against the
dense autograd reference; its memory guard and the default's choice of it."""

from __future__ import annotations

import pytest
import torch
from conftest import many_classes, probe_kernel_report, random_data, tiny_model

from lightning_flatness import FlatnessMonitor
from lightning_flatness.core import defaults, memory, reference, spectral
from lightning_flatness.core.curvature import stored_rows
from lightning_flatness.core.curvature.row_store import RowStore
from lightning_flatness.core.curvature.stored_rows import quadrature_seconds
from lightning_flatness.core.defaults import StructureChoice, choose_structure
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.options import KernelOptions
from lightning_flatness.lightning import monitor_checks

LAM = 1e-3
#: a formed-kernel guard every run here exceeds, and a P × P guard below P: the stored rows
STORED = {"max_kernel_size": 10, "max_parameters": 10}


def _exact(model, inputs) -> spectral.SpectralSummary:
    return spectral.spectral_summary(
        spectral.psd_eigenvalues(reference.dense_fisher(model, inputs)), LAM
    )


@pytest.mark.parametrize("batch_size", [1, 48])
def test_exact_rows_converge_to_the_dense_fishers_trace_functions(batch_size, one_thread):
    """The exact output rows (probes = classes, no probe bias): the stored-row estimate of
    every trace function is within its error bars of the dense reference, its trace and largest
    eigenvalue exact, and it does not depend on the batch size."""
    model, inputs, targets = many_classes()
    exact = _exact(model, inputs)
    options = {"probes": 30, "groups": 1, "slq_probes": 32, "slq_steps": 100, **STORED}
    report = probe_kernel_report(model, inputs, targets, batch_size, **options)
    stderr = report.blocks["stderr"]
    for field in ("soft_rank", "soft_rank2", "logdet"):
        error = abs(getattr(report, field) - getattr(exact, field))
        assert error < 4 * getattr(stderr, field), field
        assert error < 0.05 * getattr(exact, field), field
    assert report.trace_fisher == pytest.approx(exact.trace, rel=1e-9)
    assert report.max_eig == pytest.approx(exact.max_eig, rel=1e-8)
    other = probe_kernel_report(model, inputs, targets, 5, **options)
    assert other.soft_rank == pytest.approx(report.soft_rank, rel=1e-9)


def test_probe_rows_converge_to_the_formed_kernel_of_the_same_rows(one_thread):
    """4 probes in 2 groups: the stored-row estimate jackknifes the probes' bias as the formed
    kernel does, and converges to it as its Hutchinson probes grow."""
    model, inputs, targets = many_classes()
    formed = probe_kernel_report(model, inputs, targets, probes=4, side="samples")
    errors = {}
    for slq_probes in (8, 256):
        stored = probe_kernel_report(
            model, inputs, targets, probes=4, slq_probes=slq_probes, slq_steps=100, **STORED
        )
        errors[slq_probes] = abs(stored.soft_rank / formed.soft_rank - 1)
        assert abs(stored.soft_rank - formed.soft_rank) < 4 * stored.blocks["stderr"].soft_rank
        assert stored.trace_fisher == pytest.approx(formed.trace_fisher, rel=1e-9)
    assert errors[256] < errors[8] and errors[256] < 0.02
    plain = stored.blocks["uncorrected"].soft_rank
    exact = _exact(model, inputs).soft_rank
    assert plain < stored.soft_rank  # the jackknife lifts the concave estimate toward F's
    assert abs(stored.soft_rank - exact) < abs(plain - exact)


@pytest.fixture
def steps(monkeypatch) -> list[int]:
    """One entry per Lanczos step of the stored-row runs (their rows'-space products)."""
    taken: list[int] = []
    advance = stored_rows.RowSpaceRuns.advance

    def counted(self, *args):
        taken.append(1)
        return advance(self, *args)

    monkeypatch.setattr(stored_rows.RowSpaceRuns, "advance", counted)
    return taken


def test_the_runs_stop_once_the_quadrature_bracket_is_within_its_tolerance(one_thread, steps):
    """The Gauss and Gauss–Radau rules bracket each run's soft rank: with a loose tolerance the
    runs end well before the step cap, with a tight one they go on, and either way the value is
    within the bracket's tolerance (and its standard error) of the same rows' long run."""
    model, inputs, targets = many_classes()
    found = {}
    for tolerance in (1e-6, 0.05):
        steps.clear()
        report = probe_kernel_report(
            model, inputs, targets, probes=4, slq_steps=120, slq_tolerance=tolerance, **STORED
        )
        found[tolerance] = (report.soft_rank, report.blocks["stderr"].soft_rank, len(steps))
    (tight, _, tight_steps), (loose, loose_stderr, loose_steps) = found[1e-6], found[0.05]
    assert loose_steps < tight_steps
    assert loose_steps % stored_rows.CHECK_EVERY == 0
    assert abs(loose - tight) <= 0.05 * tight + 1e-9
    assert abs(loose - tight) <= loose_stderr


def test_a_bracket_wider_than_the_loose_tolerance_at_the_step_cap_goes_on(one_thread, steps):
    """At ``slq_steps`` the runs stop only once the bracket is within the loose tolerance (10%):
    5 steps leave this model's bracket wider, so the runs go on to the first check within it
    and give the numbers of a run capped there; with no extension they stop at 5, wider."""
    model, inputs, targets = many_classes()
    options = {"probes": 4, "slq_tolerance": 1e-6, **STORED}
    extended = probe_kernel_report(model, inputs, targets, slq_steps=5, **options)
    taken = len(steps)
    assert taken == 5 + stored_rows.CHECK_EVERY  # the first check after 5 (see below)
    assert taken <= KernelOptions().slq_extension * 5
    assert extended.blocks["stderr"].soft_rank <= 0.1 * extended.soft_rank
    capped = probe_kernel_report(model, inputs, targets, slq_steps=taken, **options)
    assert extended.soft_rank == pytest.approx(capped.soft_rank, rel=1e-12)
    steps.clear()
    short = probe_kernel_report(model, inputs, targets, slq_steps=5, slq_extension=1, **options)
    assert len(steps) == 5
    assert short.blocks["stderr"].soft_rank > 0.1 * short.soft_rank


def test_the_papers_mlp_at_its_default_slq_budget(one_thread):
    """The paper's MLP on 60 samples at the default 16 probes of 80 steps: within 5% of the
    formed kernel of the same rows."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(60)
    # the probes named: at the default ones the formed kernel of this small model, whose soft
    # rank nears its probe rows, would be measured again with the exact rows
    probes = {"probes": 4, "groups": 2}
    formed = probe_kernel_report(model, inputs, targets, 20, side="samples", **probes)
    stored = probe_kernel_report(model, inputs, targets, 20, **STORED, **probes)
    assert stored.soft_rank == pytest.approx(formed.soft_rank, rel=0.05)
    assert stored.logdet == pytest.approx(formed.logdet, rel=0.05)


def test_the_rows_memory_is_the_guard(monkeypatch):
    """Rows beyond max_row_elements are refused with the fix named; by default the guard is a
    share of the free memory of the rows' device."""
    model, inputs, targets = many_classes()
    per_batch = 4 * 7 * 326
    with pytest.raises(StructureTooLargeError, match="max_row_elements"):
        probe_kernel_report(model, inputs, targets, side="samples", max_row_elements=2 * per_batch)
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 10 * 2**30)
    assert memory.row_element_limit() == int(memory.ROW_MEMORY_SHARE * 10 * 2**30) // 4
    assert memory.row_elements(KernelOptions()) == memory.row_element_limit()
    assert memory.row_elements(KernelOptions(max_row_elements=99)) == 99
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: None)
    assert memory.row_element_limit() == memory.FALLBACK_ROW_ELEMENTS


def test_the_default_keeps_rows_past_the_formed_kernels_guard(monkeypatch):
    """78,000 parameters and 10,000 samples of 2 probes: 1.6·10⁹ numbers of rows (6 GiB of
    float32), sketched 4 times shorter at the default (1.5 GiB); stored when they fit in memory,
    sketched shorter still where that makes them fit, the matrix-free cg when nothing does;
    across processes each keeps its share, in the memory the processes of one machine share."""
    options, unsketched = KernelOptions(probes=2), KernelOptions(probes=2, sketch_factor=1)
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 20 * 2**30)
    for chosen in (options, unsketched):
        choice = choose_structure(78_000, 10_000, chosen)
        assert choice.structure == "probe_kernel" and "Lanczos quadrature" in choice.reason
        assert ("sketched to 19,584" in choice.reason) == (chosen is options)
        assert choice.sketch_factor is None  # the option's own factor fits
        spread = choose_structure(78_000, 5_000, chosen, summable=True, sharing=2)
        assert spread.structure == "probe_kernel" and "parameters' space" in spread.reason
        assert ("sketched to 19,584" in spread.reason) == (chosen is options)
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 8 * 2**30)
    assert choose_structure(78_000, 10_000, unsketched).structure == "cg"
    assert choose_structure(78_000, 10_000, options).sketch_factor is None
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2**30)  # 0.4 GiB for rows
    choice = choose_structure(78_000, 10_000, options)
    assert choice.structure == "probe_kernel" and choice.sketch_factor == 16
    assert "sketched to 4,896" in choice.reason
    # four processes' rows in that memory: each a quarter of it, its rows 32 times shorter
    assert choose_structure(78_000, 5_000, options, summable=True, sharing=4).sketch_factor == 32
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2**24)
    assert choose_structure(78_000, 10_000, options).structure == "cg"


class _Module(torch.nn.Linear):
    """A module with the ``device`` a LightningModule has."""

    device = torch.device("cpu")


def test_the_monitor_predicts_the_quadrature_its_fit_start_trial_does_not_run(monkeypatch):
    """The trial measures 32 samples, never the stored-row path; the first exact measurement's
    predicted cost adds the quadrature where the whole set will take that path, and across
    processes each one's share of the rows (always kept above the P × P guard)."""
    calls = []

    def predicted(rows, parameters, **options):
        calls.append((rows, parameters, options["groups"], options["probes"]))
        return 7.0

    monkeypatch.setattr(monitor_checks, "quadrature_seconds", predicted)
    monitor = FlatnessMonitor()
    monitor.state.active_structure = "probe_kernel"
    assert monitor.fit_start.quadrature_seconds(_Module(10, 3), 100_000, 1) == 0.0  # P × P sums
    assert monitor.fit_start.quadrature_seconds(_Module(10, 3), 100_000, 2) == 0.0  # summed across
    assert (
        monitor.fit_start.quadrature_seconds(_Module(1000, 10), 2000, 1) == 0.0
    )  # a formed kernel
    assert monitor.fit_start.quadrature_seconds(_Module(1000, 10), 4000, 1) == 7.0  # stored rows
    assert monitor.fit_start.quadrature_seconds(_Module(1000, 10), 2000, 2) == 7.0  # kept by each
    slq = KernelOptions().slq_probes
    assert calls == [(16_000, 10_010, 2, slq), (4_000, 10_010, 2, slq)]
    state = torch.get_rng_state()
    assert quadrature_seconds(300, 50, groups=2, probes=2, steps=3) > 0.0
    assert torch.equal(torch.get_rng_state(), state)  # the training's RNG is not drawn from


def test_the_decrements_runs_share_the_soft_ranks_passes_and_change_nothing(one_thread):
    """The Newton decrement's Lanczos runs advance in the soft rank's passes over the rows
    (StoredRows.lockstep): the soft rank is the same with and without them, and the decrement
    is the one of Lanczos runs on explicit F̂ products from g, for every group's estimate."""
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 13, 40, dtype=torch.float64, generator=generator) for _ in range(3)]
    gradient = torch.randn(40, dtype=torch.float64, generator=generator)
    budget = stored_rows.QuadratureBudget(probes=6, steps=30, tolerance=1e-9)

    def estimate(with_gradient):
        store = RowStore(4, 40)
        for chunk in rows:
            store.append(chunk)
        return stored_rows.stored_rows_estimate(
            store, 2, 39, LAM, budget=budget, gradient=gradient if with_gradient else None
        )

    alone, shared = estimate(False), estimate(True)
    assert shared.summary.soft_rank == pytest.approx(alone.summary.soft_rank, rel=1e-12)
    assert alone.newton_decrement != alone.newton_decrement  # NaN without a gradient
    stacked = torch.cat(rows, dim=1)  # (4, 39, 40): groups of 2 probes
    fishers = [stacked[2 * g : 2 * g + 2].reshape(-1, 40) for g in range(2)]
    fishers = [block.T @ block / 39 for block in fishers]
    whole = (fishers[0] + fishers[1]) + LAM * torch.eye(40, dtype=torch.float64)
    leave_outs = [2 * fishers[1 - g] + LAM * torch.eye(40, dtype=torch.float64) for g in range(2)]
    forms = [0.5 * float(gradient @ torch.linalg.solve(m, gradient)) for m in [whole, *leave_outs]]
    expected, _ = stored_rows.probe_decrement(forms[0], forms[1:])
    assert shared.newton_decrement == pytest.approx(expected, rel=1e-6)


def test_the_monitors_choice_counts_the_probes_its_measurements_take(monkeypatch):
    """From 8,192 measured samples measure() takes 2 probes per sample; the monitor's fit-start
    choice (and its sketch factor) counts the same rows, not 4 per sample."""
    seen = []

    def choose(parameters, samples, options, **kwargs):
        seen.append((samples, options.probes))
        return StructureChoice("probe_kernel", "probe_kernel: the rows fit")

    class _Trainer:
        world_size = num_devices = 1
        train_dataloader = None

    monkeypatch.setattr(defaults, "choose_structure", choose)
    for samples in (10_000, 1_000):
        monitor = FlatnessMonitor()
        monitor.state.resolved_num_train_samples = samples
        monitor.fit_start.choose_structure(_Trainer(), _Module(10, 3))
    assert seen == [(10_000, 2), (1_000, 4)]
