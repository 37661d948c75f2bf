"""The layer-hook backend of ``kfac``, ``diag``, ``diag_mc`` and ``probe_kernel``: any
differentiable model.

Per batch one forward and one backward pass per cotangent row on the live model
(:class:`~lightning_flatness.core.hooked_pass.HookedPass`), in eval mode with every module's mode
restored, no gradient written and the hooks removed after the measurement; the training
batches feed :class:`~lightning_flatness.core.curvature.kfac.KFACFisher` (``kfac``), the exact
(``diag``) or sampled-label (``diag_mc``) diagonals of F and C, whose spectrum and diagonal TIC
:class:`~lightning_flatness.core.curvature.diag.DiagonalFisher` computes, or the per-sample
gradients of Rademacher probe rows that
:class:`~lightning_flatness.core.curvature.probe_kernel.ProbeKernelFisher` turns into the whole
Fisher's spectrum (``probe_kernel``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples, take_rows
from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.curvature.diag import DiagonalFisher
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.curvature.newton_decrement import objective_gradient
from lightning_flatness.core.curvature.probe_kernel import ProbeKernelFisher
from lightning_flatness.core.curvature.spread_rows import SpreadProbeKernel
from lightning_flatness.core.curvature.stored_rows import QuadratureBudget
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import AllReduce, check_finite_loss
from lightning_flatness.core.hooked_pass import HookedPass
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.memory import row_elements
from lightning_flatness.core.model_state import left_as_found
from lightning_flatness.core.module_rules import RecurrentRule
from lightning_flatness.core.options import DiagOptions, KernelOptions, KFACOptions
from lightning_flatness.core.pipeline import Backend, model_device_dtype
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.statistics import StatisticSums, output_sums

__all__ = ["CHUNK_NUMBERS", "FIRST_CHUNK", "RECURRENT_CHUNK", "HookBackend"]

#: recorded layer-output numbers per pass at which the hooked pass's time per sample is
#: lowest on one CPU thread: larger batches are split into passes of about this many (the
#: small ResNet's and the mid-size CNN's passes of 256 samples cost 1.2–1.4× their passes of
#: 64; an MLP's are cheapest whole; docs/RESULTS.md)
CHUNK_NUMBERS = 3 * 2**20
#: the samples of the first pass, which measures how many numbers one sample records (a batch
#: of at most this many is one pass, so that timing a measurement of a few samples, as the
#: monitor does at fit start to predict its cost, times one pass)
FIRST_CHUNK = 32
#: the most samples per pass of a model with a recurrent layer: its step-by-step recursion
#: under ``vmap`` costs more per sample beyond (the zoo LSTM's 1,024 samples: 0.09 s in passes
#: of 256, 0.10 s in passes of 512, 0.14 s in one)
RECURRENT_CHUNK = 256
#: the samples per pass an earlier measurement of the same model (the user's module, held
#: weakly) found for the same structure and per-sample input shapes: a later one goes straight
#: to passes of that size instead of a first pass of :data:`FIRST_CHUNK` samples (a fill-in of
#: 128 samples of the ladder's ResNet: 0.058 s in one pass against 0.073 s in 32 + 96)
_KNOWN_CHUNKS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, int]] = weakref.WeakKeyDictionary()


class _Chunk(NamedTuple):
    inputs: Leaves
    targets: Tensor


class HookBackend(Backend):
    """``kfac``, ``diag``, ``diag_mc`` or ``probe_kernel`` from layer hooks (module docstring).

    Args:
        model: the wrapped model.
        options: the structure's options, which name it (``options.structure``):
            :class:`~lightning_flatness.core.options.KFACOptions` (``kfac``),
            :class:`~lightning_flatness.core.options.DiagOptions` (``diag`` uses the exact
            rows, ``diag_mc`` ``mc_samples`` sampled ones) or
            :class:`~lightning_flatness.core.options.KernelOptions` (``probe_kernel``:
            ``probes`` probe rows, already settled).
        reading: how batches and outputs are read; its ``loss`` names the likelihood.
        seed: keys the sampled labels and probes (with each sample's position).
        all_reduce: sums a tensor across processes in place (data parallelism): the curvature
            state must then add up across processes.
        shard: ``(rank, world_size)`` when this process measures every world_size-th sample of
            the measured set from ``rank`` on (its probes are then those one process would draw;
            :class:`~lightning_flatness.core.hooked_pass.HookedPass`).
        decay: per-parameter weight decays ``D``: the rows are scaled by ``λ_j^{-1/2}`` and the
            estimate is taken at λ = 1, which is ``Tr(F(F+D)⁻¹)``
            (:mod:`~lightning_flatness.core.decay`).
    """

    def __init__(
        self,
        model: LogitsModule,
        options: KFACOptions | DiagOptions | KernelOptions,
        reading: BatchReading,
        *,
        seed: int,
        all_reduce: AllReduce | None = None,
        shard: tuple[int, int] | None = None,
        decay: ParameterDecay | None = None,
    ) -> None:
        self.model = model
        self.decay = decay
        self.structure = structure = options.structure
        self.likelihood = get_likelihood(reading.loss)
        if isinstance(options, KernelOptions):
            rows, count = "probe", options.probes
        elif isinstance(options, KFACOptions):
            rows, count = options.kfac_mode, options.mc_samples
        else:
            rows, count = ("sampled" if options.sampled else "exact"), options.mc_samples
        hooked_structure = {"kfac": "kfac", "probe_kernel": "rows"}.get(structure, "diag")
        self.settings = {
            "kfac_mode": rows,
            "mc_samples": count,
            "trace_estimator": options.trace_estimator,
            "structure": hooked_structure,
        }
        self.seed = seed
        self.options = options
        self.all_reduce = all_reduce
        self.summable = all_reduce is not None
        self.shard = shard
        #: the structure's accumulator (made when the session knows the parameters, the probe
        #: kernel's on the first training batch, when the number of outputs is known)
        self.estimator: CurvatureAccumulator | None = None
        self.hooked: HookedPass | None = None
        self.num_outputs: int | None = None
        self.num_parameters = 0
        #: samples per pass (:data:`CHUNK_NUMBERS`), known after the first pass
        self.chunk: int | None = None
        #: ``probe_kernel``: the summed per-sample NLL gradients of the training samples (P,),
        #: for the Newton decrement; summed across processes with the curvature state
        self.gradient_sum: Tensor | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        with left_as_found(self.model):
            self.hooked = HookedPass(
                self.model,
                self.likelihood,
                seed=self.seed,
                shard=self.shard,
                **self.settings,
            )
            names = self.hooked.names
            params = dict(self.model.model.named_parameters())
            self.num_parameters = sum(params[name].numel() for name in names)
            if self.structure == "kfac":
                self.estimator = KFACFisher(
                    order=names, precision=model_device_dtype(self.model)[1], decay=self.decay
                )
            elif self.structure in ("diag", "diag_mc"):
                sampled = self.structure == "diag_mc"
                self.estimator = DiagonalFisher(names, sampled=sampled, decay=self.decay)
            elif not self.options.summary_only:  # the Newton decrement's gradient
                device = model_device_dtype(self.model)[0]
                self.gradient_sum = torch.zeros(
                    self.num_parameters, dtype=torch.float64, device=device
                )
            try:
                yield
            finally:
                self.hooked.close()

    def batch(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        """The batch's sums, in passes of about :data:`CHUNK_NUMBERS` recorded numbers each (the
        probes and sampled labels are keyed by position, so the split changes no number)."""
        total = None
        for chunk in self._chunks(inputs, targets):
            sums = self._pass(chunk.inputs, chunk.targets, split, index)
            total = sums if total is None else total + sums
        return total

    def _chunks(self, inputs: Leaves, targets: Tensor) -> Iterator[_Chunk]:
        """The batch whole, or consecutive parts of :attr:`chunk` samples (before that is
        known, the first :data:`FIRST_CHUNK` samples alone)."""
        samples, start = num_samples(inputs), 0
        if self.chunk is None:
            self.chunk = _KNOWN_CHUNKS.get(self.model.model, {}).get(self._chunk_key(inputs))
        if samples <= (self.chunk or FIRST_CHUNK):
            yield _Chunk(inputs, targets)
            return
        while start < samples:  # self.chunk read for each part: the first pass sets it
            rows = slice(start, min(samples, start + (self.chunk or FIRST_CHUNK)))
            yield _Chunk(take_rows(inputs, rows), targets[rows])
            start = rows.stop

    def _chunk_key(self, inputs: Leaves) -> tuple:
        """What the samples per pass depend on besides the model: the structure and each
        input's per-sample shape."""
        return (self.structure, *(tuple(leaf.shape[1:]) for leaf in inputs))

    def _pass(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        hooked = self.hooked
        logits = hooked.forward(inputs)
        if self.chunk is None:
            per_sample = hooked.recorded_numbers() / max(num_samples(inputs), 1)
            self.chunk = max(FIRST_CHUNK, int(CHUNK_NUMBERS // max(per_sample, 1.0)))
            if any(isinstance(rule, RecurrentRule) for rule in hooked.rules):
                self.chunk = min(self.chunk, max(FIRST_CHUNK, RECURRENT_CHUNK))
            known = _KNOWN_CHUNKS.setdefault(self.model.model, {})
            known[self._chunk_key(inputs)] = self.chunk
        targets = self.likelihood.prepare_targets(targets, logits)
        sums = output_sums(self.likelihood, logits, targets, hooked.last_layer, hooked.features())
        check_finite_loss(sums.loss, split, index)
        training = split == "training"
        self.num_outputs = int(logits.shape[1])
        if training and self.structure == "probe_kernel" and self.estimator is None:
            self.estimator = self._probe_kernel(logits.shape[1])
        if training and isinstance(self.estimator, ProbeKernelFisher):
            self.estimator.check_batch(logits.shape[0])
        terms = hooked.terms(logits, targets, inputs, curvature=training)
        sums.grad_norm_sq, sums.fisher_trace = terms.grad_norm_sq, terms.fisher_trace
        if not training:
            return sums
        if self.gradient_sum is not None:
            self.gradient_sum += torch.cat([terms.gradient[n] for n in self.hooked.names])
        self.estimator.add(CurvatureBatch(int(logits.shape[0]), self.num_outputs, terms=terms))
        return sums

    def _probe_kernel(self, num_outputs: int) -> ProbeKernelFisher:
        """The probe-kernel state; with no more outputs than probes, the exact rows of the
        output Fisher's square root are as cheap and have no probe bias: they are used instead
        (one group, nothing to correct)."""
        options = self.options
        rows, groups = options.probes, options.groups
        if num_outputs <= options.probes:
            self.hooked.kfac_mode = "exact"
            rows, groups = num_outputs, 1
        device = model_device_dtype(self.model)[0]
        common = {
            "probes": rows,
            "groups": groups,
            "max_parameters": options.max_parameters,
            "max_kernel_size": options.max_kernel_size,
            "max_row_elements": row_elements(options, device),
            "device": device,
            "quadrature": QuadratureBudget(
                options.slq_probes, options.slq_steps, options.slq_tolerance, options.slq_extension
            ),
            "sketching": options.sketching,
            "spectrum": not options.summary_only,
            "order": self.hooked.names,
            "decay": self.decay,
        }
        above = self.num_parameters > options.max_parameters
        if self.all_reduce is not None and above and options.side != "parameters":
            # across processes above the P × P guard: each keeps its rows
            return SpreadProbeKernel(
                self.num_parameters, all_reduce=self.all_reduce, shard=self.shard, **common
            )
        return ProbeKernelFisher(
            self.num_parameters, side=options.side, summable=self.summable, **common
        )

    def summable_states(self) -> list[Tensor]:
        states = self.estimator.summable_states() if self.estimator is not None else []
        return states if self.gradient_sum is None else [*states, self.gradient_sum]

    def curvature(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate at ``lam``; ``probe_kernel`` also gets the objective's gradient, for
        the Newton decrement."""
        if self.gradient_sum is not None and isinstance(self.estimator, ProbeKernelFisher):
            params = dict(self.model.model.named_parameters())
            names = self.hooked.names
            self.estimator.gradient = objective_gradient(
                self.gradient_sum,
                num_samples,
                names,
                [params[name] for name in names],
                self.decay if self.decay is not None else lam,
            )
        estimate = self.estimator.estimate(num_samples, lam)
        if isinstance(self.estimator, ProbeKernelFisher):
            estimate.probe_rows = (self.estimator.probes, int(self.num_outputs or 0))
        return estimate

    def rank_shape(self) -> tuple[int, int]:
        return self.num_parameters, self.num_outputs or 0

    def scales_by_decay(self) -> bool:
        return self.decay is not None

    def coverage(self) -> dict[str, str] | None:
        """The block structures' coverage (the probe kernel has every cross-layer block)."""
        if isinstance(self.estimator, ProbeKernelFisher):
            return None
        return self.hooked.coverage()
