"""Hutchinson estimates of diag(F) and Tr(F) (fim_bounds_hutchinson.txt, Eq. 2, 8, 9) against
exact per-sample Jacobians, float64 tiny models: unbiased (convergence in the number of probes,
within a few standard errors) and ordered lower ≤ estimate ≤ upper."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, curvature_and_sums, random_data, tiny_model

from lightning_flatness.core import reference
from lightning_flatness.core.curvature.hutchinson import jackknife_summary
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import MatrixFreeOptions
from lightning_flatness.core.spectral import soft_rank as spectral_soft_rank

LAM = 1e-3
N_TRAIN = 1000
NUM_SAMPLES = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def exact_diagonals(model, inputs):
    """Exact diagonals of F, of the Eq. 8 upper bound and of the Eq. 9 lower bound (eigh)."""
    jac = reference.per_sample_jacobians(model, inputs)
    with torch.no_grad():
        probs = torch.softmax(model(inputs), -1)
    core = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
    values, vectors = torch.linalg.eigh(core)
    m = inputs.shape[0]
    return {
        "estimate": torch.einsum("ncp,ncd,ndp->p", jac, core, jac) / m,
        "upper": torch.einsum("nc,ncp->p", probs, jac.square()) / m,
        "lower": torch.einsum("nc,ncp->np", vectors[:, :, -1], jac).square().T @ values[:, -1] / m,
    }


@pytest.fixture(scope="module")
def cases():
    result = {}
    for architecture in ("mlp", "cnn", "resmlp"):
        model = tiny_model(architecture).eval()
        inputs, targets = random_data(NUM_SAMPLES)
        result[architecture] = (model, inputs, targets, exact_diagonals(model, inputs))
    return result


def run(model, inputs, targets, batch_size=16, seed=0, all_reduce=None, **options):
    return curvature_and_sums(
        model,
        batches(inputs, targets, batch_size),
        structure="hutchinson",
        lam=LAM,
        seed=seed,
        all_reduce=all_reduce,
        options={"trace_estimator": "exact", **options},
    )


def test_diagonal_and_trace_are_unbiased(cases, architecture):
    """Mean over probes → exact diag F and Tr F: the error shrinks with probes and the trace is
    within 4 standard errors (Prop. 12 and the remark after it)."""
    model, inputs, targets, exact = cases[architecture]
    diagonal = exact["estimate"]
    few, _ = run(model, inputs, targets, probes=4, seed=1)
    many, _ = run(model, inputs, targets, probes=256, seed=2)
    assert many.eigenvalues.shape == diagonal.shape and many.eigenvalues.dtype == torch.float64
    error_few = float((few.eigenvalues - diagonal).norm() / diagonal.norm())
    error_many = float((many.eigenvalues - diagonal).norm() / diagonal.norm())
    assert error_many < 0.5 * error_few and error_many < 0.1
    trace = float(diagonal.sum())
    assert abs(many.summary.trace - trace) <= 4 * many.blocks["stderr"].trace
    assert many.blocks["hutchinson_estimate"] == many.summary
    assert many.blocks["stderr"].trace < 0.25 * few.blocks["stderr"].trace
    assert many.summary.trace == pytest.approx(float(many.eigenvalues.sum()), rel=1e-12)


def test_bounds_are_unbiased_and_sandwich_the_estimate(cases, architecture):
    """Eq. 8 and Eq. 9 estimate Σ p_c ∇z_c∇z_cᵀ ⪰ F ⪰ Σ λ_C Jᵀ v_C v_Cᵀ J (Prop. 6, 13, 14)."""
    model, inputs, targets, exact = cases[architecture]
    estimate, _ = run(model, inputs, targets, probes=128)
    blocks = estimate.blocks
    traces = {
        "lower": (blocks["hutchinson_lower"].trace, blocks["hutchinson_lower_stderr"].trace),
        "estimate": (estimate.summary.trace, blocks["stderr"].trace),
        "upper": (blocks["hutchinson_upper"].trace, blocks["hutchinson_upper_stderr"].trace),
    }
    exact_traces = {name: float(diagonal.sum()) for name, diagonal in exact.items()}
    assert exact_traces["lower"] <= exact_traces["estimate"] <= exact_traces["upper"]
    (low, low_se), (mid, mid_se), (high, high_se) = traces.values()
    assert low - 3 * low_se <= mid + 3 * mid_se and mid - 3 * mid_se <= high + 3 * high_se
    assert abs(high - exact_traces["upper"]) <= 4 * high_se
    # The diagonal-core bound orders the soft ranks of the diagonals as well (h is monotone).
    assert blocks["hutchinson_upper"].soft_rank >= estimate.summary.soft_rank - 4 * (
        blocks["hutchinson_upper_stderr"].soft_rank + blocks["stderr"].soft_rank
    )


def test_lower_bound_is_unbiased_for_a_confident_model():
    """With peaked p the top eigenvector of diag p − ppᵀ is well separated, power iteration
    finds it, and Eq. 9 estimates the eigh-based lower bound (Prop. 14)."""
    model = tiny_model("mlp").eval()
    with torch.no_grad():
        model[3].weight.mul_(6.0)
        model[3].bias.mul_(6.0)
    inputs, targets = random_data(NUM_SAMPLES)
    exact = float(exact_diagonals(model, inputs)["lower"].sum())
    estimate, _ = run(model, inputs, targets, probes=128)
    lower = estimate.blocks["hutchinson_lower"].trace
    assert abs(lower - exact) <= 4 * estimate.blocks["hutchinson_lower_stderr"].trace
    assert lower < 0.6 * estimate.summary.trace


def test_jackknife_standard_error_of_the_trace_is_std_over_sqrt_probes():
    generator = torch.Generator().manual_seed(0)
    per_probe = [torch.rand(50, generator=generator, dtype=torch.float64) for _ in range(7)]
    summary, stderr = jackknife_summary(per_probe, LAM)
    traces = torch.stack([d.sum() for d in per_probe])
    assert summary.trace == pytest.approx(float(traces.mean()), rel=1e-12)
    assert stderr.trace == pytest.approx(float(traces.std() / math.sqrt(7)), rel=1e-10)
    _, single = jackknife_summary(per_probe[:1], LAM)
    assert math.isnan(single.soft_rank)


def test_tic_uses_the_estimated_diagonal(cases):
    """Regularized TIC with a diagonal: Σ_k C_kk/(F̂_kk + λ), C_kk from per-sample gradients."""
    model, inputs, targets, _ = cases["mlp"]
    report = measure(
        model,
        batches(inputs, targets, 7),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(structure="hutchinson", probes=4, trace_estimator="exact"),
    )
    grads = reference.per_sample_gradients(model, inputs, targets)
    covariance = grads.square().mean(0)
    expected = float((covariance / (report.eigenvalues + LAM)).sum()) / N_TRAIN
    assert report.tic == pytest.approx(expected, rel=1e-9)
    assert set(report.blocks) == {
        "stderr",
        "hutchinson_estimate",
        "hutchinson_estimate_stderr",
        "hutchinson_upper",
        "hutchinson_upper_stderr",
        "hutchinson_lower",
        "hutchinson_lower_stderr",
    }


def test_sums_are_reduced_across_processes(cases):
    """An all_reduce that doubles every sum (two identical processes) changes nothing."""
    model, inputs, targets, _ = cases["cnn"]
    single, train = run(model, inputs, targets, probes=4)
    doubled, train2 = run(model, inputs, targets, probes=4, all_reduce=lambda t: t.mul_(2), rank=0)
    assert train2.count == 2 * train.count
    torch.testing.assert_close(doubled.eigenvalues, single.eigenvalues, rtol=1e-12, atol=0)
    assert doubled.summary.soft_rank == pytest.approx(single.summary.soft_rank, rel=1e-12)


def test_regression_fisher_is_estimated_without_bias(cases):
    """loss="mse": F = JᵀJ/m; the estimate (and the Eq. 8 variant, exact for Λ = I) converge."""
    model, inputs, _, _ = cases["mlp"]
    targets = torch.randn(inputs.shape[0], 10, dtype=torch.float64)
    jac = reference.per_sample_jacobians(model, inputs)
    trace = float(jac.square().sum()) / inputs.shape[0]
    estimate, sums = curvature_and_sums(
        model,
        batches(inputs, targets, 16),
        structure="hutchinson",
        lam=LAM,
        loss="mse",
        options={"probes": 128, "trace_estimator": "exact"},
    )
    assert sums.fisher_trace / sums.count == pytest.approx(trace, rel=1e-10)
    assert abs(estimate.summary.trace - trace) <= 4 * estimate.blocks["stderr"].trace
    upper = estimate.blocks["hutchinson_upper"].trace
    assert abs(upper - trace) <= 4 * estimate.blocks["hutchinson_upper_stderr"].trace
    assert estimate.blocks["hutchinson_lower"].trace < upper


def test_soft_rank_is_jackknife_corrected_so_its_error_bars_cover_its_bias(cases):
    """One probe per batch makes a big batch's probe noisy, and the soft rank of a noisy
    diagonal is biased low (concave h). On one batch of all 64 samples with 8 probes, the plain
    soft rank of the mean diagonal is several of its standard errors low; the reported,
    jackknife-corrected one is within one standard error of the exact diagonal's."""
    model, inputs, targets, exact = cases["mlp"]
    lam, seeds = 1e-2, 12
    truth = spectral_soft_rank(exact["estimate"], lam)
    corrected, plain, stderr = [], [], []
    for seed in range(seeds):
        estimate, _ = curvature_and_sums(
            model,
            batches(inputs, targets, NUM_SAMPLES),
            structure="hutchinson",
            lam=lam,
            seed=seed,
            options={"trace_estimator": "exact", "probes": 8, "bounds": False},
        )
        corrected.append(estimate.summary.soft_rank)
        plain.append(spectral_soft_rank(estimate.eigenvalues, lam))
        stderr.append(estimate.blocks["stderr"].soft_rank)
    bias_plain = sum(plain) / seeds - truth
    bias_corrected = sum(corrected) / seeds - truth
    typical_error = sum(stderr) / seeds
    assert bias_plain < -2 * typical_error  # the defect: biased low, beyond its error bars
    assert abs(bias_corrected) <= typical_error
    assert abs(bias_corrected) < 0.5 * abs(bias_plain)
