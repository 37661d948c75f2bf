"""From what a user's data loader and model hand over to ``(inputs, targets)`` and logits.

Three conventions are read, each replaceable by a callable of the user's:

- ``unpack_batch(batch) -> (inputs, targets)`` (default :func:`default_unpack_batch`):
  sequences ``(x, y, *rest)`` give ``(x, y)``; mappings give the value under the first present
  key of :data:`TARGET_KEYS` as targets and the remaining entries as inputs (the convention of
  Hugging Face and of Lightning's own text-classification example).
- calling the model on the inputs (:func:`call_model`): a tensor positionally, a tuple or list
  as positional arguments, a mapping as keyword arguments when the model's ``forward`` accepts
  those names, or positionally when a single entry remains;
- ``logits_fn(module, inputs) -> logits`` (default :func:`default_logits_fn`): calls the model
  and reads its output (:func:`read_logits`): a tensor as it is, an object's ``.logits``
  (Hugging Face ``ModelOutput``), a mapping's ``"logits"``, the first element of a tuple/list.

Inside the package inputs travel as a flat tuple of tensors (the *leaves*) together with the
:class:`InputSpec` that rebuilds the user's structure, so that every stage that counts, slices,
splits, moves or shards a batch does it once, here, for tensors, tuples and dicts alike.
:class:`LogitsModule` wraps the user's model as a module whose ``forward`` takes the leaves and
returns logits, which is what BackPACK, :mod:`torch.func` and the regularizer evaluate.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = [
    "TARGET_KEYS",
    "BatchError",
    "InputSpec",
    "Leaves",
    "LogitsFn",
    "LogitsModule",
    "UnpackBatch",
    "call_model",
    "default_logits_fn",
    "default_unpack_batch",
    "num_samples",
    "prepared_batches",
    "read_logits",
    "split_leaves",
    "take_rows",
    "unsqueeze_leaves",
    "wrap_for_batches",
]

#: keys under which a mapping batch holds its targets, in the order they are looked for
TARGET_KEYS = ("labels", "label", "targets", "target", "y")

UnpackBatch = Callable[[Any], tuple[Any, Any]]
LogitsFn = Callable[[nn.Module, Any], Tensor]
Leaves = tuple[Tensor, ...]


class BatchError(ValueError):
    """A batch, a model call or a model output the package cannot read; the message names the
    argument (``unpack_batch=`` or ``logits_fn=``) that fixes it."""


def _keys(batch: Mapping) -> str:
    return ", ".join(repr(key) for key in batch)


def default_unpack_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a ``(x, y, *rest)`` sequence or a mapping (module docstring).

    Raises:
        BatchError: for any other batch, or a mapping without a target key; names the batch
            type and its keys, and ``unpack_batch=``.
    """
    if isinstance(batch, Mapping):
        key = next((key for key in TARGET_KEYS if key in batch), None)
        if key is None:
            raise BatchError(
                f"The batch is a {type(batch).__name__} with keys {_keys(batch)}, none of which "
                f"holds the targets (looked for {', '.join(TARGET_KEYS)}). Pass "
                "unpack_batch=lambda batch: (inputs, targets) to say which entries are which."
            )
        inputs = {name: value for name, value in batch.items() if name != key}
        if not inputs:
            raise BatchError(
                f"The batch {type(batch).__name__} holds only the targets ({key!r}); pass "
                "unpack_batch=lambda batch: (inputs, targets)."
            )
        return inputs, batch[key]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) >= 2:
        return batch[0], batch[1]
    kind = type(batch).__name__
    detail = f" of length {len(batch)}" if isinstance(batch, Sequence) else ""
    raise BatchError(
        f"Cannot tell inputs from targets in a batch of type {kind}{detail}: expected (inputs, "
        f"targets, ...) or a mapping with one of the keys {', '.join(TARGET_KEYS)}. Pass "
        "unpack_batch=lambda batch: (inputs, targets)."
    )


def _accepts_keywords(module: nn.Module, names: Iterable[str]) -> bool:
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    parameters = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return set(names) <= accepted


def _has_forward(module: nn.Module) -> bool:
    if "forward" in vars(module):  # set on the instance, e.g. by torch.compile's wrapper
        return True
    forward = type(module).forward
    return forward is not nn.Module.forward and forward.__qualname__ != "LightningModule.forward"


def call_model(module: nn.Module, inputs: Any) -> Any:
    """Call ``module`` on ``inputs`` by the conventions of the module docstring.

    Raises:
        BatchError: the module defines no ``forward``, or a mapping's names do not fit it.
    """
    if not _has_forward(module):
        raise BatchError(
            f"{type(module).__name__} defines no forward(), so the monitor cannot compute its "
            "logits. Define forward() or pass logits_fn=lambda module, inputs: "
            "module.model(inputs) (the call your training_step makes)."
        )
    if isinstance(inputs, Mapping):
        if _accepts_keywords(module, inputs):
            return module(**inputs)
        if len(inputs) == 1:
            return module(next(iter(inputs.values())))
        raise BatchError(
            f"The inputs have the keys {_keys(inputs)}, but {type(module).__name__}.forward "
            f"{inspect.signature(module.forward)} does not accept them as keywords. Pass "
            "logits_fn=lambda module, inputs: module(...) with the call your training_step makes."
        )
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def _is_tensor(value: Any) -> bool:
    """A tensor, or its stand-in while BackPACK's converter traces the model."""
    return isinstance(value, (Tensor, torch.fx.Proxy))


def read_logits(output: Any) -> Tensor:
    """The logits in a model's output: a tensor, ``.logits``, ``["logits"]`` or ``[0]``.

    Raises:
        BatchError: naming what the model returned and ``logits_fn=``.
    """
    if _is_tensor(output):
        return output
    logits = getattr(output, "logits", None)
    if _is_tensor(logits):
        return logits
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        raise BatchError(
            f"The model returned a {type(output).__name__} with keys {_keys(output)} and no "
            "'logits'. Pass logits_fn=lambda module, inputs: module(inputs)[<key of the logits>]."
        )
    if isinstance(output, (tuple, list)) and output and _is_tensor(output[0]):
        return output[0]
    raise BatchError(
        f"Cannot find the logits in the model's output of type {type(output).__name__}: "
        "expected a tensor, an object with .logits, a mapping with 'logits' or a tuple whose "
        "first element is the logits. Pass logits_fn=lambda module, inputs: <the logits>."
    )


def default_logits_fn(module: nn.Module, inputs: Any) -> Tensor:
    """``read_logits(call_model(module, inputs))``."""
    return read_logits(call_model(module, inputs))


@dataclass(frozen=True)
class InputSpec:
    """The structure of a batch's inputs: one tensor, a tuple of tensors, or a dict of them."""

    kind: str  # "tensor", "tuple" or "dict"
    keys: tuple[str, ...] = ()
    size: int = 1

    @classmethod
    def of(cls, inputs: Any) -> InputSpec:
        """The spec of ``inputs``; raises :class:`BatchError` for anything but tensors."""
        if isinstance(inputs, Tensor):
            return cls("tensor")
        if isinstance(inputs, Mapping):
            values, kind, keys = list(inputs.values()), "dict", tuple(inputs)
        elif isinstance(inputs, (tuple, list)):
            values, kind, keys = list(inputs), "tuple", ()
        else:
            raise BatchError(
                f"The inputs of a batch are a {type(inputs).__name__}; expected a tensor, a "
                "tuple or a dict of tensors. Pass unpack_batch=lambda batch: (inputs, targets)."
            )
        wrong = [
            repr(key) if keys else str(index)
            for index, (key, value) in enumerate(zip(keys or values, values, strict=True))
            if not isinstance(value, Tensor)
        ]
        if not values or wrong:
            raise BatchError(
                f"Every input entry must be a tensor; entries {', '.join(wrong) or '(none)'} of "
                f"the {type(inputs).__name__} are not. Pass unpack_batch=lambda batch: (inputs, "
                "targets) that keeps only the model's tensor inputs."
            )
        return cls(kind, keys, len(values))

    def flatten(self, inputs: Any) -> Leaves:
        """The leaves of ``inputs`` (which must have this spec)."""
        if self.kind == "tensor":
            leaves: Leaves = (inputs,)
        elif self.kind == "dict":
            if tuple(inputs) != self.keys:
                raise BatchError(
                    f"The inputs' keys changed from {self.keys} to {tuple(inputs)} between "
                    "batches; every batch must have the same entries."
                )
            leaves = tuple(inputs.values())
        else:
            leaves = tuple(inputs)
        if len(leaves) != self.size or not all(isinstance(t, Tensor) for t in leaves):
            raise BatchError("Every batch must have the same kind and number of tensor inputs.")
        return leaves

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """The user's structure from the leaves (tensors or tracing proxies)."""
        if self.kind == "tensor":
            return leaves[0]
        if self.kind == "dict":
            return {key: leaves[index] for index, key in enumerate(self.keys)}
        return tuple(leaves[index] for index in range(self.size))


def num_samples(leaves: Leaves) -> int:
    """The batch size shared by all leaves (their first dimension).

    Raises:
        BatchError: leaves of different lengths, or a 0-dimensional leaf.
    """
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = [tuple(t.shape) for t in leaves]
        raise BatchError(
            f"The input tensors of a batch must share their first (batch) dimension; got shapes "
            f"{shapes}. Pass unpack_batch=... that returns only per-sample inputs."
        )
    return int(next(iter(sizes)))


def take_rows(leaves: Leaves, rows: slice | Tensor) -> Leaves:
    """The samples ``rows`` of every leaf."""
    return tuple(t[rows] for t in leaves)


def unsqueeze_leaves(leaves: Leaves) -> Leaves:
    """One sample's leaves as a batch of one (for per-sample functions under ``vmap``)."""
    return tuple(t.unsqueeze(0) for t in leaves)


def split_leaves(leaves: Leaves, size: int) -> list[Leaves]:
    """Consecutive chunks of ``size`` samples (the last one may be shorter)."""
    return list(zip(*(t.split(size) for t in leaves), strict=True))


def _move(t: Tensor, device: torch.device, dtype: torch.dtype | None) -> Tensor:
    """``t`` on ``device``, in ``dtype`` if it is floating (and ``dtype`` given), autograd-ready."""
    t = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)
    return t.clone() if t.is_inference() else t


class LogitsModule(nn.Module):
    """The user's model as a module from input leaves to logits (module docstring).

    The model is the child ``model``, so parameter names carry the prefix ``"model."``;
    :meth:`call` takes parameters under the model's own names.
    """

    PREFIX = "model."

    def __init__(self, model: nn.Module, spec: InputSpec, logits_fn: LogitsFn | None = None):
        super().__init__()
        self.model = model
        self.spec = spec
        self.logits_fn = logits_fn or default_logits_fn

    def forward(self, *leaves: Tensor) -> Tensor:
        return read_logits(self.logits_fn(self.model, self.spec.unflatten(leaves)))

    def call(self, params: Mapping[str, Tensor], leaves: Leaves) -> Tensor:
        """The logits with ``params`` (keyed by the model's own names) in place of the model's."""
        prefixed = {self.PREFIX + name: value for name, value in params.items()}
        return functional_call(self, prefixed, tuple(leaves))

    def is_plain(self) -> bool:
        """An ``nn.Sequential`` called on one tensor: the wrapped model alone computes the
        same logits (a chain of modules BackPACK can extend without converting its graph)."""
        return (
            self.logits_fn is default_logits_fn
            and self.spec.kind == "tensor"
            and isinstance(self.model, nn.Sequential)
        )


def _peek_spec(
    batches: Iterable, unpack_batch: UnpackBatch | None = None
) -> tuple[InputSpec | None, Iterable]:
    """The :class:`InputSpec` of the first batch, and an iterable that still yields it.

    The returned iterable is single-use; ``(None, [])`` when there is no batch.
    """
    iterator = iter(batches)
    for first in iterator:
        inputs, _ = (unpack_batch or default_unpack_batch)(first)
        return InputSpec.of(inputs), itertools.chain([first], iterator)
    return None, []


def wrap_for_batches(
    model: nn.Module,
    batches: Iterable,
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
) -> tuple[LogitsModule, Iterable, bool]:
    """``model`` wrapped for the input structure of the first batch of ``batches``.

    Returns:
        The :class:`LogitsModule`, a single-use iterable that still yields every batch (the
        first one was read to learn the inputs' structure), and whether there was a batch at
        all (without one the wrapper expects one tensor).
    """
    spec, first_pass = _peek_spec(batches, unpack_batch)
    wrapped = LogitsModule(model, spec or InputSpec("tensor"), logits_fn)
    return wrapped, first_pass, spec is not None


def prepared_batches(
    batches: Iterable,
    max_samples: int | None,
    device: torch.device,
    dtype: torch.dtype,
    unpack_batch: UnpackBatch | None = None,
    spec: InputSpec | None = None,
) -> Iterator[tuple[int, Leaves, Tensor]]:
    """``(index, leaves, targets)`` per batch, on ``device``; floating inputs in ``dtype``.

    Batches are unpacked with ``unpack_batch`` (default :func:`default_unpack_batch`) and
    their inputs flattened with ``spec`` (default: the spec of the first batch); the stream is
    truncated after ``max_samples`` samples in all, and empty batches are skipped. Targets are
    moved but keep their dtype (the likelihood prepares them against the logits). Tensors
    created under ``torch.inference_mode`` are cloned so autograd can use them.
    """
    unpack = unpack_batch or default_unpack_batch
    seen = 0
    for index, batch in enumerate(batches):
        if max_samples is not None and seen >= max_samples:
            break
        inputs, targets = unpack(batch)
        if spec is None:
            spec = InputSpec.of(inputs)
        leaves = spec.flatten(inputs)
        if not isinstance(targets, Tensor):
            raise BatchError(
                f"The targets of a batch are a {type(targets).__name__}, not a tensor. Pass "
                "unpack_batch=lambda batch: (inputs, targets) returning a target tensor."
            )
        size = num_samples(leaves)
        if targets.dim() == 0 or targets.shape[0] != size:
            raise BatchError(
                f"A batch has {size} inputs but targets of shape {tuple(targets.shape)}; the "
                "first dimension of both is the batch. Pass unpack_batch=... if the batch "
                "holds them differently."
            )
        if max_samples is not None and size > max_samples - seen:
            keep = slice(0, max_samples - seen)
            leaves, targets, size = take_rows(leaves, keep), targets[keep], max_samples - seen
        if size == 0:
            continue
        seen += size
        leaves = tuple(_move(t, device, dtype) for t in leaves)
        yield index, leaves, _move(targets, device, None)
