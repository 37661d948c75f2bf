"""How the monitor's fill-in tracks the exact soft rank on fewer samples, and what its
calibration's probe rows buy: on the ladder's first rung (a 14,514-parameter BatchNorm ResNet,
n = 5,000, ``benchmarks/_ladder.py``) trained with SGD, at chosen epochs of a fit:

- the default structure's soft rank on the whole training set (the exact value), and the ratio
  exact ÷ ``kfac`` (measured as the monitor measures its fill-in) on the nested fixed subsets of
  m = 64, 128, 256, 512 and 1,024 samples the monitor reads, with the fill-in's seconds;
- with ``--kernel-tracker``, the ratio exact ÷ the default structure itself on each of those
  subsets (its trace functions alone, as the calibration measures them), with its seconds: a
  candidate for the tracker between calibrations, to set against ``kfac``'s drift;
- the calibration on the nested subsets of ``--calibration-samples`` (default 1,024: the
  probe kernel with ``--calibration-probes`` rows per sample in as many jackknife groups, for
  its trace functions alone as the monitor measures it, its first half read off its kernel,
  extrapolated to n) ÷ the exact value, with its seconds.

    python benchmarks/bench_fill_in_samples.py --decays 5e-4 5e-3 --calibration-probes 1 2
    python benchmarks/bench_fill_in_samples.py --decays 5e-4 5e-3 --calibration-samples 512 768 1024
    python benchmarks/bench_fill_in_samples.py --decays 5e-4 5e-3 --kernel-tracker
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import markdown_table
from _ladder import LadderClassifier, LadderResNet, colour16, ladder_trainer, quiet_start
from lightning import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_flatness as lf
from lightning_flatness.core.curvature.probe_kernel import FIRST_HALF
from lightning_flatness.core.sample_growth import extrapolated_soft_rank
from lightning_flatness.lightning.monitor_measurement import monitor_options
from lightning_flatness.lightning.trainer_facts import fixed_subset_batches

SUBSETS = (64, 128, 256, 512, 1024)


class FillInRatios(Callback):
    """At the ends of ``epochs``: the exact soft rank, the fill-in on each subset and the
    calibration with each probe count (module docstring)."""

    def __init__(
        self,
        loader: DataLoader,
        epochs: set[int],
        decay: float,
        probes: list[int],
        calibration_samples: list[int],
        kernel_tracker: bool = False,
    ) -> None:
        self.loader, self.epochs, self.decay, self.probes = loader, epochs, decay, probes
        self.calibration_samples = calibration_samples
        self.kernel_tracker = kernel_tracker
        self.rows: list[list[str]] = []

    def _measure(self, module: LightningModule, samples: int | None, **options) -> tuple:
        batches = list(fixed_subset_batches(self.loader, samples, samples or 256, seed=0))
        started = time.perf_counter()
        report = lf.measure(
            module.model,
            batches,
            lam=self.decay,
            num_train_samples=len(self.loader.dataset),
            **options,
        )
        return report, time.perf_counter() - started

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch not in self.epochs:
            return
        n = len(self.loader.dataset)
        with torch.inference_mode(False), torch.enable_grad():
            exact, _ = self._measure(pl_module, None)
            row = [f"{self.decay * n:g}", str(trainer.current_epoch), f"{exact.soft_rank:,.0f}"]
            for samples in SUBSETS:
                kfac, seconds = self._measure(pl_module, samples, structure=monitor_options("kfac"))
                row.append(f"{exact.soft_rank / kfac.soft_rank:.3f} ({seconds:.2f} s)")
            for samples in SUBSETS if self.kernel_tracker else ():
                options = lf.KernelOptions(summary_only=True)
                kernel, seconds = self._measure(pl_module, samples, structure=options)
                row.append(f"{exact.soft_rank / kernel.soft_rank:.3f} ({seconds:.2f} s)")
            for samples, probes in _calibrations(self.calibration_samples, self.probes):
                options = lf.KernelOptions(
                    probes=probes, groups=probes, summary_only=True, trace_estimator="probe"
                )
                subset, seconds = self._measure(pl_module, samples, structure=options)
                half = subset.blocks[FIRST_HALF].soft_rank
                whole = extrapolated_soft_rank(half, subset.soft_rank, subset.num_samples, n)
                row.append(f"{whole / exact.soft_rank:.3f} ({seconds:.2f} s)")
        self.rows.append(row)
        print(" | ".join(row), flush=True)


def _calibrations(samples: list[int], probes: list[int]) -> list[tuple[int, int]]:
    """The calibrations measured: every subset size with every probe count."""
    return [(m, s) for m in samples for s in probes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decays", type=float, nargs="+", default=[5e-4, 5e-3])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--at", type=int, nargs="+", default=[0, 2, 5, 9, 14, 20, 29])
    parser.add_argument("--calibration-probes", type=int, nargs="*", default=[2])
    parser.add_argument("--calibration-samples", type=int, nargs="*", default=[1024])
    parser.add_argument("--kernel-tracker", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    quiet_start(args.threads)
    x, y, _, _ = colour16(5000, 0)
    header = ["c", "epoch", "exact soft rank, n"]
    header += [f"exact ÷ kfac, m = {m:,} (its seconds)" for m in SUBSETS]
    if args.kernel_tracker:
        header += [f"exact ÷ default, m = {m:,} (its seconds)" for m in SUBSETS]
    calibrations = _calibrations(args.calibration_samples, args.calibration_probes)
    header += [f"calibration ÷ exact, m = {m:,}, {p} probe rows (seconds)" for m, p in calibrations]
    rows = []
    for decay in args.decays:
        seed_everything(0)
        dataset = TensorDataset(x, y)
        ratios = FillInRatios(
            DataLoader(dataset, batch_size=256),
            set(args.at),
            decay,
            args.calibration_probes,
            args.calibration_samples,
            args.kernel_tracker,
        )
        module = LadderClassifier(LadderResNet((8, 16, 24)), decay)
        ladder_trainer(args.epochs, [ratios]).fit(
            module, DataLoader(dataset, batch_size=64, shuffle=True)
        )
        rows += ratios.rows
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
