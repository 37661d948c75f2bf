"""Every structure and report field of ``measure()`` against the dense autograd reference.

Float64, tiny versions of the paper's MLP and CNN and a residual MLP; the same numbers must come
out for batch sizes 1, 7 and 64 over the same samples.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, random_data, tiny_model

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import DiagOptions, KFACOptions
from lightning_flatness.core.reading import BatchReading

LAM = 1e-3
N_TRAIN = 1000
NUM_SAMPLES = 64


def reference_values(model, inputs, targets):
    """Everything measure() reports, computed from the dense P × P definitions."""
    model = model.eval()
    fisher = reference.dense_fisher(model, inputs)
    cov = reference.dense_gradient_covariance(model, inputs, targets)
    eigenvalues = spectral.psd_eigenvalues(fisher)
    with torch.no_grad():
        logits = model(inputs)
    probs = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(targets, 10).to(probs.dtype)
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype)
    return {
        "fisher": fisher,
        "eigenvalues": eigenvalues,
        "summary": spectral.spectral_summary(eigenvalues, LAM),
        "trace_fisher": float(fisher.trace()),
        "trace_cov": float(cov.trace()),
        "tic": float(torch.trace(cov @ torch.linalg.inv(fisher + LAM * eye))) / N_TRAIN,
        "tic_diag": float((cov.diagonal() / (fisher.diagonal() + LAM)).sum()) / N_TRAIN,
        "loss": float(torch.nn.functional.cross_entropy(logits, targets).detach()),
        "error_uncertainty": float(
            (onehot - probs).square().sum(-1).mean() / (1 - probs.square().sum(-1)).mean()
        ),
        "accuracy": float((logits.argmax(-1) == targets).double().mean()),
    }


@pytest.fixture(scope="module")
def cases():
    """(model, inputs, targets, reference) per architecture, computed once."""
    result = {}
    for architecture in ("mlp", "cnn", "resmlp"):
        model = tiny_model(architecture)
        inputs, targets = random_data(NUM_SAMPLES)
        result[architecture] = (model, inputs, targets, reference_values(model, inputs, targets))
    return result


def assert_summary_matches(report, summary, rel=1e-7):
    assert report.soft_rank == pytest.approx(summary.soft_rank, rel=rel)
    assert report.soft_rank2 == pytest.approx(summary.soft_rank2, rel=rel)
    assert report.logdet == pytest.approx(summary.logdet, rel=rel)
    assert report.max_eig == pytest.approx(summary.max_eig, rel=rel)


@pytest.mark.parametrize("structure", ["dense", "gram"])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_exact_structures_match_reference(cases, architecture, structure, batch_size):
    model, inputs, targets, ref = cases[architecture]
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=structure,
    )
    assert report.num_samples == NUM_SAMPLES
    assert_summary_matches(report, ref["summary"])
    assert report.trace_fisher == pytest.approx(ref["trace_fisher"], rel=1e-9)
    assert report.trace_cov == pytest.approx(ref["trace_cov"], rel=1e-9)
    assert report.tic == pytest.approx(ref["tic"], rel=1e-6)
    assert report.train_nll == pytest.approx(ref["loss"], rel=1e-10)
    assert report.train_accuracy == pytest.approx(ref["accuracy"])
    assert report.error_uncertainty_train == pytest.approx(ref["error_uncertainty"], rel=1e-10)
    ratio = ref["trace_cov"] / ref["trace_fisher"]
    assert report.trace_ratio_train == pytest.approx(ratio, rel=1e-9)
    assert report.thomas_gap == pytest.approx(ratio / N_TRAIN, rel=1e-9)
    rank = ref["summary"].soft_rank
    assert report.predicted_gap_train == pytest.approx(ratio * rank / N_TRAIN, rel=1e-7)
    # No validation data: validation fields and the held-out prediction are undefined, and the
    # headline reads the training ratio (and says so).
    assert math.isnan(report.val_nll) and math.isnan(report.trace_ratio_val)
    assert math.isnan(report.predicted_gap_val)
    assert report.predicted_gap == pytest.approx(ratio * rank / (N_TRAIN + rank), rel=1e-7)
    assert report.predicted_gap_held_out == 0.0
    assert report.predicted_test_nll == pytest.approx(ref["loss"] + report.predicted_gap)


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_diagonal_matches_reference_diagonal(cases, architecture, batch_size):
    model, inputs, targets, ref = cases[architecture]
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure="diag",
    )
    diag = ref["fisher"].diagonal()
    assert_summary_matches(report, spectral.spectral_summary(diag, LAM))
    assert report.trace_fisher == pytest.approx(ref["trace_fisher"], rel=1e-9)
    assert report.tic == pytest.approx(ref["tic_diag"], rel=1e-7)
    assert torch.allclose(report.eigenvalues, diag, rtol=1e-8, atol=1e-14)


def _kfac_reference_blocks(model, inputs):
    """Exact per-layer KFAC factors from autograd: A = mean a aᵀ, G = mean Σ_c s_c s_cᵀ.

    For Linear layers ``s_c`` is the gradient of ``√p_c log p_c`` w.r.t. the layer output.
    """
    captured = {}

    def hook(module, args, output):
        output.retain_grad()
        captured[module] = (args[0].detach(), output)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_hook(hook) for m in linears]
    factors = {m: [0.0, 0.0] for m in linears}
    try:
        for x in inputs:
            log_probs = torch.log_softmax(model(x.unsqueeze(0)), -1).squeeze(0)
            probs = log_probs.exp().detach()
            for c in range(10):
                model.zero_grad()
                for _, out in captured.values():
                    out.grad = None
                (probs[c].sqrt() * log_probs[c]).backward(retain_graph=True)
                for module, (_, out) in captured.items():
                    s = out.grad.reshape(-1)
                    factors[module][0] = factors[module][0] + torch.outer(s, s)
            for module, (a, _) in captured.items():
                a = a.reshape(-1)
                factors[module][1] = factors[module][1] + torch.outer(a, a)
    finally:
        for handle in handles:
            handle.remove()
    m = inputs.shape[0]
    return {module: (g / m, a / m) for module, (g, a) in factors.items()}


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_kfac_matches_autograd_kronecker_factors(cases, batch_size):
    model, inputs, targets, _ = cases["mlp"]
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure="kfac",
    )
    expected = spectral.SpectralSummary(0.0, 0.0, 0.0, 0.0, 0.0)
    for g, a in _kfac_reference_blocks(model.eval(), inputs[:NUM_SAMPLES]).values():
        g_eigs, a_eigs = spectral.psd_eigenvalues(g), spectral.psd_eigenvalues(a)
        expected = expected + spectral.kron_summary([g_eigs, a_eigs], LAM)  # weight
        expected = expected + spectral.spectral_summary(g_eigs, LAM)  # bias: G alone
    assert_summary_matches(report, expected, rel=1e-7)


@pytest.mark.parametrize(
    ("architecture", "exact_blocks"),
    [
        ("mlp", ["1.weight", "1.bias", "3.weight", "3.bias"]),
        # biases, and the class convolution whose output is a single position (KFC's 1/T = 1)
        ("cnn", ["0.bias", "2.bias", "4.weight", "4.bias"]),
    ],
)
def test_kfac_is_exact_per_layer_for_one_sample(cases, architecture, exact_blocks):
    model, inputs, targets, _ = cases[architecture]
    x, y = inputs[:1], targets[:1]
    fisher = reference.dense_fisher(model.eval(), x)
    report = measure(model, [(x, y)], lam=LAM, num_train_samples=N_TRAIN, structure="kfac")
    slices = dict(reference.parameter_blocks(model))
    for name in exact_blocks:
        block = fisher[slices[name], slices[name]]
        expected = spectral.spectral_summary(spectral.psd_eigenvalues(block), LAM)
        assert report.blocks[name].soft_rank == pytest.approx(expected.soft_rank, rel=1e-7)
        assert report.blocks[name].trace == pytest.approx(expected.trace, rel=1e-9)


def test_kfac_convolution_trace_is_normalised_per_output_position(cases):
    """KFC (Grosse & Martens 2016): without the 1/T factor the trace of a convolution block is
    off by about T; with it, it is within a factor 2 of the exact block trace."""
    model, inputs, targets, ref = cases["cnn"]
    report = measure(
        model, [(inputs, targets)], lam=LAM, num_train_samples=N_TRAIN, structure="kfac"
    )
    slices = dict(reference.parameter_blocks(model))
    for name in ("0.weight", "2.weight"):  # 25 and 9 output positions
        exact = float(ref["fisher"][slices[name], slices[name]].trace())
        assert 0.5 < report.blocks[name].trace / exact < 2.0


def test_pinching_inequalities(cases, architecture):
    """Prop. 6.1: rank_λ(diag F) ≥ rank_λ(per-layer blocks of F) ≥ rank_λ(F)."""
    model, inputs, targets, ref = cases[architecture]
    fisher = ref["fisher"]
    block = sum(
        spectral.soft_rank(spectral.psd_eigenvalues(fisher[sl, sl]), LAM)
        for _, sl in reference.parameter_blocks(model)
    )
    data = batches(inputs, targets, 16)
    diag = measure(model, data, lam=LAM, num_train_samples=N_TRAIN, structure="diag")
    full = measure(model, data, lam=LAM, num_train_samples=N_TRAIN, structure="gram")
    assert diag.soft_rank >= block - 1e-9
    assert block >= full.soft_rank - 1e-9
    assert diag.soft_rank > full.soft_rank  # strict on a generic model


def test_validation_fields_and_predicted_gap(cases):
    model, inputs, targets, ref = cases["mlp"]
    val_inputs, val_targets = random_data(40, seed=7)
    val_ref = reference_values(model, val_inputs, val_targets)
    report = measure(
        model,
        batches(inputs, targets, 10),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure="gram",
        val_batches=batches(val_inputs, val_targets, 9),
    )
    val_ratio = val_ref["trace_cov"] / val_ref["trace_fisher"]
    assert report.num_val_samples == 40
    assert report.val_nll == pytest.approx(val_ref["loss"], rel=1e-10)
    assert report.val_accuracy == pytest.approx(val_ref["accuracy"])
    assert report.trace_ratio_val == pytest.approx(val_ratio, rel=1e-9)
    assert report.error_uncertainty_val == pytest.approx(val_ref["error_uncertainty"], rel=1e-10)
    assert report.observed_gap == pytest.approx(val_ref["loss"] - ref["loss"], rel=1e-9)
    # Eq. (13) with the held-out trace ratio and the training soft rank, and with the training
    # ratio; the headline: the held-out ratio times rank / (n + rank).
    rank = ref["summary"].soft_rank
    assert report.predicted_gap_val == pytest.approx(val_ratio * rank / N_TRAIN, rel=1e-7)
    train_ratio = ref["trace_cov"] / ref["trace_fisher"]
    assert report.predicted_gap_train == pytest.approx(train_ratio * rank / N_TRAIN, rel=1e-7)
    assert report.predicted_gap == pytest.approx(val_ratio * rank / (N_TRAIN + rank), rel=1e-7)
    assert report.predicted_gap_held_out == 1.0
    assert report.predicted_test_nll == pytest.approx(
        ref["loss"] + val_ratio * rank / (N_TRAIN + rank), rel=1e-7
    )


@pytest.mark.parametrize("structure", ["probe_kernel", "kfac", "gram", "cg"])
def test_observed_gap_stderr_is_the_two_means_sampling_error(cases, structure):
    """√(s²_train/m + s²_val/m_val) of the per-sample NLLs, whatever the batch size."""
    model, inputs, targets, _ = cases["mlp"]
    val_inputs, val_targets = random_data(40, seed=7)
    with torch.no_grad():
        train_nll = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
        val_nll = torch.nn.functional.cross_entropy(
            model(val_inputs), val_targets, reduction="none"
        )
    expected = math.sqrt(train_nll.var() / train_nll.numel() + val_nll.var() / val_nll.numel())
    for train_batch, val_batch in ((10, 9), (NUM_SAMPLES, 40), (1, 3)):
        report = measure(
            model,
            batches(inputs, targets, train_batch),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure=structure,
            val_batches=batches(val_inputs, val_targets, val_batch),
        )
        assert report.observed_gap_stderr == pytest.approx(expected, rel=1e-9)
    without_val = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=N_TRAIN)
    assert math.isnan(without_val.observed_gap_stderr)


def test_relative_flatness_matches_hessian_definition(cases):
    """κ = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr(H_{s,s'}) with H the last layer's exact Fisher block."""
    model, inputs, targets, ref = cases["mlp"]
    name, sl = reference.parameter_blocks(model)[-2]  # last weight, (C × d), rows s
    weight = dict(model.named_parameters())[name].detach()
    classes, width = weight.shape
    block = ref["fisher"][sl, sl].reshape(classes, width, classes, width)
    traces = torch.einsum("sjtj->st", block)
    expected = float(((weight @ weight.T) * traces).sum())
    report = measure(model, batches(inputs, targets, 5), lam=LAM, num_train_samples=N_TRAIN)
    assert report.relative_flatness == pytest.approx(expected, rel=1e-9)


def test_relative_flatness_is_nan_without_a_linear_class_layer(cases):
    model, inputs, targets, _ = cases["cnn"]
    report = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=N_TRAIN)
    assert math.isnan(report.relative_flatness)


def test_sampled_diagonal_and_trace_converge_to_exact(cases):
    """DiagGGNMC / the sampled trace are unbiased: the mean over seeds approaches the exact
    values within a few standard errors, and the error shrinks with more draws."""
    model, inputs, targets, ref = cases["mlp"]
    data = batches(inputs, targets, 32)
    draws = [
        measure(
            model,
            data,
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure=DiagOptions(sampled=True, trace_estimator="sampled"),
            seed=seed,
        )
        for seed in range(40)
    ]
    traces = torch.tensor([d.trace_fisher for d in draws])
    stderr = float(traces.std() / math.sqrt(len(draws)))
    assert abs(float(traces.mean()) - ref["trace_fisher"]) < 4 * stderr
    diags = torch.stack([d.eigenvalues for d in draws])
    exact = ref["fisher"].diagonal()
    few = (diags[:4].mean(0) - exact).norm()
    many = (diags.mean(0) - exact).norm()
    assert many < few
    assert many / exact.norm() < 0.1


def test_sampled_kfac_converges_to_exact_kfac(cases):
    model, inputs, targets, _ = cases["mlp"]
    data = batches(inputs, targets, 32)
    exact = measure(model, data, lam=LAM, num_train_samples=N_TRAIN, structure="kfac")
    one = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=KFACOptions(kfac_mode="sampled"),
    )
    many = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=KFACOptions(kfac_mode="sampled", mc_samples=200),
    )
    assert abs(many.logdet - exact.logdet) < abs(one.logdet - exact.logdet)
    assert many.logdet == pytest.approx(exact.logdet, rel=0.05)


def test_max_samples_truncates_the_stream(cases):
    model, inputs, targets, _ = cases["mlp"]
    report = measure(
        model, batches(inputs, targets, 7), lam=LAM, num_train_samples=N_TRAIN, max_samples=20
    )
    truncated = measure(model, [(inputs[:20], targets[:20])], lam=LAM, num_train_samples=N_TRAIN)
    assert report.num_samples == 20
    assert report.soft_rank == pytest.approx(truncated.soft_rank, rel=1e-10)


def test_regression_fisher_is_jacobian_gram(cases):
    """Gaussian regression (loss="mse"): F = (1/m) Σ J_iᵀ J_i and losses ½‖y − f‖²."""
    model, inputs, _, _ = cases["mlp"]
    targets = torch.randn(inputs.shape[0], 10, dtype=torch.float64)
    flat = reference.per_sample_jacobians(model, inputs)
    fisher = torch.einsum("ncp,ncq->pq", flat, flat) / inputs.shape[0]
    residual = model(inputs) - targets
    report = measure(
        model,
        batches(inputs, targets, 8),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure="gram",
        reading=BatchReading(loss="mse"),
    )
    assert report.soft_rank == pytest.approx(
        spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM), rel=1e-7
    )
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    grads = torch.einsum("ncp,nc->np", flat, residual.detach())
    assert report.trace_cov == pytest.approx(float(grads.square().sum(1).mean()), rel=1e-9)
    assert report.train_nll == pytest.approx(float(0.5 * residual.square().sum(1).mean()))
    assert math.isnan(report.error_uncertainty_train)


def test_as_dict_has_every_documented_field(cases):
    model, inputs, targets, _ = cases["mlp"]
    report = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=N_TRAIN)
    values = report.as_dict()
    required = {
        *("soft_rank", "soft_rank2", "logdet", "trace_fisher", "max_eig", "trace_cov"),
        *("trace_ratio_train", "trace_ratio_val", "predicted_gap", "predicted_gap_val"),
        *("predicted_gap_train", "predicted_gap_held_out", "predicted_test_nll"),
        *("thomas_gap", "tic", "train_nll", "val_nll", "observed_gap", "relative_flatness"),
        "observed_gap_stderr",
        *("error_uncertainty_train", "error_uncertainty_val", "num_samples", "lam", "structure"),
        *("rank_bound", "soft_rank_stderr", "trusted"),
    }
    assert required <= set(values)
    assert values["structure"] == "probe_kernel"  # the default where it fits
    assert values["rank_bound"] == min(sum(p.numel() for p in model.parameters()), 64 * 9)
    assert all(isinstance(v, float) for k, v in values.items() if k != "structure")
