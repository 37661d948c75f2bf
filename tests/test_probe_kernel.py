"""``structure="probe_kernel"`` against the dense autograd reference (float64).

With no more outputs than probes the structure uses the exact rows of the output Fisher's square
root: its spectrum is then the whole Fisher's, to round-off, on every zoo model and batch size.
With fewer probes than outputs it is random: unbiased in F, jackknifed in h(F), and it must
converge to the exact soft rank as the probes grow. The two sides (P × P and ms × ms) must give
the same numbers, and so must a run summed across processes.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, many_classes, random_data, tiny_model
from zoo import ZOO, build, zoo_data

from lightning_flatness.core import defaults, reference, spectral
from lightning_flatness.core.batches import wrap_for_batches
from lightning_flatness.core.curvature import probe_kernel
from lightning_flatness.core.curvature.probe_kernel import symmetric_gram
from lightning_flatness.core.defaults import choose_structure
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.measure import measure
from lightning_flatness.core.model_state import left_as_found, original_module
from lightning_flatness.core.options import KernelOptions, structure_options
from lightning_flatness.core.positional import position_signs
from lightning_flatness.core.trust import DECREMENT_LIMIT, TRUST_THRESHOLD

LAM = 1e-3
N = 24


def _split(inputs, targets, batch_size: int) -> list:
    if isinstance(inputs, dict):
        size = targets.shape[0]
        return [
            ({k: v[i : i + batch_size] for k, v in inputs.items()}, targets[i : i + batch_size])
            for i in range(0, size, batch_size)
        ]
    return batches(inputs, targets, batch_size)


def _case(name: str):
    if name in ZOO:
        model = build(name)
        inputs, targets = zoo_data(name, N)
    else:
        model = tiny_model(name).eval()
        inputs, targets = random_data(N)
    return model, inputs, targets


@pytest.fixture(scope="module")
def exact_cases():
    """(model, inputs, targets, exact eigenvalues) per model, the dense Fisher computed once."""
    result = {}
    for name in (*ZOO, "mlp", "cnn", "resmlp"):
        model, inputs, targets = _case(name)
        result[name] = (model, inputs, targets, _exact_eigenvalues(model, inputs, targets))
    return result


def _exact_eigenvalues(model, inputs, targets):
    """The dense reference Fisher's spectrum of any zoo model (tensor or dict inputs)."""
    wrapped, _, _ = wrap_for_batches(original_module(model), [(inputs, targets)])
    leaf = tuple(inputs.values()) if isinstance(inputs, dict) else inputs
    leaf = leaf[0] if isinstance(leaf, tuple) and len(leaf) == 1 else leaf
    with left_as_found(wrapped):
        return spectral.psd_eigenvalues(reference.dense_fisher(wrapped, leaf))


def _exact_rows_report(case, name: str, batch_size: int):
    """``probe_kernel`` with as many probes as classes: the exact rows, one group."""
    model, inputs, targets, _ = case
    classes = 10 if name in ("mlp", "cnn", "resmlp") else 5
    return measure(
        model,
        _split(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=100,
        structure=KernelOptions(probes=classes, groups=1),
    )


@pytest.mark.parametrize("name", [*ZOO, "mlp", "cnn", "resmlp"])
@pytest.mark.parametrize("batch_size", [1, 7, N])
def test_exact_rows_give_the_whole_fishers_spectrum(exact_cases, name, batch_size, one_thread):
    eigenvalues = exact_cases[name][-1]
    report = _exact_rows_report(exact_cases[name], name, batch_size)
    expected = spectral.spectral_summary(eigenvalues, LAM)
    assert report.soft_rank == pytest.approx(expected.soft_rank, rel=1e-8)
    assert report.logdet == pytest.approx(expected.logdet, rel=1e-8)
    assert report.soft_rank2 == pytest.approx(expected.soft_rank2, rel=1e-8)
    assert report.max_eig == pytest.approx(expected.max_eig, rel=1e-8)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_a_large_estimate_is_summarised_without_its_eigendecomposition(
    exact_cases, name, monkeypatch, one_thread
):
    """Above EIGEN_SIZE_LIMIT the summary comes from a Cholesky factorisation and Lanczos: the
    same numbers as the spectrum's, and a histogram sample of the spectrum."""
    monkeypatch.setattr(probe_kernel, "EIGEN_SIZE_LIMIT", 0)
    eigenvalues = exact_cases[name][-1]
    report = _exact_rows_report(exact_cases[name], name, 7)
    expected = spectral.spectral_summary(eigenvalues, LAM)
    for field in ("soft_rank", "soft_rank2", "logdet", "max_eig"):
        assert getattr(report, field) == pytest.approx(getattr(expected, field), rel=1e-8), field
    histogram = report.eigenvalues
    assert histogram.numel() > 0
    assert float(histogram.min()) > 0
    assert float(histogram.max()) <= expected.max_eig * (1 + 1e-8)


def test_dense_reference_agrees_with_the_exact_rows(one_thread):
    """The same check against the package's independent reference (not BackPACK)."""
    model, inputs, targets = _case("mlp")
    fisher = reference.dense_fisher(model, inputs)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    report = measure(
        model,
        batches(inputs, targets, 7),
        lam=LAM,
        num_train_samples=100,
        structure=KernelOptions(probes=10, groups=1),
    )
    assert report.soft_rank == pytest.approx(exact, rel=1e-8)


def _probe_report(model, inputs, targets, probes, groups, seed=0, batch_size=7, **more):
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=100,
        structure=KernelOptions(probes=probes, groups=groups, **more.pop("options", {})),
        seed=seed,
        **more,
    )


def test_probes_converge_to_the_exact_soft_rank_and_the_jackknife_helps(one_thread):
    """30 classes, 4 to 28 probes: the error shrinks with the budget, and the jackknifed value
    is closer than the plain one."""
    model, inputs, targets = many_classes()
    fisher = reference.dense_fisher(model, inputs)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    errors = {}
    for probes in (4, 16, 28):
        report = _probe_report(model, inputs, targets, probes, 2)
        plain = report.blocks["uncorrected"].soft_rank
        assert plain < exact  # concavity: the plain probe estimate is low
        assert abs(report.soft_rank - exact) < abs(plain - exact)
        errors[probes] = abs(report.soft_rank / exact - 1)
    assert errors[28] < errors[4]
    assert errors[16] < 0.05
    assert errors[28] < 0.01


@pytest.mark.parametrize("batch_size", [1, 7, 48])
def test_probe_estimate_does_not_depend_on_the_batch_size(batch_size, one_thread):
    """Each sample's probes are keyed by its position: every batch size gives the same numbers."""
    model, inputs, targets = many_classes()
    probe = {"trace_estimator": "probe"}
    one = _probe_report(model, inputs, targets, 16, 4, batch_size=batch_size, options=probe)
    other = _probe_report(model, inputs, targets, 16, 4, batch_size=5, options=probe)
    for key, value in other.as_dict().items():
        if key not in ("seconds", "structure"):
            assert one.as_dict()[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
    different_seed = _probe_report(model, inputs, targets, 16, 4, seed=1)
    assert different_seed.soft_rank != one.soft_rank


def test_both_sides_and_a_summed_run_give_the_same_numbers(one_thread):
    model, inputs, targets = many_classes()
    samples = _probe_report(model, inputs, targets, 4, 2, options={"side": "samples"})
    parameters = _probe_report(model, inputs, targets, 4, 2, options={"side": "parameters"})
    # a small kernel guard moves "auto" from the kept rows to the P × P sums mid-stream
    moved = _probe_report(model, inputs, targets, 4, 2, options={"max_kernel_size": 50})
    summed = _probe_report(model, inputs, targets, 4, 2, all_reduce=lambda t: t)
    for other in (parameters, moved, summed):
        assert other.soft_rank == pytest.approx(samples.soft_rank, rel=1e-9)
        assert other.logdet == pytest.approx(samples.logdet, rel=1e-9)
        assert other.as_dict()["soft_rank_stderr"] == pytest.approx(
            samples.as_dict()["soft_rank_stderr"], rel=1e-6, abs=1e-9
        )


@pytest.mark.parametrize("batch_size", [1, 7, 48])
def test_the_first_half_of_a_formed_kernel_is_a_measurement_of_those_samples(
    one_thread, batch_size
):
    """A formed sample-side kernel's ``first_half`` block is what measuring the first half of
    its samples alone gives (the same probe rows: they are drawn by sample position), at any
    batch size, jackknife included; the parameter side, which sums over samples, has none."""
    model, inputs, targets = many_classes()
    half_size = inputs.shape[0] // 2
    options = {"options": {"side": "samples"}, "batch_size": batch_size}
    whole = _probe_report(model, inputs, targets, 4, 2, **options)
    half = _probe_report(model, inputs[:half_size], targets[:half_size], 4, 2, **options)
    first_half = whole.blocks[probe_kernel.FIRST_HALF]
    assert first_half.soft_rank == pytest.approx(half.soft_rank, rel=1e-9)
    assert first_half.logdet == pytest.approx(half.logdet, rel=1e-9)
    assert first_half.soft_rank < whole.soft_rank  # fewer samples, a smaller soft rank
    one_group = _probe_report(model, inputs, targets, 4, 1, **options)
    alone = _probe_report(model, inputs[:half_size], targets[:half_size], 4, 1, **options)
    assert one_group.blocks[probe_kernel.FIRST_HALF].soft_rank == pytest.approx(
        alone.soft_rank, rel=1e-9
    )
    parameters = _probe_report(model, inputs, targets, 4, 2, options={"side": "parameters"})
    assert probe_kernel.FIRST_HALF not in parameters.blocks


@pytest.mark.parametrize("side", ["samples", "parameters"])
@pytest.mark.parametrize("batch_size", [1, 7, 48])
def test_summary_only_gives_the_same_trace_functions_without_spectrum_or_decrement(
    one_thread, side, batch_size
):
    """``summary_only`` (the monitor's calibration): the jackknifed trace functions, their
    standard errors and a formed kernel's first half as without it, to round-off, on either
    side and at any batch size; no Newton decrement, and the spectrum only as Lanczos's sample
    (its largest eigenvalue the same)."""
    model, inputs, targets = many_classes()
    options = {"side": side}
    full = _probe_report(model, inputs, targets, 4, 2, batch_size=batch_size, options=options)
    summary = _probe_report(
        model,
        inputs,
        targets,
        4,
        2,
        batch_size=batch_size,
        options={**options, "summary_only": True},
    )
    for field in ("soft_rank", "soft_rank2", "logdet", "max_eig"):
        assert getattr(summary, field) == pytest.approx(getattr(full, field), rel=1e-9), field
    for block in ("uncorrected", "stderr", *([probe_kernel.FIRST_HALF] * (side == "samples"))):
        expected, got = full.blocks[block], summary.blocks[block]
        assert got.soft_rank == pytest.approx(expected.soft_rank, rel=1e-9), block
    assert full.newton_decrement > 0
    assert math.isnan(summary.newton_decrement)
    assert 0 < float(summary.eigenvalues.max()) <= full.max_eig * (1 + 1e-8)


def test_size_guards_name_the_fix():
    model, inputs, targets = many_classes()
    with pytest.raises(StructureTooLargeError, match="max_row_elements"):
        _probe_report(
            model, inputs, targets, 4, 2, options={"side": "samples", "max_row_elements": 6000}
        )
    with pytest.raises(StructureTooLargeError, match="batches of at most 2 samples"):
        _probe_report(model, inputs, targets, 4, 2, options={"max_row_elements": 4 * 2 * 326})
    with pytest.raises(StructureTooLargeError, match="max_parameters"):
        _probe_report(
            model, inputs, targets, 4, 2, options={"side": "parameters", "max_parameters": 10}
        )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"probes": 4, "groups": 3}, "must divide"),
        ({"probe": 4}, r"no option \['probe'\]"),
        ({"probes": 0}, "probes"),
        ({"side": "both"}, "side"),
        ({"summary_only": "yes"}, "summary_only"),
    ],
)
def test_bad_options_are_refused_with_their_name(options, match):
    model, inputs, targets = many_classes()
    with pytest.raises(ValueError, match=match):
        measure(
            model,
            batches(inputs, targets, 7),
            lam=LAM,
            num_train_samples=100,
            structure=structure_options("probe_kernel", options),
        )


def test_auto_chooses_the_probe_kernel_where_it_fits():
    options = KernelOptions()
    assert choose_structure(4210, 50_000, options).structure == "probe_kernel"  # P × P side
    assert choose_structure(50_000, 1000, options).structure == "probe_kernel"  # kept rows
    # 200,000 rows fit sketched (the factor depends on the free memory), 10⁷ parameters do not
    assert choose_structure(100_000, 50_000, options).structure == "probe_kernel"
    assert choose_structure(10_000_000, 50_000, options).structure == "cg"
    # across processes each keeps its rows; 10⁷ parameters' rows fit on none
    assert choose_structure(100_000, 1000, options, summable=True).structure == "probe_kernel"
    assert choose_structure(10_000_000, 50_000, options, summable=True).structure == "cg"
    assert "max_samples" in choose_structure(100_000, None, options).reason


@pytest.mark.parametrize(
    ("max_samples", "options", "expected"),
    [(None, None, 2), (40, None, 4), (None, {"groups": 1}, 4), (None, {"probes": 6}, 6)],
)
def test_many_measured_samples_take_two_probes_unless_told(
    max_samples, options, expected, monkeypatch
):
    """From SAMPLES_FOR_TWO_PROBES measured samples the default is 2 probes per sample (the rows
    m·s, not s, set the probes' bias); probes or groups the user names are kept."""
    monkeypatch.setattr(defaults, "SAMPLES_FOR_TWO_PROBES", 50)
    built = []
    original = probe_kernel.ProbeKernelFisher.__init__

    def spy(self, *args, **kwargs):
        built.append(kwargs["probes"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(probe_kernel.ProbeKernelFisher, "__init__", spy)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 12).double()
    inputs, targets = torch.randn(100, 4, dtype=torch.float64), torch.randint(0, 12, (100,))
    measure(
        model,
        batches(inputs, targets, 25),
        lam=LAM,
        num_train_samples=100,
        max_samples=max_samples,
        structure=KernelOptions(**(options or {})),
    )
    # (at the default probes, this model's soft rank near its rows is measured again with its
    # 12 exact rows: tests/test_probe_bias.py)
    assert built[0] == expected and built[1:] in ([], [12])
    assert built[1:] == [] or options is None


def test_approximations_are_never_trusted_and_impossible_values_warn(one_thread):
    """8 samples of 10 classes: the Fisher's rank is at most 72, which kfac's soft rank
    exceeds on the tiny MLP; the probe kernel (exact rows here) stays below it."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(8)
    with pytest.warns(UserWarning, match="above 72"):
        kfac = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=100, structure="kfac")
    assert kfac.rank_bound == 72 and kfac.soft_rank > 72 and kfac.trusted == 0.0
    with pytest.warns(UserWarning, match="above 72"):  # the matrix-free diagonal, likewise
        diagonal = measure(
            model, [(inputs, targets)], lam=LAM, num_train_samples=100, structure="hutchinson"
        )
    assert diagonal.rank_bound == 72 and diagonal.trusted == 0.0
    exact = measure(
        model,
        [(inputs, targets)],
        lam=LAM,
        num_train_samples=100,
        structure=KernelOptions(probes=10, groups=1),
    )
    assert exact.structure == "probe_kernel" and exact.soft_rank <= 72
    settled = exact.newton_decrement <= DECREMENT_LIMIT
    assert exact.trusted == float(exact.trust_score >= TRUST_THRESHOLD and settled)


def _trained(architecture: str, steps: int):
    """A tiny paper model fit to 64 random images: lightly (30 steps) or to over-confidence
    (400 steps, every training label right)."""
    model = tiny_model(architecture)
    inputs, targets = random_data(64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return model.eval(), inputs, targets


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "resmlp"])
@pytest.mark.parametrize("steps", [30, 400])
def test_default_is_within_ten_percent_on_trained_models(architecture, steps, one_thread):
    """The default (4 probes for 10 classes) against the dense reference, at batch sizes
    1, 7 and 64, within 10%; a budget of C = 10 probes is the exact rows, exact to round-off.
    (At this tiny n = 64 the 256–512 probe rows are close to the soft rank, 60–350: 4 probes
    are up to 8% low and 8 probes up to 10% high on the lightly trained models, where the
    jackknife's 1/s law does not hold yet; see docs/RESULTS.md.)"""
    model, inputs, targets = _trained(architecture, steps)
    fisher = reference.dense_fisher(model, inputs)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    values = []
    for batch_size in (1, 7, 64):
        report = measure(
            model, batches(inputs, targets, batch_size), lam=LAM, num_train_samples=100
        )
        assert report.structure == "probe_kernel"
        values.append(report.soft_rank)
    assert values[0] == pytest.approx(values[1], rel=1e-9) == values[2]
    assert values[0] == pytest.approx(exact, rel=0.10)
    exact_rows = _probe_report(model, inputs, targets, 10, 1)
    assert exact_rows.soft_rank == pytest.approx(exact, rel=1e-8)


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("steps", [20, 300])
def test_default_is_within_ten_percent_on_the_trained_zoo(name, steps, one_thread):
    """The zoo fit to 64 samples, lightly and to over-confidence: the default against the
    dense reference (exact rows where C ≤ 4; functional_cnn, C = 5, by probes: 1.09 and 1.05
    of exact at this tiny n, where the probe rows barely exceed the soft rank)."""
    model = build(name)
    inputs, targets = zoo_data(name, 64)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        torch.nn.functional.cross_entropy(logits, targets).backward()
        optimizer.step()
    model.eval()
    exact = spectral.soft_rank(_exact_eigenvalues(model, inputs, targets), LAM)
    report = measure(model, _split(inputs, targets, 7), lam=LAM, num_train_samples=100)
    assert report.structure == "probe_kernel"
    assert report.soft_rank == pytest.approx(exact, rel=0.10)


@pytest.mark.parametrize("shape", [(7, 5), (40, 33), (3, 1)])
def test_symmetric_gram_is_the_plain_product(shape):
    rows = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    expected = (rows.T @ rows).to(torch.float64)
    assert torch.allclose(symmetric_gram(rows), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(symmetric_gram(rows), symmetric_gram(rows).T)


def test_shards_draw_the_probes_one_process_draws():
    """Process r of 3 measuring samples r, r + 3, … draws, for its local sample j, the signs
    one process draws at global position 3j + r (the monitor's fixed subset is sharded so)."""
    whole = position_signs(7, torch.arange(3000), 4, 10)
    for rank in range(3):
        local = torch.arange(1000)
        assert torch.equal(position_signs(7, local * 3 + rank, 4, 10), whole[:, rank::3])
    assert not torch.equal(position_signs(8, torch.arange(3000), 4, 10), whole)
