"""A differentiable soft-rank (or log-det) penalty on one minibatch.

Two estimators (``SoftRankPenalty(options=PenaltyOptions(estimator=...))``):

- ``"batched"`` (default): the batched upper bound of Theorem 6.5, below;
- ``"compositional"``: the gradient of ``h(F)/n`` itself at a running estimate ``F̂`` of the
  training Fisher (Kronecker factors kept as moving averages), "Flatness After All?",
  Section 6.3; see :mod:`lightning_flatness.regularizer.compositional` (docs/math.md,
  "Compositional gradient of h(F)"). Same options except ``labels`` (it draws Rademacher
  probes) and ``backend`` (it needs one backward pass with graph through any model).

The batched bound:

"Flatness After All?", Theorem 6.5 (docs/math.md, "Batched upper bound (Theorem 6.5) — the
regularizer"): for a continuous concave ``h`` with ``h(0) = 0`` and PSD matrices ``X_b``,
``h(Σ_b X_b) ≤ Σ_b h(X_b)`` for the trace function ``h(X) = Σ_k h(μ_k(X))``. Splitting the
training Fisher over the minibatches of an epoch, ``F = Σ_b F_b`` with
``F_b = (1/n) Σ_{i∈b} V_iᵀ V_i`` (n training samples), gives

    h(F)/n ≤ (1/n) Σ_b h(F_b),

and for equal batches of size B the one-batch term ``h(F_b)/B`` is an unbiased estimate of the
right-hand side (its mean over the batches of an epoch *is* the right-hand side). That term is
what :func:`soft_rank_penalty` returns; adding ``β · penalty`` to the training loss minimises an
upper bound on ``β · h(F)/n``.

``h(F_b)`` is computed exactly through the small kernel ``K_b = (1/n) V_b V_bᵀ``, whose nonzero
eigenvalues are those of ``F_b`` (docs/math.md, "Gram trick"; the first step of the proof of
Theorem 6.5). Two functions (docs/math.md, "Spectral functions of F"):

- ``function="soft_rank"``: ``h(μ) = μ/(μ+λ)``, so ``h(F_b) = Tr(K_b (K_b+λI)⁻¹)``;
- ``function="logdet"``: ``h(μ) = ½ log(1 + μ/λ)``, so ``h(F_b) = ½ log det(I + K_b/λ)``. The
  ½ is included, as in :func:`lightning_flatness.core.spectral.logdet_complexity`, so the penalty
  estimates (an upper bound on) the log-det complexity the library reports, divided by n.
  Immer et al. (2023) is the case ``h(x) = log(1 + x)``; the factor only rescales β.

Rows of ``V_b`` (``labels=``):

- ``"exact"``: all C classes, row ``(i, c)`` is ``√p_ic ∇θ log p_ic`` (docs/math.md, "The three
  matrices"), B·C rows, a BC × BC kernel. **p is not detached**: the penalty is the function
  ``θ ↦ h(F_b(θ))/B`` of the exact batch Fisher and its gradient is the true gradient of that
  function, including the dependence of the weights ``√p`` on θ, so central finite
  differences of the returned value agree with ``.backward()``. ``√p`` is evaluated as
  ``exp(½ log p)``, so a probability that underflows to 0 gives a zero, not a NaN, gradient.
- ``"sampled"``: one label ``ĉ_i ~ p_i`` per input from the model's own predictive
  distribution (as BackPACK's ``SqrtGGNMC`` with one sample), row ``∇θ log p_{iĉ_i}``, a B × B
  kernel. ``E_ĉ[∇log p_ĉ ∇log p_ĉᵀ] = Σ_c p_c ∇log p_c ∇log p_cᵀ = V_iᵀV_i``, so the sampled
  ``F̂_b`` is unbiased for ``F_b`` (``h(F̂_b)`` itself is biased low, ``h`` being concave).
  Labels are drawn by inverting the CDF of the detached ``p_i`` at a uniform from a private
  :class:`torch.Generator`: the global RNG stream is never consumed. For fixed labels the
  penalty is again an exact function of θ and its gradient the true gradient of that
  function; the labels' (piecewise constant) dependence on θ is not differentiated, i.e. the
  score-function term of ``∇θ E_ĉ[h(F̂_b)]`` is dropped.

Only the parameters selected by ``params=`` are differentiated (their rows form ``V_b``); the
others enter as constants (detached), so the penalty gives them no gradient at all.

Backends (``backend=``), all exact and returning the same number:

- ``"func"``: per-sample gradients that keep their graph, by :func:`torch.func.vmap` of
  :func:`torch.func.grad` (sampled) or :func:`torch.func.jacrev` (exact) over
  :func:`torch.func.functional_call`, with the model's own ``nn.Parameter`` s as the
  differentiated inputs. Works for any differentiable model; memory ``O(B·C·P)``.
- ``"layerwise"``: for ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``) the per-sample gradient
  of the weight is ``Σ_t δ_it a_itᵀ`` (layer inputs ``a``, output gradients ``δ``, positions
  ``t``), so the kernel is assembled layer by layer from one batched forward and one batched
  backward (``create_graph=True``) — ``(ΔΔᵀ) ⊙ (AAᵀ)`` when a layer sees one position per
  sample — without ever forming the B × P per-sample gradients of wide layers. Per layer the
  cheaper of that and materialising the per-sample gradients is used. Needs every selected
  parameter to be the weight or bias of such a layer and the model to process samples
  independently (which also defines ``V_i``). The layers are the measurement's Kronecker rules
  (the same hooks and patch unfolding); the first evaluation for a model checks one sample's
  rows against autograd, as for ``"rules"`` (a parameter also used outside its module's
  forward other than as an ``nn.Linear`` weight applied by ``F.linear``, which is followed, or a
  model that mixes samples, fails it).
- ``"rules"``: the rows of ``V_b`` from the measurement's layer rules
  (:mod:`lightning_flatness.regularizer.rule_rows`): linear maps, Hugging Face's ``Conv1D``,
  convolutions, embeddings, normalisation layers, attention, recurrent layers (padded or
  packed) and class tokens give their per-sample gradients from one batched forward and one
  batched backward kept in the graph, also where the model's control flow depends on the data
  (GPT-2's and BERT's mask code, which ``vmap`` cannot follow). Needs every selected parameter
  inside such a layer, with the samples on the first axis; the first evaluation for a model
  checks one sample's rows against autograd.
- ``"auto"`` (default): ``"layerwise"`` when it applies, else ``"rules"``, else ``"func"``
  (said once per model).

Either way the smaller of ``V_b V_bᵀ`` and ``V_bᵀ V_b`` is factorised (Cholesky of
``I + K/λ`` in float64), and the trace function has a closed-form gradient
(``∂/∂K Tr(K(K+λI)⁻¹) = λ(K+λI)⁻²``, ``∂/∂K ½ log det(I+K/λ) = ½(K+λI)⁻¹``). The penalty is
differentiable once (its gradient is exact; it cannot be differentiated a second time).
Cost per call: one extra forward and backward (with graph) of the model, the Gram matrix, and
``O(m³)`` float64 work for the ``m × m`` factorisation, ``m = min(B, P)`` for sampled labels
and ``min(B·C, P)`` for exact ones; the latter dominates for exact labels at large B.

Inside the penalty BatchNorm uses its running statistics and Dropout is off (with batch
statistics a sample's output depends on the whole batch, so ``V_i`` is undefined, and a masked
network's Fisher is random): the standard per-sample-gradient practice, said once per model; the
training step itself keeps its modes. BatchNorm without running statistics is refused. Models
must return logits of shape ``(batch, classes)``. Under :func:`torch.no_grad` the penalty is
evaluated without building a graph (for logging).

The module is pure PyTorch (no Lightning); the same call serves a callback and manual
optimisation::

    penalty = SoftRankPenalty(lam=1e-4, num_train_samples=len(train_set), seed=0)
    loss = F.cross_entropy(model(x), y) + beta * penalty(model, x)
    loss.backward()
"""

from __future__ import annotations

from lightning_flatness.regularizer.arguments import BACKENDS, ESTIMATORS, FUNCTIONS, LABELS
from lightning_flatness.regularizer.func_rows import fisher_rows
from lightning_flatness.regularizer.kernel import fisher_gram
from lightning_flatness.regularizer.labels import sample_labels
from lightning_flatness.regularizer.options import PenaltyOptions
from lightning_flatness.regularizer.parameters import select_parameters
from lightning_flatness.regularizer.penalty import SoftRankPenalty, soft_rank_penalty
from lightning_flatness.regularizer.trace_function import gram_trace_function

__all__ = [
    "BACKENDS",
    "ESTIMATORS",
    "FUNCTIONS",
    "LABELS",
    "PenaltyOptions",
    "SoftRankPenalty",
    "fisher_gram",
    "fisher_rows",
    "gram_trace_function",
    "sample_labels",
    "select_parameters",
    "soft_rank_penalty",
]
