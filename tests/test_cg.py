"""``structure="cg"``: Hutchinson on Tr((F+λI)⁻¹F) with preconditioned conjugate gradients,
against the dense autograd reference (float64).

The estimate is random only through its probes: with enough of them it lands on the exact soft
rank within its error bar; every iterate is a lower bound that rises with the budget; and the
preconditioner changes how fast the solves converge, not where they go.
"""

from __future__ import annotations

import pytest
import torch
from conftest import batches, random_data, tiny_model

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.curvature.cg import KroneckerPreconditioner, conjugate_gradients
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import MatrixFreeOptions

LAM = 1e-3


def _cg(model, inputs, targets, batch_size=7, **options):
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(**{"cg_tol": 1e-4, "cg_steps": 300, **options}),
    )


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_cg_lands_on_the_exact_soft_rank_within_its_error_bar(architecture, one_thread):
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(48)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(reference.dense_fisher(model, inputs)), LAM)
    report = _cg(model, inputs, targets, probes=16)
    stderr = report.as_dict()["soft_rank_stderr"]
    assert 0 < stderr < 0.05 * exact
    assert abs(report.soft_rank - exact) < 4 * stderr
    assert report.blocks["cg_gap"].soft_rank < 1e-3 * exact


def test_every_iterate_is_a_lower_bound_that_rises_with_the_budget(one_thread):
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(32)
    values = [
        _cg(model, inputs, targets, probes=4, cg_steps=steps).soft_rank for steps in (2, 5, 300)
    ]
    assert values[0] < values[1] < values[2]


def test_the_preconditioner_changes_the_path_not_the_answer(one_thread):
    model = tiny_model("resmlp").eval()
    inputs, targets = random_data(32)
    plain = _cg(model, inputs, targets, probes=4, preconditioner="none")
    kfac = _cg(model, inputs, targets, probes=4, preconditioner="kfac")
    assert kfac.soft_rank == pytest.approx(plain.soft_rank, rel=1e-3)


def test_batch_size_does_not_change_the_solve(one_thread):
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(32)
    whole = _cg(model, inputs, targets, batch_size=32, probes=4)
    split = _cg(model, inputs, targets, batch_size=5, probes=4)
    assert split.trace_fisher == pytest.approx(whole.trace_fisher, rel=1e-9)
    # the probes are drawn per sample in stream order: the same draws, the same solves
    assert split.soft_rank == pytest.approx(whole.soft_rank, rel=1e-3)


def test_conjugate_gradients_solve_a_known_system():
    generator = torch.Generator().manual_seed(0)
    basis = torch.randn(30, 30, generator=generator, dtype=torch.float64)
    fisher = basis @ basis.T / 30
    rhs = torch.randn(3, 30, generator=generator, dtype=torch.float64)
    values, gaps, steps = conjugate_gradients(
        lambda v: v @ fisher, rhs, 0.1, max_steps=100, tol=1e-12
    )
    solved = torch.linalg.solve(fisher + 0.1 * torch.eye(30, dtype=torch.float64), rhs.T).T
    assert torch.allclose(values, (rhs * solved).sum(-1), rtol=1e-8)
    assert steps <= 31 and float(gaps.sum()) <= 1e-12 * float(values.sum())


def test_each_solve_is_the_galerkin_projection_onto_the_shared_block_krylov_space():
    """After j steps every solve's value is wᵀx for the best x in span{W, AW, …, A^(j-1)W}
    (A = F + λI): the K solves share one search space, which independent solves would not."""
    generator = torch.Generator().manual_seed(2)
    basis = torch.randn(40, 40, generator=generator, dtype=torch.float64)
    fisher = basis @ torch.diag(torch.logspace(-3, 1, 40, dtype=torch.float64)) @ basis.T / 40
    lam = 0.01
    system = fisher + lam * torch.eye(40, dtype=torch.float64)
    rhs = torch.randn(3, 40, generator=generator, dtype=torch.float64)
    for steps in (1, 2, 4):
        values, gaps, used = conjugate_gradients(
            lambda v: v @ fisher, rhs, lam, max_steps=steps, tol=1e-14
        )
        krylov = torch.cat([rhs @ torch.linalg.matrix_power(system, j) for j in range(steps)])
        space = torch.linalg.qr(krylov.T).Q  # (40, 3·steps)
        projected = space.T @ system @ space
        best = space @ torch.linalg.solve(projected, space.T @ rhs.T)  # (40, 3)
        expected = (rhs.T * best).sum(0)
        exact = (rhs.T * torch.linalg.solve(system, rhs.T)).sum(0)
        assert used == steps
        assert torch.allclose(values, expected, rtol=1e-8)
        assert torch.all(values <= exact) and torch.all(exact - values <= gaps * (1 + 1e-9))


def test_kronecker_preconditioner_inverts_its_own_approximation():
    """(G ⊗ A + λI)⁻¹ applied to (G ⊗ A + λI) v gives v back; likewise a bias block and a
    diagonal."""
    generator = torch.Generator().manual_seed(1)
    g_root = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    a_root = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    b_root = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    kfac = KFACFisher()
    kfac.kronecker["w"] = [g_root @ g_root.T, a_root @ a_root.T]
    kfac.blocks["b"] = b_root @ b_root.T
    kfac.diagonal["d"] = torch.rand(5, generator=generator, dtype=torch.float64)
    shapes = [torch.Size([3, 4]), torch.Size([3]), torch.Size([5])]
    lam = 0.3
    precondition = KroneckerPreconditioner(kfac, ["w", "b", "d"], shapes, 1, lam)
    dense = torch.block_diag(
        torch.kron(kfac.kronecker["w"][0], kfac.kronecker["w"][1]),
        kfac.blocks["b"],
        torch.diag(kfac.diagonal["d"]),
    ) + lam * torch.eye(20, dtype=torch.float64)
    vectors = torch.randn(2, 20, generator=generator, dtype=torch.float64)
    assert torch.allclose(precondition(vectors @ dense), vectors, atol=1e-10)


def test_kronecker_preconditioner_reads_a_transposed_weight_in_its_own_layout():
    """A weight stored (in, out) (Hugging Face's ``Conv1D``) has the factors of its (out, in)
    map: in the stored layout its block is ``A ⊗ G``, square or not."""
    generator = torch.Generator().manual_seed(2)
    for outputs, features in ((3, 4), (3, 3)):
        g_root = torch.randn(outputs, outputs, generator=generator, dtype=torch.float64)
        a_root = torch.randn(features, features, generator=generator, dtype=torch.float64)
        kfac = KFACFisher()
        kfac.kronecker["t"] = [g_root @ g_root.T, a_root @ a_root.T]
        lam = 0.3
        shape = torch.Size([features, outputs])
        precondition = KroneckerPreconditioner(
            kfac, ["t"], [shape], 1, lam, transposed=frozenset({"t"})
        )
        size = outputs * features
        stored = torch.kron(kfac.kronecker["t"][1], kfac.kronecker["t"][0])
        dense = stored + lam * torch.eye(size, dtype=torch.float64)
        vectors = torch.randn(2, size, generator=generator, dtype=torch.float64)
        assert torch.allclose(precondition(vectors @ dense), vectors, atol=1e-10)


def test_cg_measures_gpt2_with_frozen_transposed_weights(one_thread):
    """BitFit-style fine-tuning: Conv1D weights frozen, their biases trained; the
    preconditioner has no transposed weight to read and cg still lands on the exact value."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import build, zoo_data

    model = build("gpt2").double().eval()
    for module in (model.c_attn, model.attn_proj, model.c_fc, model.mlp_proj):
        module.weight.requires_grad_(False)
    inputs, targets = zoo_data("gpt2", 8)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(8):
        one = {key: value[i : i + 1] for key, value in inputs.items()}
        log_p = model(**one)[0].log_softmax(-1)
        for c in range(log_p.shape[0]):
            grads = torch.autograd.grad(log_p[c], trainable, retain_graph=True)
            rows.append(log_p[c].exp().sqrt().detach() * torch.cat([g.flatten() for g in grads]))
    stacked = torch.stack(rows)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(stacked.T @ stacked / 8), LAM)
    data = [({k: v[i : i + 4] for k, v in inputs.items()}, targets[i : i + 4]) for i in (0, 4)]
    report = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=100,
        structure=MatrixFreeOptions(probes=16, cg_steps=300, cg_tol=1e-6),
    )
    assert abs(report.soft_rank - exact) < 4 * report.as_dict()["soft_rank_stderr"] + 1e-6
