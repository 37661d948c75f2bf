"""Trace functions of eigenvalues and of Kronecker factors: closed forms, limits, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_flatness.core import spectral
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS, trace_function

eigenvalue_lists = st.lists(
    st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=1, max_size=30
)
lams = st.floats(min_value=1e-6, max_value=1e3)


def test_closed_forms_on_a_known_spectrum():
    mu = torch.tensor([0.0, 1.0, 3.0])
    assert spectral.soft_rank(mu, 1.0) == pytest.approx(0.5 + 0.75)
    assert spectral.soft_rank2(mu, 1.0) == pytest.approx(0.25 + 0.5625)
    assert spectral.logdet_complexity(mu, 1.0) == pytest.approx(0.5 * (math.log(2) + math.log(4)))
    assert spectral.trace(mu) == 4.0
    assert spectral.max_eig(mu) == 3.0


def test_soft_rank_equals_matrix_definition():
    generator = torch.Generator().manual_seed(0)
    root = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    fisher = root.T @ root  # rank 6, 9 × 9
    lam = 0.3
    definition = torch.trace(
        fisher @ torch.linalg.inv(fisher + lam * torch.eye(9, dtype=torch.float64))
    )
    eigenvalues = torch.linalg.eigvalsh(fisher)
    assert spectral.soft_rank(eigenvalues, lam) == pytest.approx(float(definition), rel=1e-10)
    logdet = 0.5 * torch.logdet(torch.eye(9, dtype=torch.float64) + fisher / lam)
    assert spectral.logdet_complexity(eigenvalues, lam) == pytest.approx(float(logdet), rel=1e-10)


def test_limits_in_lambda():
    mu = torch.tensor([0.0, 0.0, 1e-3, 2.0, 50.0])
    assert spectral.soft_rank(mu, 1e-12) == pytest.approx(3.0, abs=1e-6)  # λ → 0: the rank
    assert spectral.soft_rank(mu, 1e12) == pytest.approx(0.0, abs=1e-9)  # λ → ∞: zero


@settings(max_examples=60, deadline=None)
@given(eigenvalue_lists, lams, lams)
def test_monotone_decreasing_in_lambda_and_bounded(values, lam_a, lam_b):
    mu = torch.tensor(values, dtype=torch.float64)
    low, high = sorted((lam_a, lam_b))
    for fn in (spectral.soft_rank, spectral.soft_rank2, spectral.logdet_complexity):
        assert fn(mu, low) >= fn(mu, high) - 1e-9
    rank = spectral.soft_rank(mu, low)
    assert 0.0 <= spectral.soft_rank2(mu, low) <= rank + 1e-12
    assert rank <= int((mu > 0).sum()) + 1e-9


@settings(max_examples=40, deadline=None)
@given(eigenvalue_lists, eigenvalue_lists, lams)
def test_kronecker_summary_equals_summary_of_the_product(a_values, g_values, lam):
    a = torch.tensor(a_values, dtype=torch.float64)
    g = torch.tensor(g_values, dtype=torch.float64)
    product = torch.linalg.eigvalsh(torch.kron(torch.diag(g), torch.diag(a)))
    expected = spectral.spectral_summary(product, lam)
    got = spectral.kron_summary([g, a], lam)
    for name in ("soft_rank", "soft_rank2", "logdet", "trace", "max_eig"):
        assert getattr(got, name) == pytest.approx(getattr(expected, name), rel=1e-9, abs=1e-9)


def test_kronecker_summary_of_dense_factors_in_small_chunks():
    generator = torch.Generator().manual_seed(3)
    a_root = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    g_root = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    a, g = a_root @ a_root.T, g_root @ g_root.T
    full = torch.linalg.eigvalsh(torch.kron(g, a))
    factors = [torch.linalg.eigvalsh(g), torch.linalg.eigvalsh(a)]
    chunked = spectral._kron_reduce(factors, lambda mu: mu / (mu + 0.7), chunk=3)
    assert chunked == pytest.approx(spectral.soft_rank(full, 0.7), rel=1e-10)
    assert spectral.kron_eigenvalues(factors).sort().values == pytest.approx(
        full.clamp_min(0).sort().values, abs=1e-9
    )


def test_block_summaries_add_up():
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([5.0])
    combined = spectral.spectral_summary(first, 1.0) + spectral.spectral_summary(second, 1.0)
    whole = spectral.spectral_summary(torch.cat([first, second]), 1.0)
    for name in ("soft_rank", "soft_rank2", "logdet", "trace", "max_eig"):
        assert getattr(combined, name) == pytest.approx(getattr(whole, name))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_lambda_must_be_positive(bad):
    with pytest.raises(ValueError, match="lam="):
        spectral.soft_rank(torch.ones(3), bad)


def test_negative_roundoff_is_clamped_and_nan_is_refused():
    assert spectral.soft_rank(torch.tensor([-1e-12, 1.0]), 1.0) == pytest.approx(0.5)
    with pytest.raises(FloatingPointError, match="NaN"):
        spectral.soft_rank(torch.tensor([math.nan]), 1.0)


def test_psd_eigenvalues_of_rank_deficient_matrix():
    generator = torch.Generator().manual_seed(4)
    root = torch.randn(40, 25, generator=generator, dtype=torch.float64)
    matrix = root @ root.T  # 40 × 40 of rank 25
    expected = torch.linalg.svdvals(root).square()
    got = spectral.psd_eigenvalues(matrix)
    assert got.shape == (40,)
    assert torch.allclose(got[-25:].sort().values, expected.sort().values, rtol=1e-9, atol=1e-9)
    assert got[:15].abs().max() < 1e-9 * float(expected.max())


# ------------------------------------------------------------------ the trace-function registry


@pytest.mark.parametrize("name", list(TRACE_FUNCTIONS))
def test_each_trace_function_is_consistent_in_every_form(name):
    """``h(0) = 0``, ``h'`` is the derivative of ``h``, and ``h/μ`` has the limit ``h'(0)``."""
    h, lam = TRACE_FUNCTIONS[name], 0.3
    mu = torch.tensor([0.0, 1e-320, 1e-6, 0.2, 3.0, 40.0], dtype=torch.float64)
    assert float(h.value(mu[:1], lam)) == 0.0
    points = mu[2:].clone().requires_grad_(True)
    (autograd,) = torch.autograd.grad(h.value(points, lam).sum(), points)
    torch.testing.assert_close(h.derivative(points.detach(), lam), autograd)
    torch.testing.assert_close(h.over_mu(mu[2:], lam) * mu[2:], h.value(mu[2:], lam))
    limit = h.derivative(torch.zeros(1, dtype=torch.float64), lam)
    torch.testing.assert_close(h.over_mu(mu[:2], lam), limit.expand(2))


@pytest.mark.parametrize("name", [n for n, h in TRACE_FUNCTIONS.items() if h.kernel])
def test_kernel_form_is_the_trace_function_of_the_kernel_and_its_gradient(name):
    """From ``A = I + (s/λ)G``: value ``Σ h(eig(sG))`` and ``∂/∂G = c · gradient(A⁻¹)``."""
    h, lam, scale = TRACE_FUNCTIONS[name], 0.05, 0.25
    rows = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gram = (rows @ rows.T).requires_grad_(True)
    exact = h.value(torch.linalg.eigvalsh(scale * gram).clamp_min(0.0), lam).sum()
    (expected_gradient,) = torch.autograd.grad(exact, gram)
    system = torch.eye(5, dtype=torch.float64) + (scale / lam) * gram.detach()
    factor = torch.linalg.cholesky(system)
    inverse = torch.cholesky_inverse(factor)
    torch.testing.assert_close(h.kernel.value(factor, inverse), exact.detach())
    torch.testing.assert_close((scale / lam) * h.kernel.gradient(inverse), expected_gradient)


def test_unknown_trace_function_names_the_known_ones():
    with pytest.raises(ValueError, match="soft_rank"):
        trace_function("rank")
    assert trace_function("logdet") is TRACE_FUNCTIONS["logdet"]


@pytest.mark.parametrize("lam", [1e-5, 1e-3, 1.0])
def test_cholesky_summary_matches_the_eigenvalues(lam):
    """Soft rank, rank⁽²⁾, log-det and trace of a rank-deficient PSD matrix, without its
    spectrum, equal the eigenvalue formulas."""
    generator = torch.Generator().manual_seed(0)
    scale = torch.rand(60, generator=generator, dtype=torch.float64) ** 3
    rows = torch.randn(40, 60, generator=generator, dtype=torch.float64) * scale
    matrix = rows.T @ rows / 40
    got = spectral.cholesky_summary(matrix, lam)
    want = spectral.spectral_summary(spectral.psd_eigenvalues(matrix), lam)
    for field in ("soft_rank", "soft_rank2", "logdet", "trace"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9), field
    assert math.isnan(got.max_eig)


def test_float32_factorisations_only_where_they_are_accurate():
    """float32 is chosen for a float32 measurement whose Tr(M)/λ is at most 1e7, and then its
    soft rank, rank⁽²⁾ and log-det agree with float64's to 1e-4 on an ill-conditioned matrix."""
    assert spectral.factorisation_dtype(10.0, 1e-5, torch.float32) == torch.float32
    assert spectral.factorisation_dtype(10.0, 1e-7, torch.float32) == torch.float64
    assert spectral.factorisation_dtype(10.0, 1e-5, torch.float64) == torch.float64
    assert spectral.factorisation_dtype(math.nan, 1e-5, torch.float32) == torch.float64
    generator = torch.Generator().manual_seed(0)
    scale = torch.logspace(0, -6, 300, dtype=torch.float64)
    rows = torch.randn(500, 300, generator=generator, dtype=torch.float64) * scale
    matrix = rows.T @ rows / 500
    lam = float(matrix.diagonal().sum()) / 1e6
    eigen = spectral.spectral_summary(spectral.psd_eigenvalues(matrix), lam)
    eigen32 = spectral.spectral_summary(spectral.psd_eigenvalues(matrix, torch.float32), lam)
    cholesky = spectral.cholesky_summary(matrix, lam)
    cholesky32 = spectral.cholesky_summary(matrix, lam, torch.float32)
    for field in ("soft_rank", "soft_rank2", "logdet", "trace"):
        assert getattr(eigen32, field) == pytest.approx(getattr(eigen, field), rel=1e-4), field
        assert getattr(cholesky32, field) == pytest.approx(getattr(cholesky, field), rel=1e-4)
    assert eigen32.max_eig == pytest.approx(eigen.max_eig, rel=1e-5)
