"""The one contract of every curvature structure (``core/curvature/base.py``): per-batch data
through ``add(batch: CurvatureBatch)`` alone, per-group decay at construction alone, and
``summable_states()`` a list everywhere (``gram`` included: an empty one)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import lightning_flatness.core as core
from lightning_flatness.core.backpack.gram import GramFisher
from lightning_flatness.core.batch_terms import BatchTerms
from lightning_flatness.core.curvature.base import CurvatureAccumulator, CurvatureBatch
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.decay import ParameterDecay


def _structures() -> list[type[CurvatureAccumulator]]:
    for module in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
        importlib.import_module(module.name)
    found, todo = [], [CurvatureAccumulator]
    while todo:
        for child in todo.pop().__subclasses__():
            todo.append(child)
            if not inspect.isabstract(child):
                found.append(child)
    return found


STRUCTURES = _structures()


def test_the_structures_are_found():
    names = {kind.__name__ for kind in STRUCTURES}
    assert {"KFACFisher", "DiagonalFisher", "ProbeKernelFisher", "HutchinsonFisher"} <= names
    assert {"LanczosFisher", "CGFisher", "DenseFisher", "GramFisher"} <= names


@pytest.mark.parametrize("kind", STRUCTURES, ids=lambda kind: kind.__name__)
def test_every_structure_takes_its_batches_one_way_and_its_decay_at_construction(kind):
    add = inspect.signature(kind.add).parameters
    assert list(add) == ["self", "batch"]
    for old in ("update", "add_rows"):
        assert not hasattr(kind, old), f"{kind.__name__}.{old}: feed batches through add()"
    init = inspect.signature(kind.__init__).parameters
    if kind.__name__ != "SpreadProbeKernel":  # hands its options on to ProbeKernelFisher's
        assert "decay" in init, kind.__name__
    assert "column_scale" not in init


def test_gram_keeps_the_promise_of_a_list():
    """Its per-sample rows do not sum: an empty list (the backend refuses gram across
    processes before any batch, ``NOT_SUMMABLE``)."""
    assert GramFisher().summable_states() == []


def test_kfac_scales_its_terms_by_the_decay_it_was_built_with():
    """The same batch under per-group decay: the G factor of each weight divided by λ_j."""
    g, a = torch.eye(2, dtype=torch.float64), 2 * torch.eye(3, dtype=torch.float64)
    decay = ParameterDecay({"w": 0.5, "b": 0.0})

    def batch() -> CurvatureBatch:
        return CurvatureBatch(4, 2, terms=BatchTerms(kronecker={"w": (g.clone(), a.clone())}))

    plain, decayed = KFACFisher(), KFACFisher(decay=decay)
    plain.add(batch())
    decayed.add(batch())
    assert torch.equal(decayed.kronecker["w"][0], plain.kronecker["w"][0] / 0.5)
    assert torch.equal(decayed.kronecker["w"][1], plain.kronecker["w"][1])
    assert plain.summable_states() and isinstance(decayed.summable_states(), list)
