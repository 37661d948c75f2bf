"""Matrix-free measurement: ``structure="lanczos"``, ``"cg"`` and ``"hutchinson"`` for any
classifier.

:class:`MatrixFreeBackend` is the backend :func:`lightning_flatness.core.measure.measure` runs
for the structures of ``MATRIX_FREE_STRUCTURES``. It uses :mod:`torch.func` only (no BackPACK),
so it needs nothing of the model but a differentiable ``forward``: LayerNorm, attention, custom
modules that use their own ``nn.Parameter`` functionally, shared weights.

One pass over the training batches computes the statistics of
:func:`~lightning_flatness.core.functional_stats.batch_statistics` (and, for ``"hutchinson"``, the
probes' gradients); ``"lanczos"`` and ``"cg"`` keep the prepared inputs (``cache=True``) and then
make one more pass per Lanczos step or conjugate-gradient iteration (docs/math.md,
"Matrix-free"; :mod:`lightning_flatness.core.curvature.lanczos`,
:mod:`lightning_flatness.core.curvature.cg`).
The Fisher averages every sample given (up to ``max_samples``), since its soft rank is biased
low on subsets (docs/math.md, "Sample size").

The model is left exactly as found: it is evaluated in eval mode through ``functional_call``
with detached parameters (never modified, no ``.grad`` written) and private copies of its
buffers (BatchNorm statistics untouched), every module's train/eval flag is restored, and all
randomness comes from private ``torch.Generator`` s seeded by ``seed`` inside
``torch.random.fork_rng``.

Options (the fields of :class:`~lightning_flatness.core.options.MatrixFreeOptions`, passed to
``measure`` as ``structure=MatrixFreeOptions(structure=..., ...)``; ``structure_options(name,
mapping)`` builds it from a mapping and names any unknown key):

==================  ============  ===========================================================
field                default       meaning
==================  ============  ===========================================================
probes              10            probe vectors (Lanczos runs / Hutchinson probes per batch)
lanczos_steps       40            Lanczos steps per probe (one pass over the data each)
space               "auto"        Lanczos on F (``"parameters"``, dim P) or on the Gram kernel
                                  K (``"samples"``, dim m·C); ``"auto"``: the smaller one
start               "range"       ``"range"`` (start at the Eq. 2 gradient, see lanczos.py) or
                                  ``"random"`` (classic SLQ in parameter space)
distribution        "rademacher"  probe entries: ``"rademacher"`` or ``"gaussian"``
trace_estimator     "auto"        Tr(F) statistic: ``"exact"`` (per-sample Jacobians),
                                  ``"sampled"`` (Hutchinson, Eq. 2) or ``"auto"`` (exact when
                                  C·P ≤ chunk_elements)
chunk_elements      2**25         numbers per vectorized chunk (per-sample gradients and
                                  Jacobians; activations of the batched products)
chunk_size          None          samples per product call (None: from chunk_elements and the
                                  activation size measured on the first batch)
power_iterations    50            power iterations of the rank-1 core (Eq. 9)
bounds              True          Hutchinson: also the Eq. 8 / Eq. 9 bounds
cache               True          Lanczos: keep the prepared inputs in memory; False iterates
                                  ``train_batches`` again per step (must repeat the same
                                  samples in the same order; checked)
rank                None          this process's rank (None: ``torch.distributed``'s, else 0);
                                  decorrelates the per-sample probes of different processes
max_basis_elements  2**28         size guard on the Lanczos basis (steps × probes × dim)
max_histogram       100_000       entries of the returned spectral-density sample
breakdown_tol       None          Lanczos breakdown tolerance (None: √eps of the dtype)
cg_steps            60            ``cg``: at most this many Fisher-vector products per solve
cg_tol              0.02          ``cg``: stop when the solves' bound on what they still miss
                                  is below this share of the soft rank
preconditioner      "kfac"        ``cg``: ``"kfac"`` (damped Kronecker factors from the layer
                                  hooks, one more backward pass per batch) or ``"none"``
==================  ============  ===========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_flatness.core.backends.kept_inputs import CachedInputs, Chunker, ReiteratedInputs
from lightning_flatness.core.backends.sample_probes import SampleProbes, process_rank
from lightning_flatness.core.batch_terms import BatchTerms
from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples, take_rows
from lightning_flatness.core.curvature.base import CurvatureBatch, CurvatureEstimate
from lightning_flatness.core.curvature.cg import CGFisher
from lightning_flatness.core.curvature.hutchinson import VARIANTS, HutchinsonFisher
from lightning_flatness.core.curvature.lanczos import LanczosFisher
from lightning_flatness.core.curvature.newton_decrement import objective_gradient
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import check_finite_loss
from lightning_flatness.core.functional_stats import (
    FunctionalModel,
    batch_statistics,
    resolve_trace_estimator,
)
from lightning_flatness.core.hooked_pass import HookedPass
from lightning_flatness.core.likelihoods import Likelihood, get_likelihood
from lightning_flatness.core.model_state import left_as_found
from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, MatrixFreeOptions
from lightning_flatness.core.pipeline import SPLITS, Backend
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["MATRIX_FREE_STRUCTURES", "MatrixFreeBackend", "MatrixFreeOptions"]

AllReduce = Callable[[Tensor], Tensor]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    """A private generator on ``device`` seeded by ``seed`` (the global RNG is never used)."""
    return torch.Generator(device=device).manual_seed(int(seed) % (2**63))


def _num_outputs(model: FunctionalModel, inputs: Leaves) -> int:
    """C, the number of outputs, from one sample."""
    with torch.no_grad():
        return int(model.logits(model.params, take_rows(inputs, slice(0, 1))).shape[-1])


class MatrixFreeBackend(Backend):
    """``lanczos``, ``cg`` and ``hutchinson`` through ``torch.func`` (module docstring).

    The first pass computes every batch's statistics (:func:`batch_statistics`) and hands the
    structure's accumulator each training batch's inputs
    (:meth:`~lightning_flatness.core.curvature.base.CurvatureAccumulator.add`): ``hutchinson``
    adds its probes' gradients, chunk by chunk; ``lanczos`` and ``cg`` keep the inputs
    (``cache=True``) or their fingerprints (and ``cg`` its preconditioner's layer-hook terms)
    and make their passes in :meth:`estimate`.

    Args:
        model: the model wrapped as a :class:`~lightning_flatness.core.batches.LogitsModule`.
        options: the table in the module docstring; ``options.structure`` is ``"lanczos"``
            (SLQ of the exact F), ``"cg"`` (conjugate-gradient solves) or ``"hutchinson"``
            (Hutchinson diagonal, Eq. 2, with the Eq. 8 / Eq. 9 bounds).
        reading: how batches are read: ``loss`` (``"cross_entropy"``, ``"bce"`` or ``"mse"``,
            :mod:`lightning_flatness.core.likelihoods`) and ``unpack_batch`` (for the passes
            over ``repeatable_train_batches``).
        seed: seeds the private generators (probes, sampled traces).
        all_reduce: sums a tensor across processes in place and returns it (data parallelism):
            statistics and Hutchinson sums are reduced once, Lanczos products inside every step.
        repeatable_train_batches: what ``cache=False`` iterates again, for callers whose
            training batches are a one-shot iterator.
        max_samples: the training samples measured (``cache=False`` truncates its passes there).
        decay: per-parameter weight decays (the spectrum of ``D^{-1/2} F D^{-1/2}``).
        shard: ``(rank, world_size)`` when the positions of this process's samples are known.
    """

    def __init__(
        self,
        model: LogitsModule,
        options: MatrixFreeOptions,
        reading: BatchReading,
        *,
        seed: int,
        all_reduce: AllReduce | None,
        repeatable_train_batches: Iterable,
        max_samples: int | None,
        decay: ParameterDecay | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.decay, self.shard = decay, shard
        self.model, self.structure, self.loss = model, options.structure, reading.loss
        self.seed, self.all_reduce = seed, all_reduce
        self.settings = options
        self.unpack_batch = reading.unpack_batch
        self.repeatable_train_batches = repeatable_train_batches
        self.max_samples = max_samples
        self.classes = 0
        self.trace_estimator = {split: self.settings.trace_estimator for split in SPLITS}

    @contextmanager
    def session(self) -> Iterator[None]:
        with left_as_found(self.model):
            settings = self.settings
            functional = FunctionalModel(self.model)
            rank = process_rank(settings.rank, self.all_reduce)
            self.functional = functional
            self.draws = SampleProbes(
                self.seed,
                self.shard,
                rank,
                positions_unknown=self.shard is None and self.all_reduce is not None,
                distribution=settings.distribution,
                device=functional.device,
                dtype=functional.dtype,
            )
            self.local = _generator(functional.device, self.seed * 1_000_003 + 7919 * (rank + 1))
            self.shared = _generator(functional.device, self.seed)
            variants = 1 if self.keeps_inputs else (len(VARIANTS) if settings.bounds else 1)
            self.chunker = Chunker(functional, settings, settings.probes * variants)
            self.gradient_sum = self.grad_sq_sum = self.hooked = None
            if self.structure == "cg":  # Σ_i ∇ℓ_i, for the Newton decrement
                self.gradient_sum = torch.zeros(
                    functional.num_parameters, dtype=torch.float64, device=functional.device
                )
            if self.structure == "cg" and settings.preconditioner == "kfac":
                self.hooked = HookedPass(
                    self.model,
                    get_likelihood(self.loss),
                    kfac_mode="probe",
                    trace_estimator="probe",
                    seed=self.seed,
                    shard=self.shard,
                )
            if not self.keeps_inputs:
                self.grad_sq_sum = torch.zeros(
                    functional.num_parameters, dtype=functional.dtype, device=functional.device
                )
            self.estimator = self._estimator()
            try:
                yield
            finally:
                if self.hooked is not None:
                    self.hooked.close()

    @property
    def keeps_inputs(self) -> bool:
        """``lanczos`` and ``cg`` make further passes over the training inputs."""
        return self.structure in ("lanczos", "cg")

    def batch(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        functional, training = self.functional, split == "training"
        if self.trace_estimator[split] == "auto":
            self.trace_estimator[split] = resolve_trace_estimator(
                "auto",
                _num_outputs(functional, inputs),
                functional.num_parameters,
                self.settings.chunk_elements,
            )
        sums, logits = batch_statistics(
            functional,
            inputs,
            targets,
            loss=self.loss,
            trace_estimator=self.trace_estimator[split],
            generator=self.local,
            chunk_elements=self.settings.chunk_elements,
            grad_sq_sum=self.grad_sq_sum if training else None,
            grad_sum=self.gradient_sum if training else None,
        )
        check_finite_loss(sums.loss, split, index)
        if training:
            self.classes = logits.shape[1]
            if self.keeps_inputs:
                terms = self._kronecker_terms(inputs, targets) if self.hooked else None
                batch = CurvatureBatch(num_samples(inputs), self.classes, terms, inputs=inputs)
                self.estimator.add(batch)
            else:
                for piece in self.chunker.split(inputs):
                    self.estimator.add(
                        CurvatureBatch(num_samples(piece), self.classes, inputs=piece)
                    )
        return sums

    def _kronecker_terms(self, inputs: Leaves, targets: Tensor) -> BatchTerms:
        """The preconditioner's layer-hook terms of one batch (one probe row per sample)."""
        with torch.enable_grad():
            logits = self.hooked.forward(inputs)
            prepared = get_likelihood(self.loss).prepare_targets(targets, logits)
            return self.hooked.terms(logits, prepared, inputs, curvature=True)

    def summable_states(self) -> list[Tensor]:
        states = self.estimator.summable_states()
        return states if self.gradient_sum is None else [*states, self.gradient_sum]

    @property
    def likelihood(self) -> Likelihood:
        return get_likelihood(self.loss)

    def curvature(self, num_samples: int, lam: float) -> CurvatureEstimate:
        # every process has measured samples (the pipeline refuses otherwise), so knows C
        if self.structure == "cg":
            decay = self.decay if self.decay is not None else lam
            self.estimator.gradient = _own_coordinates_gradient(
                self.functional, self.gradient_sum, num_samples, decay
            )
        return self.estimator.estimate(num_samples, lam)

    def rank_shape(self) -> tuple[int, int]:
        return self.functional.num_parameters, self.classes

    def scales_by_decay(self) -> bool:
        """``D^{-1/2} F D^{-1/2}`` at λ = 1, except ``cg`` (it solves with ``F + D``)."""
        return self.decay is not None and self.structure != "cg"

    def _estimator(self) -> HutchinsonFisher | LanczosFisher | CGFisher:
        """The structure's accumulator; ``lanczos`` and ``cg`` keep the inputs their
        :meth:`add` is given in memory (``cache=True``) or by fingerprint, to read the training
        batches again for every pass."""
        functional, settings = self.functional, self.settings
        if not self.keeps_inputs:
            return HutchinsonFisher(
                functional,
                loss=self.loss,
                probes=settings.probes,
                distribution=settings.distribution,
                draw_sample_probes=self.draws.hutchinson,
                power_iterations=settings.power_iterations,
                bounds=settings.bounds,
                grad_sq_sum=self.grad_sq_sum,
                decay=self.decay,
            )
        source = CachedInputs(self.chunker)
        if not settings.cache:
            source = ReiteratedInputs(
                self.chunker,
                self.repeatable_train_batches,
                self.max_samples,
                functional,
                self.unpack_batch,
            )
        if self.structure == "cg":
            return CGFisher(
                functional,
                source,
                loss=self.loss,
                probes=settings.probes,
                draw_sample_probes=self.draws.cg,
                all_reduce=self.all_reduce,
                preconditioned=self.hooked is not None,
                max_steps=settings.cg_steps,
                tol=settings.cg_tol,
                decay=self.decay,
                transposed=self.hooked.transposed_weights() if self.hooked else frozenset(),
            )
        return LanczosFisher(
            functional,
            source,
            loss=self.loss,
            settings=settings,
            draw_sample_probes=self.draws.lanczos,
            shared_generator=self.shared,
            all_reduce=self.all_reduce,
            decay=self.decay,
        )


def _own_coordinates_gradient(
    functional: FunctionalModel,
    gradient_sum: Tensor,
    num_samples: int,
    decay: float | ParameterDecay,
) -> Tensor:
    """g of the regularized objective in the parameters' own coordinates, where ``cg`` solves
    with ``F + D`` (:func:`objective_gradient` gives it times ``D^{-1/2}`` under per-group
    decay, the coordinates of the other structures)."""
    names = functional.names
    parameters = [functional.params[name] for name in names]
    gradient = objective_gradient(gradient_sum, num_samples, names, parameters, decay)
    if not isinstance(decay, ParameterDecay):
        return gradient
    scale = decay.column_scale(names, [p.numel() for p in parameters])
    return gradient / scale.to(gradient)
