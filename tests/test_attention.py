"""nn.MultiheadAttention's projections measured as the linear maps they are: exact per-sample
gradients from their patches and output gradients, Kronecker factors under kfac, and the
module's own per-sample gradients where the projections cannot be followed (cross-attention,
bias_k/bias_v)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_kronecker_blocks_exact
from torch import Tensor, nn

from lightning_flatness import KFACOptions, measure
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.module_rules import AttentionRule, LocalRule
from lightning_flatness.core.rule_assignment import record_call

LAM = 1e-3


class AttentionClassifier(nn.Module):
    """Tokens → embedding → one attention layer (self- or cross-attention to a fixed memory) →
    mean over positions → classes; padding tokens (0) are masked as keys."""

    def __init__(self, batch_first: bool = True, cross: bool = False, **attention) -> None:
        super().__init__()
        self.batch_first, self.cross = batch_first, cross
        self.embed = nn.Embedding(11, 6)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=batch_first, **attention)
        self.memory = nn.Parameter(torch.randn(1, 3, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        mask = tokens == 0
        if self.cross:
            memory = self.memory.expand(len(tokens), -1, -1) * 1.0
            keys, mask = memory, None
        else:
            keys = x
        if not self.batch_first:  # self-attention: one tensor for query, key and value
            x, keys = x.transpose(0, 1), (keys.transpose(0, 1) if self.cross else None)
            keys = x if keys is None else keys
        out, _ = self.attention(x, keys, keys, key_padding_mask=mask)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


def _data(n: int, steps: int = 5) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 11, (n, steps), generator=generator)
    lengths = torch.randint(2, steps + 1, (n,), generator=generator)
    tokens = tokens.masked_fill(torch.arange(steps) >= lengths.unsqueeze(1), 0)
    return tokens, torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("batch_first", [True, False])
def test_projection_maps_give_the_modules_own_per_sample_gradients(batch_first):
    torch.manual_seed(0)
    module = nn.MultiheadAttention(6, 2, batch_first=batch_first).double().eval()
    names = {attr: attr for attr, _ in module.named_parameters()}
    shape = (4, 5, 6) if batch_first else (5, 4, 6)
    x = torch.randn(*shape, dtype=torch.float64)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[0, 3:] = True
    rule = AttentionRule([module], names, batch_dim=0 if batch_first else 1)
    record_call([rule], module, (x, x, x), {"key_padding_mask": mask}, module(x, x, x), 4)
    cotangents = torch.randn(3, *rule.calls[0].output.shape, dtype=torch.float64)
    plain = LocalRule([module], names, calls=rule.calls, batch_dim=rule.batch_dim)
    expected = plain.per_sample_gradients([cotangents])
    found = rule.per_sample_gradients([cotangents])
    assert set(rule.factored) == set(names)
    for name, value in expected.items():
        assert torch.allclose(found[name], value, rtol=1e-10, atol=1e-13), name


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_is_kronecker_and_exact_for_one_sample_at_one_position(batch_first):
    """G ⊗ A of each projection is its exact Fisher block for one sample at one position (the
    factorisation's only approximation is over samples and positions)."""
    torch.manual_seed(0)
    model = AttentionClassifier(batch_first).double().eval()
    names = ["attention.in_proj_weight", "attention.out_proj.weight"]
    assert_kronecker_blocks_exact(model, torch.tensor([[4]]), torch.tensor([2]), names, LAM)


@pytest.mark.parametrize(
    ("options", "kind"),
    [
        ({"batch_first": True}, "kronecker"),
        ({"batch_first": False}, "kronecker"),
        ({"cross": True}, "diagonal"),  # query ≠ key: three maps in one weight
        ({"add_bias_kv": True}, "diagonal"),
    ],
)
def test_every_structure_is_exact_where_it_claims_and_batch_size_free(options, kind):
    torch.manual_seed(0)
    model = AttentionClassifier(**options).double().eval()
    inputs, targets = _data(10)
    fisher = reference.dense_fisher(model, inputs)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    for size in (1, 4, 10):
        data = [(inputs[i : i + size], targets[i : i + size]) for i in range(0, 10, size)]
        default = measure(model, data, lam=LAM, num_train_samples=100)  # exact rows
        assert default.soft_rank == pytest.approx(exact, rel=1e-8)
        assert default.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-8)
        kfac = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
        assert kfac.coverage["attention.in_proj_weight"] == kind
        assert kfac.coverage["attention.out_proj.weight"] == kind
        assert kfac.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-8)
        diag = measure(model, data, lam=LAM, num_train_samples=100, structure="diag")
        expected = spectral.soft_rank(fisher.diagonal(), LAM)
        assert diag.soft_rank == pytest.approx(expected, rel=1e-8)
        if size == 1:
            first = kfac.soft_rank
        else:
            assert kfac.soft_rank == pytest.approx(first, rel=1e-9)


@pytest.mark.parametrize("batch_first", [True, False])
def test_projections_read_off_the_pass_equal_a_second_run_of_the_module(batch_first, monkeypatch):
    """The hooked pass records the projections' own calls and reads their output gradients off
    its backward rows; forcing the second run of the module per sample instead gives the same
    kfac numbers at every batch size, and the recorded path is the one taken."""
    import lightning_flatness.core.module_rules as module_rules

    torch.manual_seed(0)
    model = AttentionClassifier(batch_first).double().eval()
    inputs, targets = _data(9)
    taken = []
    recorded = module_rules.recorded_projection_maps

    def counting(*args, **kwargs):
        maps = recorded(*args, **kwargs)
        taken.append(maps is not None)
        return maps

    monkeypatch.setattr(module_rules, "recorded_projection_maps", counting)
    options = {"lam": LAM, "num_train_samples": 100, "structure": KFACOptions(kfac_mode="probe")}
    for size in (1, 4, 9):
        data = [(inputs[i : i + size], targets[i : i + size]) for i in range(0, 9, size)]
        read_off = measure(model, data, **options)
        assert taken and all(taken)
        taken.clear()
        with monkeypatch.context() as forced:
            forced.setattr(module_rules, "recorded_projection_maps", lambda *a, **k: None)
            second_run = measure(model, data, **options)
        assert read_off.coverage["attention.in_proj_weight"] == "kronecker"
        assert read_off.soft_rank == pytest.approx(second_run.soft_rank, rel=1e-10)
        assert read_off.trace_fisher == pytest.approx(second_run.trace_fisher, rel=1e-10)
        assert read_off.trace_cov == pytest.approx(second_run.trace_cov, rel=1e-10)
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_projection_recording_restores_linear_when_the_forward_fails():
    from lightning_flatness.core.batches import wrap_for_batches
    from lightning_flatness.core.hooked_pass import HookedPass
    from lightning_flatness.core.likelihoods import get_likelihood

    model = AttentionClassifier().double().eval()
    inputs, targets = _data(4)
    wrapped, _, _ = wrap_for_batches(model, [(inputs, targets)])
    hooked = HookedPass(wrapped, get_likelihood("cross_entropy"))
    wrong = nn.Parameter(torch.randn(6, 5, dtype=torch.float64))  # W_out of the wrong shape
    model.attention.out_proj.weight = wrong
    try:
        with pytest.raises(RuntimeError):
            hooked.forward((inputs,))
    finally:
        hooked.close()
    assert torch.nn.functional.linear is torch._C._nn.linear
