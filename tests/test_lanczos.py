"""Stochastic Lanczos quadrature (``structure="lanczos"``) against exact spectra.

The Lanczos core is checked on explicit matrices (Gauss quadrature is exact once the Krylov space
is exhausted); the Fisher estimate on tiny float64 models against the dense autograd reference,
with an error that must shrink as probes grow and stay within a few standard errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, curvature_and_sums, random_data, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.curvature import lanczos_quadrature
from lightning_flatness.core.curvature.lanczos import (
    FIELDS,
    density_sample,
    gauss_quadrature,
    lanczos,
    slq_values,
    truncated,
)
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import MatrixFreeOptions

LAM = 1e-3
N_TRAIN = 1000
NUM_SAMPLES = 64
SUMMARY_FIELDS = ("soft_rank", "soft_rank2", "logdet")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cases():
    result = {}
    for architecture in ("mlp", "cnn", "resmlp"):
        model = tiny_model(architecture).eval()
        inputs, targets = random_data(NUM_SAMPLES)
        eigenvalues = spectral.psd_eigenvalues(reference.dense_fisher(model, inputs))
        result[architecture] = (model, inputs, targets, eigenvalues)
    return result


def _low_rank_psd(dim: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    scales = torch.logspace(-2, 1, rank, dtype=torch.float64)
    return (factor * scales) @ factor.T / dim


def _exact_quadratic_forms(matrix: torch.Tensor, vector: torch.Tensor) -> dict[str, float]:
    mu, basis = torch.linalg.eigh(matrix)
    mu = mu.clamp_min(0.0)
    weights = (basis.T @ vector).square()
    return slq_values(mu, weights, 1.0, LAM, divide_by_mu=False)


@settings(max_examples=25, deadline=None)
@given(
    dim=st.integers(4, 30),
    rank_fraction=st.floats(0.1, 1.0),
    extra_steps=st.integers(1, 10),
    seed=st.integers(0, 10_000),
)
def test_quadrature_is_exact_once_the_krylov_space_is_exhausted(
    dim, rank_fraction, extra_steps, seed
):
    """A start vector meets at most rank + 1 eigenspaces (the null space is one), so after
    rank + 1 steps Lanczos breaks down and Gauss quadrature integrates h exactly."""
    rank = max(1, int(rank_fraction * dim))
    matrix = _low_rank_psd(dim, rank, seed)
    start = torch.randn(
        3, dim, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    steps = min(dim, rank + 1 + extra_steps)
    decomposition = lanczos(lambda v: v @ matrix, start, steps)
    assert bool((decomposition.lengths <= rank + 1).all())
    for index in range(3):
        nodes, weights = gauss_quadrature(decomposition, index)
        assert bool((nodes >= 0).all())
        assert float(weights.sum()) == pytest.approx(1.0, rel=1e-10)
        norm_sq = float(decomposition.norms[index]) ** 2
        estimate = slq_values(nodes, weights, norm_sq, LAM, divide_by_mu=False)
        exact = _exact_quadratic_forms(matrix, start[index])
        for name, value in exact.items():
            assert estimate[name] == pytest.approx(value, rel=1e-6, abs=1e-9)


def test_range_start_integrates_h_over_mu_exactly():
    """From v = Bᵀξ (A = BᵀB), ‖v‖² Σ τ² h(θ)/θ equals ξᵀ h(BBᵀ) ξ — the Hutchinson form on
    the Gram side — without ever meeting A's null space."""
    generator = torch.Generator().manual_seed(3)
    factor = torch.randn(6, 40, generator=generator, dtype=torch.float64)  # rank 6 in R^40
    matrix = factor.T @ factor
    xi = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    start = xi @ factor
    decomposition = lanczos(lambda v: v @ matrix, start, 20)
    assert bool((decomposition.lengths <= 6).all())
    for index in range(2):
        nodes, weights = gauss_quadrature(decomposition, index)
        norm_sq = float(decomposition.norms[index]) ** 2
        estimate = slq_values(nodes, weights, norm_sq, LAM, divide_by_mu=True)
        exact = _exact_quadratic_forms(factor @ factor.T, xi[index])
        for name, value in exact.items():
            assert estimate[name] == pytest.approx(value, rel=1e-7)


def test_a_basis_grown_block_by_block_gives_the_same_runs(monkeypatch):
    """The basis allocated a few steps at a time (past its first block, twice) gives the
    coefficients of one allocated whole, and stays orthonormal."""
    generator = torch.Generator().manual_seed(5)
    factor = torch.randn(80, 80, generator=generator, dtype=torch.float64)
    matrix = factor.T @ factor / 80
    start = torch.randn(3, 80, generator=generator, dtype=torch.float64)
    whole = lanczos(lambda v: v @ matrix, start, 30)
    monkeypatch.setattr(lanczos_quadrature, "BASIS_BLOCK", 12)
    runs = lanczos_quadrature.LanczosRuns(start, 30)
    while not runs.finished:
        runs.advance(runs.block() @ matrix)
    grown = runs.decomposition()
    assert runs.basis.shape[0] == 30  # 12 + 12 + 6
    assert torch.allclose(grown.alphas, whole.alphas, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grown.betas, whole.betas, rtol=1e-12, atol=1e-12)
    gram = torch.einsum("skn,tkn->kst", runs.basis, runs.basis)
    assert torch.allclose(gram, torch.eye(30, dtype=torch.float64).expand(3, -1, -1), atol=1e-10)


def test_breakdown_zero_start_and_negative_round_off():
    """A zero start vector gives an empty run; tiny negative eigenvalues give Ritz values ≥ 0."""
    basis, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64))
    mu = torch.tensor(
        [-1e-15, -1e-16, 0.0, 1e-3, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0], dtype=torch.float64
    )
    matrix = basis @ torch.diag(mu) @ basis.T
    start = torch.stack([torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)])
    decomposition = lanczos(lambda v: v @ matrix, start, 10)
    assert int(decomposition.lengths[0]) == 0
    assert int(decomposition.lengths[1]) <= 8  # 8 distinct eigenvalues
    nodes, weights = gauss_quadrature(decomposition, 1)
    assert bool((nodes >= 0).all()) and weights.numel() == int(decomposition.lengths[1])
    empty_nodes, _ = gauss_quadrature(decomposition, 0)
    assert empty_nodes.numel() == 0


def test_density_sample_preserves_counts_and_caps_its_size():
    nodes = torch.tensor([0.3, 0.1, 0.2], dtype=torch.float64)
    sample = density_sample(nodes, torch.tensor([2.4, 1.3, 0.6], dtype=torch.float64), 1000)
    assert sample.numel() == 4 and bool((sample[:-2] <= sample[1:-1]).all())
    capped = density_sample(nodes, torch.tensor([2e5, 1e5, 1e5]), 1000)
    assert capped.numel() == 1000 and int((capped == 0.3).sum()) == 500


def _run(model, inputs, targets, seed=0, **options):
    estimate, _ = curvature_and_sums(
        model,
        batches(inputs, targets, NUM_SAMPLES),
        structure="lanczos",
        lam=LAM,
        seed=seed,
        options={"lanczos_steps": 40, "trace_estimator": "exact", **options},
    )
    return estimate


def test_soft_rank_and_logdet_converge_to_the_dense_reference(cases, architecture):
    """The error shrinks with the number of probes and stays within 3 standard errors (plus
    0.5 % for the quadrature with 40 steps); the max eigenvalue is the top Ritz value."""
    model, inputs, targets, eigenvalues = cases[architecture]
    truth = spectral.spectral_summary(eigenvalues, LAM)
    many = _run(model, inputs, targets, probes=64, seed=0)
    few = [_run(model, inputs, targets, probes=4, seed=seed) for seed in range(1, 7)]
    for name in SUMMARY_FIELDS:
        exact = getattr(truth, name)
        error_many = abs(getattr(many.summary, name) - exact)
        stderr_many = getattr(many.stderr, name)
        assert error_many <= 3 * stderr_many + 5e-3 * exact, name
        rms_few = math.sqrt(sum((getattr(f.summary, name) - exact) ** 2 for f in few) / len(few))
        assert error_many < rms_few, name
        mean_stderr_few = sum(getattr(f.stderr, name) for f in few) / len(few)
        assert stderr_many < 0.5 * mean_stderr_few, name
    assert many.summary.max_eig == pytest.approx(truth.max_eig, rel=1e-8)
    assert abs(many.summary.trace - truth.trace) <= 4 * many.stderr.trace
    assert many.blocks["stderr"] == many.stderr


def test_parameter_and_sample_spaces_give_the_same_probe_values(cases):
    """Both spaces evaluate ξᵀ h(K) ξ for the same ξ; with enough steps to exhaust the Krylov
    spaces the per-probe values agree to round-off (8 samples: dim K = 80 < P)."""
    model, inputs, targets, _ = cases["resmlp"]
    inputs, targets = inputs[:8], targets[:8]
    runs = [
        _run(model, inputs, targets, probes=3, lanczos_steps=80, space=space)
        for space in ("parameters", "samples")
    ]
    assert [run.space for run in runs] == ["parameters", "samples"]
    torch.testing.assert_close(runs[0].probe_values, runs[1].probe_values, rtol=1e-7, atol=1e-9)
    auto = _run(model, inputs, targets, probes=3, lanczos_steps=80)
    assert auto.space == "samples"  # m·C = 80 < P = 830


def test_classic_random_start_is_supported(cases):
    model, inputs, targets, eigenvalues = cases["mlp"]
    truth = spectral.spectral_summary(eigenvalues, LAM)
    estimate = _run(model, inputs, targets, probes=32, start="random", lanczos_steps=60)
    assert estimate.space == "parameters"
    assert estimate.summary.soft_rank == pytest.approx(truth.soft_rank, rel=0.05)


def test_density_sample_is_a_histogram_of_the_spectrum(cases):
    """``eigenvalues`` repeats Ritz values by their estimated counts: its size is about the
    dimension of K's range (m(C − 1) = 576) and its counts above thresholds follow the exact
    spectrum."""
    model, inputs, targets, eigenvalues = cases["mlp"]
    estimate = _run(model, inputs, targets, probes=32, lanczos_steps=60)
    sample = estimate.eigenvalues
    assert sample.dtype == torch.float64 and sample.dim() == 1
    assert abs(sample.numel() - NUM_SAMPLES * 9) <= 3
    for threshold in (10 * LAM, 0.1 * float(eigenvalues.max())):
        exact = int((eigenvalues > threshold).sum())
        assert abs(int((sample > threshold).sum()) - exact) <= 0.1 * exact + 3
    assert float(estimate.weights.sum()) == pytest.approx(sample.numel(), abs=1.0)


def test_measure_reports_lanczos_with_exact_statistics(cases):
    model, inputs, targets, eigenvalues = cases["cnn"]
    report = measure(
        model,
        batches(inputs, targets, 16),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(
            structure="lanczos", probes=16, lanczos_steps=40, trace_estimator="exact"
        ),
    )
    assert report.structure == "lanczos" and report.num_samples == NUM_SAMPLES
    assert report.trace_fisher == pytest.approx(float(eigenvalues.sum()), rel=1e-9)
    truth = spectral.soft_rank(eigenvalues, LAM)
    assert abs(report.soft_rank - truth) <= 4 * report.blocks["stderr"].soft_rank + 0.01 * truth
    assert math.isnan(report.tic)


def test_basis_size_guard(cases):
    model, inputs, targets, _ = cases["mlp"]
    with pytest.raises(StructureTooLargeError, match="max_basis_elements"):
        _run(model, inputs, targets, probes=4, max_basis_elements=1000)


def test_leading_steps_reproduce_a_shorter_run(cases):
    """T after s steps is the leading block of T after more steps (same probes), so one long run
    shows how the quadrature converges with the number of steps."""
    model, inputs, targets, _ = cases["cnn"]
    long = _run(model, inputs, targets, probes=3, lanczos_steps=20)
    short = _run(model, inputs, targets, probes=3, lanczos_steps=8)
    head = truncated(long.decomposition, 8)
    for index in range(3):
        nodes, weights = gauss_quadrature(head, index)
        norm_sq = float(head.norms[index]) ** 2
        values = slq_values(nodes, weights, norm_sq, LAM, long.divide_by_mu)
        expected = short.probe_values[index]
        for position, name in enumerate(FIELDS):
            assert values[name] == pytest.approx(float(expected[position]), rel=1e-9), name


def _shifted_quadratic_forms(matrix: Tensor, starts: Tensor, lam: float) -> Tensor:
    """``zᵀ A(A + λ)⁻¹ z`` of each start vector, from the eigendecomposition."""
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp_min(0.0)
    return ((starts @ vectors).square() * (values / (values + lam))).sum(1)


@pytest.mark.parametrize("steps", [3, 10, 25])
def test_gauss_and_radau_rules_bracket_the_soft_rank_of_every_run(steps):
    """For h(μ) = μ/(μ + λ) the Gauss rule is above ``zᵀh(A)z`` and the Gauss–Radau rule with
    a node at 0 below it, at every number of steps, and both reach it once the Krylov space is
    exhausted (a PSD matrix with a null space and a spread spectrum, float64)."""
    generator = torch.Generator().manual_seed(3)
    factor = torch.randn(60, 45, dtype=torch.float64, generator=generator)
    factor *= torch.logspace(0, -4, 45, dtype=torch.float64)
    matrix, lam = factor @ factor.T, 1e-4
    starts = torch.randn(5, 60, dtype=torch.float64, generator=generator)
    exact = _shifted_quadratic_forms(matrix, starts, lam)
    decomposition = lanczos_quadrature.lanczos(lambda block: block @ matrix, starts, steps)
    for index in range(5):
        scale = float(decomposition.norms[index]) ** 2
        rules = [
            lanczos_quadrature.slq_values(*rule(decomposition, index), scale, lam, False)
            for rule in (lanczos_quadrature.gauss_quadrature, lanczos_quadrature.radau_quadrature)
        ]
        gauss, radau = rules[0]["soft_rank"], rules[1]["soft_rank"]
        assert radau <= float(exact[index]) * (1 + 1e-9) + 1e-9
        assert float(exact[index]) <= gauss * (1 + 1e-9) + 1e-9
    full = lanczos_quadrature.lanczos(lambda block: block @ matrix, starts, 60)
    for index in range(5):
        scale = float(full.norms[index]) ** 2
        radau = lanczos_quadrature.slq_values(
            *lanczos_quadrature.radau_quadrature(full, index), scale, lam, False
        )
        assert radau["soft_rank"] == pytest.approx(float(exact[index]), rel=1e-6)


def test_a_stop_rule_ends_every_run_early_with_its_residuals():
    """``stop`` is asked every ``check_every`` steps; when it says so the runs end there, with
    the residuals the Radau rule needs, equal to the same steps of an uninterrupted run."""
    generator = torch.Generator().manual_seed(4)
    factor = torch.randn(80, 80, dtype=torch.float64, generator=generator)
    matrix = factor @ factor.T
    starts = torch.randn(3, 80, dtype=torch.float64, generator=generator)
    asked = []

    def stop(decomposition: lanczos_quadrature.LanczosDecomposition) -> bool:
        asked.append(decomposition.alphas.shape[1])
        return decomposition.alphas.shape[1] >= 12

    early = lanczos_quadrature.lanczos(
        lambda block: block @ matrix, starts, 50, stop=stop, check_every=4
    )
    assert asked == [4, 8, 12]
    assert early.alphas.shape[1] == 12
    whole = lanczos_quadrature.lanczos(lambda block: block @ matrix, starts, 50)
    leading = lanczos_quadrature.truncated(whole, 12)
    assert torch.allclose(early.alphas, leading.alphas)
    assert torch.allclose(early.residuals, leading.residuals)
