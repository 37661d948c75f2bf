"""``measure()`` leaves the model as found and refuses bad input with a clear message."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TwoProcesses, batches, random_data, tiny_model
from torch import nn

from lightning_flatness.core.failures import (
    MeasurementError,
    StructureTooLargeError,
    TrainingSplitError,
    UnsupportedModelError,
)
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import (
    DenseOptions,
    DiagOptions,
    GramOptions,
    KernelOptions,
    KFACOptions,
    MatrixFreeOptions,
    structure_options,
)
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.report import FlatnessReport

LAM = 1e-3


class BatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(49, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def snapshot(model: nn.Module) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "grads": {
            k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()
        },
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "modes": [m.training for m in model.modules()],
        "attributes": [sorted(vars(m)) for m in model.modules()],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, after: dict) -> None:
    for key in ("params", "buffers"):
        for name, value in before[key].items():
            assert torch.equal(value, after[key][name]), f"{key} {name} changed"
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None and other is None) or torch.equal(grad, other), f"grad {name}"
    assert before["modes"] == after["modes"]
    assert before["attributes"] == after["attributes"]
    assert before["hooks"] == after["hooks"]
    assert torch.equal(before["rng"], after["rng"])


@pytest.mark.parametrize("structure", ["dense", "gram", "kfac", "diag", "diag_mc"])
def test_model_left_as_found(structure):
    torch.manual_seed(0)
    # KFAC has no BatchNorm rule (tested below); the other structures see running statistics.
    model = tiny_model("cnn").train() if structure == "kfac" else BatchNormMLP().double().train()
    inputs, targets = random_data(32)
    model(inputs)  # non-trivial running statistics
    nn.functional.cross_entropy(model(inputs), targets).backward()  # a .grad to preserve
    before = snapshot(model)
    sampled = {"trace_estimator": "sampled"}
    if structure == "kfac":
        sampled["kfac_mode"] = "sampled"
    report = measure(
        model,
        batches(inputs, targets, 8),
        lam=LAM,
        num_train_samples=100,
        structure=structure_options(structure, sampled),
        val_batches=batches(inputs, targets, 8),
    )
    assert math.isfinite(report.soft_rank)
    assert_same(before, snapshot(model))


def test_measures_in_eval_mode():
    """BatchNorm uses its running statistics: the loss equals the eval-mode loss."""
    torch.manual_seed(0)
    model = BatchNormMLP().double().train()
    inputs, targets = random_data(32)
    model(inputs)
    report = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=100, structure="diag")
    model.eval()
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model(inputs), targets)
    assert report.train_nll == pytest.approx(float(expected), rel=1e-10)


def test_training_after_measure_is_bit_identical():
    inputs, targets = random_data(64)

    def train(measure_between: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = tiny_model("cnn").train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
        for step in range(4):
            optimizer.zero_grad()
            index = torch.randperm(64)[:16]  # consumes the global RNG
            nn.functional.cross_entropy(model(inputs[index]), targets[index]).backward()
            if measure_between and step == 1:
                measure(
                    model,
                    batches(inputs, targets, 16),
                    lam=LAM,
                    num_train_samples=64,
                    structure=KFACOptions(kfac_mode="sampled"),
                )
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for plain, measured in zip(train(False), train(True), strict=True):
        assert torch.equal(plain, measured)


@pytest.mark.parametrize("lam", [0.0, -1e-3, math.nan])
def test_lambda_must_be_positive(lam):
    model = tiny_model("mlp")
    with pytest.raises(ValueError, match="lam="):
        measure(model, [random_data(4)], lam=lam, num_train_samples=10)


def test_bad_arguments_name_the_value():
    model = tiny_model("mlp")
    data = [random_data(4)]
    with pytest.raises(ValueError, match="'spectral'"):
        measure(model, data, lam=LAM, num_train_samples=10, structure="spectral")
    with pytest.raises(ValueError, match="num_train_samples"):
        measure(model, data, lam=LAM, num_train_samples=0)
    with pytest.raises(ValueError, match="max_samples"):
        measure(model, data, lam=LAM, num_train_samples=10, max_samples=0)
    with pytest.raises(ValueError, match="kfac_mode"):
        KFACOptions(kfac_mode="fast")
    with pytest.raises(ValueError, match="trace_estimator"):
        KernelOptions(trace_estimator="approx")
    with pytest.raises(ValueError, match="mc_samples"):
        DiagOptions(sampled=True, mc_samples=0)
    with pytest.raises(ValueError, match=r"DenseOptions\.max_parameters"):
        DenseOptions(max_parameters=0)
    with pytest.raises(ValueError, match="probes"):
        MatrixFreeOptions(structure="lanczos", probes=0)


@pytest.mark.parametrize(
    "keyword",
    [
        {"kfac_mode": "probe"},
        {"trace_estimator": "exact"},
        {"mc_samples": 2},
        {"dense_max_parameters": 10},
        {"gram_max_kernel_size": 10},
        {"matrix_free_options": {"probes": 2}},
        {"kernel_options": {"probes": 2}},
        {"loss": "mse"},
        {"unpack_batch": lambda batch: batch},
        {"logits_fn": lambda model, inputs: model(inputs)},
    ],
)
def test_the_removed_keywords_are_refused(keyword):
    """A structure's options are set only through its options object, and how batches are read
    only through a BatchReading: the loose keywords of either are refused, never ignored."""
    with pytest.raises(TypeError, match=next(iter(keyword))):
        measure(tiny_model("mlp"), [random_data(4)], lam=LAM, num_train_samples=10, **keyword)


@pytest.mark.parametrize(
    ("structure", "match"),
    [
        ({"kfac_mode": "probe"}, r"dict.*KFACOptions\(kfac_mode='probe'\)"),
        (KFACOptions, "KFACOptions"),
        (3, "structure's name"),
    ],
)
def test_a_structure_that_is_no_name_and_no_options_object_is_refused(structure, match):
    with pytest.raises(ValueError, match=match):
        measure(
            tiny_model("mlp"), [random_data(4)], lam=LAM, num_train_samples=10, structure=structure
        )


@pytest.mark.parametrize("reading", [{"loss": "mse"}, "mse", lambda batch: batch])
def test_a_reading_that_is_no_batch_reading_is_refused(reading):
    with pytest.raises(ValueError, match=r"reading must be a BatchReading.*BatchReading\(loss="):
        measure(tiny_model("mlp"), [random_data(4)], lam=LAM, num_train_samples=10, reading=reading)


def test_measure_takes_at_most_twelve_parameters():
    """One way to configure a measurement: the structure's options object and the BatchReading
    carry every option, so the signature stays short (issue item 2)."""
    import inspect

    parameters = inspect.signature(measure).parameters
    assert len(parameters) <= 12
    assert {"structure", "reading"} <= set(parameters)


@pytest.mark.parametrize(
    ("structure", "kind", "field", "value"),
    [
        ("kfac", KFACOptions, "kfac_mode", "exact"),
        ("diag", DiagOptions, "sampled", False),
        ("diag_mc", DiagOptions, "sampled", True),
        ("dense", DenseOptions, "max_parameters", None),
        ("gram", GramOptions, "max_kernel_size", None),
        ("probe_kernel", KernelOptions, "probes", None),
        ("lanczos", MatrixFreeOptions, "structure", "lanczos"),
        ("hutchinson", MatrixFreeOptions, "trace_estimator", "auto"),
    ],
)
def test_a_name_gives_its_structures_default_options(structure, kind, field, value):
    options = structure_options(structure)
    assert type(options) is kind and options.structure == structure
    assert getattr(options, field) == value


def test_options_from_a_mapping_name_an_unknown_field():
    assert structure_options("lanczos", {"probes": 3}) == MatrixFreeOptions(
        structure="lanczos", probes=3
    )
    assert structure_options("kfac", {"kfac_mode": "probe"}) == KFACOptions(kfac_mode="probe")
    with pytest.raises(ValueError, match=r"KFACOptions.*no option \['probes'\].*'kfac_mode'"):
        structure_options("kfac", {"probes": 3})
    with pytest.raises(ValueError, match="sampled"):
        structure_options("diag", {"sampled": True})  # the name says which diagonal


def test_the_monitor_measures_with_the_options_object_it_is_given():
    """An options object names its structure; the monitor hands it to measure() as it is, and
    a name gets the monitor's defaults (Tr(F) and kfac's rows from probes)."""
    from lightning_flatness import FlatnessMonitor

    options = MatrixFreeOptions(structure="lanczos", probes=3)
    monitor = FlatnessMonitor(structure=options)
    assert monitor.structure == "lanczos"
    assert monitor.measurer.arguments("lanczos") == {"structure": options}
    assert monitor.measurer.arguments("kfac") == {
        "structure": KFACOptions(kfac_mode="probe", trace_estimator="probe")
    }
    with pytest.raises(ValueError, match="kfac_mode must be one of"):
        KFACOptions(kfac_mode="fast")
    with pytest.raises(ValueError, match="structure must be one of"):
        MatrixFreeOptions(structure="kfac")


def test_empty_loader_is_refused():
    with pytest.raises(MeasurementError, match="no samples"):
        measure(tiny_model("mlp"), [], lam=LAM, num_train_samples=10)


@pytest.mark.parametrize("structure", ["probe_kernel", "kfac", "cg"])
def test_a_process_without_training_samples_is_refused_on_every_process(structure, one_thread):
    """Under data parallelism a process given no batches has no curvature states to sum with
    the others': every process raises the same clear error (none hangs or crashes)."""
    inputs, targets = random_data(20)
    group, raised = TwoProcesses(), [None, None]

    def run(rank: int) -> None:
        try:
            measure(
                tiny_model("mlp").eval(),
                batches(inputs, targets, 5) if rank == 0 else [],
                lam=LAM,
                num_train_samples=20,
                structure=structure,
                all_reduce=group.for_rank(rank),
                shard=(rank, 2),
            )
        except MeasurementError as error:
            raised[rank] = str(error)

    group.run(run)
    assert raised[0] == raised[1]
    assert "1 of 2 processes measured no training samples" in raised[0]


def test_gram_across_processes_is_refused_naming_what_sums():
    """``gram`` keeps per-sample rows, which do not add up across processes: refused before
    any batch is read, with the structures that do."""
    inputs, targets = random_data(8)
    with pytest.raises(ValueError, match=r"do not sum across processes.*'dense', 'kfac'"):
        measure(
            tiny_model("mlp"),
            batches(inputs, targets, 4),
            lam=LAM,
            num_train_samples=10,
            structure="gram",
            all_reduce=lambda tensor: tensor,
        )


def test_non_finite_loss_is_refused():
    inputs, targets = random_data(8)
    inputs[3] = math.nan
    with pytest.raises(MeasurementError, match="batch 1"):
        measure(tiny_model("mlp"), batches(inputs, targets, 2), lam=LAM, num_train_samples=10)


@pytest.mark.parametrize("structure", ["kfac", "probe_kernel", "gram", "lanczos"])
def test_a_non_finite_training_batch_keeps_the_held_out_numbers(structure):
    """The training split's failure carries the held-out split's statistics, equal to those of
    a measurement whose training data are sound."""
    inputs, targets = random_data(8)
    bad = inputs.clone()
    bad[3] = math.nan
    val = batches(*random_data(6, seed=2), 4)
    kwargs = {"lam": LAM, "num_train_samples": 10, "structure": structure}
    sound = measure(tiny_model("mlp"), batches(inputs, targets, 4), val_batches=val, **kwargs)
    with pytest.raises(TrainingSplitError, match="batch 0") as failure:
        measure(tiny_model("mlp"), batches(bad, targets, 4), val_batches=val, **kwargs)
    kept = FlatnessReport.failed(structure, LAM, 10, val=failure.value.val_sums)
    for name in ("val_nll", "val_accuracy", "trace_fisher_val", "trace_cov_val", "trace_ratio_val"):
        assert getattr(kept, name) == pytest.approx(getattr(sound, name), rel=1e-9), name
    assert kept.num_val_samples == 6
    assert math.isnan(kept.soft_rank) and math.isnan(kept.train_nll)


def test_unsupported_layer_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(10, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = nn.Sequential(tiny_model("mlp"), Scale())
    with pytest.raises(UnsupportedModelError, match="Scale"):
        measure(model, [random_data(4)], lam=LAM, num_train_samples=10, structure="gram")
    # the layer-hook structures measure it: its parameter is an exact diagonal block
    report = measure(model, [random_data(4)], lam=LAM, num_train_samples=10, structure="diag")
    assert report.coverage["1.scale"] == "diagonal"


def test_size_guards():
    model = tiny_model("mlp")
    with pytest.raises(StructureTooLargeError, match=r"DenseOptions\.max_parameters"):
        measure(
            model,
            [random_data(4)],
            lam=LAM,
            num_train_samples=10,
            structure=DenseOptions(max_parameters=100),
        )
    with pytest.raises(StructureTooLargeError, match=r"GramOptions\.max_kernel_size"):
        measure(
            model,
            [random_data(16)],
            lam=LAM,
            num_train_samples=10,
            structure=GramOptions(max_kernel_size=50),
        )


def test_random_structures_report_their_error_bars():
    data = [random_data(32)]
    lanczos = measure(
        tiny_model("mlp"),
        data,
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="lanczos", probes=4, lanczos_steps=10),
    ).as_dict()
    assert lanczos["soft_rank_stderr"] > 0 and lanczos["logdet_stderr"] > 0
    hutchinson = measure(
        tiny_model("mlp"),
        data,
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(structure="hutchinson", probes=4),
    ).as_dict()
    for bound in ("lower", "estimate", "upper"):
        assert hutchinson[f"hutchinson_trace_{bound}_stderr"] >= 0
    assert hutchinson["hutchinson_trace_lower"] <= hutchinson["hutchinson_trace_upper"]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("kfac", KFACOptions()),
        ("diag_mc", DiagOptions(sampled=True)),
        ("probe_kernel", KernelOptions()),
        ("cg", MatrixFreeOptions()),
    ],
)
def test_a_name_measures_as_its_default_options_object_does(name, options):
    """A name is its structure's default options object: the same report, number for number
    (the probe kernel's rows chosen from the samples either way)."""
    model = tiny_model("mlp")
    inputs, targets = random_data(24)
    common = {"lam": 1e-2, "num_train_samples": 24, "seed": 3}
    by_name = measure(model, batches(inputs, targets, 8), structure=name, **common)
    by_object = measure(model, batches(inputs, targets, 8), structure=options, **common)
    assert by_object.structure == options.structure
    first, second = by_name.as_dict(), by_object.as_dict()
    first.pop("seconds"), second.pop("seconds")
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert value == second[key] or (math.isnan(value) and math.isnan(second[key])), key


def test_a_batch_reading_is_handed_to_every_structure():
    """``reading`` says the loss and how a batch is read, for every backend alike."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(12, 4, dtype=torch.float64, generator=generator)
    targets = torch.randn(12, 2, dtype=torch.float64, generator=generator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    reading = BatchReading(loss="mse", unpack_batch=lambda batch: (batch["x"], batch["y"]))
    data = [{"x": inputs[:6], "y": targets[:6]}, {"x": inputs[6:], "y": targets[6:]}]
    dense = measure(model, data, lam=LAM, num_train_samples=12, structure="dense", reading=reading)
    for structure in ("probe_kernel", "lanczos"):
        report = measure(
            model, data, lam=LAM, num_train_samples=12, structure=structure, reading=reading
        )
        assert report.train_nll == pytest.approx(dense.train_nll, rel=1e-12), structure
