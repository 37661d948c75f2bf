"""The default structure and the matrix-free ones on the models of :mod:`zoo`, in float64.

Every exact quantity the default ``kfac`` reports (Tr F, Tr C, the NLL, and the exact blocks it
keeps: a bias's block, the diagonal of every parameter no Kronecker rule covers) equals the
dense ``torch.func`` reference, at several batch sizes; its soft rank with the Kronecker
blocks replaced by exact layer blocks bounds the exact soft rank (Prop. 6.1); the matrix-free
structures agree with the reference within their error bars.
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import pytest
import torch
from conftest import tiny_model
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader
from zoo import ZOO, build, zoo_data

from lightning_flatness import FlatnessMonitor, MatrixFreeOptions, SoftRankRegularizer, measure
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.batches import wrap_for_batches
from lightning_flatness.core.layer_rules import is_transposed_linear
from lightning_flatness.core.model_state import left_as_found, original_module
from lightning_flatness.lightning.budget import CHEAP, EXACT
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.regularizer import PenaltyOptions

LAM = 1e-3
N = 8


def _batches(inputs, targets, size):
    if isinstance(inputs, dict):
        return [
            ({k: v[i : i + size] for k, v in inputs.items()}, targets[i : i + size])
            for i in range(0, targets.shape[0], size)
        ]
    return [(inputs[i : i + size], targets[i : i + size]) for i in range(0, targets.shape[0], size)]


def _reference(model, inputs, targets):
    """Dense F, C, per-parameter slices (the user's names) and the mean NLL."""
    plain = original_module(model)
    wrapped, _, _ = wrap_for_batches(plain, [(inputs, targets)])
    leaf = tuple(inputs.values()) if isinstance(inputs, dict) else inputs
    leaf = leaf[0] if isinstance(leaf, tuple) and len(leaf) == 1 else leaf
    with left_as_found(wrapped):
        fisher = reference.dense_fisher(wrapped, leaf)
        cov = reference.dense_gradient_covariance(wrapped, leaf, targets)
        logits = wrapped(*leaf) if isinstance(leaf, tuple) else wrapped(leaf)
    nll = float(torch.nn.functional.cross_entropy(logits, targets))
    slices = {name.removeprefix("model."): sl for name, sl in reference.parameter_blocks(wrapped)}
    return fisher, cov, slices, nll


def _models():
    return [*ZOO, "mlp", "cnn", "resmlp"]


def _model_and_data(name):
    if name in ZOO:
        return build(name), *zoo_data(name, N)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(N, 1, 7, 7, generator=generator, dtype=torch.float64)
    return tiny_model(name).eval(), inputs, torch.randint(0, 10, (N,), generator=generator)


@pytest.fixture(scope="module")
def references():
    cache = {}
    for name in _models():
        model, inputs, targets = _model_and_data(name)
        cache[name] = (model, inputs, targets, _reference(model, inputs, targets))
    return cache


@pytest.mark.parametrize("name", _models())
@pytest.mark.parametrize("batch_size", [1, 3, N])
def test_default_structure_is_exact_where_it_claims_to_be(references, name, batch_size, one_thread):
    model, inputs, targets, (fisher, cov, slices, nll) = references[name]
    report = measure(
        model,
        _batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=100,
        structure="kfac",
    )
    assert report.structure == "kfac"
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    assert report.trace_cov == pytest.approx(float(cov.trace()), rel=1e-9)
    assert report.train_nll == pytest.approx(nll, rel=1e-9)
    assert set(report.coverage) == set(slices)
    for param, kind in report.coverage.items():
        block = fisher[slices[param], slices[param]]
        if kind.startswith("diagonal"):
            expected = spectral.spectral_summary(block.diagonal(), LAM)
        elif kind == "exact block":
            expected = spectral.spectral_summary(spectral.psd_eigenvalues(block), LAM)
        else:
            continue
        got = report.blocks[param]
        assert got.soft_rank == pytest.approx(expected.soft_rank, rel=1e-8), param
        assert got.trace == pytest.approx(expected.trace, rel=1e-9), param
        assert got.logdet == pytest.approx(expected.logdet, rel=1e-8), param


@pytest.mark.parametrize("name", _models())
def test_diag_is_the_exact_diagonal_on_every_model(references, name, one_thread):
    model, inputs, targets, (fisher, cov, _, _) = references[name]
    report = measure(
        model, _batches(inputs, targets, 3), lam=LAM, num_train_samples=100, structure="diag"
    )
    diag = fisher.diagonal()
    assert torch.allclose(report.eigenvalues, diag, rtol=1e-9, atol=1e-15)
    assert report.soft_rank == pytest.approx(spectral.soft_rank(diag, LAM), rel=1e-9)
    assert report.tic == pytest.approx(float((cov.diagonal() / (diag + LAM)).sum()) / 100, rel=1e-8)


@pytest.mark.parametrize("name", _models())
def test_numbers_do_not_depend_on_the_batch_size(references, name, one_thread):
    model, inputs, targets, _ = references[name]
    whole = measure(
        model, _batches(inputs, targets, N), lam=LAM, num_train_samples=100, structure="kfac"
    )
    split = measure(
        model, _batches(inputs, targets, 3), lam=LAM, num_train_samples=100, structure="kfac"
    )
    for key, value in whole.as_dict().items():
        if key not in ("seconds", "structure"):
            assert split.as_dict()[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key


@pytest.mark.parametrize("name", _models())
def test_block_diagonal_soft_rank_bounds_the_exact_one(references, name, one_thread):
    """Prop. 6.1 for the blocks the default keeps: with each Kronecker block replaced by the
    exact layer block, rank_λ(blocks) ≥ rank_λ(F); and the default's own non-Kronecker part
    equals that pinching's."""
    model, inputs, targets, (fisher, _, slices, _) = references[name]
    report = measure(
        model, _batches(inputs, targets, 3), lam=LAM, num_train_samples=100, structure="kfac"
    )
    pinched = 0.0
    for param, kind in report.coverage.items():
        block = fisher[slices[param], slices[param]]
        values = (
            block.diagonal() if kind.startswith("diagonal") else spectral.psd_eigenvalues(block)
        )
        pinched += spectral.soft_rank(values, LAM)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    assert pinched >= exact - 1e-9
    assert report.soft_rank > 0


def test_coverage_names_how_each_parameter_is_measured():
    model, inputs, targets = _model_and_data("transformer")
    coverage = measure(
        model, _batches(inputs, targets, 4), lam=LAM, num_train_samples=100, structure="kfac"
    ).coverage
    assert coverage["embed.weight"] == "kronecker"
    assert coverage["encoder.linear1.weight"] == "kronecker"
    assert coverage["encoder.linear1.bias"] == "exact block"
    assert coverage["encoder.self_attn.in_proj_weight"] == "kronecker"
    assert coverage["encoder.self_attn.in_proj_bias"] == "exact block"
    assert coverage["encoder.self_attn.out_proj.weight"] == "kronecker"
    assert coverage["encoder.norm1.weight"] == "diagonal"
    assert coverage["pos"] == "diagonal"
    tied = measure(
        build("tied_mlp"),
        _batches(*zoo_data("tied_mlp", 4), 4),
        lam=LAM,
        num_train_samples=10,
        structure="kfac",
    )
    assert tied.coverage["shared.weight"] == "kronecker"  # two layers, three calls: positions
    assert tied.coverage["shared.bias"] == "exact block"
    assert tied.coverage["head.weight"] == "kronecker"  # also applied by F.linear outside
    assert tied.coverage["head.bias"] == "exact block"


@pytest.mark.parametrize("name", ["functional_cnn", "resnet", "transformer", "vit"])
def test_layer_rules_cover_every_parameter_of_ordinary_models(name):
    """No parameter of these models needs the costly whole-model fallback."""
    model, inputs, targets = _model_and_data(name)
    report = measure(
        model, _batches(inputs, targets, 4), lam=LAM, num_train_samples=100, structure="kfac"
    )
    assert "diagonal (whole model)" not in report.coverage.values(), report.coverage


def test_compiled_module_is_measured_as_the_module_it_compiles(one_thread):
    data = _batches(*zoo_data("compiled", N), 4)
    compiled = measure(build("compiled"), data, lam=LAM, num_train_samples=100, structure="kfac")
    plain = measure(build("tied_mlp"), data, lam=LAM, num_train_samples=100, structure="kfac")
    for structure_report in (compiled,):
        assert structure_report.soft_rank == pytest.approx(plain.soft_rank, rel=1e-12)
    lanczos = {"structure": MatrixFreeOptions(structure="lanczos", probes=4, lanczos_steps=10)}
    first = measure(build("compiled"), data, lam=LAM, num_train_samples=100, **lanczos)
    second = measure(build("tied_mlp"), data, lam=LAM, num_train_samples=100, **lanczos)
    assert first.soft_rank == pytest.approx(second.soft_rank, rel=1e-10)


@pytest.mark.parametrize(
    "name", ["functional_cnn", "resnet", "transformer", "vit", "tied_mlp", "gpt2"]
)
def test_matrix_free_structures_agree_with_the_reference(references, name, one_thread):
    model, inputs, targets, (fisher, _, _, _) = references[name]
    truth = spectral.spectral_summary(spectral.psd_eigenvalues(fisher), LAM)
    data = _batches(inputs, targets, 4)
    report = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="lanczos", probes=24, lanczos_steps=30),
    )
    stderr = report.blocks["stderr"]
    assert abs(report.soft_rank - truth.soft_rank) <= 4 * stderr.soft_rank + 5e-3 * truth.soft_rank
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    hutchinson = measure(
        model, data, lam=LAM, num_train_samples=100, structure="hutchinson"
    ).as_dict()
    assert hutchinson["trace_fisher"] == pytest.approx(float(fisher.trace()), rel=1e-9)
    error = hutchinson["hutchinson_trace_estimate_stderr"]
    assert abs(hutchinson["hutchinson_trace_estimate"] - truth.trace) <= 4 * error + 1e-9
    cg = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(probes=16, cg_steps=400, cg_tol=1e-6),
    ).as_dict()
    assert abs(cg["soft_rank"] - truth.soft_rank) <= 4 * cg["soft_rank_stderr"]


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_measuring_leaves_the_model_as_found(name):
    model = build(name).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, targets = zoo_data(name, N)
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    measure(model, _batches(inputs, targets, 4), lam=LAM, num_train_samples=100, structure="kfac")
    assert torch.equal(torch.rand(3), expected_next)
    assert model.training and all(m.training for m in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert torch.backends.mha.get_fastpath_enabled() and torch.backends.mkldnn.enabled


# ------------------------------------------------------------------ the regularizer on the zoo


@pytest.mark.parametrize(
    "name", ["functional_cnn", "resnet", "transformer", "vit", "tied_mlp", "gpt2"]
)
def test_penalty_gradient_matches_finite_differences_on_the_zoo(name, one_thread):
    """BatchNorm in training mode (its running statistics are used), Dropout on (switched
    off), dict token batches, class tokens, attention and tied weights: the penalty's gradient
    is the finite-difference one."""
    from test_regularizer import directional_check

    from lightning_flatness.regularizer import SoftRankPenalty

    model = original_module(build(name)).train()
    inputs, _ = zoo_data(name, 4)
    penalty = SoftRankPenalty(
        lam=1e-2, num_train_samples=40, options=PenaltyOptions(labels="exact")
    )
    with pytest.warns(UserWarning) if name in ("resnet", "transformer") else nullcontext():
        directional_check(model, lambda: penalty(model, inputs))
    assert model.training and all(m.training for m in model.modules() if m is not model)


@pytest.mark.parametrize("labels", ["sampled", "exact"])
@pytest.mark.parametrize(
    "name", ["gpt2", "resnet", "functional_cnn", "transformer", "lstm", "tied_mlp", "vit"]
)
def test_rule_rows_are_the_per_sample_gradients_of_torch_func(name, labels, one_thread):
    """The batch kernel from the measurement's layer rules (one batched backward with graph)
    equals the one from torch.func's per-sample gradients, in value and in gradient, on GPT-2's
    data-dependent mask code, BatchNorm, attention, an LSTM and a head weight also applied by
    ``F.linear`` outside its layer (tied); a sequence-first stack (the ViT's encoder) is
    refused, saying why."""
    from lightning_flatness.regularizer import fisher_gram

    model = original_module(build(name)).eval()
    inputs, _ = zoo_data(name, 5)
    params = [p for p in model.parameters() if p.requires_grad]

    def kernel_and_gradient(backend: str):
        generator = torch.Generator().manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the func rows' loop over samples on GPT-2
            kernel = fisher_gram(model, inputs, labels=labels, generator=generator, backend=backend)
        gradient = torch.autograd.grad(kernel.square().sum(), params, allow_unused=True)
        return kernel.detach(), [
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(gradient, params, strict=True)
        ]

    if name == "vit":
        missing = "(first axis|mixes samples)"
        with pytest.raises(ValueError, match=f"backend='rules' cannot handle.*{missing}"):
            kernel_and_gradient("rules")
        return
    expected, expected_grads = kernel_and_gradient("func")
    kernel, grads = kernel_and_gradient("rules")
    assert torch.allclose(kernel, expected, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-8, atol=1e-10)


class TokenMixer(torch.nn.Module):
    """Hugging Face ViT's way with tokens, without attention: a linear patch embedding, a class
    token and a position embedding as raw parameters of shape (1, ...) added in ``forward``,
    LayerNorm, and a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Linear(4, 5)
        self.cls_token = torch.nn.Parameter(0.1 * torch.randn(1, 1, 5))
        self.position = torch.nn.Parameter(0.1 * torch.randn(1, 5, 5))
        self.mix = torch.nn.Linear(5, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        tokens = self.patch(x.reshape(x.shape[0], 4, 4))  # four patches of four pixels
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], 1)
        tokens = tokens + self.position
        tokens = tokens + torch.tanh(self.mix(self.norm(tokens))).mean(1, keepdim=True)
        return self.head(tokens[:, 0])


@pytest.mark.parametrize("labels", ["sampled", "exact"])
def test_rule_rows_take_class_tokens_as_per_sample_copies(labels, one_thread):
    from lightning_flatness.regularizer import fisher_gram

    torch.manual_seed(0)
    model = TokenMixer().double().eval()
    inputs = torch.randn(5, 16, dtype=torch.float64)
    params = list(model.parameters())
    results = []
    for backend in ("func", "rules"):
        kernel = fisher_gram(
            model,
            inputs,
            labels=labels,
            generator=torch.Generator().manual_seed(2),
            backend=backend,
        )
        results.append((kernel, torch.autograd.grad(kernel.square().sum(), params)))
    (expected, want), (kernel, got) = results
    assert torch.allclose(kernel, expected, rtol=1e-9, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)


class ZooClassifier(LightningModule):
    """A zoo network trained the way users write the LightningModule (SGD with weight decay)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.net = build(name).float().train()

    def forward(self, inputs=None, **features):
        """A tensor, or (as Hugging Face models take them) keyword features."""
        return self.net(**features) if features else self.net(inputs)

    def training_step(self, batch, _):
        if isinstance(batch, dict):
            features = dict(batch)
            targets = features.pop("labels")
            return torch.nn.functional.cross_entropy(self(**features), targets)
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self(inputs), targets)

    def validation_step(self, batch, _):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, weight_decay=1e-3)


def _zoo_loaders(name: str):
    inputs, targets = zoo_data(name, 32, seed=3)
    if isinstance(inputs, dict):
        rows = [
            {**{key: value[i] for key, value in inputs.items()}, "labels": targets[i]}
            for i in range(targets.shape[0])
        ]
    else:
        inputs = inputs.float() if inputs.is_floating_point() else inputs
        rows = list(zip(inputs, targets, strict=True))
    generator = torch.Generator().manual_seed(0)
    return DataLoader(rows, batch_size=8, shuffle=True, generator=generator), DataLoader(
        rows[:16], batch_size=8
    )


def _zoo_fit(name: str, monitor: FlatnessMonitor | None) -> ZooClassifier:
    seed_everything(0)
    module = ZooClassifier(name)
    trainer = Trainer(
        max_epochs=2,
        callbacks=[monitor] if monitor else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train, val = _zoo_loaders(name)
    trainer.fit(module, train, val)
    return module


def _quiet_monitor(**kwargs) -> FlatnessMonitor:
    return FlatnessMonitor(
        max_samples=32, **kwargs, log_options=LogOptions(summary=False, spectrum=False)
    )


@pytest.mark.parametrize("name", ["resnet", "transformer", "vit", "gpt2", "lstm"])
def test_metrics_only_monitor_leaves_training_bit_identical_and_measures(name):
    """The budget's two measurements, the fill-in (with its calibration) at the first epoch
    and the exact one at the second, change nothing of the training."""
    monitor = _quiet_monitor()
    script = [EXACT, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    with_monitor = _zoo_fit(name, monitor)
    without = _zoo_fit(name, None)
    for key, value in without.state_dict().items():  # weights and BatchNorm statistics
        assert torch.equal(with_monitor.state_dict()[key], value), key
    assert [r["fill_in"] for r in monitor.history] == [0.0, 1.0]
    assert math.isfinite(monitor.history[-1]["calibration"])
    record = monitor.history[0]
    assert monitor.state.active_structure == "probe_kernel"
    assert all(math.isfinite(record[k]) for k in ("soft_rank", "trace_fisher", "trace_cov"))


@pytest.mark.parametrize("name", ["functional_cnn", "resnet", "transformer", "vit", "gpt2"])
def test_a_short_fit_at_the_defaults_logs_every_epoch_and_ends_exact(name):
    """A 2-epoch fit of a few seconds, the monitor at its defaults: a value at every epoch
    (the budget's allowance, not its share of a fit this short, decides), the last one exact
    with the held-out trace ratio."""
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))
    _zoo_fit(name, monitor)
    assert [r["epoch"] for r in monitor.history] == [0.0, 1.0]
    assert monitor.history[-1]["fill_in"] == 0.0
    for record in monitor.history:
        for key in ("soft_rank", "predicted_gap", "trace_ratio_val"):
            assert math.isfinite(record[key]), (key, record)
        assert record["soft_rank"] <= record["rank_bound"]


@pytest.mark.parametrize(
    ("name", "params", "estimator"),
    [
        ("resnet", "all", "batched"),
        ("resnet", "last_layer", "batched"),
        ("transformer", "all", "batched"),
        ("resnet", "all", "compositional"),
        ("transformer", "all", "compositional"),
        ("vit", "all", "compositional"),
        ("gpt2", "all", "batched"),
        ("gpt2", "all", "compositional"),
        ("lstm", "all", "batched"),
        ("lstm", "all", "compositional"),
    ],
)
def test_regularized_fit_trains_on_batchnorm_and_token_models(name, params, estimator):
    plain = _zoo_fit(name, None)
    penalty = PenaltyOptions(params=params, estimator=estimator)
    monitor = _quiet_monitor(regularize=SoftRankRegularizer(strength=1.0, penalty=penalty))
    regularized = _zoo_fit(name, monitor)
    changed = any(
        not torch.equal(value, regularized.state_dict()[key])
        for key, value in plain.state_dict().items()
        if "running" not in key and "num_batches" not in key
    )
    assert changed
    assert all(torch.isfinite(p).all() for p in regularized.parameters())


@pytest.mark.parametrize("name", _models())
def test_no_ordinary_weight_matrix_falls_back_to_a_diagonal(name):
    """Every linear map (``nn.Linear``, Hugging Face's transposed ``Conv1D``, convolutions,
    embeddings) is measured as one — tied across layers, or also applied by ``F.linear``
    outside its layer (the tied MLP's head, compiled or not) included."""
    model, inputs, targets = _model_and_data(name)
    report = measure(
        model, _batches(inputs, targets, 4), lam=LAM, num_train_samples=100, structure="kfac"
    )
    linear_maps = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Embedding)
    checked = 0
    for module_name, module in original_module(model).named_modules():
        if isinstance(module, torch.nn.MultiheadAttention):  # its two projections
            keys = [f"{module_name}.in_proj_weight", f"{module_name}.out_proj.weight"]
        elif isinstance(module, linear_maps) or is_transposed_linear(module):
            keys = [f"{module_name}.weight"]
        else:
            continue
        for key in keys:
            if key not in report.coverage:  # a tied weight, reported under its first name
                continue
            assert report.coverage[key] == "kronecker", (key, report.coverage[key])
            checked += 1
    assert checked >= 2
