"""Per-group weight decay: Tr(F(F+D)⁻¹) with D = diag(λ_j), against the dense reference."""

from __future__ import annotations

import pytest
import torch
from conftest import batches, quiet_trainer, random_data, tiny_model

from lightning_flatness import (
    FlatnessClassifier,
    FlatnessMonitor,
    KernelOptions,
    MatrixFreeOptions,
    MNIST7DataModule,
    measure,
)
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.trainer_facts import resolve_lam
from lightning_flatness.regularizer import PenaltyOptions

LAM = 1e-2


def _decays(model, bias_decay: float) -> dict[str, float]:
    """λ on weights, ``bias_decay`` on biases (the usual no-decay group when 0)."""
    return {
        name: (bias_decay if name.endswith("bias") else LAM) for name, p in model.named_parameters()
    }


def _damping(model, decays: dict[str, float]) -> torch.Tensor:
    """D: each parameter entry's λ_j (a zero-decay group at its measured floor), float64."""
    names, sizes = zip(*((name, p.numel()) for name, p in model.named_parameters()), strict=True)
    return ParameterDecay(decays).diagonal(list(names), list(sizes))


def _exact(model, inputs, decays: dict[str, float]) -> spectral.SpectralSummary:
    """Tr(F(F+D)⁻¹) as the λ = 1 summary of D^{-1/2} F D^{-1/2} (dense, float64)."""
    fisher = reference.dense_fisher(model, inputs)
    scale = _damping(model, decays).rsqrt()
    whitened = scale[:, None] * fisher * scale[None, :]
    return spectral.spectral_summary(spectral.psd_eigenvalues(whitened), 1.0)


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
@pytest.mark.parametrize("bias_decay", [0.0, 1e-3])
@pytest.mark.parametrize("batch_size", [1, 7])
def test_probe_kernel_exact_rows_give_the_generalised_soft_rank(
    architecture, bias_decay, batch_size, one_thread
):
    model = tiny_model(architecture)
    inputs, targets = random_data(24)
    decays = _decays(model, bias_decay)
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=decays,
        num_train_samples=100,
        structure=KernelOptions(probes=10, groups=1),  # 10 classes: the exact rows
    )
    expected = _exact(model, inputs, decays)
    assert report.soft_rank == pytest.approx(expected.soft_rank, rel=1e-7)
    assert report.logdet == pytest.approx(expected.logdet, rel=1e-7)
    assert report.lam == LAM


def test_diag_is_the_exact_generalised_diagonal_soft_rank(one_thread):
    model = tiny_model("mlp")
    inputs, targets = random_data(20)
    decays = _decays(model, 1e-4)
    report = measure(
        model, batches(inputs, targets, 6), lam=decays, num_train_samples=100, structure="diag"
    )
    diagonal = reference.dense_fisher(model, inputs).diagonal()
    lam = torch.cat(
        [
            torch.full((p.numel(),), decays[n], dtype=torch.float64)
            for n, p in model.named_parameters()
        ]
    )
    assert report.soft_rank == pytest.approx(float((diagonal / (diagonal + lam)).sum()), rel=1e-9)


def test_kfac_blocks_use_their_own_decay(one_thread):
    """The exact bias blocks of kfac at their group's λ, against the dense blocks."""
    model = tiny_model("mlp")
    inputs, targets = random_data(20)
    decays = _decays(model, 1e-4)
    report = measure(
        model, batches(inputs, targets, 5), lam=decays, num_train_samples=100, structure="kfac"
    )
    fisher = reference.dense_fisher(model, inputs)
    start = 0
    for name, param in model.named_parameters():
        block = fisher[start : start + param.numel(), start : start + param.numel()]
        start += param.numel()
        if name.endswith("bias"):
            expected = spectral.soft_rank(spectral.psd_eigenvalues(block), decays[name])
            assert report.blocks[name].soft_rank == pytest.approx(expected, rel=1e-8), name


@pytest.mark.parametrize("structure", ["dense", "gram"])
@pytest.mark.parametrize("bias_decay", [0.0, 1e-3])
@pytest.mark.parametrize("batch_size", [1, 7])
def test_backpack_structures_give_the_generalised_soft_rank(structure, bias_decay, batch_size):
    """dense and gram scale BackPACK's rows and gradients by λ_j^{-1/2}: the exact
    Tr(F(F+D)⁻¹), log-det and TIC trace Tr(C(F+D)⁻¹)."""
    model = tiny_model("cnn")
    inputs, targets = random_data(12)
    decays = _decays(model, bias_decay)
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=decays,
        num_train_samples=100,
        structure=structure,
    )
    expected = _exact(model, inputs, decays)
    assert report.soft_rank == pytest.approx(expected.soft_rank, rel=1e-7)
    assert report.logdet == pytest.approx(expected.logdet, rel=1e-7)
    assert report.lam == LAM
    fisher = reference.dense_fisher(model, inputs)
    covariance = reference.dense_gradient_covariance(model, inputs, targets)
    damping = _damping(model, decays)
    tic = torch.linalg.solve(fisher + torch.diag(damping), covariance).diagonal().sum()
    assert report.tic == pytest.approx(float(tic) / 100, rel=1e-6)


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
@pytest.mark.parametrize("bias_decay", [0.0, 1e-3])
def test_cg_solves_with_the_per_group_decay(architecture, bias_decay, one_thread):
    """cg's solves are (F + D) x = w: the generalised soft rank within its error bar."""
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(32)
    decays = _decays(model, bias_decay)

    def cg(lam):
        return measure(
            model,
            batches(inputs, targets, 7),
            lam=lam,
            num_train_samples=100,
            structure=MatrixFreeOptions(probes=64, cg_steps=300, cg_tol=1e-4),
        )

    report, one_lam = cg(decays), cg(LAM)
    expected = _exact(model, inputs, decays).soft_rank
    plain = _exact(model, inputs, _decays(model, LAM)).soft_rank
    stderr = report.as_dict()["soft_rank_stderr"]
    assert 0 < stderr < 0.03 * expected
    assert abs(report.soft_rank - expected) < 4 * stderr
    # the same probes with one λ: the difference is the biases' decay, measured closely
    difference = report.soft_rank - one_lam.soft_rank
    assert difference == pytest.approx(expected - plain, rel=0.2)


def test_one_decay_for_all_is_the_plain_soft_rank_and_zero_decay_counts_directions(one_thread):
    model = tiny_model("mlp")
    inputs, targets = random_data(20)
    data = batches(inputs, targets, 7)
    plain = measure(model, data, lam=LAM, num_train_samples=100)
    same = measure(model, data, lam=_decays(model, LAM), num_train_samples=100)
    assert same.soft_rank == plain.soft_rank
    free_biases = measure(model, data, lam=_decays(model, 0.0), num_train_samples=100)
    assert free_biases.soft_rank > plain.soft_rank


@pytest.mark.parametrize("bias_decay", [0.0, 1e-3])
def test_lanczos_and_hutchinson_take_the_scaled_fisher(bias_decay, one_thread):
    """lanczos runs on D^{-1/2} F D^{-1/2} (within its error bar of the exact generalised soft
    rank); hutchinson's diagonal is scaled by 1/λ_j (its exact-diagonal limit with many probes)."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(24)
    decays = _decays(model, bias_decay)
    data = batches(inputs, targets, 7)
    expected = _exact(model, inputs, decays).soft_rank
    lanczos = measure(
        model,
        data,
        lam=decays,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="lanczos", probes=32, lanczos_steps=80),
    )
    stderr = lanczos.as_dict()["soft_rank_stderr"]
    assert abs(lanczos.soft_rank - expected) < 4 * stderr + 0.02 * expected
    diagonal = reference.dense_fisher(model, inputs).diagonal()
    damping = _damping(model, decays)
    exact_diagonal = float((diagonal / (diagonal + damping)).sum())
    hutchinson = measure(
        model,
        data,
        lam=decays,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="hutchinson", probes=256),
    )
    assert hutchinson.soft_rank == pytest.approx(exact_diagonal, rel=0.05)


def test_decays_of_zero_everywhere_are_refused():
    with pytest.raises(ValueError, match="weight_decay 0"):
        ParameterDecay({"a": 0.0, "b": 0.0})


def _grouped(model, decay: float, bias_decay: float) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.Adam(
        [
            {"params": weights, "weight_decay": decay},
            {"params": biases, "weight_decay": bias_decay},
        ],
        lr=1e-3,
    )


def test_optimizer_groups_give_per_parameter_decays():
    model = tiny_model("mlp")
    resolved = resolve_lam([_grouped(model, 1e-3, 0.0)], None, model)
    assert isinstance(resolved, ParameterDecay)
    assert resolved.decays == _decays(model, 0.0) | {
        n: 1e-3 for n in resolved.decays if not n.endswith("bias")
    }
    assert resolve_lam([_grouped(model, 1e-3, 1e-3)], None, model) == 1e-3
    assert resolve_lam([_grouped(model, 1e-3, 0.0)], 5e-4, model) == 5e-4  # explicit wins


class GroupedClassifier(FlatnessClassifier):
    def configure_optimizers(self):
        return _grouped(self, 1e-3, 0.0)


def test_a_fit_with_no_decay_groups_is_measured(tmp_path):
    monitor = FlatnessMonitor(
        max_samples=64, overhead_budget=None, log_options=LogOptions(summary=False)
    )
    trainer = quiet_trainer(tmp_path, [monitor])
    data = MNIST7DataModule(train_size=128, val_size=64, batch_size=32)
    trainer.fit(GroupedClassifier(architecture="mlp"), data)
    record = monitor.history[-1]
    assert record["lam"] == 1e-3
    assert record["soft_rank"] > 0 and record["predicted_gap"] > 0


def test_cg_measures_the_per_group_decay_in_a_fit(tmp_path):
    """cg (what 'auto' measures where the probe kernel does not fit) solves with D, so the
    fit is measured."""
    monitor = FlatnessMonitor(
        structure="cg",
        overhead_budget=None,
        log_options=LogOptions(summary=False),
    )
    trainer = quiet_trainer(tmp_path, [monitor])
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=32)
    trainer.fit(GroupedClassifier(architecture="mlp"), data)
    assert monitor.disabled_reason is None
    record = monitor.history[-1]
    assert record["lam"] == 1e-3 and record["soft_rank"] > 0


# ------------------------------------------------------------------ the regularizer under D


@pytest.mark.parametrize("backend", ["layerwise", "rules", "func"])
@pytest.mark.parametrize("labels", ["exact", "sampled"])
@pytest.mark.parametrize("bias_decay", [0.0, 1e-3])
def test_batched_penalty_is_the_generalised_soft_rank_of_the_batch_fisher(
    backend, labels, bias_decay, one_thread
):
    """``h(F_b)/B`` with F_b from the batch's rows and D = diag(λ_j), dense, for every backend:
    Tr(F_b(F_b+D)⁻¹)/B over the decayed parameters."""
    from lightning_flatness.regularizer import fisher_rows, soft_rank_penalty

    model = tiny_model("mlp")
    inputs, _ = random_data(6)
    decays = _decays(model, bias_decay)
    n = 40
    rows = fisher_rows(model, inputs, labels=labels, generator=torch.Generator().manual_seed(5))
    decayed = torch.cat(
        [torch.full((p.numel(),), decays[name] > 0) for name, p in model.named_parameters()]
    )  # a zero-decay group is left out of the batched bound (docs/math.md)
    rows = rows.detach()[:, decayed]
    fisher = rows.T @ rows / n
    damping = _damping(model, decays)[decayed]
    expected = torch.trace(fisher @ torch.linalg.inv(fisher + torch.diag(damping))) / 6
    value = soft_rank_penalty(
        model,
        inputs,
        lam=decays,
        num_train_samples=n,
        labels=labels,
        generator=torch.Generator().manual_seed(5),
        backend=backend,
    )
    assert float(value) == pytest.approx(float(expected), rel=1e-8)


@pytest.mark.parametrize("estimator", ["batched", "compositional"])
def test_penalty_gradient_under_per_group_decay_matches_finite_differences(estimator, one_thread):
    from test_regularizer import directional_check

    from lightning_flatness.regularizer import SoftRankPenalty

    model = tiny_model("cnn")
    inputs, _ = random_data(5)
    decays = _decays(model, 1e-4)
    labels = "exact" if estimator == "batched" else "sampled"
    options = PenaltyOptions(estimator=estimator, labels=labels)
    penalty = SoftRankPenalty(lam=decays, num_train_samples=40, options=options)
    if estimator == "batched":
        directional_check(model, lambda: penalty(model, inputs))
        return
    from test_compositional import fixed_probe_surrogate

    penalty(model, inputs)  # F̂ initialised; then the surrogate q/n at a fixed F̂ and probes
    value, _ = fixed_probe_surrogate(penalty, model, inputs)
    directional_check(model, value)


def test_compositional_value_is_the_generalised_soft_rank_of_the_running_fisher(one_thread):
    """h(F̂)/n with each block of F̂ at its own λ_j equals Tr(F̂(F̂+D)⁻¹)/n formed densely."""
    from lightning_flatness.regularizer import SoftRankPenalty
    from lightning_flatness.regularizer.compositional import running_trace_function

    model = tiny_model("mlp")
    inputs, _ = random_data(8)
    decays = _decays(model, 0.0)
    penalty = SoftRankPenalty(
        lam=decays, num_train_samples=40, options=PenaltyOptions(estimator="compositional")
    )
    for _ in range(3):
        penalty(model, inputs)
    with torch.no_grad():
        value = float(penalty(model, inputs))
    dense = penalty.running_fisher.dense().to(torch.float64)
    damping = _damping(model, decays)
    expected = torch.trace(dense @ torch.linalg.inv(dense + torch.diag(damping))) / 40
    assert value == pytest.approx(float(expected), rel=1e-6)
    # the same F̂ at one λ for all: the zero-decay biases count fully only under D
    plain = running_trace_function(penalty.running_fisher, LAM, "soft_rank") / 40
    assert plain < value


@pytest.mark.parametrize("estimator", ["batched", "compositional"])
def test_a_regularized_fit_with_no_decay_groups_penalises_the_same_decays(tmp_path, estimator):
    """The standard decay / no-decay groups are accepted by the regularizer, which penalises
    with the per-parameter decays the monitor measures with."""
    from lightning_flatness import SoftRankRegularizer

    regularizer = SoftRankRegularizer(strength=0.1, penalty=PenaltyOptions(estimator=estimator))
    trainer = quiet_trainer(tmp_path, [regularizer])
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=32)
    model = GroupedClassifier(architecture="mlp")
    trainer.fit(model, data)
    penalty = regularizer._penalty
    assert penalty is not None and penalty.lam == 1e-3
    assert penalty.parameter_decay is not None
    expected = {n: 0.0 if n.endswith("bias") else 1e-3 for n, _ in model.named_parameters()}
    assert penalty.parameter_decay.decays == expected
    assert all(torch.isfinite(p).all() for p in model.parameters())
