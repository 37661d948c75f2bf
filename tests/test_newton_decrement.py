"""The Newton decrement ``½ gᵀ(F+λI)⁻¹g`` of the regularized objective against a dense autograd
reference (float64): g from scratch with ``torch.autograd`` on the whole set's mean loss plus
the decay term, F the dense reference Fisher. Exact for ``dense`` and ``gram`` and for the
probe kernel's exact rows (as many probes as classes) on each of its sides; with fewer probes
the jackknifed value converges to it as the probes grow; ``cg`` brackets it with one more
solve; per-group decay; a sum of the states of two processes equals one process."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TwoProcesses, batches, random_data, tiny_model
from zoo import build, zoo_data

from lightning_flatness.core import reference
from lightning_flatness.core.curvature.newton_decrement import regularized_form
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import structure_options
from lightning_flatness.core.spectral import regularized_cholesky
from lightning_flatness.core.trust import DECREMENT_LIMIT, verdict

LAM = 1e-3
N = 24
#: the probe kernel's three sides, forced: the P × P sums, the formed ms × ms kernel, the stored
#: rows (a formed-kernel guard every run here exceeds and a P × P guard below P)
SIDES = {
    "parameters": {"side": "parameters"},
    "formed kernel": {"side": "samples"},
    "stored rows": {"max_kernel_size": 10, "max_parameters": 10, "slq_tolerance": 1e-9},
}


def _objective_gradient(model, inputs, targets, decays, reduction: str) -> torch.Tensor:
    """The gradient of ``mean NLL + ½ Σ λ_j‖θ_j‖²`` by autograd, from the loss with either
    reduction (``"sum"`` divided by m)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = F.cross_entropy(model(inputs), targets, reduction=reduction)
    if reduction == "sum":
        loss = loss / targets.shape[0]
    flat = torch.cat([p.reshape(-1) for p in params])
    loss = loss + 0.5 * (decays * flat.square()).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def reference_decrement(model, inputs, targets, lam=LAM, decays=None, reduction="mean"):
    """``½ gᵀ(F + D)⁻¹g`` from the dense reference Fisher (D = λI, or diag(decays))."""
    model.eval()
    fisher = reference.dense_fisher(model, inputs)
    size = fisher.shape[0]
    diagonal = torch.full((size,), lam, dtype=fisher.dtype) if decays is None else decays
    gradient = _objective_gradient(model, inputs, targets, diagonal, reduction)
    return 0.5 * float(gradient @ torch.linalg.solve(fisher + torch.diag(diagonal), gradient))


def _measure(model, inputs, targets, batch_size, structure="probe_kernel", options=None, **kwargs):
    """``measure()`` of ``structure`` with these fields of its options object."""
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=kwargs.pop("lam", LAM),
        num_train_samples=100,
        structure=structure_options(structure, options),
        **kwargs,
    )


def _zoo_case(name: str):
    model = build(name).eval()
    inputs, targets = zoo_data(name, N)
    return model, inputs, targets


def test_the_reference_does_not_depend_on_the_loss_reduction(one_thread):
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(N)
    mean = reference_decrement(model, inputs, targets, reduction="mean")
    assert reference_decrement(model, inputs, targets, reduction="sum") == pytest.approx(
        mean, rel=1e-12
    )


@pytest.mark.parametrize("structure", ["dense", "gram"])
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
@pytest.mark.parametrize("batch_size", [1, 7, N])
def test_exact_structures_give_the_reference_decrement(
    structure, architecture, batch_size, one_thread
):
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(N)
    expected = reference_decrement(model, inputs, targets)
    report = _measure(model, inputs, targets, batch_size, structure)
    assert report.newton_decrement == pytest.approx(expected, rel=1e-8)
    assert report.as_dict()["newton_decrement"] == report.newton_decrement


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "functional_cnn"])
@pytest.mark.parametrize("batch_size", [1, 7, N])
def test_exact_rows_give_the_reference_decrement_on_every_side(name, side, batch_size, one_thread):
    """As many probes as classes: the exact rows, no probe bias, so the decrement is exact on
    every side (the stored rows' quadrature bracket to its tolerance), for the paper's
    models and a ResNet with BatchNorm and Dropout, whatever the batch size."""
    if name in ("mlp", "cnn"):
        model, (inputs, targets), classes = tiny_model(name).eval(), random_data(N), 10
    else:
        (model, inputs, targets), classes = _zoo_case(name), {"resnet": 4}.get(name, 5)
    expected = reference_decrement(model, inputs, targets)
    options = {"probes": classes, "groups": 1, **SIDES[side]}
    report = _measure(model, inputs, targets, batch_size, options=options)
    tolerance = 1e-5 if side == "stored rows" else 1e-8
    assert report.newton_decrement == pytest.approx(expected, rel=tolerance)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_probes_converge_to_the_reference_decrement(architecture, side, one_thread):
    """Fewer probes than classes: the value comes within a few standard errors (and 25%) of
    the reference with 8 probes, and its error shrinks from 2 to 8 probes; the three sides
    agree."""
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(200)
    expected = reference_decrement(model, inputs, targets, lam=1e-2)
    errors = {}
    for probes in (2, 8):
        options = {"probes": probes, "groups": 2, **SIDES[side]}
        report = _measure(model, inputs, targets, 50, lam=1e-2, options=options)
        errors[probes] = abs(report.newton_decrement - expected)
        if probes == 8:
            assert errors[8] < 4 * report.newton_decrement_stderr + 0.05 * expected
            assert errors[8] < 0.25 * expected
    assert errors[8] < errors[2]


def test_a_plain_value_replaces_a_jackknife_out_of_its_reach(one_thread):
    """Two probes of ten classes at λ = 1e-3: the jackknife would over-correct; the reported
    value is then the plain one, above the reference (convexity), with the correction as its
    standard error."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(200)
    expected = reference_decrement(model, inputs, targets)
    options = {"probes": 2, "groups": 2}
    report = _measure(model, inputs, targets, 50, options=options)
    assert report.newton_decrement > expected
    assert report.newton_decrement - report.newton_decrement_stderr < expected


def _per_group_decays(model) -> tuple[dict[str, float], torch.Tensor]:
    """A λ_j per parameter tensor (each different, the biases' larger) and its diagonal D."""
    names = [name for name, _ in model.named_parameters()]
    lams = {name: LAM * (3.0 if "bias" in name else 1.0) * (i + 1) for i, name in enumerate(names)}
    sizes = [(n, p.numel()) for n, p in model.named_parameters()]
    decays = torch.cat([torch.full((k,), lams[n], dtype=torch.float64) for n, k in sizes])
    return lams, decays


def test_per_group_decay_gives_the_reference_decrement(one_thread):
    """λ_j per parameter tensor: ``½ gᵀ(F + D)⁻¹g`` with the decay term ``D θ`` in g, for the
    exact rows on each side and for ``dense``."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(N)
    lams, decays = _per_group_decays(model)
    expected = reference_decrement(model, inputs, targets, decays=decays)
    for side in SIDES.values():
        options = {"probes": 10, "groups": 1, **side}
        report = _measure(model, inputs, targets, 7, lam=lams, options=options)
        assert report.newton_decrement == pytest.approx(expected, rel=1e-5)
    dense = _measure(model, inputs, targets, 7, "dense", lam=lams)
    assert dense.newton_decrement == pytest.approx(expected, rel=1e-8)


def test_two_processes_summing_their_states_equal_one_process(one_thread):
    """Each of two processes measures every other sample (``shard``); their summed states give
    the decrement of one process on the union (its P × P side, the summable one). ``cg``'s,
    whose products use forward-mode autodiff that two threads cannot share, is checked over two
    real processes (test_ddp)."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(N)
    options = {"probes": 4, "groups": 2}
    single = _measure(model, inputs, targets, 5, options=options, all_reduce=lambda t: t)
    group, reports = TwoProcesses(), [None, None]
    # a replica per rank, as each process has its own: two threads hooking one module would
    # record each other's forward passes
    replicas = [copy.deepcopy(model) for _ in range(2)]

    def run(rank: int) -> None:
        local = (inputs[rank::2], targets[rank::2])
        reports[rank] = _measure(
            replicas[rank],
            *local,
            5,
            options=options,
            all_reduce=group.for_rank(rank),
            shard=(rank, 2),
        )

    group.run(run)
    for report in reports:
        assert report.num_samples == N
        assert report.newton_decrement == pytest.approx(single.newton_decrement, rel=1e-9)
        assert report.newton_decrement_stderr == pytest.approx(
            single.newton_decrement_stderr, rel=1e-6
        )


def _tanh_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = (torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    return torch.nn.Sequential(*layers).double()


def test_a_minimum_has_a_tiny_decrement_and_one_step_from_it_a_large_one(one_thread):
    """A smooth MLP trained to a minimum of its regularized objective (full-batch L-BFGS to a
    gradient norm below 1e-7): a decrement far below the limit; one SGD step from its
    initialisation: far above."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(64, 6, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, 4, (64,), generator=generator)
    model = _tanh_mlp()
    params = list(model.parameters())
    optimizer = torch.optim.LBFGS(
        params,
        max_iter=1000,
        tolerance_grad=1e-12,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        flat = torch.cat([p.reshape(-1) for p in params])
        loss = F.cross_entropy(model(inputs), targets) + 0.5 * 0.05 * flat.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    for structure in ("dense", "probe_kernel"):
        settled = _measure(model.eval(), inputs, targets, 16, structure, lam=0.05)
        assert settled.newton_decrement < 1e-9, structure
    started = _tanh_mlp()
    step = torch.optim.SGD(started.parameters(), lr=0.1, weight_decay=0.05)
    step.zero_grad()
    F.cross_entropy(started(inputs), targets).backward()
    step.step()
    early = _measure(started.eval(), inputs, targets, 16, "dense", lam=0.05)
    assert early.newton_decrement > 2 * DECREMENT_LIMIT
    assert verdict(1.0, "dense", 10.0, 100.0, early.newton_decrement) == 0.0
    assert verdict(1.0, "dense", 10.0, 100.0, settled.newton_decrement) == 1.0


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
@pytest.mark.parametrize("batch_size", [1, 7, N])
def test_cg_brackets_the_reference_decrement_with_one_more_solve(
    architecture, batch_size, one_thread
):
    """``cg`` solves for g in the block of its probes: ``gᵀx`` below the form and ``gᵀx +
    ‖r‖²/λ`` above it, so the reference is within the reported half-width of the value, for
    any batch size; with a tight stopping share the bracket closes on it."""
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(N)
    expected = reference_decrement(model, inputs, targets)
    report = _measure(model, inputs, targets, batch_size, "cg")
    assert abs(report.newton_decrement - expected) <= report.newton_decrement_stderr * (1 + 1e-9)
    assert report.newton_decrement_stderr < 0.02 * expected
    tight = _measure(model, inputs, targets, batch_size, "cg", {"cg_tol": 1e-10})
    assert tight.newton_decrement == pytest.approx(expected, rel=1e-6)


def test_cg_gives_the_reference_decrement_under_per_group_decay(one_thread):
    """λ_j per parameter tensor: ``cg`` solves ``(F + D) x = g`` in the parameters' own
    coordinates, with the decay term ``D θ`` in g."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(N)
    lams, decays = _per_group_decays(model)
    expected = reference_decrement(model, inputs, targets, decays=decays)
    report = _measure(model, inputs, targets, 7, "cg", {"cg_tol": 1e-10}, lam=lams)
    assert report.newton_decrement == pytest.approx(expected, rel=1e-6)


def test_structures_without_the_decrement_report_nan_and_keep_the_rule(one_thread):
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(N)
    for structure in ("kfac", "diag", "hutchinson"):
        report = _measure(model, inputs, targets, 8, structure)
        assert math.isnan(report.newton_decrement), structure
        assert report.trusted == 0.0  # not of exact quality
    # a NaN decrement (a non-finite gradient, a failed solve) is not read
    assert verdict(1.0, "cg", 10.0, 100.0, math.nan) == 1.0
    assert verdict(1.0, "probe_kernel", 10.0, 100.0, DECREMENT_LIMIT) == 1.0
    assert verdict(1.0, "probe_kernel", 10.0, 100.0, DECREMENT_LIMIT * 1.01) == 0.0


def test_a_float32_factor_is_refined_to_the_float64_form():
    """The soft rank's float32 Cholesky factor, used as the preconditioner of conjugate
    gradients, gives ``vᵀ(M + λI)⁻¹v`` to float64 accuracy on an ill-conditioned M."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 200, dtype=torch.float64, generator=generator)
    matrix = (rows * torch.logspace(0, -3, 200, dtype=torch.float64)).T
    matrix = matrix @ matrix.T
    vector = torch.randn(200, dtype=torch.float64, generator=generator)
    lam = 1e-4
    exact = float(vector @ torch.linalg.solve(matrix + lam * torch.eye(200).double(), vector))
    factor = regularized_cholesky(matrix, lam, torch.float32)
    assert regularized_form(matrix, lam, vector, factor) == pytest.approx(exact, rel=1e-10)
    assert regularized_form(matrix, lam, vector) == pytest.approx(exact, rel=1e-10)
