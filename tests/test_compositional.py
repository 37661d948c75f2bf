"""The compositional soft-rank penalty and its running Fisher, in float64.

References: dense Fishers of :mod:`lightning_flatness.core.reference` (and, for the gradient, a
dense Fisher written here with its output weights differentiated), eigenvalues of P × P
matrices, and central finite differences for a fixed running estimate and fixed probes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from contextlib import nullcontext

import pytest
import torch
from test_regularizer import directional_check
from torch import Tensor, nn
from zoo import build, zoo_data

from lightning_flatness.core.model_state import original_module
from lightning_flatness.core.models import build_model
from lightning_flatness.core.reference import dense_fisher
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty
from lightning_flatness.regularizer.running_fisher import RunningFisher

DTYPE = torch.float64
LAM = 1e-2
N = 40

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", input_shape=(6,), num_classes=3, hidden=5).to(DTYPE)


def warmed_penalty(model: nn.Module, inputs, steps: int = 3, **kwargs) -> SoftRankPenalty:
    """A compositional penalty whose running Fisher has ``steps`` updates."""
    fields = {f.name for f in dataclasses.fields(PenaltyOptions)}
    options = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
    options = PenaltyOptions(**{"estimator": "compositional", **options})
    penalty = SoftRankPenalty(lam=LAM, num_train_samples=N, options=options, **kwargs)
    for _ in range(steps):
        penalty(model, inputs)
    return penalty


def hprime(dense: Tensor, function: str = "soft_rank") -> Tensor:
    values, vectors = torch.linalg.eigh(dense)
    weights = TRACE_FUNCTIONS[function].derivative(values.clamp_min(0.0), LAM)
    return vectors @ torch.diag(weights) @ vectors.mT


# ------------------------------------------------------------------ the running Fisher
def cross_entropy_root_transpose(p: Tensor, xi: Tensor) -> Tensor:
    """``Aᵀ ξ`` for ``A = diag √p − √p pᵀ`` (``AᵀA = diag p − ppᵀ``)."""
    return p.sqrt() * xi - p * (p.sqrt() * xi).sum()


def test_running_fisher_is_exact_when_the_fisher_is_a_kronecker_product():
    """One sample through a linear softmax layer: ``F = Λ ⊗ x xᵀ``. Averaging over all 2^C
    sign vectors makes ``E[ξξᵀ] = I`` exact, so the factors must give ``F`` to rounding."""
    torch.manual_seed(0)
    x = torch.randn(4, dtype=DTYPE)
    p = torch.softmax(torch.randn(3, dtype=DTYPE), 0)
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=3)), dtype=DTYPE)
    gradients = torch.stack([torch.outer(cross_entropy_root_transpose(p, xi), x) for xi in signs])
    running = RunningFisher({"weight": torch.Size([3, 4])}, decay=0.0)
    running.update({"weight": gradients}, batch_size=1)
    fisher = torch.kron(torch.diag(p) - torch.outer(p, p), torch.outer(x, x))
    assert torch.allclose(running.dense(), fisher, atol=1e-13)


@pytest.mark.parametrize("shape", [(3, 4), (2, 5), (5,), (2, 3, 2)])
def test_running_fisher_keeps_the_trace_with_full_and_diagonal_factors(shape):
    torch.manual_seed(1)
    gradients = torch.randn(6, *shape, dtype=DTYPE)  # 6 probes over a batch of 2
    for max_factor_dim in (1, 2, 3, 512):
        running = RunningFisher({"p": torch.Size(shape)}, decay=0.5, max_factor_dim=max_factor_dim)
        running.update({"p": gradients}, batch_size=2)
        dense = running.dense()
        assert float(torch.trace(dense)) == pytest.approx(
            float(gradients.square().sum()) / (2 * 6), rel=1e-12
        )
        assert torch.allclose(dense, dense.mT) and float(torch.linalg.eigvalsh(dense)[0]) > -1e-12
        rows, cols = shape[0], math.prod(shape[1:])
        if rows > max_factor_dim and cols > max_factor_dim:  # the elementwise diagonal
            assert torch.allclose(dense.diagonal(), gradients.square().mean(0).reshape(-1) / 2)


def test_running_fisher_moving_average_is_bias_corrected():
    first, second = torch.randn(1, 3, 2, dtype=DTYPE), torch.randn(1, 3, 2, dtype=DTYPE)
    running = RunningFisher({"p": torch.Size([3, 2])}, decay=0.9)
    running.update({"p": first}, batch_size=1)
    once = RunningFisher({"p": torch.Size([3, 2])}, decay=0.0)
    once.update({"p": first}, batch_size=1)
    assert torch.allclose(running.dense(), once.dense())  # not 0.1 × the first update
    running.update({"p": second}, batch_size=1)
    left = (0.9 * 0.1 * first[0] @ first[0].T + 0.1 * second[0] @ second[0].T) / (1 - 0.81)
    assert torch.allclose(running.blocks["p"].left.sum / running.weight, left)


def test_running_fisher_state_round_trip_and_mismatch():
    running = RunningFisher({"a": torch.Size([3, 2]), "b": torch.Size([3])}, decay=0.8)
    running.update({"a": torch.randn(2, 3, 2), "b": torch.randn(2, 3)}, batch_size=4)
    copy = RunningFisher({"a": torch.Size([3, 2]), "b": torch.Size([3])}, decay=0.8)
    copy.load_state_dict(running.state_dict())
    assert torch.equal(copy.dense(), running.dense()) and copy.updates == 1
    other = RunningFisher({"a": torch.Size([2, 2])})
    with pytest.raises(ValueError, match="other parameters"):
        other.load_state_dict(running.state_dict())
    with pytest.raises(ValueError, match="decay"):
        RunningFisher({}, decay=1.0)


# ------------------------------------------------------------------ gradient and unbiasedness
def fixed_probe_surrogate(penalty: SoftRankPenalty, model: nn.Module, inputs):
    """``q/n`` as a function of θ for the probes the generator draws next (fixed), and the
    generator state that draws them."""
    state = penalty.generator.get_state()

    def value() -> Tensor:
        penalty.generator.set_state(state)
        return penalty.surrogate(model, inputs)

    return value, state


@pytest.mark.parametrize(
    ("name", "function", "loss"),
    [
        ("mlp", "soft_rank", "cross_entropy"),
        ("mlp", "logdet", "cross_entropy"),
        ("mlp", "soft_rank", "bce"),
        ("mlp", "soft_rank", "mse"),
        ("functional_cnn", "soft_rank", "cross_entropy"),
        ("resnet", "soft_rank", "cross_entropy"),
        ("transformer", "logdet", "cross_entropy"),
        ("vit", "soft_rank", "cross_entropy"),
        ("tied_mlp", "soft_rank", "cross_entropy"),
        ("compiled", "soft_rank", "cross_entropy"),
    ],
)
def test_gradient_matches_finite_differences_for_a_fixed_running_fisher(
    name, function, loss, one_thread
):
    """For fixed ``F̂`` and probes the surrogate ``q/n`` is a function of θ: its autograd
    gradient is the finite-difference one, and it is the gradient the penalty returns."""
    if name == "mlp":
        model, inputs = mlp(), torch.randn(5, 6, dtype=DTYPE)
    else:
        model = build(name).train()
        inputs, _ = zoo_data(name, 4)
    warns = name in ("resnet", "transformer")
    with pytest.warns(UserWarning) if warns else nullcontext():
        penalty = warmed_penalty(model, inputs, function=function, loss=loss)
    value, probes = fixed_probe_surrogate(penalty, model, inputs)
    plain = original_module(model)
    directional_check(plain, value)
    expected = [
        torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in plain.parameters()
    ]
    plain.zero_grad(set_to_none=True)
    before = penalty.running_fisher.dense()
    penalty.generator.set_state(probes)  # the same probes
    returned = penalty(model, inputs)
    returned.backward()
    for got, want in zip(plain.parameters(), expected, strict=True):
        got = torch.zeros_like(got) if got.grad is None else got.grad  # mse: the output bias
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)
    spectrum = torch.linalg.eigvalsh(before).clamp_min(0.0)
    h = float(TRACE_FUNCTIONS[function].value(spectrum, LAM).sum())
    assert float(returned) == pytest.approx(h / N, rel=1e-9)  # value: h(F̂)/n before the update
    assert not torch.equal(penalty.running_fisher.dense(), before)  # then F̂ moved
    assert model.training and all(m.training for m in plain.modules())


@pytest.mark.parametrize("name", ["mlp", "functional_cnn", "resnet"])
def test_surrogate_is_unbiased_for_the_trace_against_the_batch_fisher(name, one_thread):
    """``E_ξ[q] = Tr(h'(F̂) F_b)`` with ``F_b`` the dense batch Fisher (mean over the batch)."""
    if name == "mlp":
        model, inputs = mlp(), torch.randn(5, 6, dtype=DTYPE)
    else:
        model = original_module(build(name)).eval()
        inputs, _ = zoo_data(name, 4)
    penalty = warmed_penalty(model, inputs, steps=5)
    outer = hprime(penalty.running_fisher.dense())
    target = float(torch.trace(outer @ dense_fisher(model, inputs)))
    draws = torch.tensor([float(penalty.surrogate(model, inputs)) * N for _ in range(1500)])
    error = float(draws.mean()) - target
    assert abs(error) < 4.5 * float(draws.std()) / math.sqrt(len(draws)), (error, target)
    assert abs(error) < 0.05 * abs(target)


def batch_function_fisher(model: nn.Module, inputs: Tensor) -> Tensor:
    """``(1/B) Jᵀ diag(Λ_i) J`` for the Jacobian J (B·C × P) of the logits of the whole batch,
    BatchNorm on the batch's statistics: the Fisher the training step's network has."""
    params = dict(model.named_parameters())
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # left untouched

    def logits_of(*values: Tensor) -> Tensor:
        theta = dict(zip(params, values, strict=True))
        return torch.func.functional_call(model, {**theta, **buffers}, (inputs,))

    jacobians = torch.autograd.functional.jacobian(logits_of, tuple(params.values()))
    logits = logits_of(*params.values()).detach()
    batch, classes = logits.shape
    jacobian = torch.cat([j.reshape(batch * classes, -1) for j in jacobians], dim=1)
    p = torch.softmax(logits, -1)
    blocks = torch.block_diag(*[torch.diag(q) - torch.outer(q, q) for q in p])
    return jacobian.T @ blocks @ jacobian / batch


def test_batch_statistics_surrogate_is_unbiased_for_the_training_networks_fisher(one_thread):
    """BatchNorm in training mode: ``E_ξ[q] = Tr(h'(F̂) F)`` for the Fisher of the network the
    training step computes (batch statistics), and the BatchNorm buffers do not move."""
    model = original_module(build("resnet")).train()
    inputs, _ = zoo_data("resnet", 6)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.warns(UserWarning):
        penalty = warmed_penalty(model, inputs, steps=5)
    assert penalty.batch_norm == "batch"
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    outer = hprime(penalty.running_fisher.dense())
    model.dropout.eval()  # the penalty switches Dropout off; the reference must too
    target = float(torch.trace(outer @ batch_function_fisher(model, inputs)))
    model.train()
    draws = torch.tensor([float(penalty.surrogate(model, inputs)) * N for _ in range(1500)])
    error = float(draws.mean()) - target
    assert abs(error) < 4.5 * float(draws.std()) / math.sqrt(len(draws)), (error, target)
    assert abs(error) < 0.05 * abs(target)
    eval_target = float(torch.trace(outer @ dense_fisher(model.eval(), inputs)))
    assert abs(eval_target - target) > 10 * abs(error)  # the two networks' Fishers differ


def test_running_statistics_can_be_chosen_and_the_batched_estimator_refuses_batch(one_thread):
    model = original_module(build("resnet")).train()
    inputs, _ = zoo_data("resnet", 4)
    with pytest.warns(UserWarning):
        penalty = warmed_penalty(model, inputs, batch_norm="running")
    value, _ = fixed_probe_surrogate(penalty, model, inputs)
    directional_check(model, value)
    with pytest.raises(ValueError, match=r"needs estimator=.compositional"):
        SoftRankPenalty(lam=LAM, num_train_samples=N, options=PenaltyOptions(batch_norm="batch"))


def differentiable_batch_fisher(model: nn.Module, inputs: Tensor) -> Tensor:
    """``(1/B) Σ_i J_iᵀ Λ_i J_i`` with ``Λ_i = diag p_i − p_i p_iᵀ`` differentiated in θ (the
    reference's output weights are detached)."""
    params = list(model.parameters())
    logits = model(inputs)
    rows = []
    for i in range(inputs.shape[0]):
        jac = [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(z, params, create_graph=True)])
            for z in logits[i]
        ]
        jacobian = torch.stack(jac)
        p = torch.softmax(logits[i], 0)
        rows.append(jacobian.T @ (torch.diag(p) - torch.outer(p, p)) @ jacobian)
    return torch.stack(rows).mean(0)


def test_gradient_is_unbiased_for_the_gradient_of_the_trace_form(one_thread):
    """``E_ξ[∇q] = ∇θ Tr(h'(F̂) F_b(θ))`` for fixed ``F̂``: the compositional gradient."""
    model, inputs = mlp(3), torch.randn(4, 6, dtype=DTYPE)
    penalty = warmed_penalty(model, inputs, steps=5)
    outer = hprime(penalty.running_fisher.dense())
    model.zero_grad(set_to_none=True)
    (torch.trace(outer @ differentiable_batch_fisher(model, inputs)) / N).backward()
    reference = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    draws = []
    for _ in range(1500):
        model.zero_grad(set_to_none=True)
        penalty.surrogate(model, inputs).backward()
        draws.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    stack = torch.stack(draws)
    error = stack.mean(0) - reference
    stderr = stack.std(0) / math.sqrt(len(draws))
    assert float((error.abs() / (stderr + 1e-15)).max()) < 5.0
    assert float(error.norm()) < 0.05 * float(reference.norm())


# ------------------------------------------------------------------ the penalty object
def test_penalty_state_restores_the_running_fisher_and_the_probes():
    model, inputs = mlp(), torch.randn(5, 6, dtype=DTYPE)
    penalty = warmed_penalty(model, inputs, steps=4, seed=3)
    state = penalty.state_dict()
    resumed = SoftRankPenalty(
        lam=LAM, num_train_samples=N, options=PenaltyOptions(estimator="compositional")
    )
    resumed.load_state_dict(state)  # before the first call: kept until the parameters are known
    assert torch.equal(resumed(model, inputs), penalty(model, inputs))
    assert torch.equal(resumed.running_fisher.dense(), penalty.running_fisher.dense())
    other = build_model("mlp", input_shape=(6,), num_classes=3, hidden=4).to(DTYPE)
    with pytest.raises(ValueError, match="another model"):
        penalty(other, inputs)


def test_penalty_under_no_grad_reads_the_running_value_without_updating():
    model, inputs = mlp(), torch.randn(5, 6, dtype=DTYPE)
    fresh = SoftRankPenalty(
        lam=LAM, num_train_samples=N, options=PenaltyOptions(estimator="compositional")
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match="no running Fisher yet"):
        fresh(model, inputs)
    penalty = warmed_penalty(model, inputs)
    updates = penalty.running_fisher.updates
    with torch.no_grad():
        value = penalty(model, inputs)
    assert penalty.running_fisher.updates == updates and not value.requires_grad


def test_max_samples_uses_the_first_samples_of_the_batch():
    model, inputs = mlp(), torch.randn(12, 6, dtype=DTYPE)
    common = {"lam": LAM, "num_train_samples": N, "seed": 4}
    subset = SoftRankPenalty(
        **common, options=PenaltyOptions(estimator="compositional", max_samples=5)
    )
    reference = SoftRankPenalty(
        **common, options=PenaltyOptions(estimator="compositional", max_samples=None)
    )
    for _ in range(3):
        assert torch.equal(subset(model, inputs), reference(model, inputs[:5]))
    assert torch.equal(subset.running_fisher.dense(), reference.running_fisher.dense())


def test_compositional_options_are_checked():
    base = {"estimator": "compositional"}
    with pytest.raises(ValueError, match="labels='exact'"):
        PenaltyOptions(**base, labels="exact")
    with pytest.raises(ValueError, match="probes"):
        PenaltyOptions(**base, probes=0)
    with pytest.raises(ValueError, match="decay"):
        PenaltyOptions(**base, decay=-0.1)
    with pytest.raises(ValueError, match="max_samples"):
        PenaltyOptions(**base, max_samples=0)
    with pytest.raises(ValueError, match="estimator"):
        PenaltyOptions(estimator="scgd")
