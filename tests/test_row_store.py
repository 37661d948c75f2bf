"""The probe kernel's kept rows: pieces written once into slabs of samples read back as the
concatenated rows, with the rows' squared norms, in slabs that depend on the samples only."""

from __future__ import annotations

import pytest
import torch

from lightning_flatness.core.curvature import row_store
from lightning_flatness.core.curvature.row_store import RowStore


def _batches(sizes, probes=3, width=11, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(probes, size, width, generator=generator, dtype=torch.float64) for size in sizes
    ]


@pytest.mark.parametrize("sizes", [[5, 7, 9, 2], [23], [1] * 23])
def test_pieces_across_slab_boundaries_read_back_as_the_rows(sizes, monkeypatch):
    """Slabs of 4, 4, 8, 16 samples: every batch split into layer pieces and across slabs
    comes back as the rows, in order, with their squared norms per probe."""
    monkeypatch.setattr(row_store, "FIRST_SLAB_SAMPLES", 4)
    store = RowStore(3, 11)
    batches = _batches(sizes)
    for batch in batches:
        store.append([batch[..., :2], batch[..., 2:7], batch[..., 7:]])
    rows = torch.cat(batches, dim=1)
    assert torch.equal(torch.cat(store.chunks(), dim=1), rows)
    assert [chunk.shape[1] for chunk in store.chunks()] == [4, 4, 8, 7]
    assert store.samples == 23
    expected = rows.square().sum((1, 2))
    assert torch.allclose(store.squared_norms, expected, rtol=1e-12)


def test_a_slab_holds_at_most_its_share_of_numbers(monkeypatch):
    """Wide rows: slabs of at most SLAB_NUMBERS numbers, however many samples come at once."""
    monkeypatch.setattr(row_store, "SLAB_NUMBERS", 3 * 11 * 5)
    store = RowStore(3, 11)
    store.append(_batches([12])[0])
    assert [chunk.shape[1] for chunk in store.chunks()] == [5, 5, 2]


def test_pieces_that_do_not_make_the_rows_are_refused():
    store = RowStore(3, 11)
    with pytest.raises(ValueError, match="do not make 11 parameters"):
        store.append([torch.zeros(3, 2, 5), torch.zeros(3, 2, 5)])
    store.append(torch.ones(3, 2, 11))
    store.clear()
    assert store.samples == 0 and store.chunks() == []
    assert float(store.squared_norms.sum()) == 0.0
