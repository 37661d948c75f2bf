"""What the callback reads from a Trainer: λ from the optimizer, n from the data, fixed subsets.

Kept apart from the callback so each rule is stated (and tested) once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from lightning_flatness.core.decay import ParameterDecay

__all__ = [
    "LambdaResolutionError",
    "all_dataloaders",
    "first_dataloader",
    "fixed_subset_batches",
    "is_sized",
    "resolve_lam",
    "resolve_missing",
    "resolve_num_train_samples",
    "select_dataloader",
    "sharding_refusal",
]

#: Optimizers whose ``weight_decay`` adds ``λθ`` to the gradient (coupled L2), i.e. minimise
#: ``mean loss + ½λ‖θ‖²`` — the λ of the soft rank (docs/math.md, "Setting").
COUPLED_DECAY_OPTIMIZERS = ("SGD", "Adam", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD")
#: Optimizers whose decay is decoupled from the gradient (not this λ).
DECOUPLED_DECAY_OPTIMIZERS = ("AdamW", "Lion", "SGDW")


class LambdaResolutionError(ValueError):
    """λ cannot be read from the optimizer; the message says to pass ``lam=``."""


def resolve_lam(
    optimizers: Sequence[torch.optim.Optimizer],
    explicit: float | None,
    module: torch.nn.Module | None = None,
) -> float | ParameterDecay:
    """λ for the soft rank: ``explicit`` if given, else the optimizers' coupled weight decay;
    when the parameter groups decay differently (no decay on biases and norms), the decay of
    each of ``module``'s trainable parameters (:class:`ParameterDecay`, soft rank
    ``Tr(F(F+D)⁻¹)``).

    Raises:
        LambdaResolutionError: no optimizer, decoupled decay (AdamW), ``weight_decay=0`` on
            every group, or different decays across groups without a ``module`` to name them;
            each message names the value and says to pass ``FlatnessMonitor(lam=...)``.
    """
    if explicit is not None:
        return float(explicit)
    fix = "Pass FlatnessMonitor(lam=...) with the coupled L2 weight decay λ of your objective."
    if not optimizers:
        raise LambdaResolutionError(f"The trainer has no optimizer to read λ from. {fix}")
    decays = set()
    by_parameter: dict[int, float] = {}
    for optimizer in optimizers:
        name = type(optimizer).__name__
        groups = [group.get("weight_decay", 0.0) for group in optimizer.param_groups]
        if name in DECOUPLED_DECAY_OPTIMIZERS or optimizer.defaults.get("decoupled_weight_decay"):
            raise LambdaResolutionError(
                f"{name} uses decoupled weight decay (weight_decay={groups[0]}), which is not the "
                "λ of L = mean loss + ½λ‖θ‖² in the soft rank. Use a coupled decay (Adam/SGD "
                f"weight_decay) or {fix[5:]}"
            )
        if name not in COUPLED_DECAY_OPTIMIZERS:
            raise LambdaResolutionError(
                f"Cannot tell whether {name}'s weight_decay is a coupled L2 term. {fix}"
            )
        decays.update(float(decay) for decay in groups)
        for group in optimizer.param_groups:
            for param in group["params"]:
                by_parameter[id(param)] = float(group.get("weight_decay", 0.0))
    if len(decays) > 1:
        if module is None:
            raise LambdaResolutionError(
                f"The parameter groups use different weight decays {sorted(decays)}; this "
                f"needs one λ. {fix}"
            )
        return _parameter_decay(module, by_parameter, fix)
    (lam,) = decays
    if lam <= 0.0:
        raise LambdaResolutionError(
            f"The optimizer's weight_decay is {lam}: the soft rank needs λ > 0 (with λ = 0 it is "
            f"the plain rank of F). {fix}"
        )
    return lam


def first_dataloader(loaders: object) -> DataLoader | None:
    """The first DataLoader in what ``trainer.train_dataloader`` / ``val_dataloaders`` return."""
    if loaders is None or isinstance(loaders, DataLoader):
        return loaders
    if isinstance(loaders, dict):
        return first_dataloader(next(iter(loaders.values()), None))
    if isinstance(loaders, (list, tuple)):
        return first_dataloader(loaders[0]) if loaders else None
    return None


def all_dataloaders(loaders: object) -> list[DataLoader]:
    """Every DataLoader in what ``trainer.val_dataloaders`` returns, in order."""
    if loaders is None:
        return []
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [loader for item in loaders for loader in all_dataloaders(item)]
    return []


def select_dataloader(loaders: object, index: int) -> DataLoader | None:
    """The ``index``-th DataLoader of ``loaders`` (None when there are none).

    Raises:
        ValueError: ``index`` beyond the loaders there are; names ``val_dataloader``.
    """
    found = all_dataloaders(loaders)
    if not found:
        return None
    if index >= len(found):
        raise ValueError(
            f"val_dataloader={index}, but the trainer has {len(found)} validation "
            f"dataloader(s); pass FlatnessMonitor(val_dataloader=0 … {len(found) - 1})."
        )
    return found[index]


def is_sized(loader: DataLoader) -> bool:
    """Whether ``loader``'s dataset has a length (map-style), so a fixed subset can be drawn."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return False
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def dataset_length(loader: DataLoader | None) -> int | None:
    """``len(loader.dataset)`` where the dataset defines one (map-style, or an iterable
    dataset with ``__len__``), else None."""
    try:
        return len(loader.dataset)  # type: ignore[arg-type, union-attr]
    except (TypeError, AttributeError):
        return None


def _parameter_decay(
    module: torch.nn.Module, by_parameter: dict[int, float], fix: str
) -> ParameterDecay:
    """The decay of each trainable parameter of ``module`` by name (frozen ones are not
    measured); a trainable parameter no optimizer holds has no decay to read."""
    decays = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) not in by_parameter:
            raise LambdaResolutionError(
                f"The trainable parameter {name!r} is in no optimizer group, so its weight "
                f"decay is unknown. {fix}"
            )
        decays[name] = by_parameter[id(param)]
    try:
        return ParameterDecay(decays)
    except ValueError as error:
        raise LambdaResolutionError(f"{error} {fix}") from error


#: strategies and module wrappers that shard parameters across processes (docs/sharded.md)
SHARDING_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")
SHARDED_MODULES = ("FullyShardedDataParallel", "FSDPModule", "DeepSpeedEngine")


def sharding_refusal(strategy: object, module: torch.nn.Module) -> str | None:
    """Why the monitor cannot measure under ``strategy`` or a sharded ``module`` (FSDP, FSDP2,
    DeepSpeed ZeRO), or None. Matched by class name, so that the optional libraries need not
    be installed to be recognised."""
    strategy_names = {cls.__name__ for cls in type(strategy).__mro__}
    found = strategy_names.intersection(SHARDING_STRATEGIES)
    wrapped = [
        type(m).__name__
        for m in module.modules()
        if {cls.__name__ for cls in type(m).__mro__}.intersection(SHARDED_MODULES)
    ]
    if not found and not wrapped:
        return None
    what = f"the {sorted(found)[0]}" if found else f"a {wrapped[0]} module"
    return (
        f"The monitor cannot measure a model sharded across processes ({what}): every process "
        "holds only a shard of each parameter outside the forward pass, and the measurement's "
        "hooks and Fisher-vector products need whole parameters (docs/sharded.md). Train with "
        "strategy='ddp' (the monitor runs under DDP), or measure the gathered model after "
        "training with measure()."
    )


def resolve_num_train_samples(loader: DataLoader | None, explicit: int | None) -> int:
    """n, the global training-set size: ``explicit``, else ``len(loader.dataset)`` (an iterable
    dataset's ``__len__`` included).

    Under DDP the sampler shards the data, but ``loader.dataset`` is still the whole set.
    """
    if explicit is not None:
        return int(explicit)
    length = dataset_length(loader)
    if length is None:
        raise ValueError(
            "Cannot read the training-set size n from the training dataloader (none, or an "
            "iterable dataset without __len__). Pass FlatnessMonitor(num_train_samples=n), "
            "the number of training samples per epoch."
        )
    return length


def fixed_subset_batches(
    loader: DataLoader,
    max_samples: int | None,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterable:
    """A deterministic set of at most ``max_samples`` samples of ``loader``'s dataset, sharded.

    The indices are drawn once from a private generator seeded with ``seed`` (the user's RNG
    streams and the training loader's sampler and iterator are not touched), sorted, and split
    across ranks as ``indices[rank::world_size]`` so the union over ranks is the same set a
    single process would measure. Iterable datasets fall back to the first batches of a fresh
    iterator of ``loader``.
    """
    if not is_sized(loader):
        num_batches = None if max_samples is None else math.ceil(max_samples / loader.batch_size)
        return list(itertools.islice(iter(loader), num_batches))
    size = len(loader.dataset)
    if max_samples is None or max_samples >= size:
        indices = torch.arange(size)
    else:
        generator = torch.Generator().manual_seed(seed)
        indices = torch.randperm(size, generator=generator)[:max_samples].sort().values
    shard = indices[rank::world_size].tolist()
    return DataLoader(
        Subset(loader.dataset, shard),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=loader.collate_fn,
        num_workers=0,
        generator=torch.Generator().manual_seed(seed),
    )


def resolve_missing(target: Any, trainer: Any, given: Any = None) -> None:
    """Set ``target.resolved_lam`` and ``target.resolved_num_train_samples`` where still
    None: λ from the trainer's optimizers (:func:`resolve_lam`, per-group decays as a
    :class:`ParameterDecay`; ``given.lam`` if set), n from its training dataloader
    (:func:`resolve_num_train_samples`; ``given.num_train_samples`` if set). ``given`` is the
    object holding the user's arguments (``target`` itself by default). Both callbacks read λ
    and n this one way."""
    given = target if given is None else given
    if target.resolved_lam is None:
        target.resolved_lam = resolve_lam(trainer.optimizers, given.lam, trainer.lightning_module)
    if target.resolved_num_train_samples is None:
        target.resolved_num_train_samples = resolve_num_train_samples(
            first_dataloader(trainer.train_dataloader), given.num_train_samples
        )
