"""Tests of the Theorem 6.5 penalty (``lightning_flatness.regularizer``), in float64.

References are the dense definitions of :mod:`lightning_flatness.core.reference` (docs/math.md, "The
three matrices") and eigenvalues of the P × P matrices, on models small enough to diagonalise.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_flatness.core import spectral
from lightning_flatness.core.last_layer import last_layer
from lightning_flatness.core.models import build_model
from lightning_flatness.core.reference import dense_fisher, parameter_blocks, per_sample_sqrt_fisher
from lightning_flatness.regularizer import (
    PenaltyOptions,
    SoftRankPenalty,
    fisher_gram,
    fisher_rows,
    gram_trace_function,
    sample_labels,
    select_parameters,
    soft_rank_penalty,
)

DTYPE = torch.float64
NUM_CLASSES = 10

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


# ------------------------------------------------------------------------------- fixtures


def small_cnn() -> nn.Module:
    """The paper's CNN layout (3×3 convolutions, 7 → 5 → 3 → 1 pixels) with 3 and 4 channels."""
    return nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Conv2d(4, NUM_CLASSES, 3),
        nn.Flatten(),
    )


class TokenMLP(nn.Module):
    """A Linear applied at 3 positions per sample and called twice (shared weights).

    ``mix`` is wide enough that the layerwise backend assembles its kernel from position inner
    products (``(AAᵀ) ⊙ (ΔΔᵀ)`` summed over position pairs) instead of per-sample gradients.
    """

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.width = width
        self.embed = nn.Linear(49, 3 * width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        tokens = torch.tanh(self.embed(x.flatten(1))).reshape(x.shape[0], 3, self.width)
        tokens = torch.tanh(self.mix(tokens))
        tokens = torch.tanh(self.mix(tokens))  # second call of the same module
        return self.head(tokens.mean(dim=1))


class FunctionalReuse(nn.Module):
    """Uses ``fc.weight`` once through the module and once through ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(49, 49)
        self.head = nn.Linear(49, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x.flatten(1)))
        h = torch.tanh(nn.functional.linear(h, self.fc.weight))
        return self.head(h)


class MatmulReuse(FunctionalReuse):
    """Uses ``fc.weight`` once through the module and once through a matrix product."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x.flatten(1)))
        h = torch.tanh(h @ self.fc.weight.T)
        return self.head(h)


class IdleLayers(nn.Module):
    """An MLP with a Linear whose output is discarded and a Linear that is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = build_model("mlp", hidden=8)
        self.discarded = nn.Linear(49, 3)
        self.never = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.discarded(x.flatten(1))
        return self.body(x)


class NormMLP(nn.Module):
    """An MLP with a LayerNorm: its parameters are outside the layerwise backend."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(49, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, NUM_CLASSES)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: build_model("mlp", hidden=8),
    "small_mlp": lambda: build_model("mlp", hidden=4),
    "cnn": small_cnn,
    "resmlp": lambda: build_model("resmlp", hidden=6),
    "token": TokenMLP,
    "idle": IdleLayers,
}


def make(name: str, seed: int = 0, batch: int = 6) -> tuple[nn.Module, Tensor]:
    """A float64 model and a batch of 7×7 inputs (logits scaled up so p is far from uniform)."""
    torch.manual_seed(seed)
    model = MODELS[name]().to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    inputs = torch.randn(batch, 1, 7, 7, dtype=DTYPE)
    return model, inputs


def h_of(eigenvalues: Tensor, lam: float, function: str) -> float:
    """``Σ h(μ)`` with the library's conventions (the log-det carries the ½)."""
    if function == "soft_rank":
        return spectral.soft_rank(eigenvalues, lam)
    return spectral.logdet_complexity(eigenvalues, lam)


def columns(model: nn.Module, params: str) -> list[int]:
    """Flat-axis indices (reference order) of the parameters selected by ``params``."""
    selected = select_parameters(model, params)
    return [
        i
        for name, block in parameter_blocks(model)
        if name in selected
        for i in range(block.start, block.stop)
    ]


def dense_h(
    model: nn.Module,
    inputs: Tensor,
    n: int,
    lam: float,
    function: str,
    params: str,
    loss: str = "cross_entropy",
):
    """``h(F_b)`` from the eigenvalues of the P × P matrix ``(1/n) V_bᵀ V_b`` (reference)."""
    factors = per_sample_sqrt_fisher(model, inputs, loss)
    flat = factors.reshape(-1, factors.shape[-1])[:, columns(model, params)]
    return h_of(torch.linalg.eigvalsh(flat.T @ flat / n), lam, function)


def directional_check(
    model: nn.Module, value: Callable[[], Tensor], params: str = "all", seed: int = 1
) -> None:
    """``⟨∇ value, d⟩`` from ``.backward()`` equals central differences along random ``d``."""
    selected = select_parameters(model, params)
    model.zero_grad(set_to_none=True)
    value().backward()
    gradients = {  # None: the value does not depend on p (e.g. an output bias under mse)
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in selected.items()
    }
    generator = torch.Generator().manual_seed(seed)
    eps = 1e-5
    for _ in range(3):
        direction = {
            name: torch.randn(p.shape, generator=generator, dtype=DTYPE)
            for name, p in selected.items()
        }
        analytic = sum(float((gradients[k] * direction[k]).sum()) for k in selected)
        values = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for name, p in selected.items():
                    p.add_(sign * eps * direction[name])
                values.append(float(value()))
                for name, p in selected.items():
                    p.sub_(sign * eps * direction[name])
        numeric = (values[0] - values[1]) / (2 * eps)
        assert numeric == pytest.approx(analytic, rel=1e-5, abs=1e-9 * (1 + abs(analytic)))


# ---------------------------------------------------------- kernel route = P × P route


@pytest.mark.parametrize("backend", ["func", "layerwise"])
@pytest.mark.parametrize("params", ["all", "last_layer"])
@pytest.mark.parametrize("function", ["soft_rank", "logdet"])
@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("mlp", "cross_entropy"),
        ("cnn", "cross_entropy"),
        ("resmlp", "cross_entropy"),
        ("mlp", "bce"),
        ("cnn", "bce"),
        ("mlp", "mse"),
        ("cnn", "mse"),
    ],
)
def test_kernel_route_equals_dense_eigenvalues(name, loss, function, params, backend):
    model, inputs = make(name)
    n, lam = 40, 1e-3
    penalty = soft_rank_penalty(
        model,
        inputs,
        lam=lam,
        num_train_samples=n,
        function=function,
        labels="exact",
        params=params,
        backend=backend,
        loss=loss,
    )
    expected = dense_h(model, inputs, n, lam, function, params, loss) / inputs.shape[0]
    assert float(penalty) == pytest.approx(expected, rel=1e-9)


def test_parameter_side_gram_when_parameters_are_fewer_than_rows():
    """Exact labels, last layer of width 4: P = 50 < B·C = 80, so ``V_bᵀV_b`` is factorised."""
    torch.manual_seed(0)
    model = build_model("mlp", hidden=4).to(DTYPE)
    inputs = torch.randn(8, 1, 7, 7, dtype=DTYPE)
    for backend in ("func", "layerwise"):
        penalty = soft_rank_penalty(
            model,
            inputs,
            lam=1e-3,
            num_train_samples=8,
            labels="exact",
            params="last_layer",
            backend=backend,
        )
        expected = dense_h(model, inputs, 8, 1e-3, "soft_rank", "last_layer") / 8
        assert float(penalty) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("labels", ["exact", "fixed"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "resmlp", "token", "idle"])
def test_layerwise_kernel_equals_torch_func_kernel(name, labels, monkeypatch):
    model, inputs = make(name)
    spec = "exact" if labels == "exact" else torch.tensor([0, 3, 9, 1, 1, 5])
    func = fisher_gram(model, inputs, labels=spec, backend="func")
    equations = []
    einsum = torch.einsum

    def spy(equation: str, *operands: Tensor) -> Tensor:
        equations.append(equation)
        return einsum(equation, *operands)

    monkeypatch.setattr(torch, "einsum", spy)
    layerwise = fisher_gram(model, inputs, labels=spec, backend="layerwise")
    monkeypatch.undo()
    # The multi-position kernel path ran for the token model (and only there).
    assert ("itk,jsk->ijts" in equations) == (name == "token")
    rows = fisher_rows(model, inputs, labels=spec)
    torch.testing.assert_close(layerwise, func, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(func, rows @ rows.T)
    if labels == "exact":  # rows are the reference V rows, sample-major
        reference = per_sample_sqrt_fisher(model, inputs)
        torch.testing.assert_close(rows, reference.reshape(rows.shape))


class TiedLinears(nn.Module):
    """Two nn.Linear layers sharing one weight: its per-sample gradient sums both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.second.weight = self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.second(self.first(x).tanh()).tanh())


@pytest.mark.parametrize("labels", ["exact", "sampled"])
def test_layerwise_kernel_of_a_weight_tied_across_layers(labels):
    """The kernel of the sum of both uses' gradients, cross terms included."""
    torch.manual_seed(0)
    model, inputs = TiedLinears().to(DTYPE), torch.randn(5, 4, dtype=DTYPE)
    kernels = [
        fisher_gram(
            model,
            inputs,
            labels=labels,
            generator=torch.Generator().manual_seed(1),
            backend=backend,
        )
        for backend in ("func", "layerwise")
    ]
    torch.testing.assert_close(kernels[1], kernels[0], rtol=1e-10, atol=1e-12)


class BatchCentred(nn.Module):
    """An MLP that subtracts the batch mean of its hidden layer: samples are not independent."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.first(x).tanh()
        return self.head(hidden - hidden.mean(0))


def test_layerwise_refuses_a_model_that_mixes_samples():
    torch.manual_seed(0)
    model, inputs = BatchCentred().to(DTYPE), torch.randn(5, 4, dtype=DTYPE)
    with pytest.raises(ValueError, match="mixes samples"):
        fisher_gram(model, inputs, labels="exact", backend="layerwise")


def test_sampled_labels_are_the_same_for_both_backends():
    model, inputs = make("mlp")
    kernels = [
        fisher_gram(model, inputs, generator=torch.Generator().manual_seed(7), backend=backend)
        for backend in ("func", "layerwise")
    ]
    labels = sample_labels(model, inputs, torch.Generator().manual_seed(7))
    torch.testing.assert_close(kernels[0], kernels[1])
    torch.testing.assert_close(kernels[0], fisher_gram(model, inputs, labels=labels))


# --------------------------------------------------------------- gradients: finite differences


@pytest.mark.parametrize("backend", ["func", "layerwise"])
@pytest.mark.parametrize("labels", ["exact", "sampled"])
@pytest.mark.parametrize("function", ["soft_rank", "logdet"])
@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("mlp", "cross_entropy"),
        ("cnn", "cross_entropy"),
        ("token", "cross_entropy"),
        ("mlp", "bce"),
        ("mlp", "mse"),
    ],
)
def test_penalty_gradient_matches_finite_differences(name, loss, function, labels, backend):
    model, inputs = make(name)
    seed = 3

    def value() -> Tensor:
        return soft_rank_penalty(
            model,
            inputs,
            lam=1e-2,
            num_train_samples=20,
            function=function,
            labels=labels,
            generator=torch.Generator().manual_seed(seed),  # same uniforms at every θ
            backend=backend,
            loss=loss,
        )

    def draws() -> Tensor:
        return sample_labels(model, inputs, torch.Generator().manual_seed(seed), loss=loss)

    drawn = draws()
    directional_check(model, value)
    # The sampled labels did not change across the finite-difference points.
    assert torch.equal(draws(), drawn)


def test_full_size_cnn_gradient_matches_finite_differences():
    torch.manual_seed(0)
    model = build_model("cnn").to(DTYPE)
    inputs = torch.randn(4, 1, 7, 7, dtype=DTYPE)
    penalty = SoftRankPenalty(
        lam=1e-3, num_train_samples=100, options=PenaltyOptions(labels="exact")
    )
    directional_check(model, lambda: penalty(model, inputs))


@pytest.mark.parametrize("backend", ["func", "layerwise"])
def test_last_layer_gradient_is_finite_differences_in_the_last_layer_only(backend):
    model, inputs = make("mlp")

    def value() -> Tensor:
        return soft_rank_penalty(
            model,
            inputs,
            lam=1e-2,
            num_train_samples=20,
            labels="exact",
            params="last_layer",
            backend=backend,
        )

    directional_check(model, value, params="last_layer")
    model.zero_grad(set_to_none=True)
    value().backward()
    assert model[1].weight.grad is None and model[1].bias.grad is None
    assert model[3].weight.grad is not None and float(model[3].weight.grad.norm()) > 0


@pytest.mark.parametrize("function", ["soft_rank", "logdet"])
def test_trace_function_gradient(function):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, generator=generator, dtype=DTYPE)
    gram = (rows @ rows.T).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda g: gram_trace_function(g, lam=0.3, scale=0.5, function=function), (gram,)
    )
    value = gram_trace_function(gram, lam=0.3, scale=0.5, function=function)
    eigenvalues = torch.linalg.eigvalsh(0.5 * gram.detach())
    assert float(value) == pytest.approx(h_of(eigenvalues, 0.3, function), rel=1e-12)


# ------------------------------------------------------------------- Theorem 6.5, unbiasedness


@functools.lru_cache(maxsize=1)
def _tiny_factors() -> Tensor:
    """Per-sample V (m, C, P) of a tiny MLP (P = 130) on 30 inputs."""
    torch.manual_seed(11)
    model = build_model("mlp", hidden=2).to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    return per_sample_sqrt_fisher(model, torch.randn(30, 1, 7, 7, dtype=DTYPE)).detach()


@settings(max_examples=20, deadline=None)
@given(
    assignment=st.lists(st.integers(0, 5), min_size=30, max_size=30),
    lam=st.sampled_from([1e-4, 1e-2, 1.0]),
    function=st.sampled_from(["soft_rank", "logdet"]),
)
def test_theorem_6_5_batched_upper_bound(assignment, lam, function):
    """``h(Σ_b F_b) ≤ Σ_b h(F_b)`` for any partition of the samples into batches."""
    factors = _tiny_factors()
    n = factors.shape[0]
    blocks = torch.einsum("icp,icq->ipq", factors, factors) / n  # V_iᵀV_i / n
    labels = torch.tensor(assignment)
    batch_matrices = [blocks[labels == b].sum(dim=0) for b in labels.unique()]
    total = sum(batch_matrices)
    whole = h_of(torch.linalg.eigvalsh(total), lam, function)
    batched = sum(h_of(torch.linalg.eigvalsh(f), lam, function) for f in batch_matrices)
    assert whole <= batched * (1 + 1e-10) + 1e-10
    torch.testing.assert_close(total, blocks.sum(dim=0))


@pytest.mark.parametrize("function", ["soft_rank", "logdet"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_epoch_mean_of_penalties_is_the_batched_bound(seed, function):
    """Over one shuffled epoch of equal batches, mean_b h(F_b)/B = (1/n) Σ_b h(F_b) ≥ h(F)/n.

    The left side is what training adds up (the library's one-batch penalty, kernel route); the
    right side is computed from dense P × P matrices of each batch and of the whole training
    set, so the 1/n and 1/B scalings and the bound are all checked.
    """
    model, data = make("small_mlp", seed=seed, batch=24)
    n, batch_size, lam = data.shape[0], 6, 1e-2
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    penalties = [
        float(
            soft_rank_penalty(
                model, data[b], lam=lam, num_train_samples=n, function=function, labels="exact"
            )
        )
        for b in batches
    ]
    batched = sum(dense_h(model, data[b], n, lam, function, "all") for b in batches) / n
    whole = h_of(torch.linalg.eigvalsh(dense_fisher(model, data)), lam, function) / n
    assert sum(penalties) / len(penalties) == pytest.approx(batched, rel=1e-9)
    assert whole < batched


def test_sampled_kernel_is_unbiased_for_the_exact_trace_contributions():
    """``E_ĉ[‖∇log p_ĉ‖²] = Σ_c p_c‖∇log p_c‖² = Tr(V_iᵀV_i)`` and off-diagonals average 0.

    2000 independent label draws per input (one call on the inputs repeated 2000 times);
    tolerances are 5 standard errors of the Monte Carlo mean.
    """
    torch.manual_seed(5)
    model = build_model("mlp", hidden=4).to(DTYPE)
    inputs = torch.randn(4, 1, 7, 7, dtype=DTYPE)
    draws = 2000
    repeated = inputs.repeat(draws, 1, 1, 1)
    rows = fisher_rows(model, repeated, generator=torch.Generator().manual_seed(0)).detach()
    rows = rows.reshape(draws, inputs.shape[0], -1)
    kernels = torch.einsum("dip,djp->dij", rows, rows)  # one sampled K_b (times n) per draw
    mean, error = kernels.mean(dim=0), kernels.std(dim=0) / math.sqrt(draws)
    exact = per_sample_sqrt_fisher(model, inputs).square().sum(dim=(1, 2))
    assert torch.all((mean.diagonal() - exact).abs() <= 5 * error.diagonal())
    off = ~torch.eye(inputs.shape[0], dtype=torch.bool)
    assert torch.all(mean[off].abs() <= 5 * error[off])
    # The labels follow p: frequencies within 5 binomial standard errors.
    labels = sample_labels(model, repeated, torch.Generator().manual_seed(0))
    probs = torch.softmax(model(inputs), dim=-1).detach()
    counts = torch.nn.functional.one_hot(labels.reshape(draws, -1), NUM_CLASSES).sum(0).to(DTYPE)
    binomial = (draws * probs * (1 - probs)).sqrt()
    assert torch.all((counts - draws * probs).abs() <= 5 * binomial + 1)


# --------------------------------------------------------------------- training behaviour


def test_training_with_large_beta_decreases_the_penalty():
    torch.manual_seed(0)
    model = build_model("mlp", hidden=8).to(DTYPE)
    inputs = torch.randn(16, 1, 7, 7, dtype=DTYPE)
    targets = torch.randint(0, NUM_CLASSES, (16,))
    penalty = SoftRankPenalty(lam=1e-3, num_train_samples=160, seed=0)
    exact = SoftRankPenalty(lam=1e-3, num_train_samples=160, options=PenaltyOptions(labels="exact"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = float(exact(model, inputs))
    for _ in range(15):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        (loss + 100.0 * penalty(model, inputs)).backward()
        optimizer.step()
    after = float(exact(model, inputs))
    assert after < 0.8 * before


@pytest.mark.parametrize("backend", ["func", "layerwise"])
def test_last_layer_penalty_leaves_earlier_gradients_untouched(backend):
    model, inputs = make("resmlp")
    targets = torch.arange(inputs.shape[0]) % NUM_CLASSES
    penalty = SoftRankPenalty(
        lam=1e-2, num_train_samples=60, options=PenaltyOptions(params="last_layer", backend=backend)
    )
    model.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(inputs), targets)
    (loss + 50.0 * penalty(model, inputs)).backward()
    for name, p in model.named_parameters():
        if name.startswith("head."):
            assert not torch.allclose(p.grad, plain[name])
        else:
            torch.testing.assert_close(p.grad, plain[name], rtol=0, atol=0)


def test_module_names_select_parameters():
    model, inputs = make("mlp")
    assert list(select_parameters(model, "last_layer")) == ["3.weight", "3.bias"]
    assert list(select_parameters(model, ["3"])) == ["3.weight", "3.bias"]
    assert list(select_parameters(model, ["3", "1"])) == list(dict(model.named_parameters()))
    by_name = soft_rank_penalty(
        model, inputs, lam=1e-2, num_train_samples=20, labels="exact", params=["1", "3"]
    )
    everything = soft_rank_penalty(model, inputs, lam=1e-2, num_train_samples=20, labels="exact")
    assert float(by_name) == pytest.approx(float(everything), rel=1e-12)


@pytest.mark.parametrize("backend", ["auto", "func", "layerwise"])
def test_sampled_call_leaves_global_rng_untouched(backend):
    model, inputs = make("cnn")
    penalty = SoftRankPenalty(
        lam=1e-2, num_train_samples=60, seed=4, options=PenaltyOptions(backend=backend)
    )
    state = torch.get_rng_state()
    value = penalty(model, inputs)
    value.backward()
    assert torch.equal(torch.get_rng_state(), state)
    again = SoftRankPenalty(
        lam=1e-2, num_train_samples=60, seed=4, options=PenaltyOptions(backend=backend)
    )
    assert float(again(model, inputs)) == float(value)  # reproducible from the seed


def test_generator_state_round_trip_reproduces_the_labels():
    model, inputs = make("mlp")
    penalty = SoftRankPenalty(lam=1e-2, num_train_samples=60, seed=1)
    penalty(model, inputs)
    state = penalty.state_dict()
    first = float(penalty(model, inputs))
    resumed = SoftRankPenalty(lam=1e-2, num_train_samples=60, seed=99)
    resumed.load_state_dict(state)
    assert float(resumed(model, inputs)) == first


def test_no_grad_evaluation_has_no_graph_and_the_same_value():
    model, inputs = make("mlp")
    for backend in ("func", "layerwise"):
        kwargs = {"lam": 1e-2, "num_train_samples": 20, "labels": "exact", "backend": backend}
        with torch.no_grad():
            quiet = soft_rank_penalty(model, inputs, **kwargs)
        assert quiet.grad_fn is None
        assert float(quiet) == pytest.approx(float(soft_rank_penalty(model, inputs, **kwargs)))


def test_float32_model_gives_float32_penalty_close_to_float64():
    model, inputs = make("cnn")
    reference = soft_rank_penalty(model, inputs, lam=1e-2, num_train_samples=60, labels="exact")
    value = soft_rank_penalty(
        model.float(), inputs.float(), lam=1e-2, num_train_samples=60, labels="exact"
    )
    assert value.dtype == torch.float32
    assert float(value) == pytest.approx(float(reference), rel=1e-4)


# ------------------------------------------------------------------ backend selection, errors


def test_auto_falls_back_to_torch_func_outside_linear_and_conv():
    model, inputs = make("mlp")
    norm = NormMLP().to(DTYPE)
    kwargs = {"lam": 1e-2, "num_train_samples": 20, "labels": "exact"}
    auto = soft_rank_penalty(norm, inputs, **kwargs)
    func = soft_rank_penalty(norm, inputs, backend="func", **kwargs)
    assert float(auto) == pytest.approx(float(func), rel=1e-12)
    with pytest.raises(ValueError, match="LayerNorm"):
        soft_rank_penalty(norm, inputs, backend="layerwise", **kwargs)
    # Only the Linear layers selected: the layerwise backend applies again.
    layerwise = soft_rank_penalty(norm, inputs, backend="layerwise", params=["net.4"], **kwargs)
    func = soft_rank_penalty(norm, inputs, backend="func", params=["net.4"], **kwargs)
    assert float(layerwise) == pytest.approx(float(func), rel=1e-10)
    del model


def test_parameter_used_outside_its_module_is_detected():
    torch.manual_seed(0)
    model = MatmulReuse().to(DTYPE)
    inputs = torch.randn(5, 1, 7, 7, dtype=DTYPE)
    kwargs = {"lam": 1e-2, "num_train_samples": 20, "labels": "exact"}
    with pytest.raises(ValueError, match="outside its module"):
        soft_rank_penalty(model, inputs, backend="layerwise", **kwargs)
    with pytest.warns(RuntimeWarning, match="torch.func"):
        auto = soft_rank_penalty(model, inputs, **kwargs)
    func = soft_rank_penalty(model, inputs, backend="func", **kwargs)
    assert float(auto) == pytest.approx(float(func), rel=1e-12)


def test_a_weight_applied_by_f_linear_outside_its_module_is_followed():
    """``F.linear(h, fc.weight)`` outside ``fc`` is more positions of ``fc``'s map: the hooked
    backends follow it (no torch.func fallback) and agree with torch.func."""
    torch.manual_seed(0)
    model = FunctionalReuse().to(DTYPE)
    inputs = torch.randn(5, 1, 7, 7, dtype=DTYPE)
    kwargs = {"lam": 1e-2, "num_train_samples": 20, "labels": "exact"}
    func = soft_rank_penalty(model, inputs, backend="func", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "uses torch.func" fallback
        for backend in ("layerwise", "rules", "auto"):
            value = soft_rank_penalty(model, inputs, backend=backend, **kwargs)
            assert float(value) == pytest.approx(float(func), rel=1e-10), backend


@pytest.mark.parametrize("labels", ["exact", "sampled"])
def test_layer_norm_models_get_the_finite_difference_gradient(labels):
    """vmap of a double backward through aten::native_layer_norm is wrong in torch 2.13; the
    penalty computes LayerNorm from elementary ops (and leaves the module as it was)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)
    inputs = torch.randn(4, 6, dtype=DTYPE)

    def value() -> Tensor:
        penalty = SoftRankPenalty(
            lam=1e-2, num_train_samples=40, options=PenaltyOptions(labels=labels, backend="func")
        )
        return penalty(model, inputs)

    directional_check(model, value)
    assert "forward" not in vars(model[1])


def test_batchnorm_and_dropout_are_evaluated_in_eval_mode_inside_the_penalty():
    """Training-mode BatchNorm uses its running statistics and Dropout is off inside the
    penalty (said once); the value is the eval-mode one, the modes and statistics are left as
    found, and BatchNorm without running statistics is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(75, 10),
    ).to(DTYPE)
    with torch.no_grad():  # non-trivial running statistics
        model(torch.randn(16, 1, 7, 7, dtype=DTYPE))
    inputs = torch.randn(4, 1, 7, 7, dtype=DTYPE)
    stats = [b.clone() for b in model.buffers()]
    kwargs = {"lam": 1e-2, "num_train_samples": 40, "options": PenaltyOptions(labels="exact")}
    with pytest.warns(
        UserWarning, match=r"running statistics, Dropout and attention dropout off \(1, 4\)"
    ):
        train_mode = SoftRankPenalty(**kwargs)(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model
        SoftRankPenalty(**kwargs)(model, inputs)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    model.eval()
    eval_mode = SoftRankPenalty(**kwargs)(model, inputs)
    func_options = PenaltyOptions(labels="exact", backend="func")
    func = SoftRankPenalty(**{**kwargs, "options": func_options})(model, inputs)
    assert float(train_mode) == pytest.approx(float(eval_mode), rel=1e-12)
    assert float(eval_mode) == pytest.approx(float(func), rel=1e-10)
    unstable = nn.Sequential(
        nn.Flatten(),
        nn.Linear(49, 5),
        nn.BatchNorm1d(5, track_running_stats=False),
        nn.Linear(5, 3),
    ).to(DTYPE)
    with pytest.raises(ValueError, match="without running statistics"):
        SoftRankPenalty(**kwargs)(unstable, inputs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lam": 0.0}, ValueError, "finite positive"),
        ({"lam": -1.0}, ValueError, "finite positive"),
        ({"lam": math.nan}, ValueError, "finite positive"),
        ({"num_train_samples": 3}, ValueError, "smaller than the batch size"),
        ({"num_train_samples": 10.0}, TypeError, "must be an int"),
        ({"params": ["nope", "3"]}, ValueError, r"Unknown module name\(s\) \['nope'\].*'1'"),
        ({"params": []}, ValueError, "non-empty list"),
        ({"function": "trace"}, ValueError, "function must be one of"),
        ({"labels": "true"}, ValueError, "labels must be one of"),
        ({"backend": "backpack"}, ValueError, "backend must be one of"),
        ({"labels": "sampled", "generator": None}, ValueError, "private torch.Generator"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    model, inputs = make("mlp")
    arguments = {
        "lam": 1e-2,
        "num_train_samples": 20,
        "labels": "exact",
        **kwargs,
    }
    with pytest.raises(error, match=match):
        soft_rank_penalty(model, inputs, **arguments)


def test_bad_inputs_raise_clear_errors():
    model, inputs = make("mlp")
    kwargs = {"lam": 1e-2, "num_train_samples": 20, "labels": "exact"}
    with pytest.raises(TypeError, match="a tensor, a tuple or a dict of tensors"):
        soft_rank_penalty(model, inputs.numpy(), **kwargs)
    with pytest.raises(ValueError, match="non-empty batch"):
        soft_rank_penalty(model, inputs[:0], **kwargs)
    with pytest.raises(ValueError, match="logits of shape"):
        flat = nn.Sequential(nn.Flatten(), nn.Linear(49, NUM_CLASSES), nn.Flatten(0))
        soft_rank_penalty(flat.to(DTYPE), inputs, **kwargs)
    with pytest.raises(ValueError, match="no trainable parameter"):
        frozen = build_model("mlp", hidden=4).to(DTYPE).requires_grad_(False)
        soft_rank_penalty(frozen, inputs, **kwargs)
    with pytest.raises(ValueError, match="finite positive"):
        SoftRankPenalty(lam=0.0, num_train_samples=10)
    with pytest.raises(ValueError, match="positive int"):
        SoftRankPenalty(lam=1.0, num_train_samples=0)


def test_penalty_repr_names_the_options():
    text = repr(
        SoftRankPenalty(lam=0.5, num_train_samples=10, options=PenaltyOptions(params=["a", "b"]))
    )
    assert "lam=0.5" in text and "params=('a', 'b')" in text and "backend='auto'" in text


# ------------------------------------------------------- other likelihoods, structured inputs


@pytest.mark.parametrize("loss", ["bce", "mse"])
def test_other_likelihoods_sampled_kernel_is_unbiased(loss):
    """E[∇log p(ỹ) ∇log p(ỹ)ᵀ] = V_iᵀV_i: the mean sampled trace converges to the exact one."""
    model, inputs = make("mlp", batch=3)
    exact = float(torch.trace(fisher_gram(model, inputs, labels="exact", loss=loss)))
    generator = torch.Generator().manual_seed(0)
    draws = [
        float(torch.trace(fisher_gram(model, inputs, generator=generator, loss=loss)))
        for _ in range(3000)
    ]
    mean = sum(draws) / len(draws)
    stderr = (sum((d - mean) ** 2 for d in draws) / (len(draws) - 1) / len(draws)) ** 0.5
    assert abs(mean - exact) < 4 * stderr


class DictModel(nn.Module):
    """``forward(image, scale)`` returning ``{"logits": ..., "features": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = build_model("mlp", hidden=6)

    def forward(self, image: Tensor, scale: Tensor) -> dict[str, Tensor]:
        logits = self.body(image) * scale.unsqueeze(-1)
        return {"logits": logits, "features": image.flatten(1)}


@pytest.mark.parametrize("backend", ["func", "layerwise"])
def test_dict_inputs_and_dict_outputs_give_the_plain_models_penalty(backend):
    torch.manual_seed(0)
    model = DictModel().to(DTYPE)
    inputs = torch.randn(6, 1, 7, 7, dtype=DTYPE)
    ones = torch.ones(6, dtype=DTYPE)
    kwargs = {"lam": 1e-3, "num_train_samples": 40, "labels": "exact", "backend": backend}
    structured = soft_rank_penalty(model, {"image": inputs, "scale": ones}, **kwargs)
    plain = soft_rank_penalty(model.body, inputs, **kwargs)
    assert float(structured) == pytest.approx(float(plain), rel=1e-10)
    penalty = SoftRankPenalty(
        lam=1e-3, num_train_samples=40, options=PenaltyOptions(labels="exact")
    )
    assert float(penalty(model, {"image": inputs, "scale": ones})) == pytest.approx(
        float(plain), rel=1e-10
    )


class TokenClassifier(nn.Module):
    """Integer token ids, embedded: the penalty differentiates the parameters, not the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.embed(input_ids).mean(1))


def test_integer_token_inputs_are_differentiated_through_the_parameters():
    torch.manual_seed(0)
    model = TokenClassifier().to(DTYPE)
    tokens = torch.randint(0, 11, (6, 4))

    def value() -> Tensor:
        return soft_rank_penalty(model, tokens, lam=1e-2, num_train_samples=20, labels="exact")

    directional_check(model, value)


@pytest.mark.parametrize(("architecture", "head"), [("mlp", nn.Linear), ("cnn", nn.Conv2d)])
def test_last_layer_has_one_definition(architecture, head):
    """``params="last_layer"`` selects the parameters of the package's one last layer."""
    model = build_model(architecture)
    layer = last_layer(model)
    assert isinstance(layer, head)
    selected = select_parameters(model, "last_layer")
    assert [id(p) for p in selected.values()] == [id(p) for p in layer.parameters()]
    with pytest.raises(ValueError, match="last_layer"):
        select_parameters(nn.Sequential(nn.Flatten(), nn.ReLU()), "last_layer")


@pytest.mark.parametrize("estimator", ["batched", "compositional"])
def test_processes_draw_independently_and_share_the_generator_state(estimator):
    """Under data parallelism each process draws its own labels or probes (the same draws on
    different samples would not average out), while the shared generator advances alike on
    every process (a checkpoint from rank 0 resumes them all); one process draws as before."""
    torch.manual_seed(0)
    model = build_model("mlp", hidden=8).to(DTYPE)
    inputs = torch.randn(8, 1, 7, 7, dtype=DTYPE)

    def penalty_of(process):
        penalty = SoftRankPenalty(
            lam=1e-3,
            num_train_samples=80,
            seed=0,
            options=PenaltyOptions(estimator=estimator, backend="func"),
        )
        penalty.process = process
        values = [float(penalty(model, inputs)) for _ in range(2)]
        return values, penalty.generator.get_state()

    (rank0, state0), (rank1, state1) = penalty_of((0, 2)), penalty_of((1, 2))
    assert rank0 != rank1
    assert torch.equal(state0, state1)
    single, _ = penalty_of(None)
    assert single == penalty_of((0, 1))[0]
    assert single != rank0
