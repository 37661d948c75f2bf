"""Everything that touches BackPACK, in one place, so the user's model is left as found.

:func:`measurement_copy` makes a private deep copy of the model in eval mode and extends *the
copy*: BackPACK's ``extend`` registers hooks and stores attributes on modules, so working on the
live model would leave hooks behind (slowing every later training step) and overwrite ``.grad``.
The copy is dropped after the measurement; the live model's parameters, gradients, mode and
BatchNorm statistics are never touched.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from backpack import backpack, extend
from backpack.core.derivatives.bcewithlogitsloss import BCELossWithLogitsDerivatives
from backpack.extensions import DiagGGNExact, DiagGGNMC, SqrtGGNExact, SqrtGGNMC
from backpack.extensions.secondorder.diag_ggn.losses import DiagGGNLoss
from backpack.extensions.secondorder.hbp import HBP
from backpack.extensions.secondorder.hbp.losses import HBPLoss
from backpack.extensions.secondorder.sqrt_ggn.losses import SqrtGGNBaseLossModule
from torch import Tensor, nn

from lightning_flatness.core.batches import LogitsModule
from lightning_flatness.core.failures import UnsupportedModelError
from lightning_flatness.core.hook_recorder import HookRecorder
from lightning_flatness.core.last_layer import last_layer

__all__ = [
    "ExtendedModel",
    "backward_with",
    "extended_loss",
    "loss_scale",
    "measurement_copy",
    "support_loss",
]

# Attributes objects commonly hold that must be shared, not copied (e.g. a LightningModule's
# trainer, which owns dataloaders and loggers).
_SHARED_ATTRIBUTES = ("_trainer", "_fabric")


@dataclass
class ExtendedModel:
    """A BackPACK-extended private copy of a model.

    Attributes:
        module: the extended copy (eval mode, hooks installed).
        parameters: its trainable parameters in the original ``named_parameters()`` order.
        names: the original names of those parameters.
        last_layer: the model's last layer (:func:`~lightning_flatness.core.last_layer.last_layer`).
        last_layer_input: its input in the latest forward pass.
    """

    module: nn.Module
    parameters: list[nn.Parameter]
    names: list[str]
    last_layer: nn.Module | None = None
    _inputs: list[Tensor] = field(default_factory=list)

    @property
    def last_layer_input(self) -> Tensor | None:
        """The last layer's input in the latest forward pass (None before one, or without)."""
        return self._inputs[-1] if self._inputs else None

    def record_forward_facts(self) -> None:
        """Install a forward hook (on the private copy, which is discarded with its hooks) that
        keeps what BackPACK frees after backward: the last linear layer's input."""
        self.last_layer = last_layer(self.module)
        self._inputs = HookRecorder().last_layer_inputs(self.last_layer, latest=True)

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None


def _plain_deepcopy(model: nn.Module) -> nn.Module:
    memo: dict[int, object] = {}
    for module in model.modules():
        for attribute in _SHARED_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if value is not None and not isinstance(value, (Tensor, nn.Module)):
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def _needs_converter(model: nn.Module) -> bool:
    """BackPACK follows a chain of modules; anything but nested ``nn.Sequential`` may branch."""
    if isinstance(model, nn.Sequential):
        return any(_needs_converter(child) for child in model.children())
    return any(True for _ in model.children())


def measurement_copy(model: LogitsModule) -> ExtendedModel:
    """Deep-copy ``model`` in eval mode and extend the copy with BackPACK.

    When the wrapped model alone computes the logits from one tensor (the default call) the
    copy of the wrapped model is extended, else the copy of the whole :class:`LogitsModule`.
    Residual and other non-sequential graphs go through BackPACK's graph converter
    (``use_converter=True``), which turns functional operations such as ``+`` into modules.
    Parameter names are those of the user's model either way.

    Raises:
        UnsupportedModelError: when the graph cannot be converted; names the reason.
    """
    inner = model.model
    original = [(name, p) for name, p in inner.named_parameters() if p.requires_grad]
    if not original:
        raise ValueError("The model has no trainable parameters; there is no Fisher to measure.")
    clone = _plain_deepcopy(inner if model.is_plain() else model)
    clone.eval()
    prefix = "" if model.is_plain() else LogitsModule.PREFIX
    clone_params = dict(clone.named_parameters())
    parameters = [clone_params[prefix + name] for name, _ in original]
    if _needs_converter(clone):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                extended = extend(clone, use_converter=True)
        except Exception as error:  # torch.fx cannot trace data-dependent control flow
            raise UnsupportedModelError(
                f"BackPACK's graph converter could not convert {type(inner).__name__} "
                f"({type(error).__name__}: {error}). Use a matrix-free structure "
                "(structure='lanczos' or 'hutchinson') for this model."
            ) from error
        extended.eval()
    else:
        extended = extend(clone)
    result = ExtendedModel(extended, parameters, [name for name, _ in original])
    result.record_forward_facts()
    return result


@contextmanager
def _translated_errors(structure: str):
    try:
        yield
    except NotImplementedError as error:
        message = str(error)
        if "accumulation rule" in message:
            hint = (
                f"structure={structure!r} cannot follow branching (residual) graphs in BackPACK; "
                "use structure='kfac' (any graph) or 'dense', 'gram', 'diag', 'diag_mc' here."
            )
        else:
            hint = (
                "A layer with trainable parameters has no BackPACK rule (supported: Linear, "
                "Conv1d/2d/3d, ConvTranspose, BatchNorm in eval mode, Embedding, RNN/LSTM and "
                "parameter-free activations, pooling, Flatten, Dropout). Use structure='kfac' "
                "(any differentiable model) or a matrix-free structure, or freeze that layer."
            )
        raise UnsupportedModelError(
            f"BackPACK cannot compute {structure!r} for this model: {message}. {hint}"
        ) from error


class _MultiOutputBCEDerivatives(BCELossWithLogitsDerivatives):
    """BackPACK's BCE-with-logits derivatives for C ≥ 1 independent outputs and soft targets.

    BackPACK 1.7 accepts one output and 0/1 targets only. The loss Hessian of
    ``Σ_c BCE(z_c, y_c)`` is ``diag(σ(1 − σ))`` whatever the targets, with square root
    ``diag √(σ(1 − σ))`` (shape [C, N, C]); the sampled square root (one Bernoulli draw per
    output) is BackPACK's own and already works per output.
    """

    def _verify_support(self, module: nn.BCEWithLogitsLoss) -> None:
        self._check_is_default(module)
        if module.input0.dim() != 2:
            raise NotImplementedError("loss='bce' needs logits of shape (batch, outputs).")

    def _sqrt_hessian(self, module, g_inp, g_out, subsampling=None) -> Tensor:
        self._verify_support(module)
        logits = module.input0 if subsampling is None else module.input0[subsampling]
        sigma = logits.sigmoid()
        root = torch.diag_embed((sigma * (1.0 - sigma)).sqrt())  # [N, C, C]
        if module.reduction == "mean":
            root = root / module.input0.shape[0] ** 0.5
        return root.transpose(0, 1)  # [C, N, C]: root[:, n, :] is sample n's (symmetric) root


def support_loss(extensions: Sequence[object], loss: str) -> None:
    """Prepare ``extensions`` for the loss module of ``loss``, once before a pass over batches.

    For ``"bce"`` the second-order extensions get the multi-output BCE derivatives; the other
    losses need nothing.
    """
    if loss != "bce":
        return
    for extension in extensions:
        if isinstance(extension, (DiagGGNExact, DiagGGNMC)):
            module_extension = DiagGGNLoss(_MultiOutputBCEDerivatives())
        elif isinstance(extension, (SqrtGGNExact, SqrtGGNMC)):
            module_extension = SqrtGGNBaseLossModule(_MultiOutputBCEDerivatives())
        elif isinstance(extension, HBP):
            module_extension = HBPLoss(_MultiOutputBCEDerivatives())
        else:
            continue
        extension.set_module_extension(nn.BCEWithLogitsLoss, module_extension, overwrite=True)


def backward_with(
    model: ExtendedModel,
    loss: Tensor,
    extensions: Sequence[object],
    structure: str,
) -> None:
    """Run one backward pass of ``loss`` with the given BackPACK extensions active."""
    model.zero_grad()
    with _translated_errors(structure), backpack(*extensions), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        loss.backward()


def loss_scale(loss: str) -> float:
    """``Σ_i −log p(y_i | z_i)`` ÷ :func:`extended_loss`: BackPACK's gradients and curvature
    times this factor are those of the negative log-likelihood (0.5 for ``"mse"``, whose
    ``MSELoss`` is ``‖y − f‖²``, twice ``½‖y − f‖²``; 1 otherwise)."""
    return 0.5 if loss == "mse" else 1.0


def extended_loss(loss: str) -> nn.Module:
    """The summed per-sample loss, extended: sum reduction makes every BackPACK quantity a sum
    over samples, which :mod:`lightning_flatness.core.measure` divides by the sample count once.
    Multiply its gradients and curvature by :func:`loss_scale`.
    """
    if loss == "cross_entropy":
        return extend(nn.CrossEntropyLoss(reduction="sum"))
    if loss == "bce":
        return extend(nn.BCEWithLogitsLoss(reduction="sum"))
    if loss == "mse":
        return extend(nn.MSELoss(reduction="sum"))
    raise ValueError(f"loss must be 'cross_entropy', 'bce' or 'mse', got {loss!r}.")
