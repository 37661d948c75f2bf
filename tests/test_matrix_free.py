"""``measure(structure="lanczos" | "hutchinson")``: statistics parity
with the BackPACK path, models BackPACK cannot handle, and the model left as found."""

from __future__ import annotations

import math
import os
import socket
import warnings

import pytest
import torch
from conftest import batches, random_data, tiny_model
from torch import nn

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.backends.matrix_free import MatrixFreeOptions
from lightning_flatness.core.failures import MeasurementError, UnsupportedModelError
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import structure_options
from lightning_flatness.core.reading import BatchReading

LAM = 1e-3
N_TRAIN = 1000
NUM_SAMPLES = 64
STATISTICS = (
    "train_nll",
    "trace_cov",
    "trace_fisher",
    "error_uncertainty_train",
    "relative_flatness",
    "train_accuracy",
    "val_nll",
    "trace_cov_val",
    "trace_fisher_val",
    "error_uncertainty_val",
    "val_accuracy",
    "trace_ratio_train",
    "trace_ratio_val",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    inputs, targets = random_data(NUM_SAMPLES)
    val_inputs, val_targets = random_data(40, seed=7)
    return inputs, targets, val_inputs, val_targets


def _measure(model, inputs, targets, batch_size, structure, val=None, **options):
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=structure_options(structure, {"probes": 2, "lanczos_steps": 5, **options}),
        val_batches=None if val is None else batches(*val, 9),
    )


@pytest.fixture(scope="module")
def gram_reports(data):
    inputs, targets, val_inputs, val_targets = data
    return {
        architecture: measure(
            tiny_model(architecture),
            batches(inputs, targets, 16),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure="gram",
            val_batches=batches(val_inputs, val_targets, 9),
        )
        for architecture in ("mlp", "cnn", "resmlp")
    }


@pytest.mark.parametrize("structure", ["lanczos", "hutchinson"])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_statistics_match_the_backpack_path(data, gram_reports, structure, batch_size):
    inputs, targets, val_inputs, val_targets = data
    report = _measure(
        tiny_model("mlp"),
        inputs,
        targets,
        batch_size,
        structure,
        val=(val_inputs, val_targets),
        trace_estimator="exact",
    )
    expected = gram_reports["mlp"]
    assert report.num_samples == NUM_SAMPLES and report.num_val_samples == 40
    for name in STATISTICS:
        assert getattr(report, name) == pytest.approx(getattr(expected, name), rel=1e-8), name
    assert report.observed_gap == pytest.approx(expected.observed_gap, rel=1e-8)


@pytest.mark.parametrize("architecture", ["cnn", "resmlp"])
def test_statistics_match_for_cnn_and_residual(data, gram_reports, architecture):
    inputs, targets, val_inputs, val_targets = data
    report = _measure(
        tiny_model(architecture),
        inputs,
        targets,
        7,
        "hutchinson",
        val=(val_inputs, val_targets),
    )  # trace_estimator "auto" → exact for tiny models
    expected = gram_reports[architecture]
    for name in STATISTICS:
        value, reference_value = getattr(report, name), getattr(expected, name)
        if math.isnan(reference_value):
            assert math.isnan(value), name  # the CNN has no linear class layer
        else:
            assert value == pytest.approx(reference_value, rel=1e-8), name


def test_lanczos_does_not_depend_on_the_batching(data):
    """ξ has one entry per sample and class, drawn in sample order: same seed, same numbers."""
    inputs, targets, _, _ = data
    model = tiny_model("mlp")
    first, second = (
        _measure(model, inputs, targets, size, "lanczos", probes=4, lanczos_steps=20)
        for size in (7, 64)
    )
    for name in ("soft_rank", "soft_rank2", "logdet", "max_eig"):
        assert getattr(first, name) == pytest.approx(getattr(second, name), rel=1e-8), name


def test_sampled_fisher_trace_is_unbiased(data, gram_reports):
    inputs, targets, _, _ = data
    model = tiny_model("mlp")
    draws = []
    for seed in range(40):
        report = measure(
            model,
            batches(inputs, targets, 16),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure=MatrixFreeOptions(
                structure="hutchinson", probes=1, bounds=False, trace_estimator="sampled"
            ),
            seed=seed,
        )
        draws.append(report.trace_fisher)
    values = torch.tensor(draws, dtype=torch.float64)
    exact = gram_reports["mlp"].trace_fisher
    assert abs(float(values.mean()) - exact) < 4 * float(values.std()) / math.sqrt(len(draws))
    assert float(values.std()) > 0


class Scale(nn.Module):
    """A custom module that uses its own parameter functionally (no BackPACK rule)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class TiedNet(nn.Module):
    """LayerNorm, a custom scale, and one weight matrix used twice (shared weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(49, 12)
        self.norm = nn.LayerNorm(12)
        self.scale = Scale(12)
        self.mix = nn.Linear(12, 12)
        self.out = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale(torch.tanh(self.norm(self.inp(x.flatten(1)))))
        h = torch.tanh(self.mix(h))
        return self.out(torch.tanh(self.mix(h)))  # self.mix applied twice


@pytest.mark.parametrize("kind", ["layernorm_scale", "tied"])
def test_models_backpack_cannot_handle_match_the_dense_reference(data, kind):
    inputs, targets, _, _ = data
    torch.manual_seed(0)
    if kind == "tied":
        model = TiedNet().double()
    else:
        model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(49, 12),
            nn.LayerNorm(12),
            Scale(12),
            nn.ReLU(),
            nn.Linear(12, 10),
        ).double()
    with pytest.raises(UnsupportedModelError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK warns about the module before failing
        measure(
            model,
            batches(inputs, targets, 16),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure="gram",
        )
    fisher = reference.dense_fisher(model.eval(), inputs)
    truth = spectral.spectral_summary(spectral.psd_eigenvalues(fisher), LAM)
    report = measure(
        model,
        batches(inputs, targets, 16),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(structure="lanczos", probes=32, lanczos_steps=40),
    )
    stderr = report.blocks["stderr"]
    assert abs(report.soft_rank - truth.soft_rank) <= 3 * stderr.soft_rank + 5e-3 * truth.soft_rank
    assert abs(report.logdet - truth.logdet) <= 3 * stderr.logdet + 5e-3 * truth.logdet
    assert report.max_eig == pytest.approx(truth.max_eig, rel=1e-8)
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    grads = reference.per_sample_gradients(model, inputs, targets)
    assert report.trace_cov == pytest.approx(float(grads.square().sum(1).mean()), rel=1e-9)
    diagonal = measure(
        model,
        batches(inputs, targets, 16),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(structure="hutchinson", probes=64),
    )
    assert diagonal.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    assert diagonal.eigenvalues.shape == (fisher.shape[0],)


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(49, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.5)
        )
        self.head = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("structure", ["lanczos", "hutchinson"])
def test_model_is_left_as_found(data, structure):
    inputs, targets, _, _ = data
    torch.manual_seed(0)
    model = Stateful().double()
    model(inputs).sum().backward()  # BatchNorm statistics move; gradients exist
    model.body[2].eval()  # a mixed mode to restore
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    _measure(model, inputs, targets, 16, structure, trace_estimator="sampled")
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert not any(m._forward_hooks for m in model.modules())


def test_max_samples_truncates_the_stream(data):
    inputs, targets, _, _ = data
    model = tiny_model("mlp")
    options = MatrixFreeOptions(structure="lanczos", probes=3, lanczos_steps=10)
    kwargs = {"lam": LAM, "num_train_samples": N_TRAIN, "structure": options}
    truncated = measure(model, batches(inputs, targets, 7), max_samples=20, **kwargs)
    direct = measure(model, [(inputs[:20], targets[:20])], **kwargs)
    assert truncated.num_samples == 20
    assert truncated.train_nll == pytest.approx(direct.train_nll, rel=1e-12)
    assert truncated.soft_rank == pytest.approx(direct.soft_rank, rel=1e-8)


def test_regression_lanczos_matches_jacobian_gram(data):
    """loss="mse": F = (1/m) Σ J_iᵀ J_i, loss ½‖y − f‖²."""
    inputs, _, _, _ = data
    model = tiny_model("mlp").eval()
    targets = torch.randn(inputs.shape[0], 10, dtype=torch.float64)
    flat = reference.per_sample_jacobians(model, inputs)
    fisher = torch.einsum("ncp,ncq->pq", flat, flat) / inputs.shape[0]
    truth = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    report = measure(
        model,
        batches(inputs, targets, 8),
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=MatrixFreeOptions(structure="lanczos", probes=32, lanczos_steps=40),
        reading=BatchReading(loss="mse"),
    )
    assert abs(report.soft_rank - truth) <= 3 * report.blocks["stderr"].soft_rank + 5e-3 * truth
    assert report.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    residual = (model(inputs) - targets).detach()
    assert report.train_nll == pytest.approx(float(0.5 * residual.square().sum(1).mean()))
    grads = torch.einsum("ncp,nc->np", flat, residual)
    assert report.trace_cov == pytest.approx(float(grads.square().sum(1).mean()), rel=1e-9)


@pytest.mark.parametrize("split", ["train", "val"])
def test_non_finite_loss_raises(data, split):
    inputs, targets, _, _ = data
    bad = inputs.clone()
    bad[3] = math.nan
    train = (bad, targets) if split == "train" else (inputs, targets)
    val = (bad, targets) if split == "val" else None
    with pytest.raises(MeasurementError, match="not finite"):
        _measure(tiny_model("mlp"), *train, 16, "hutchinson", val=val)


def test_empty_training_data_raises(data):
    with pytest.raises(MeasurementError, match="no samples"):
        measure(tiny_model("mlp"), [], lam=LAM, num_train_samples=N_TRAIN, structure="lanczos")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"probs": 3}, r"no option \['probs'\]"),
        ({"space": "weights"}, "space"),
        ({"probes": 0}, "probes"),
        ({"trace_estimator": "approx"}, "trace_estimator"),
        ({"start": "random", "space": "samples"}, "start='random'"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        structure_options("lanczos", options)


def test_uncached_passes_match_and_detect_changing_data(data):
    inputs, targets, _, _ = data
    model = tiny_model("mlp")
    options = MatrixFreeOptions(structure="lanczos", probes=3, lanczos_steps=10)
    uncached = MatrixFreeOptions(structure="lanczos", probes=3, lanczos_steps=10, cache=False)
    kwargs = {"lam": LAM, "num_train_samples": N_TRAIN}
    cached = measure(model, batches(inputs, targets, 16), structure=options, **kwargs)
    streamed = measure(model, batches(inputs, targets, 16), structure=uncached, **kwargs)
    assert streamed.soft_rank == pytest.approx(cached.soft_rank, rel=1e-10)

    class Shuffled:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(0)

        def __iter__(self):
            order = torch.randperm(NUM_SAMPLES, generator=self.generator)
            return iter(batches(inputs[order], targets[order], 16))

    with pytest.raises(MeasurementError, match="different samples"):
        measure(model, Shuffled(), structure=uncached, **kwargs)


def test_one_shot_iterators_and_inference_mode(data, gram_reports):
    """Cached inputs serve every Lanczos pass, so a generator works; inference mode is left."""
    inputs, targets, _, _ = data
    model = tiny_model("mlp")
    with torch.inference_mode():
        inputs = inputs * 1.0  # inference tensors, as a Lightning validation loop makes them
        report = measure(
            model,
            iter(batches(inputs, targets, 16)),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure=MatrixFreeOptions(structure="lanczos", probes=3, lanczos_steps=10),
        )
    assert report.num_samples == NUM_SAMPLES
    assert report.trace_cov == pytest.approx(gram_reports["mlp"].trace_cov, rel=1e-9)


def _ddp_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        inputs, targets = random_data(NUM_SAMPLES)
        half = slice(rank * 32, (rank + 1) * 32)

        def all_reduce(tensor):
            dist.all_reduce(tensor)
            return tensor

        report = measure(
            tiny_model("mlp"),
            batches(inputs[half], targets[half], 8),
            lam=LAM,
            num_train_samples=N_TRAIN,
            structure=MatrixFreeOptions(structure="lanczos", probes=32, lanczos_steps=40),
            all_reduce=all_reduce,
        )
        queue.put((rank, report.as_dict(), report.blocks["stderr"].soft_rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_two_processes_run_lanczos_in_lockstep(data, gram_reports):
    """Each process holds half the samples; products are summed inside every Lanczos step, so
    both get identical numbers, the statistics of all 64 samples, and the full-data soft rank."""
    context = torch.multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers = [context.Process(target=_ddp_worker, args=(r, port, queue)) for r in range(2)]
    for worker in workers:
        worker.start()
    results = dict((rank, (values, stderr)) for rank, values, stderr in (queue.get(), queue.get()))
    for worker in workers:
        worker.join(timeout=60)
    (first, stderr), (second, _) = results[0], results[1]
    for key, value in first.items():
        if key != "seconds":
            assert value == second[key] or (math.isnan(value) and math.isnan(second[key])), key
    expected = gram_reports["mlp"]
    assert first["num_samples"] == NUM_SAMPLES
    assert first["trace_fisher"] == pytest.approx(expected.trace_fisher, rel=1e-9)
    assert first["trace_cov"] == pytest.approx(expected.trace_cov, rel=1e-9)
    truth = expected.soft_rank
    assert abs(first["soft_rank"] - truth) <= 3 * stderr + 5e-3 * truth
