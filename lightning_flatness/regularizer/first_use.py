"""The first-use check of a hooked backend: one sample's rows against plain autograd.

The rows the hooked backends build (``"layerwise"``, ``"rules"``) are sample ``i``'s gradient
``∇θ f_i`` only when every use of a selected parameter happens inside a hooked layer's forward
and the model keeps the samples apart. Both show on one sample: for an objective on the logits
of sample ``i`` alone, the gradients of the layers' outputs vanish outside sample ``i``, and the
hooked rows of sample ``i`` equal autograd's gradient of that objective. The verdict is kept per
model and selection, so the check costs one extra forward and backward once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.layer_rules import Rule
from lightning_flatness.regularizer.refusals import LayerwiseIncomplete, LayerwiseUnsupported
from lightning_flatness.regularizer.rule_gradients import hooked_rows

__all__ = ["FirstUseChecks", "first_use_error"]

#: relative size of the rows' error, and of the gradients that leak to other samples, allowed
_TOLERANCE = 1e-4


def _tolerance(grads: list[Tensor]) -> float:
    """:data:`_TOLERANCE`, or four rounding units of the least precise dtype the layers'
    outputs were computed in (``bfloat16`` or ``float16`` under autocast), if larger."""
    eps = max((torch.finfo(g.dtype).eps for g in grads if g.is_floating_point()), default=0.0)
    return max(_TOLERANCE, 4 * eps)


class FirstUseChecks:
    """The verdicts of one backend: per model and key, None once checked right, else why the
    rows cannot be had (kept: a refused model is not checked again)."""

    def __init__(self) -> None:
        self._verdicts: weakref.WeakKeyDictionary[
            nn.Module, dict[Hashable, LayerwiseUnsupported | None]
        ] = weakref.WeakKeyDictionary()

    def raise_if_refused(self, model: nn.Module, key: Hashable) -> None:
        """Raise (a fresh copy of) the error the model was refused with, if it was."""
        verdict = self._verdicts.get(model, {}).get(key)
        if verdict is not None:  # a fresh instance: re-raising one object grows its traceback
            raise type(verdict)(str(verdict))

    def refuse(self, model: nn.Module, key: Hashable, error: LayerwiseUnsupported) -> None:
        """Keep ``error`` as the verdict for the model and key."""
        self._verdicts.setdefault(model, {})[key] = error

    def settle(
        self,
        model: nn.Module,
        key: Hashable,
        check: Callable[[], LayerwiseUnsupported | None],
    ) -> None:
        """Run ``check`` on first use of the model and key (an error it raises counts as its
        verdict); raise the verdict unless it is None."""
        verdicts = self._verdicts.setdefault(model, {})
        if key not in verdicts:
            try:
                verdicts[key] = check()
            except LayerwiseUnsupported as error:
                verdicts[key] = error
        self.raise_if_refused(model, key)


def first_use_error(
    wrapped: LogitsModule,
    leaves: Leaves,
    rules: list[Rule],
    taps: list[str],
    selected: dict[str, nn.Parameter],
) -> LayerwiseIncomplete | None:
    """Why the hooked rows (the ``rules``' layers, the tapped parameters) are not per-sample
    gradients of the ``selected`` parameters, or None when they are (module docstring)."""
    batch = num_samples(leaves)
    sample = batch - 1

    def one_sample(logits: Tensor) -> list[Tensor]:
        weight = torch.zeros_like(logits)
        weight[sample] = torch.linspace(0.5, 1.5, logits.shape[-1], dtype=logits.dtype)
        return [(logits * weight).sum()]

    with torch.enable_grad():
        try:
            found, grads = hooked_rows(
                wrapped, leaves, rules, taps, one_sample, False, slice(sample, sample + 1)
            )
        except (RuntimeError, IndexError) as error:  # e.g. a layer's samples on another axis
            return LayerwiseIncomplete(f"the layer rules cannot follow this model ({error}).")
        objective = one_sample(wrapped(*leaves))[0]
        expected = torch.autograd.grad(objective, list(selected.values()), allow_unused=True)
    dims = [rule.batch_dim for rule in rules for _ in rule.calls] + [0] * len(taps)
    tolerance = _tolerance(grads)
    for grad, dim in zip(grads, dims, strict=True):
        if grad.dim() < dim + 2 or grad.shape[dim + 1] != batch:
            return LayerwiseIncomplete(
                "the samples of a hooked layer are not on its first axis (a sequence-first "
                "layer, or a call on something other than the batch)."
            )
        others = float(grad.narrow(dim + 1, 0, sample).norm())
        if others > tolerance * float(grad.norm()):
            return LayerwiseIncomplete(
                "the model mixes samples: one sample's logits have a gradient at the other "
                "samples' layer outputs."
            )
    for (name, param), grad in zip(selected.items(), expected, strict=True):
        truth = torch.zeros_like(param) if grad is None else grad
        rows = found[name][0, 0].detach()
        if float((rows - truth.reshape(-1)).norm()) > tolerance * float(truth.norm()) + 1e-8:
            return LayerwiseIncomplete(
                f"the hooked layers do not give sample-wise gradients of {name!r} (it is used "
                "outside its module's forward other than by F.linear, or the model mixes "
                "samples)."
            )
    return None
