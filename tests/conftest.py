"""Shared fixtures: tiny float64 versions of the paper's models and random 7×7 data."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lightning_flatness.core.measure import measure
from lightning_flatness.core.models import build_model
from lightning_flatness.core.options import KernelOptions
from lightning_flatness.core.reading import BatchReading

#: Small widths keep the dense P × P reference fast; the structure of each model is the paper's.
TINY = {
    "mlp": {"hidden": 12},
    "cnn": {"channels": (4, 6)},
    "resmlp": {"hidden": 10},
}


def tiny_model(architecture: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(architecture, **TINY[architecture]).to(torch.float64)


def random_data(num_samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, 1, 7, 7, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 10, (num_samples,), generator=generator)
    return inputs, targets


def many_classes() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 tanh MLP with 30 classes (P = 326) and 48 samples: a few probe rows per sample
    are far from the exact output rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 30))
    generator = torch.Generator().manual_seed(3)
    inputs = 2 * torch.randn(48, 6, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, 30, (48,), generator=generator)
    return model.double().eval(), inputs, targets


def batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> list:
    return [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, inputs.shape[0], batch_size)
    ]


def probe_kernel_report(model, inputs, targets, batch_size: int = 7, **options):
    """``measure()`` of ``probe_kernel`` with these ``KernelOptions`` at λ = 1e-3, n = 100."""
    return measure(
        model,
        batches(inputs, targets, batch_size),
        lam=1e-3,
        num_train_samples=100,
        structure=KernelOptions(**options),
    )


def quiet_trainer(tmp_path, callbacks, max_epochs: int = 1, **kwargs):
    """A one-process CPU ``Trainer`` without logger, checkpoints, progress bar or model summary
    (the fit tests' usual trainer); ``kwargs`` add to or override that."""
    from lightning.pytorch import Trainer

    return Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        **{
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **kwargs,
        },
    )


def assert_records_equal(first: dict, second: dict) -> None:
    """Equal flatness records, NaN equal to NaN."""
    assert first.keys() == second.keys()
    for key, value in first.items():
        same = value == second[key] or (math.isnan(value) and math.isnan(second[key]))
        assert same, f"{key}: {value} != {second[key]}"


def assert_kronecker_blocks_exact(model, inputs, targets, names, lam: float) -> None:
    """``kfac`` on one sample at one position: the Kronecker block G ⊗ A of each of ``names``
    is its exact Fisher block (the factorisation approximates only over samples and
    positions), against the dense reference in float64."""
    from lightning_flatness import measure
    from lightning_flatness.core import reference, spectral

    report = measure(model, [(inputs, targets)], lam=lam, num_train_samples=100, structure="kfac")
    fisher = reference.dense_fisher(model, inputs)
    blocks = dict(reference.parameter_blocks(model))
    for name in names:
        assert report.coverage[name] == "kronecker", name
        block = fisher[blocks[name], blocks[name]]
        expected = spectral.soft_rank(spectral.psd_eigenvalues(block), lam)
        assert report.blocks[name].soft_rank == pytest.approx(expected, rel=1e-9), name


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread avoids OpenMP contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["mlp", "cnn", "resmlp"])
def architecture(request) -> str:
    return request.param


def curvature_and_sums(
    model,
    train_batches,
    *,
    structure: str,
    lam: float,
    loss: str = "cross_entropy",
    seed: int = 0,
    all_reduce=None,
    options: dict | None = None,
):
    """``(curvature estimate, training sums)`` from ``measure()``'s own pass
    (:func:`~lightning_flatness.core.measure.curvature_and_sums`) of ``structure`` with these
    fields of its options object, for tests that read more of the estimate than the report
    keeps (per-probe values, the Lanczos coefficients, the summary next to its blocks)."""
    from lightning_flatness.core.measure import curvature_and_sums as measured
    from lightning_flatness.core.options import structure_options

    curvature, train, _ = measured(
        model,
        train_batches,
        structure_options(structure, options),
        BatchReading(loss=loss),
        lam=lam,
        seed=seed,
        all_reduce=all_reduce,
    )
    return curvature, train


class TwoProcesses:
    """``all_reduce`` of two threads standing for two processes: each hands its tensor, both
    get the sum, in place (:meth:`for_rank`); :meth:`run` runs ``work(rank)`` on both."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            tensor.copy_(total)
            return tensor

        return all_reduce

    @staticmethod
    def run(work) -> None:
        """``work(0)`` and ``work(1)`` in two threads, joined. Two threads in a measurement's
        context at once leave torch's process-wide attention flag as the later one found it
        (processes do not share it): it is restored."""
        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
        fast_path = torch.backends.mha.get_fastpath_enabled()
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            torch.backends.mha.set_fastpath_enabled(fast_path)
