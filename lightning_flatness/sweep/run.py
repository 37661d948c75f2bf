"""One sweep run, as executed in a worker: seed, train for the step budget, measure everything.

:func:`execute_run` never raises: an exception anywhere (a bad class path, a diverged model, a
failed measurement of every structure) becomes a record with ``status="failed"``, the error and
its traceback. A structure that fails on its own (e.g. a size guard) is recorded under
``structure_errors`` and the others are kept.

The held-out set is split in two halves (:func:`held_out_halves`): the *validation* half is what
every structure's :func:`~lightning_flatness.core.measure` reads as ``val_batches`` (the held-out
trace ratio of the headline), the *test* half measures the gap the predictions are ranked
against — the test loss minus the training loss of the final model, both plain cross-entropy in
eval mode over the whole training set and the test half (the regularizer cancels, docs/math.md,
"Generalization gap"). No prediction reads the samples it is judged on.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lightning_flatness.sweep.measured import EXACT, VARIANTS, measure_arguments

__all__ = [
    "TRAINER_DEFAULTS",
    "execute_run",
    "held_out_halves",
    "instantiate",
    "resolve_exact",
    "set_threads",
]

#: Trainer arguments of every run unless the config's ``trainer`` section overrides them: a fixed
#: step budget on one CPU device, no validation during training (the held-out set is used once,
#: at the end), nothing written to disk, deterministic algorithms.
TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "max_epochs": -1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
    "deterministic": True,
}


def set_threads(threads: int | None) -> None:
    """Limit torch to ``threads`` intra-op threads (tiny models run faster on one thread)."""
    if threads is None:
        return
    torch.set_num_threads(int(threads))
    # Only settable before the first parallel work of the process.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(int(threads))


def _import(class_path: str) -> Any:
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"class_path must be 'package.module.Class', got {class_path!r}.")
    return getattr(importlib.import_module(module_name), name)


def instantiate(spec: Any) -> Any:
    """Instantiate ``{"class_path", "init_args"}`` specs, recursively (as LightningCLI does).

    Lists and other mappings are walked; any other value is returned as is.
    """
    if isinstance(spec, Mapping) and "class_path" in spec:
        arguments = {k: instantiate(v) for k, v in (spec.get("init_args") or {}).items()}
        return _import(spec["class_path"])(**arguments)
    if isinstance(spec, Mapping):
        return {k: instantiate(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [instantiate(v) for v in spec]
    return spec


def resolve_exact(num_parameters: int, num_train_samples: int, num_outputs: int) -> str:
    """``"dense"`` (P × P) if ``P ≤ n·C``, else ``"gram"`` ((n·C) × (n·C)): the smaller matrix.

    Both give the exact nonzero spectrum of F; building either costs ``O(n·C·P·min(P, n·C))``
    and its eigendecomposition ``O(min(P, n·C)³)``.
    """
    return "dense" if num_parameters <= num_train_samples * num_outputs else "gram"


def _quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*You defined a `validation_step`.*")
    warnings.filterwarnings("ignore", message=".*have no `validation_step`.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", module="backpack.*", category=DeprecationWarning)


def _loader_from(owner: Any, hook: str) -> Any:
    """``owner.<hook>()`` (a LightningModule/DataModule loader hook), ``None`` if unavailable."""
    from lightning_flatness.lightning.trainer_facts import first_dataloader

    if owner is None:
        return None
    try:
        return first_dataloader(getattr(owner, hook)())
    except Exception:  # the default hooks raise when not implemented
        return None


def _num_outputs(model: torch.nn.Module, batches: Any) -> int:
    """Number of logits of the model, from one forward pass on the first batch."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            inputs = next(iter(batches))[0][:1].to(device)
            return int(model(inputs).shape[-1])
    finally:
        model.train(was_training)


def held_out_halves(loader: Any, batch_size: int, seed: int) -> tuple[Any, Any]:
    """The held-out loader's samples in two fixed halves, ``(validation, test)``: the first and
    the second half of its dataset's indices (of its batches, for an iterable dataset), each
    read in batches of ``batch_size`` without shuffling."""
    from torch.utils.data import DataLoader, Subset

    from lightning_flatness.lightning.trainer_facts import fixed_subset_batches, is_sized

    if not is_sized(loader):
        batches = list(fixed_subset_batches(loader, None, batch_size, seed))
        half = (len(batches) + 1) // 2
        return batches[:half], batches[half:]
    size = len(loader.dataset)
    halves = (range(0, (size + 1) // 2), range((size + 1) // 2, size))
    return tuple(
        DataLoader(
            Subset(loader.dataset, list(indices)),
            batch_size=batch_size,
            shuffle=False,
            collate_fn=loader.collate_fn,
            num_workers=0,
        )
        for indices in halves
    )


def _finite(value: Any) -> Any:
    """JSON-safe number: NaN and ±inf become ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _train_and_measure(run: Mapping[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_flatness.core.measure import measure
    from lightning_flatness.core.training_nll import mean_nll
    from lightning_flatness.lightning.trainer_facts import (
        first_dataloader,
        fixed_subset_batches,
        resolve_lam,
        resolve_num_train_samples,
    )

    _quiet_lightning()
    seed = int(run["seed"])
    seed_everything(seed, workers=True, verbose=False)
    model = instantiate(run["model"])
    datamodule = instantiate(run["data"]) if run.get("data") is not None else None
    trainer_args = {**TRAINER_DEFAULTS, **instantiate(run.get("trainer") or {})}
    trainer_args["max_steps"] = int(run["steps"])
    if run.get("root_dir"):
        trainer_args.setdefault("default_root_dir", run["root_dir"])
    trainer = Trainer(**trainer_args)
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    train_seconds = time.perf_counter() - start

    lam = resolve_lam(trainer.optimizers, run.get("lam"))
    train_loader = first_dataloader(trainer.train_dataloader) or _loader_from(
        datamodule or model, "train_dataloader"
    )
    n = resolve_num_train_samples(train_loader, getattr(datamodule, "num_train_samples", None))
    val_loader = _loader_from(datamodule or model, "val_dataloader")
    batch_size = int(run.get("measure_batch_size") or 512)
    train_batches = fixed_subset_batches(train_loader, None, batch_size, seed)
    val_batches, test_batches = (
        (None, None) if val_loader is None else held_out_halves(val_loader, batch_size, seed)
    )
    num_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    exact = resolve_exact(num_parameters, n, _num_outputs(model, train_batches))

    measures: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for structure in run["structures"]:
        measured, _ = VARIANTS.get(structure, (structure, {}))
        measured = exact if structure == EXACT else measured
        arguments = measure_arguments(structure, measured, run.get("measure") or {})
        try:
            with torch.inference_mode(False), torch.enable_grad():
                report = measure(
                    model,
                    train_batches,
                    lam=lam,
                    num_train_samples=n,
                    val_batches=val_batches,
                    seed=seed,
                    **arguments,
                )
        except Exception as error:  # one structure failing must not lose the others
            errors[structure] = f"{type(error).__name__}: {error}"
            continue
        measures[structure] = {k: _finite(v) for k, v in report.as_dict().items()}
    if not measures:
        raise RuntimeError(f"Every structure failed to measure: {errors}")
    first = next(iter(measures.values()))
    test_nll = math.nan if test_batches is None else mean_nll(model, test_batches)
    return {
        "n": n,
        "lam": lam,
        "c": lam * n,
        "num_parameters": num_parameters,
        "exact_structure": exact,
        "global_step": int(trainer.global_step),
        "gap": _finite(test_nll - first["train_nll"]) if first["train_nll"] is not None else None,
        "train_nll": first["train_nll"],
        "val_nll": first["val_nll"],
        "test_nll": _finite(test_nll),
        "train_accuracy": first["train_accuracy"],
        "val_accuracy": first["val_accuracy"],
        "train_seconds": train_seconds,
        "measures": measures,
        "structure_errors": errors,
    }


def execute_run(run: Mapping[str, Any], threads: int | None = None) -> dict[str, Any]:
    """Train and measure one run; never raises.

    Args:
        run: A run of :meth:`~lightning_flatness.sweep.config.SweepConfig.runs` (optionally with
            ``root_dir``, the Trainer's ``default_root_dir``).
        threads: Torch threads for this run (``None``: leave as is).

    Returns:
        The run's record: ``key``, ``label``, ``params``, ``seed``, ``status`` (``"ok"`` or
        ``"failed"``), ``seconds`` and either the results (``n``, ``lam``, ``c``, ``gap``, losses,
        ``measures`` = ``{structure: FlatnessReport.as_dict()}``, ``structure_errors``, ...) or
        ``error`` and ``traceback``.
    """
    start = time.perf_counter()
    record: dict[str, Any] = {
        "key": run["key"],
        "label": run.get("label", ""),
        "params": dict(run.get("params") or {}),
        "seed": run.get("seed"),
    }
    try:
        set_threads(threads)
        record.update(_train_and_measure(run))
        record["status"] = "ok"
    except Exception as error:
        record["status"] = "failed"
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    record["seconds"] = time.perf_counter() - start
    return record
