"""The probe kernel under data parallelism past its P × P guard: each process keeps the probe
rows of its own samples and the stored-row quadrature runs with its vectors split across the
processes, against one process measuring the union, and ``cg`` across processes (the default
there before).

A three-stage LadderResNet (``benchmarks/_ladder.py``) is trained once with SGD and weight decay
λ = c/n on the three-channel 16×16 images; then every arm measures the whole training set with
``measure()`` at its defaults (``structure="auto"``). The processes are spawned on this machine
with the gloo backend, one thread each, every process measuring the samples at positions
``rank, rank + world, …`` (``shard``); the one-process arms take as many threads as there are
processes. Costs are in training epochs of the same model (two threads) in the same run.

    python benchmarks/bench_ddp_rows.py --rung 8,16,24:5000 --c 2.5
    python benchmarks/bench_ddp_rows.py --rung 8,16,24:5000 --c 2.5 --cg
    python benchmarks/bench_ddp_rows.py --rung 16,32,64:10000 --c 5 --epochs 5
    python benchmarks/bench_ddp_rows.py --rung 8,16,24:2000 --c 1 --epochs 3
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import environment_note, markdown_table, set_threads
from _ladder import LadderResNet, trained_ladder

import lightning_flatness as lf

BATCH = 256


def _measure(model, x, y, lam: float, n: int, **kwargs) -> tuple[lf.FlatnessReport, float]:
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, x.shape[0], BATCH)]
    started = time.perf_counter()
    report = lf.measure(model, batches, lam=lam, num_train_samples=n, **kwargs)
    return report, time.perf_counter() - started


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _worker(rank: int, world: int, port: int, folder: str, structure: str, lam: float) -> None:
    """One process: its share of the samples, measured with the others (gloo)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    saved = torch.load(Path(folder) / "state.pt", weights_only=False)
    model = LadderResNet(saved["widths"])
    model.load_state_dict(saved["weights"])
    model.eval()
    x, y = saved["x"][rank::world], saved["y"][rank::world]
    dist.barrier()
    report, seconds = _measure(
        model,
        x,
        y,
        lam,
        saved["n"],
        structure=structure,
        all_reduce=_all_reduce,
        shard=(rank, world),
    )
    if rank == 0:
        torch.save({"report": report.as_dict(), "seconds": seconds}, Path(folder) / "out.pt")
    dist.destroy_process_group()


def _across_processes(model, widths, x, y, n: int, lam: float, world: int, structure: str):
    """The measurement by ``world`` spawned processes: rank 0's record and seconds."""
    with tempfile.TemporaryDirectory() as folder:
        state = {"weights": model.state_dict(), "widths": widths, "x": x, "y": y, "n": n}
        torch.save(state, Path(folder) / "state.pt")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(world, port, folder, structure, lam), nprocs=world, join=True)
        out = torch.load(Path(folder) / "out.pt", weights_only=False)
    return out["report"], out["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rung", default="8,16,24:5000", help="stage widths:n")
    parser.add_argument("--c", type=float, default=2.5, help="c = λn")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs")
    parser.add_argument("--world", type=int, default=2, help="processes")
    parser.add_argument("--cg", action="store_true", help="also cg across processes (slow)")
    args = parser.parse_args()
    set_threads(args.world)
    print(environment_note())
    widths = tuple(int(w) for w in args.rung.split(":")[0].split(","))
    n = int(args.rung.split(":")[1])
    lam = args.c / n
    model, epoch, (x, y) = trained_ladder(widths, n, args.c, args.epochs)
    parameters = sum(p.numel() for p in model.parameters())
    results = {}
    report, seconds = _measure(model, x, y, lam, n)
    results["one process"] = (report.as_dict(), seconds)
    results[f"{args.world} processes (the default under DDP)"] = _across_processes(
        model, widths, x, y, n, lam, args.world, "auto"
    )
    if args.cg:
        results[f"{args.world} processes, cg (the default before)"] = _across_processes(
            model, widths, x, y, n, lam, args.world, "cg"
        )
    reference = results["one process"][0]["soft_rank"]
    rows = [
        [
            f"{args.rung.split(':')[0]} ({parameters:,})",
            f"{n:,}",
            f"{args.c:g}",
            name,
            f"{record['soft_rank']:,.1f} ± {record.get('soft_rank_stderr', float('nan')):.1f}",
            f"{record['soft_rank'] / reference:.6f}",
            f"{seconds:.1f}",
            f"{seconds / epoch:.1f}",
        ]
        for name, (record, seconds) in results.items()
    ]
    header = ["rung (P)", "n", "c", "arm", "soft rank ± stderr", "÷ one process"]
    print(markdown_table([*header, "s", "training epochs"], rows))


if __name__ == "__main__":
    main()
