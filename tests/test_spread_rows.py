"""The probe kernel's rows kept by several processes: stochastic Lanczos quadrature in the
rows' space with its vectors split across processes, the products' sums over rows and the
runs' inner products summed (float64, tiny models), against the dense autograd reference, the
formed kernel of the same rows and one process's estimate; per-group decay; where each
process's rows sit among the union's; two processes (threads with a summing ``all_reduce``)
against one."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TwoProcesses, batches, many_classes, random_data, tiny_model

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.curvature.row_positions import union_entries, union_samples
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import KernelOptions

LAM = 1e-3
#: P above the P × P guard and more rows than a formed kernel: one process keeps its rows
STORED = {"max_kernel_size": 10, "max_parameters": 10}
#: P above the P × P guard, the rows few enough for a formed kernel: the processes gather them
FORMED = {"max_kernel_size": 10_000, "max_parameters": 10}
#: the same where rows of 100 parameters on are sketched: few rows are not, many are
SKETCHABLE = {**FORMED, "sketch_from_parameters": 100, "sketch_factor": 2}
#: P above the guard and many rows, sketched 2 times shorter in 2 groups (the tiny models are
#: far below the default's 32,768 parameters)
SKETCHED = {**STORED, "sketch_from_parameters": 100, "sketch_factor": 2}


def one_process(tensor: torch.Tensor) -> torch.Tensor:
    """The ``all_reduce`` of a world of one: the sum over one process."""
    return tensor


def _measure(model, inputs, targets, batch_size=7, all_reduce=one_process, lam=LAM, **options):
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=lam,
        num_train_samples=100,
        structure=KernelOptions(**options),
        all_reduce=all_reduce,
    )


def _exact(model, inputs, damping: torch.Tensor | None = None) -> spectral.SpectralSummary:
    """The dense reference's trace functions at λ, or of ``Tr(F(F+D)⁻¹)`` for a diagonal D."""
    fisher = reference.dense_fisher(model, inputs)
    if damping is None:
        return spectral.spectral_summary(spectral.psd_eigenvalues(fisher), LAM)
    scale = damping.rsqrt()
    whitened = scale[:, None] * fisher * scale[None, :]
    return spectral.spectral_summary(spectral.psd_eigenvalues(whitened), 1.0)


@pytest.mark.parametrize("batch_size", [1, 48])
def test_exact_rows_converge_to_the_dense_fishers_trace_functions(batch_size, one_thread):
    """The exact output rows (no probe bias): every trace function within its error bars of
    the dense reference, the trace and the largest eigenvalue exact, the value independent of
    the batch size."""
    model, inputs, targets = many_classes()
    exact = _exact(model, inputs)
    options = {"probes": 30, "groups": 1, "slq_probes": 32, "slq_steps": 100, **STORED}
    report = _measure(model, inputs, targets, batch_size, **options)
    stderr = report.as_dict()
    for field in ("soft_rank", "logdet"):
        error = abs(getattr(report, field) - getattr(exact, field))
        assert error < 4 * stderr[f"{field}_stderr"], field
        assert error < 0.05 * getattr(exact, field), field
    assert report.trace_fisher == pytest.approx(exact.trace, rel=1e-9)
    assert report.max_eig == pytest.approx(exact.max_eig, rel=1e-8)
    other = _measure(model, inputs, targets, 5, **options)
    assert other.soft_rank == pytest.approx(report.soft_rank, rel=1e-9)


def test_probe_rows_converge_to_the_formed_kernel_of_the_same_rows(one_thread):
    """4 probes in 2 groups: the jackknife of the probe groups as on the formed kernel, and
    convergence to it as the Hutchinson probes grow."""
    model, inputs, targets = many_classes()
    formed = _measure(model, inputs, targets, all_reduce=None, probes=4, side="samples")
    errors = {}
    for slq_probes in (8, 256):
        spread = _measure(model, inputs, targets, probes=4, slq_probes=slq_probes, **STORED)
        errors[slq_probes] = abs(spread.soft_rank / formed.soft_rank - 1)
        stderr = spread.as_dict()["soft_rank_stderr"]
        assert abs(spread.soft_rank - formed.soft_rank) < 4 * stderr
        assert spread.trace_fisher == pytest.approx(formed.trace_fisher, rel=1e-9)
    assert errors[256] < errors[8] and errors[256] < 0.02


ARRANGEMENTS = pytest.mark.parametrize(
    "options",
    [STORED, SKETCHED, FORMED, SKETCHABLE],
    ids=["whole rows", "sketched rows", "gathered rows", "gathered sketchable rows"],
)


@ARRANGEMENTS
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_a_world_of_one_is_the_one_process_estimate(architecture, options, one_thread):
    """Through the split runs with a world of one: every number of the one-process stored-row
    estimate (the same probes, the same products), the decrement included; sketched rows give
    none. Rows few enough for a formed kernel: the one-process formed kernel's numbers."""
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(40)
    spread = _measure(model, inputs, targets, probes=4, **options).as_dict()
    rows = _measure(model, inputs, targets, all_reduce=None, probes=4, **options).as_dict()
    for key in ("soft_rank", "soft_rank_stderr", "logdet", "trace_fisher", "max_eig"):
        assert spread[key] == pytest.approx(rows[key], rel=1e-9), key
    decrement = spread["newton_decrement"]
    assert decrement == pytest.approx(rows["newton_decrement"], rel=1e-9, nan_ok=True)
    assert (decrement != decrement) == (options is SKETCHED)  # NaN on sketched rows


@pytest.mark.parametrize("counts", [(334, 334, 333), (700, 0, 0), (1, 0, 0), (300, 300, 299)])
def test_each_process_rows_sit_once_among_the_unions(counts):
    """Every process's entries land on distinct places of the union's rows' space, over
    several slabs; with the shares a distributed sampler gives they fill it exactly, and a
    world of one is the one process's own order."""
    probes, groups, width = 4, 2, 10
    world = len(counts)
    sums = torch.tensor(counts, dtype=torch.float64)

    def everyone(tensor: torch.Tensor) -> torch.Tensor:  # every process's one-hot count
        return sums.clone()

    total = union_samples(counts[0], (0, world), everyone)
    entries = [
        union_entries(probes, groups, width, n, (r, world), total) for r, n in enumerate(counts)
    ]
    union = torch.cat(entries)
    assert union.unique().numel() == union.numel() == probes * sum(counts)
    assert int(union.max()) < probes * total
    if total == sum(counts):
        assert torch.equal(union.sort().values, torch.arange(probes * total))
    alone = union_entries(probes, groups, width, 700, (0, 1), 700)
    assert torch.equal(alone, torch.arange(probes * 700))


def test_per_group_decay_gives_the_generalised_soft_rank(one_thread):
    """``Tr(F(F+D)⁻¹)`` with no decay on the biases: the exact rows, scaled by ``D^{-1/2}``, kept
    as one process's share, within their error bars of the dense reference."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(24)
    decays = {n: (0.0 if n.endswith("bias") else 1e-2) for n, _ in model.named_parameters()}
    names, sizes = zip(*((n, p.numel()) for n, p in model.named_parameters()), strict=True)
    damping = ParameterDecay(decays).diagonal(list(names), list(sizes))
    exact = _exact(model, inputs, damping)
    options = {"probes": 10, "groups": 1, "slq_probes": 64, "slq_steps": 100, **STORED}
    report = _measure(model, inputs, targets, lam=decays, **options)
    error = abs(report.soft_rank - exact.soft_rank)
    assert error < 4 * report.as_dict()["soft_rank_stderr"]
    assert error < 0.05 * exact.soft_rank
    assert report.max_eig == pytest.approx(exact.max_eig, rel=1e-8)  # of D^{-1/2} F D^{-1/2}


@ARRANGEMENTS
def test_two_processes_keeping_their_rows_equal_one_process(options, one_thread):
    """Each of two processes keeps the rows of every other sample (``shard``): the split runs,
    or the rows gathered where they fit a formed kernel, give every number one process gives on
    the union, the decrement included."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(40)
    single = _measure(model, inputs, targets, 5, probes=4, **options)
    group, reports = TwoProcesses(), [None, None]
    replicas = [copy.deepcopy(model) for _ in range(2)]  # each process has its own

    def run(rank: int) -> None:
        reports[rank] = measure(
            replicas[rank],
            batches(inputs[rank::2], targets[rank::2], 5),
            lam=LAM,
            num_train_samples=100,
            structure=KernelOptions(**{"probes": 4, **options}),
            all_reduce=group.for_rank(rank),
            shard=(rank, 2),
        )

    group.run(run)
    expected = single.as_dict()
    for report in reports:
        measured = report.as_dict()
        assert report.num_samples == 40
        for key in ("soft_rank", "soft_rank_stderr", "logdet", "trace_fisher", "max_eig"):
            assert measured[key] == pytest.approx(expected[key], rel=1e-9), key
        decrement = measured["newton_decrement"]
        assert decrement == pytest.approx(expected["newton_decrement"], rel=1e-9, nan_ok=True)
    assert (expected["newton_decrement"] != expected["newton_decrement"]) == (options is SKETCHED)
