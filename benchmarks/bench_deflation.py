"""Does deflating the top of the spectrum pay on stored probe rows? The Lanczos work to bracket
the soft rank of the kernel of real probe rows, plain against deflated by an approximate top-k
eigenbasis (randomized subspace iteration), each counted in column-products with the kernel
(one column-product: one vector through ``V (Vᵀ x) / m``) and timed.

The deflated estimate is Hutch++'s split, exact for any orthonormal Q:

    Tr h(K) = Σ_i q_iᵀ h(K) q_i + E[z'ᵀ h(K) z'],   z' = (I − QQᵀ) z,

each term a Lanczos run on the whole kernel, bracketed by its Gauss and Gauss–Radau rules, so
the bracket stays a bracket; what deflation buys is that the Hutchinson runs from z' no longer
see the top of the spectrum and close their bracket in fewer steps. Its price is the subspace
iteration ((k + oversampling) · (power steps + 1) column-products) and the k runs from the q_i.

The rows are the default's on a trained ladder ResNet (``benchmarks/_ladder.py``), taken from
its stored-row estimate. Only the whole kernel is bracketed here (the jackknife's
leave-one-group-out kernels multiply every cost below by the same factor).

    python benchmarks/bench_deflation.py --rung 8,16,24:5000 --c 2.5
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import environment_note, markdown_table, set_threads
from _ladder import trained_ladder

import lightning_flatness as lf
from lightning_flatness.core.curvature import probe_kernel, stored_rows
from lightning_flatness.core.curvature.lanczos_quadrature import (
    gauss_quadrature,
    lanczos,
    radau_quadrature,
    truncated,
)

#: relative half-width of the plain bracket aimed at (the default's jackknifed 2% is about
#: three times the plain half-width: G·w + (G − 1)·w₋ with G = 2)
TARGET = 0.007
#: columns beyond k in the subspace iteration
OVERSAMPLING = 10
PROBES = 8
MAX_STEPS = 100


def _rows(rung: str, c: float, epochs: int) -> tuple[torch.Tensor, int, float, float]:
    """The default's stored probe rows (R, P) of the trained rung, m, λ and its epoch time."""
    widths, n = tuple(int(w) for w in rung.split(":")[0].split(",")), int(rung.split(":")[1])
    model, epoch, (x, y) = trained_ladder(widths, n, c, epochs)
    kept = {}
    estimate = stored_rows.stored_rows_estimate

    def keep(store, groups, num_samples, lam, **options):  # the rows the default keeps
        kept["rows"] = torch.cat(store.chunks(), dim=1).reshape(-1, store.width).clone()
        kept["m"] = num_samples
        return estimate(store, groups, num_samples, lam, **options)

    probe_kernel.stored_rows_estimate = keep
    try:
        batches = [(x[i : i + 256], y[i : i + 256]) for i in range(0, n, 256)]
        lf.measure(model.eval(), batches, lam=c / n, num_train_samples=n, structure="auto")
    finally:
        probe_kernel.stored_rows_estimate = estimate
    return kept["rows"], kept["m"], c / n, epoch


class Kernel:
    """``K x = V (Vᵀ x) / m`` on the rows, counting column-products and their seconds."""

    def __init__(self, rows: torch.Tensor, m: int) -> None:
        self.rows, self.m = rows, m
        self.columns, self.seconds = 0, 0.0

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = ((block.to(self.rows.dtype) @ self.rows) @ self.rows.T).to(block.dtype) / self.m
        self.seconds += time.perf_counter() - started
        self.columns += block.shape[0]
        return out


def _soft_rank_bounds(decomposition, index: int, lam: float) -> tuple[float, float]:
    """The Gauss (upper) and Gauss–Radau (lower) soft rank of one run."""
    scale = float(decomposition.norms[index]) ** 2
    bounds = []
    for rule in (gauss_quadrature, radau_quadrature):
        nodes, weights = rule(decomposition, index)
        bounds.append(scale * float((weights * nodes / (nodes + lam)).sum()))
    return bounds[0], bounds[1]


def _bracket(decomposition, runs: slice, lam: float, steps: int, mean: bool) -> tuple:
    """Summed (or mean) Gauss and Radau soft ranks of ``runs`` after ``steps`` steps."""
    cut = truncated(decomposition, steps)
    pairs = [_soft_rank_bounds(cut, i, lam) for i in range(runs.start, runs.stop)]
    upper, lower = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    count = len(pairs) if mean else 1
    return upper / count, lower / count


def _steps_to(decomposition, runs: slice, lam: float, target: float, mean: bool) -> tuple:
    """The fewest steps whose bracket half-width is within ``target`` of its midpoint (absolute
    when ``target`` is a float number of soft-rank units), and the midpoint there."""
    length = decomposition.alphas.shape[1]
    for steps in range(1, length + 1):
        upper, lower = _bracket(decomposition, runs, lam, steps, mean)
        if (upper - lower) / 2 <= target:
            return steps, (upper + lower) / 2
    upper, lower = _bracket(decomposition, runs, lam, length, mean)
    return length, (upper + lower) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rung", default="8,16,24:5000")
    parser.add_argument("--c", type=float, default=2.5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 50, 100])
    parser.add_argument("--power", type=int, default=2, help="subspace iteration power steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment_note())
    rows, m, lam, epoch = _rows(args.rung, args.c, args.epochs)
    size = rows.shape[0]
    generator = torch.Generator().manual_seed(1)
    signs = (2 * torch.randint(0, 2, (PROBES, size), generator=generator) - 1).double()
    kernel = Kernel(rows, m)

    def timed_lanczos(start: torch.Tensor, steps: int) -> tuple:
        """A Lanczos run and its seconds per step."""
        before = kernel.seconds
        decomposition = lanczos(kernel, start, steps)
        return decomposition, (kernel.seconds - before) / steps

    plain, plain_step = timed_lanczos(signs, MAX_STEPS)
    rank = sum(_bracket(plain, slice(0, PROBES), lam, MAX_STEPS, True)) / 2
    steps, value = _steps_to(plain, slice(0, PROBES), lam, TARGET * rank, True)
    table = [["none", "—", f"{steps}", f"{value:,.1f}", f"{steps * plain_step / epoch:.1f}"]]
    for k in args.ks:
        started = kernel.seconds
        sketch = torch.randn(k + OVERSAMPLING, size, generator=generator, dtype=torch.float64)
        basis = torch.linalg.qr(kernel(sketch).T).Q
        for _ in range(args.power):
            basis = torch.linalg.qr(kernel(basis.T).T).Q
        basis = basis[:, :k]
        build_seconds = kernel.seconds - started
        top, top_step = timed_lanczos(basis.T.contiguous(), 40)
        rest, rest_step = timed_lanczos(signs - (signs @ basis) @ basis.T, MAX_STEPS)
        # the target split between the two parts: a fifth for the deflated runs' sum
        top_steps, top_value = _steps_to(top, slice(0, k), lam, TARGET * rank / 5, False)
        rest_steps, rest_value = _steps_to(rest, slice(0, PROBES), lam, 0.8 * TARGET * rank, True)
        seconds = build_seconds + top_steps * top_step + rest_steps * rest_step
        table.append(
            [
                f"{k}",
                f"{(k + OVERSAMPLING) * (args.power + 1)} + {k} × {top_steps}",
                f"{rest_steps}",
                f"{top_value + rest_value:,.1f}",
                f"{seconds / epoch:.1f}",
            ]
        )
    print(
        f"\n{args.rung}, c = {args.c:g}: {size:,} rows of {rows.shape[1]:,} parameters; "
        f"target: plain bracket within ±{100 * TARGET:.1f}% of the soft rank ({rank:,.1f}); "
        f"{PROBES} Hutchinson probes; one training epoch {epoch:.2f} s\n"
    )
    header = [
        "deflated k",
        "column-products to find the top and bracket it",
        "Hutchinson steps",
        "soft rank (midpoint)",
        "cost, training epochs",
    ]
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
