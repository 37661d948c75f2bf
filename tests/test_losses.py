"""``loss="bce"`` and ``loss="mse"`` in every structure, against the dense float64 reference.

The reference writes each likelihood's closed form out by itself (``reference.py``), so these
tests check :mod:`lightning_flatness.core.likelihoods`, the BackPACK multi-output BCE derivatives
and the torch.func path at once, at several batch sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, random_data, tiny_model

from lightning_flatness import BatchReading, DiagOptions, MatrixFreeOptions, measure
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.likelihoods import TargetError, get_likelihood

LAM = 1e-3
N_TRAIN = 1000
NUM_SAMPLES = 40


def _targets(loss: str, outputs: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if loss == "bce":  # multi-hot, or one 0/1 label per sample for a single logit
        return (torch.rand(NUM_SAMPLES, outputs, generator=generator) < 0.3).double()
    return torch.randn(NUM_SAMPLES, outputs, generator=generator, dtype=torch.float64)


def _model(architecture: str, outputs: int) -> torch.nn.Module:
    model = tiny_model(architecture)
    if outputs != 10:  # replace the class layer
        last = model[-1]
        if isinstance(last, torch.nn.Linear):
            model[-1] = torch.nn.Linear(last.in_features, outputs).double()
        else:
            model = torch.nn.Sequential(model, torch.nn.Linear(10, outputs).double())
    return model.eval()


CASES = [
    ("mlp", "bce", 10),  # multi-label
    ("mlp", "bce", 1),  # binary, one logit
    ("cnn", "bce", 10),
    ("mlp", "mse", 3),
]


@pytest.fixture(scope="module")
def cases():
    result = {}
    for architecture, loss, outputs in CASES:
        model = _model(architecture, outputs)
        inputs, _ = random_data(NUM_SAMPLES)
        targets = _targets(loss, outputs)
        if outputs == 1 and loss == "bce":
            targets = targets.reshape(-1)  # (B,) labels for a (B, 1) output are accepted
        fisher = reference.dense_fisher(model, inputs, loss)
        cov = reference.dense_gradient_covariance(
            model, inputs, targets.reshape(NUM_SAMPLES, -1), loss
        )
        with torch.no_grad():
            logits = model(inputs)
        result[(architecture, loss, outputs)] = (model, inputs, targets, fisher, cov, logits)
    return result


def _closed_form_statistics(loss, logits, targets):
    targets = targets.reshape(logits.shape)
    if loss == "bce":
        sigma = torch.sigmoid(logits)
        nll = -(targets * sigma.log() + (1 - targets) * (1 - sigma).log()).sum(-1).mean()
        accuracy = ((logits > 0).double() == targets).double().mean()
        ratio = (targets - sigma).square().sum() / (sigma * (1 - sigma)).sum()
        return float(nll), float(accuracy), float(ratio)
    nll = 0.5 * (targets - logits).square().sum(-1).mean()
    return float(nll), math.nan, math.nan


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("structure", ["dense", "gram"])
@pytest.mark.parametrize("batch_size", [1, 7, NUM_SAMPLES])
def test_exact_structures_match_reference(cases, case, structure, batch_size):
    model, inputs, targets, fisher, cov, logits = cases[case]
    loss = case[1]
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=structure,
        reading=BatchReading(loss=loss),
    )
    expected = spectral.spectral_summary(spectral.psd_eigenvalues(fisher), LAM)
    assert report.soft_rank == pytest.approx(expected.soft_rank, rel=1e-8)
    assert report.logdet == pytest.approx(expected.logdet, rel=1e-8)
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-10)
    assert report.trace_cov == pytest.approx(float(cov.trace()), rel=1e-10)
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype)
    tic = float(torch.trace(cov @ torch.linalg.inv(fisher + LAM * eye))) / N_TRAIN
    assert report.tic == pytest.approx(tic, rel=1e-7)
    nll, accuracy, ratio = _closed_form_statistics(loss, logits, targets)
    assert report.train_nll == pytest.approx(nll, rel=1e-10)
    if loss == "mse":  # nothing accuracy-like means anything for a regressor
        assert math.isnan(report.train_accuracy) and math.isnan(report.error_uncertainty_train)
    else:
        assert report.train_accuracy == pytest.approx(accuracy, rel=1e-12)
        assert report.error_uncertainty_train == pytest.approx(ratio, rel=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("batch_size", [1, 7])
def test_diagonal_and_matrix_free_traces_match_reference(cases, case, batch_size):
    model, inputs, targets, fisher, cov, _ = cases[case]
    data = batches(inputs, targets, batch_size)
    kwargs = {"lam": LAM, "num_train_samples": N_TRAIN, "reading": BatchReading(loss=case[1])}
    diag = measure(model, data, structure="diag", **kwargs)
    expected = spectral.spectral_summary(fisher.diagonal().clamp_min(0), LAM)
    assert diag.soft_rank == pytest.approx(expected.soft_rank, rel=1e-8)
    tic_diag = float((cov.diagonal() / (fisher.diagonal() + LAM)).sum()) / N_TRAIN
    assert diag.tic == pytest.approx(tic_diag, rel=1e-8)
    for structure in ("lanczos", "hutchinson"):
        options = MatrixFreeOptions(structure=structure, trace_estimator="exact")
        report = measure(model, data, structure=options, **kwargs)
        assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-10)
        assert report.trace_cov == pytest.approx(float(cov.trace()), rel=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_lanczos_soft_rank_within_its_error_bars(cases, case):
    model, inputs, targets, fisher, _, _ = cases[case]
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    report = measure(
        model,
        batches(inputs, targets, 16),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(structure="lanczos", probes=20, lanczos_steps=30),
        reading=BatchReading(loss=case[1]),
    )
    stderr = report.as_dict()["soft_rank_stderr"]
    assert abs(report.soft_rank - exact) <= 4 * stderr + 1e-6 * exact


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=lambda c: "-".join(map(str, c)))
def test_kfac_is_exact_per_layer_for_one_sample(cases, case):
    """One sample: every Linear block of KFAC is the exact block ``G ⊗ aaᵀ`` of the Fisher."""
    model, inputs, targets, *_ = cases[case]
    x, y = inputs[:1], targets[:1]
    fisher = reference.dense_fisher(model, x, case[1])
    report = measure(
        model,
        [(x, y)],
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure="kfac",
        reading=BatchReading(loss=case[1]),
    )
    for name, block in reference.parameter_blocks(model):
        expected = spectral.spectral_summary(spectral.psd_eigenvalues(fisher[block, block]), LAM)
        assert report.blocks[name].soft_rank == pytest.approx(expected.soft_rank, rel=1e-7)
        assert report.blocks[name].trace == pytest.approx(expected.trace, rel=1e-9)


@pytest.mark.parametrize("outputs", [10, 1])
def test_sampled_structures_converge_for_bce(cases, outputs):
    """diag_mc and the sampled Tr(F) draw Bernoulli labels (one per output, also for a single
    logit): unbiased, error ~ 1/√(samples)."""
    model, inputs, targets, fisher, _, _ = cases[("mlp", "bce", outputs)]
    many = inputs.repeat(50, 1, 1, 1)
    report = measure(
        model,
        [(many, targets.repeat(50, *[1] * (targets.dim() - 1)))],
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=DiagOptions(sampled=True, trace_estimator="sampled"),
        reading=BatchReading(loss="bce"),
    )
    exact = float(fisher.trace())
    assert report.trace_fisher == pytest.approx(exact, rel=0.05)
    expected = spectral.spectral_summary(fisher.diagonal(), LAM).trace
    assert float(report.eigenvalues.sum()) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    ("loss", "targets", "match"),
    [
        ("cross_entropy", torch.zeros(8, 10), "pass loss='bce'"),
        ("cross_entropy", torch.zeros(8), "loss='mse'"),
        ("cross_entropy", torch.full((8,), 12), r"\[0, 10\)"),
        ("bce", torch.zeros(8, dtype=torch.long), "cross_entropy"),
        ("bce", torch.full((8, 10), 2.0), r"\[0, 1\]"),
        ("mse", torch.zeros(8, 4), "shaped like the outputs"),
    ],
)
def test_targets_that_do_not_fit_the_loss_name_the_fix(loss, targets, match):
    model = tiny_model("mlp")
    inputs, _ = random_data(8)
    with pytest.raises(TargetError, match=match):
        measure(
            model,
            [(inputs, targets)],
            lam=LAM,
            num_train_samples=N_TRAIN,
            reading=BatchReading(loss=loss),
        )


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss` must be one of"):
        BatchReading(loss="hinge")


@pytest.mark.parametrize("loss", ["cross_entropy", "bce", "mse"])
def test_weight_traces_equal_the_dense_output_fisher_form(loss):
    """Tr(Wᵀ Λ_i W) without Λ_i (relative flatness at a thousand classes) equals the dense form."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    weight = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    likelihood = get_likelihood(loss)
    dense = torch.einsum("ab,nab->n", weight @ weight.T, likelihood.fisher_matrices(logits))
    torch.testing.assert_close(likelihood.weight_traces(logits, weight), dense)
