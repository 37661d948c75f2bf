"""A stride-1 convolution's input factor from its input's shifted overlaps: equal in float64 to
the product of the unfolded patches, and ``kfac`` measures the same with it (and with the
per-sample norms from grouped weight gradients that come with it) as without it."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_flatness.core import layer_rules
from lightning_flatness.core.convolution_terms import overlap_input_factor
from lightning_flatness.core.measure import measure

LAM = 1e-3

SIZES = [(7, 7), (5, 9), (1, 8), (12, 4)]
KERNELS = [(3, 3), (1, 1), (2, 3), (5, 1), (1, 3)]
DILATIONS = [(1, 1), (2, 1), (1, 2)]
PADDINGS = [(0, 0), (1, 1), (2, 0), (0, 3)]


def _unfolded_factor(x, kernel, dilation, padding) -> torch.Tensor:
    patches = F.unfold(x, kernel, dilation=dilation, padding=padding).transpose(1, 2)
    flat = patches.reshape(-1, patches.shape[-1])
    return flat.T @ flat


@pytest.mark.parametrize("sizes", SIZES)
def test_the_overlap_factor_is_the_unfolded_patches_product(sizes):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, *sizes, generator=generator, dtype=torch.float64)
    checked = 0
    for kernel, dilation, padding in itertools.product(KERNELS, DILATIONS, PADDINGS):
        outputs = [
            size + 2 * pad - dil * (k - 1)
            for size, pad, dil, k in zip(sizes, padding, dilation, kernel, strict=True)
        ]
        if min(outputs) <= 0:
            continue
        expected = _unfolded_factor(x, kernel, dilation, padding)
        found = overlap_input_factor(x, kernel, dilation, padding)
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 20


class Convolutions(nn.Module):
    """Stride-1 convolutions of every kind the overlap path takes (padded, valid, dilated,
    ``padding="same"``, one-dimensional, one layer applied twice), a strided one that it must
    not take, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.padded = nn.Conv2d(2, 3, 3, padding=1)
        self.dilated = nn.Conv2d(3, 3, 3, dilation=2, padding="same")
        self.twice = nn.Conv2d(3, 3, (2, 3), padding=(1, 1))
        self.strided = nn.Conv2d(3, 2, 3, stride=2)
        self.line = nn.Conv1d(2, 2, 3, dilation=2)
        self.head = nn.Linear(2 * 3 * 2 + 2 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dilated(torch.tanh(self.padded(x))))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))[..., :7, :]
        h = torch.tanh(self.strided(h))  # (N, 2, 3, 2)
        line = torch.tanh(self.line(x.flatten(2)[..., :10]))  # (N, 2, 6)
        return self.head(torch.cat([h.flatten(1), line.flatten(1)], dim=1))


def _measured(model, data, overlaps: bool, monkeypatch) -> tuple[object, list]:
    """The measurement with the cost rule answering ``overlaps`` for every stride-1 call."""
    monkeypatch.setattr(layer_rules, "overlap_pays", lambda *args, **kwargs: overlaps)
    taken = []
    original = layer_rules.overlap_input_factor

    def counted(x, kernel, dilation, padding):
        taken.append((tuple(x.shape[1:]), kernel, dilation))
        return original(x, kernel, dilation, padding)

    monkeypatch.setattr(layer_rules, "overlap_input_factor", counted)
    grouped = layer_rules.grouped_weight_gradients

    def counted_grouped(x, grad, **geometry):
        taken.append("grouped")
        return grouped(x, grad, **geometry)

    monkeypatch.setattr(layer_rules, "grouped_weight_gradients", counted_grouped)
    report = measure(
        model, data, lam=LAM, num_train_samples=100, structure="kfac", val_batches=data[:1]
    )
    return report, taken


@pytest.mark.filterwarnings("ignore:structure='kfac' reports a soft rank")
@pytest.mark.parametrize("batch_size", [1, 4, 9])
def test_kfac_measures_the_same_with_the_overlap_factor(batch_size, monkeypatch):
    model = Convolutions().to(torch.float64).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 7, 5, generator=generator, dtype=torch.float64)
    y = torch.arange(9) % 3
    data = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, 9, batch_size)]
    with_overlaps, taken = _measured(model, data, True, monkeypatch)
    without, not_taken = _measured(model, data, False, monkeypatch)
    assert not not_taken
    # the norms of the layers with at least GROUPED_MIN_POSITIONS outputs from grouped
    # weight gradients
    assert taken.count("grouped") >= len(data)
    taken = [entry for entry in taken if entry != "grouped"]
    # every stride-1 convolution (the one-dimensional one as one row), the twice-applied one
    # once per call, never the strided one
    assert len(taken) == 5 * len(data)
    assert set(taken) == {
        ((2, 7, 5), (3, 3), (1, 1)),
        ((3, 7, 5), (3, 3), (2, 2)),
        ((3, 7, 5), (2, 3), (1, 1)),
        ((3, 8, 5), (2, 3), (1, 1)),
        ((2, 1, 10), (1, 3), (1, 2)),
    }
    for name, block in without.blocks.items():
        assert with_overlaps.blocks[name].soft_rank == pytest.approx(block.soft_rank, rel=1e-10)
        assert with_overlaps.blocks[name].trace == pytest.approx(block.trace, rel=1e-10)
    # the norms (Tr(F), Tr(C)) from grouped weight gradients, the others from the patches
    for field in ("soft_rank", "trace_fisher", "trace_cov", "trace_fisher_val"):
        assert getattr(with_overlaps, field) == pytest.approx(getattr(without, field), rel=1e-10)


def test_strided_and_unbatched_convolutions_never_take_the_overlap_path(monkeypatch):
    monkeypatch.setattr(layer_rules, "overlap_pays", lambda *args, **kwargs: True)
    conv = nn.Conv2d(4, 4, 3, stride=2)
    x = torch.randn(8, 4, 9, 9)
    call = layer_rules.LayerCall(conv, (x,), {}, conv(x))
    assert not layer_rules._overlap_pays(call, False)
    conv.stride = (1, 1)
    assert layer_rules._overlap_pays(call, False)
    unbatched = layer_rules.LayerCall(conv, (x[0],), {}, conv(x[0]))
    assert not layer_rules._overlap_pays(unbatched, False)


@pytest.mark.parametrize(
    ("channels", "out", "size", "padding", "overlaps", "grouped"),
    [
        # a mid-size CNN's second layer and the zoo ResNet's blocks at a realistic width: no
        # patches at all
        (32, 64, 14, 1, True, True),
        (24, 24, 16, 1, True, True),
        # a first layer on one channel: the patches' copy costs more than the shifts
        (1, 32, 28, 1, True, True),
        # a mid-size CNN's last layer: its norms need the patches (T·(o + d) < o·d), and the
        # overlaps still beat their product
        (64, 64, 7, 1, True, False),
        # the paper's CNN: 3 × 3 outputs, the patches' way for both
        (15, 20, 5, 0, False, False),
        # unpadded convolutions on small images: four times the edge rows and columns, as
        # much as the patches cost or more
        (16, 32, 8, 0, False, False),
        (1, 16, 16, 0, False, False),
    ],
)
def test_the_default_cost_rule_takes_the_overlaps_where_they_pay(
    channels, out, size, padding, overlaps, grouped
):
    conv = nn.Conv2d(channels, out, 3, padding=padding)
    x = torch.randn(64, channels, size, size)
    rule = layer_rules.KroneckerRule([conv], {"weight": "weight"})
    rule.calls.append(layer_rules.LayerCall(conv, (x,), {}, conv(x)))
    assert rule.grouped_norms is grouped
    assert rule.from_overlaps is overlaps
