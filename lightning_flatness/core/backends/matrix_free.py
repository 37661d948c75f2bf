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

Options (``matrix_free_options`` of ``measure``; unknown keys raise):

==================  ============  ===========================================================
key                 default       meaning
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

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_flatness.core.batches import (
    Leaves,
    LogitsModule,
    UnpackBatch,
    num_samples,
    prepared_batches,
    split_leaves,
    take_rows,
)
from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.cg import CGFisher
from lightning_flatness.core.curvature.fisher_products import ParameterSpaceFisher
from lightning_flatness.core.curvature.hutchinson import (
    POWER_START_STREAM,
    VARIANTS,
    HutchinsonFisher,
)
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.curvature.lanczos import LanczosFisher
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import MeasurementError, check_finite_loss
from lightning_flatness.core.functional_stats import (
    FunctionalModel,
    batch_statistics,
    resolve_trace_estimator,
)
from lightning_flatness.core.hooked_pass import HookedPass
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import left_as_found
from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, MatrixFreeOptions
from lightning_flatness.core.pipeline import SPLITS, Backend
from lightning_flatness.core.positional import position_draws, shard_positions
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["MATRIX_FREE_STRUCTURES", "MatrixFreeBackend", "MatrixFreeOptions"]

AllReduce = Callable[[Tensor], Tensor]


#: the position-keyed draw streams (plus the seed) of ``cg``'s and ``lanczos``'s sample probes,
#: apart from the layer hooks' 2·seed + {0, 1}
CG_PROBE_STREAM = 2**40
LANCZOS_PROBE_STREAM = 2**41
HUTCHINSON_PROBE_STREAM = 2**42  # + 4·seed + the variant's stream
#: where the positions of a process's samples in the whole set are unknown, process r draws from
#: the streams shifted by r times this
PROCESS_STREAM_SPACING = 2**36


def _process_rank(explicit: int | None, all_reduce: AllReduce | None) -> int:
    if explicit is not None:
        return int(explicit)
    if all_reduce is None:
        return 0
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    warnings.warn(
        "all_reduce is given but no torch.distributed process group is initialized: pass "
        "matrix_free_options={'rank': <this process's rank>} so that each process draws its "
        "own probes (identical probes on different samples bias the Lanczos estimate).",
        stacklevel=3,
    )
    return 0


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed) % (2**63))


def _prepared(
    batches: Iterable,
    max_samples: int | None,
    model: FunctionalModel,
    unpack_batch: UnpackBatch | None,
) -> Iterator[tuple[int, Leaves, Tensor]]:
    """``(index, inputs, targets)`` on the model's device/dtype, truncated at ``max_samples``."""
    return prepared_batches(
        batches, max_samples, model.device, model.dtype, unpack_batch, model.module.spec
    )


def _activation_elements_per_sample(model: FunctionalModel, inputs: Leaves) -> float:
    """Numbers autograd saves per sample in a forward pass (difference of 2 and 1 samples)."""
    counts = []
    params = {name: p.detach().requires_grad_() for name, p in model.params.items()}
    for size in (1, 2):
        saved = [0]

        def pack(tensor: Tensor, saved: list[int] = saved) -> Tensor:
            saved[0] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.logits(
                params, tuple(t[:1].expand(size, *t.shape[1:]).contiguous() for t in inputs)
            )
        counts.append(saved[0])
    return max(1.0, float(counts[1] - counts[0]))


class _Chunker:
    """Splits batches into chunks of samples for the batched products of ``vectors`` vectors.

    Unless ``chunk_size`` is given, a chunk holds as many samples as keep the activations of
    one batched product, ``(vectors + 1) × chunk × (saved numbers per sample)``, within
    ``chunk_elements``.
    """

    def __init__(self, model: FunctionalModel, options: MatrixFreeOptions, vectors: int):
        self.model, self.options, self.vectors = model, options, vectors
        self.size: int | None = options.chunk_size

    def split(self, inputs: Leaves) -> list[Leaves]:
        if self.size is None:
            per_sample = _activation_elements_per_sample(self.model, inputs)
            budget = self.options.chunk_elements / ((self.vectors + 1) * per_sample)
            self.size = max(1, int(budget))
        return split_leaves(inputs, self.size)


class _CachedInputs:
    """This process's prepared training inputs, kept for the Lanczos passes."""

    def __init__(self, chunker: _Chunker) -> None:
        self.chunker = chunker
        self.batches: list[Leaves] = []
        self.num_samples = 0

    def add(self, inputs: Leaves) -> None:
        self.batches.append(inputs)
        self.num_samples += num_samples(inputs)

    def _batches(self) -> Iterator[Leaves]:
        yield from self.batches

    def chunks(self, with_rows: bool = False) -> Iterator:
        """Chunks of inputs (and, with ``with_rows``, their rows in this process's sample axis)."""
        offset = 0
        for inputs in self._batches():
            for piece in self.chunker.split(inputs):
                size = num_samples(piece)
                rows = slice(offset, offset + size)
                offset += size
                yield (piece, rows) if with_rows else piece


class _ReiteratedInputs(_CachedInputs):
    """Iterates ``train_batches`` again for every pass (``cache=False``), checking each pass
    yields the same samples in the same order (count and per-batch input sums)."""

    def __init__(self, chunker, batches, max_samples, model, unpack_batch, fingerprint) -> None:
        super().__init__(chunker)
        self.source, self.max_samples, self.model = batches, max_samples, model
        self.unpack_batch = unpack_batch
        self.fingerprint = fingerprint
        self.num_samples = sum(size for size, _ in fingerprint)

    def _batches(self) -> Iterator[Leaves]:
        seen = []
        source = _prepared(self.source, self.max_samples, self.model, self.unpack_batch)
        for _, inputs, _ in source:
            seen.append(_fingerprint(inputs))
            yield inputs
        if not _same_fingerprints(seen, self.fingerprint):
            raise MeasurementError(
                "train_batches yielded different samples on a later pass (shuffling, random "
                "augmentation or a one-shot iterator). structure='lanczos' makes one pass per "
                "Lanczos step over the same samples: pass a deterministic loader or keep "
                "matrix_free_options['cache']=True."
            )


def _fingerprint(inputs: Leaves) -> tuple[int, float]:
    return num_samples(inputs), sum(float(t.detach().to(torch.float64).sum()) for t in inputs)


def _same_fingerprints(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(
        n == m and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
        for (n, x), (m, y) in zip(a, b, strict=True)
    )


def _num_outputs(model: FunctionalModel, inputs: Leaves) -> int:
    """C, the number of outputs, from one sample."""
    with torch.no_grad():
        return int(model.logits(model.params, take_rows(inputs, slice(0, 1))).shape[-1])


class MatrixFreeBackend(Backend):
    """``lanczos``, ``cg`` and ``hutchinson`` through ``torch.func`` (module docstring).

    The first pass computes every batch's statistics (:func:`batch_statistics`); ``hutchinson``
    adds its probes' gradients on the way, ``lanczos`` and ``cg`` keep the inputs
    (``cache=True``) or their fingerprints and make their passes in :meth:`estimate`.

    Args:
        model: the model wrapped as a :class:`~lightning_flatness.core.batches.LogitsModule`.
        structure: ``"lanczos"`` (SLQ of the exact F), ``"cg"`` (conjugate-gradient solves)
            or ``"hutchinson"`` (Hutchinson diagonal, Eq. 2, with the Eq. 8 / Eq. 9 bounds).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"`` (see
            :mod:`lightning_flatness.core.likelihoods`).
        seed: seeds the private generators (probes, sampled traces).
        all_reduce: sums a tensor across processes in place and returns it (data parallelism):
            statistics and Hutchinson sums are reduced once, Lanczos products inside every step.
        options: see the table in the module docstring.
        unpack_batch: ``batch -> (inputs, targets)`` (see :mod:`lightning_flatness.core.batches`).
        repeatable_train_batches: what ``cache=False`` iterates again, for callers whose
            training batches are a one-shot iterator.
        max_samples: the training samples measured (``cache=False`` truncates its passes there).
        decay: per-parameter weight decays (the spectrum of ``D^{-1/2} F D^{-1/2}``).
        shard: ``(rank, world_size)`` when the positions of this process's samples are known.
    """

    def __init__(
        self,
        model: LogitsModule,
        structure: str,
        *,
        loss: str,
        seed: int,
        all_reduce: AllReduce | None,
        options: MatrixFreeOptions | Mapping[str, object] | None,
        unpack_batch: UnpackBatch | None,
        repeatable_train_batches: Iterable,
        max_samples: int | None,
        decay: ParameterDecay | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.decay, self.shard = decay, shard
        self.model, self.structure, self.loss = model, structure, loss
        self.seed, self.all_reduce = seed, all_reduce
        self.settings = (
            options
            if isinstance(options, MatrixFreeOptions)
            else MatrixFreeOptions.from_dict(options)
        )
        self.unpack_batch = unpack_batch
        self.repeatable_train_batches = repeatable_train_batches
        self.max_samples = max_samples
        self.classes = 0
        self.trace_estimator = {split: self.settings.trace_estimator for split in SPLITS}

    @contextmanager
    def session(self) -> Iterator[None]:
        with left_as_found(self.model):
            settings = self.settings
            functional = FunctionalModel(self.model)
            rank = _process_rank(settings.rank, self.all_reduce)
            self.functional = functional
            self.rank = rank
            self.local = _generator(functional.device, self.seed * 1_000_003 + 7919 * (rank + 1))
            self.shared = _generator(functional.device, self.seed)
            variants = 1 if self.keeps_inputs else (len(VARIANTS) if settings.bounds else 1)
            self.chunker = _Chunker(functional, settings, settings.probes * variants)
            self.cache = _CachedInputs(self.chunker)
            self.fingerprints: list[tuple[int, float]] = []
            self.hutchinson = self.grad_sq_sum = None
            self.hooked = self.kfac = None
            if self.structure == "cg" and settings.preconditioner == "kfac":
                self.kfac = KFACFisher()
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
                self.hutchinson = HutchinsonFisher(
                    functional,
                    loss=self.loss,
                    probes=settings.probes,
                    distribution=settings.distribution,
                    draw_sample_probes=self._hutchinson_draws,
                    power_iterations=settings.power_iterations,
                    bounds=settings.bounds,
                    grad_sq_sum=self.grad_sq_sum,
                    diagonal_scale=None if self.decay is None else self._diagonal().reciprocal(),
                )
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
        )
        check_finite_loss(sums.loss, split, index)
        if training:
            self.classes = logits.shape[1]
            if self.hooked is not None:
                self._add_kronecker_factors(inputs, targets)
            if self.hutchinson is not None:
                for piece in self.chunker.split(inputs):
                    self.hutchinson.update(piece)
            elif self.settings.cache:
                self.cache.add(inputs)
            else:
                self.fingerprints.append(_fingerprint(inputs))
        return sums

    def _add_kronecker_factors(self, inputs: Leaves, targets: Tensor) -> None:
        """The preconditioner's Kronecker factors of one batch (one probe row per sample)."""
        with torch.enable_grad():
            logits = self.hooked.forward(inputs)
            prepared = get_likelihood(self.loss).prepare_targets(targets, logits)
            self.kfac.add(self.hooked.terms(logits, prepared, inputs, curvature=True))

    def summable_states(self) -> list[Tensor]:
        states = self.kfac.summable_states() if self.kfac is not None else []
        if self.hutchinson is None:
            return states
        return [*states, *self.hutchinson.summable_states()]

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        classes, all_reduce = self.classes, self.all_reduce
        if all_reduce is not None:  # a process without samples learns C from the others
            known = all_reduce(torch.tensor([float(classes), float(classes > 0)]))
            classes = round(float(known[0]) / max(1.0, float(known[1])))
        if self.decay is not None and self.structure != "cg":  # the spectrum of D^-½ F D^-½
            lam = 1.0
        curvature = self._curvature(num_samples, classes, lam)
        curvature.rank_bound = get_likelihood(self.loss).fisher_rank_bound(
            self.functional.num_parameters, num_samples, classes
        )
        return curvature

    def _curvature(self, num_samples: int, classes: int, lam: float) -> CurvatureEstimate:
        if self.hutchinson is not None:
            return self.hutchinson.estimate(num_samples, lam)
        source = self.cache
        if not self.settings.cache:
            source = _ReiteratedInputs(
                self.chunker,
                self.repeatable_train_batches,
                self.max_samples,
                self.functional,
                self.unpack_batch,
                self.fingerprints,
            )
        settings = self.settings
        if self.structure == "cg":
            return self._solver(source, num_samples, classes).estimate(num_samples, lam)
        estimator = LanczosFisher(
            self.functional,
            source,
            loss=self.loss,
            classes=classes,
            settings=settings,
            draw_sample_probes=lambda shape: self._sample_probes(
                LANCZOS_PROBE_STREAM, shape, settings.distribution
            ),
            shared_generator=self.shared,
            all_reduce=self.all_reduce,
            column_scale=None if self.decay is None else self._column_scale(),
        )
        return estimator.estimate(num_samples, lam)

    def _diagonal(self) -> Tensor:
        """``D`` (P,) of the per-group decays over the model's flat parameters, float64."""
        functional = self.functional
        sizes = [functional.params[name].numel() for name in functional.names]
        return self.decay.diagonal(functional.names, sizes).to(functional.device)

    def _column_scale(self) -> Tensor:
        """``D^{-1/2}`` (P,), in the model's dtype."""
        return self._diagonal().rsqrt().to(self.functional.dtype)

    def _sample_probes(
        self, stream: int, shape: tuple[int, int, int], kind: str, first: int = 0
    ) -> Tensor:
        """ξ of shape (K, B, C) on this process's measured samples ``first … first + B − 1``,
        in the model's dtype: drawn by the samples' positions in the whole measured set (the
        same ξ however the set is shared among processes,
        :mod:`~lightning_flatness.core.positional`), or, under data parallelism when the
        positions are unknown, from a stream of this process's own."""
        functional = self.functional
        if self.shard is None and self.all_reduce is not None:  # positions unknown
            stream += PROCESS_STREAM_SPACING * self.rank  # this process's own draws
        positions = shard_positions(shape[1], self.shard, first)
        draws = position_draws(stream + self.seed, positions, shape[0], shape[2], kind)
        return draws.to(device=functional.device, dtype=functional.dtype)

    def _hutchinson_draws(self, stream: int, first: int, shape: tuple[int, int, int]) -> Tensor:
        """``hutchinson``'s draws (:class:`HutchinsonFisher`): stream 0–2 its variants' probes,
        :data:`POWER_START_STREAM` the power iteration's Gaussian starts."""
        kind = "gaussian" if stream == POWER_START_STREAM else self.settings.distribution
        return self._sample_probes(
            HUTCHINSON_PROBE_STREAM + 3 * self.seed + stream, shape, kind, first
        )

    def _solver(self, source, num_samples: int, classes: int) -> CGFisher:
        """``cg``'s accumulator over the kept inputs, with this backend's preconditioner sums
        (:mod:`lightning_flatness.core.curvature.cg`)."""
        functional, settings = self.functional, self.settings
        fisher = ParameterSpaceFisher(functional, source, self.loss, num_samples, self.all_reduce)
        shape = (settings.probes, source.num_samples, classes)

        def draw_probes() -> Tensor:
            xi = self._sample_probes(CG_PROBE_STREAM, shape, "rademacher")
            return fisher.range_start(xi)

        return CGFisher(
            fisher,
            draw_probes,
            functional.names,
            [functional.params[name].shape for name in functional.names],
            kfac=self.kfac,
            max_steps=settings.cg_steps,
            tol=settings.cg_tol,
            dtype=functional.dtype,
            decay=self.decay,
            transposed=self.hooked.transposed_weights() if self.hooked else frozenset(),
        )
