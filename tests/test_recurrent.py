"""Recurrent layers (nn.RNN, nn.LSTM, nn.GRU): every structure that measures per-sample
gradients gets them exactly, against the dense reference, in float64; the step-by-step
recursion they are batched through is the fused kernel's."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_kronecker_blocks_exact
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_flatness import measure
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.failures import UnsupportedModelError

LAM = 1e-3
LAYERS = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}


class SequenceClassifier(nn.Module):
    def __init__(
        self, kind: str, batch_first: bool, bidirectional: bool, layers: int, state: bool = False
    ):
        super().__init__()
        self.reads_state = state  # the head reads the last layer's final state, not out[:, -1]
        self.embed = nn.Embedding(11, 4)
        self.rnn = LAYERS[kind](
            4, 3, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional
        )
        self.batch_first = batch_first
        self.bidirectional = bidirectional
        self.head = nn.Linear(3 * (2 if bidirectional else 1), 3)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (N, T, E)
        if not self.batch_first:
            x = x.transpose(0, 1)
        out, final = self.rnn(x)
        if self.reads_state:
            hidden = final[0] if isinstance(final, tuple) else final
            return self.head(
                torch.cat(list(hidden[-2:] if self.bidirectional else hidden[-1:]), -1)
            )
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out[:, -1])


def _data(n: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 11, (n, 6), generator=generator)
    lengths = torch.randint(2, 7, (n,), generator=generator)
    ids = ids.masked_fill(torch.arange(6) >= lengths.unsqueeze(1), 0)
    return ids, torch.randint(0, 3, (n,), generator=generator)


def _assert_batched_exact_and_kronecker(model: nn.Module, data: list, fisher: Tensor) -> None:
    """The default (3 classes: exact rows) equals the dense soft rank and Tr(F), with the
    recurrent layer's rows batched through its step-by-step recursion (no loop over samples);
    under kfac its gate weights are Kronecker layers (linear maps at every step), its biases
    exact blocks."""
    exact = spectral.spectral_summary(spectral.psd_eigenvalues(fisher), LAM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = measure(model, data, lam=LAM, num_train_samples=100)
    assert not [w for w in caught if "one sample at a time" in str(w.message)]
    assert default.soft_rank == pytest.approx(exact.soft_rank, rel=1e-8)
    assert default.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-8)
    coverage = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac").coverage
    for name, kind in coverage.items():
        if name.startswith("rnn."):
            assert kind == ("kronecker" if ".weight_" in name else "exact block"), name


CASES = [
    ("rnn", True, False, 1),
    ("gru", False, True, 1),
    ("lstm", True, True, 2),
    ("lstm", False, False, 2),
]


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize(("kind", "batch_first", "bidirectional", "layers"), CASES)
def test_recurrent_models_are_measured_exactly(kind, batch_first, bidirectional, layers, state):
    """The head on the last output step or on the final state (h_n): either way the layer's
    own rule gives its rows, batched."""
    torch.manual_seed(0)
    model = SequenceClassifier(kind, batch_first, bidirectional, layers, state).double().eval()
    inputs, targets = _data(10)
    fisher = reference.dense_fisher(model, inputs)
    data = [(inputs[i : i + 4], targets[i : i + 4]) for i in range(0, 10, 4)]
    _assert_batched_exact_and_kronecker(model, data, fisher)
    diag = measure(model, data, lam=LAM, num_train_samples=100, structure="diag")
    assert diag.soft_rank == pytest.approx(spectral.soft_rank(fisher.diagonal(), LAM), rel=1e-8)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_gate_weight_kronecker_blocks_are_exact_for_one_sample_and_one_step(kind):
    """KFC's factors of a gate weight, G = Σ_k s_k s_kᵀ and A = a aᵀ, give its exact Fisher
    block for one sample at one step (the factorisation's only approximation is over samples
    and steps): the factors are those of the map's input and output gradient."""
    torch.manual_seed(0)
    model = SequenceClassifier(kind, True, True, 1).double().eval()
    names = [name for name, _ in model.named_parameters() if name.startswith("rnn.weight_ih")]
    assert_kronecker_blocks_exact(model, torch.tensor([[3]]), torch.tensor([1]), names, LAM)


def test_an_lstm_projection_keeps_exact_per_sample_gradients():
    """With ``proj_size`` the LSTM's output map is no gate map: its parameters stay exact
    diagonal blocks under kfac, still batched and exact in the default."""
    torch.manual_seed(0)
    model = SequenceClassifier("lstm", True, False, 1).double().eval()
    model.rnn = nn.LSTM(4, 3, batch_first=True, proj_size=2).double()
    model.head = nn.Linear(2, 3).double()
    inputs, targets = _data(6)
    data = [(inputs[:3], targets[:3]), (inputs[3:], targets[3:])]
    coverage = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac").coverage
    assert {coverage[name] for name in coverage if name.startswith("rnn.")} == {"diagonal"}
    fisher = reference.dense_fisher(model, inputs)
    default = measure(model, data, lam=LAM, num_train_samples=100)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    assert default.soft_rank == pytest.approx(exact, rel=1e-8)


def test_a_float32_lstm_is_measured_by_the_matrix_free_path():
    """oneDNN's fused LSTM kernel has no forward-mode derivative; the measurement switches it
    off (and back on), so cg's Fisher-vector products run and agree with the exact rows."""
    torch.manual_seed(0)
    model = SequenceClassifier("lstm", True, True, 1).eval()
    inputs, targets = _data(16)
    data = [(inputs[i : i + 8], targets[i : i + 8]) for i in range(0, 16, 8)]
    exact = measure(model, data, lam=LAM, num_train_samples=100, structure="probe_kernel")
    cg = measure(model, data, lam=LAM, num_train_samples=100, structure="cg")
    stderr = cg.blocks["stderr"].soft_rank
    assert abs(cg.soft_rank - exact.soft_rank) <= 4 * stderr + 0.05 * exact.soft_rank
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_step_by_step_recursion_is_the_fused_kernel(kind, batch_first, bidirectional):
    from lightning_flatness.core.recurrent import recurrent_forward

    torch.manual_seed(0)
    options = {"num_layers": 2, "batch_first": batch_first, "bidirectional": bidirectional}
    if kind == "lstm":
        options["proj_size"] = 2
    module = LAYERS[kind](4, 3, **options).double()
    shape = (5, 7, 4) if batch_first else (7, 5, 4)
    inputs = torch.randn(*shape, dtype=torch.float64)
    states = 2 * (2 if bidirectional else 1)
    hidden = torch.randn(states, 5, 2 if kind == "lstm" else 3, dtype=torch.float64)
    state = (hidden, torch.randn(states, 5, 3, dtype=torch.float64)) if kind == "lstm" else hidden
    for given in (None, state):
        expected = module(inputs, given)
        found = recurrent_forward(module, dict(module.named_parameters()), inputs, given)
        flat = [expected[0], *(expected[1] if kind == "lstm" else [expected[1]])]
        got = [found[0], *(found[1] if kind == "lstm" else [found[1]])]
        for want, have in zip(flat, got, strict=True):
            assert torch.allclose(have, want, atol=1e-12)
    single = module(inputs[0] if batch_first else inputs[:, 0])[0]
    alone = recurrent_forward(
        module, dict(module.named_parameters()), inputs[0] if batch_first else inputs[:, 0]
    )[0]
    assert torch.allclose(alone, single, atol=1e-12)


class PackedClassifier(nn.Module):
    """Padded token sequences packed by their lengths (unsorted), as text models do."""

    def __init__(self, kind: str, reads_state: bool):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.rnn = LAYERS[kind](4, 3, num_layers=2, batch_first=True, bidirectional=True)
        self.reads_state = reads_state
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        out, final = self.rnn(packed)
        if self.reads_state:
            hidden = final[0] if isinstance(final, tuple) else final
            return self.head(torch.cat([hidden[-2], hidden[-1]], -1))
        padded, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / lengths.unsqueeze(1))


def _autograd_fisher(model: nn.Module, tokens: Tensor, lengths: Tensor) -> Tensor:
    """F = (1/m) Σ_i Σ_c p_ic ∇log p_ic ∇log p_icᵀ, one sample and class at a time (plain
    autograd; the definition of :mod:`lightning_flatness.core.reference`)."""
    params = list(model.parameters())
    rows = []
    for i in range(tokens.shape[0]):
        log_p = model(tokens[i : i + 1], lengths[i : i + 1])[0].log_softmax(-1)
        for c in range(log_p.shape[0]):
            grads = torch.autograd.grad(log_p[c], params, retain_graph=True)
            rows.append(log_p[c].exp().sqrt().detach() * torch.cat([g.flatten() for g in grads]))
    stacked = torch.stack(rows)
    return stacked.T @ stacked / tokens.shape[0]


@pytest.mark.parametrize(("kind", "reads_state"), [("lstm", True), ("gru", False), ("rnn", True)])
def test_packed_sequences_are_measured_exactly(kind, reads_state):
    """A PackedSequence goes through the layer's rule padded, each sample's recursion masked
    beyond its length: the rows, and so the soft rank and Tr(F), are the exact ones."""
    torch.manual_seed(0)
    model = PackedClassifier(kind, reads_state).double().eval()
    tokens, targets = _data(10)
    lengths = (tokens != 0).sum(1)
    fisher = _autograd_fisher(model, tokens, lengths)  # torch.func cannot run a packed LSTM
    data = [((tokens[i : i + 4], lengths[i : i + 4]), targets[i : i + 4]) for i in (0, 4, 8)]
    _assert_batched_exact_and_kronecker(model, data, fisher)
    with pytest.raises(UnsupportedModelError, match=r"PackedSequence.*probe_kernel"):
        measure(model, data, lam=LAM, num_train_samples=100, structure="cg")
