"""Which predicted gap ranks runs as their gaps do (docs/RESULTS.md, "The headline that ranks").

Trains the grids of ``benchmarks/study_trust.py`` (same data, models, optimizer and seeds) and
splits each run's held-out images in two halves: the *validation* half is what a user gives the
monitor (``val_batches``), the *test* half measures the gap the predictions are judged against,
``test NLL − training NLL``. No candidate sees the test half, so a candidate that reads the
validation half is not judged on the samples it read.

Per run it records the package's report (its default structure, the whole training set) and,
exact in float64 from per-sample logit Jacobians, every sample's NLL, squared gradient norm
``‖gᵢ‖²``, Fisher trace ``Tr(Jᵢᵀ Λᵢ Jᵢ)``, error ``‖y − p‖²`` and uncertainty ``1 − ‖p‖²`` on
both the training set and the validation half, and the regularized TIC ``(1/n)·Tr(C (F+λI)⁻¹)``
with C from either split. Every candidate predictor (:data:`CANDIDATES`) is a function of one
record, so a new candidate is scored on the recorded runs without training again.

The headline was chosen on the grids of :data:`CHOSEN_ON` (mlp7 and short14, the trust study's
choosing grids, and bigmlp7 and resmlp14, whose records were seen before the choice); the other
trained grids check it. One run's measured gap scatters about the *expected* gap (the mean
over training sets) by ``measured_gap_stderr``, as much as the differences between the c = 100
runs, so ``--draws K`` trains every setting of the grids on K − 1 more draws of its data
(training set, held-out set and initialization from one seed per draw, as
``benchmarks/study_trust_draws.py`` draws them; draw 0 is the grid's own run), without the
exact per-sample terms.

``--analyse`` prints, per candidate: Kendall's τ-b against the measured gap on every grid, pooled
over the trained runs of the checking grids with a bootstrap 90% interval (runs resampled with
replacement), the share of trusted runs within 2× of the measured gap and the trusted share;
where draws are recorded, the same against the expected gap of each setting.

The README's main job (``configs/mlp.yaml``) is the grid ``mainjob``: its one setting on ten
draws, to set its headline against its expected gap (``--no-exact`` leaves out the per-sample
terms).

Usage::

    python benchmarks/study_headline.py --grids mlp7,short14 --output runs/headline/a.jsonl
    python benchmarks/study_headline.py --grids bigmlp7,cnn7 --output runs/headline/b.jsonl
    python benchmarks/study_headline.py --grids mlp7,cnn7 --draws 4 --output runs/headline/d.jsonl
    python benchmarks/study_headline.py --grids mainjob --no-exact --output runs/headline/main.jsonl
    python benchmarks/study_headline.py --analyse runs/headline/a.jsonl runs/headline/b.jsonl
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import study_trust
import study_trust_draws
import torch
from _common import read_records, run_study, study_parser
from torch import Tensor, nn

from lightning_flatness import measure
from lightning_flatness.core.predicted_gap import headline_gap
from lightning_flatness.sweep.kendall import bootstrap_interval, kendall_tau_b

#: grids whose runs are one to three epochs long: left out of the pooled τ (not trained)
SHORT_GRIDS = ("short7", "short14")
#: the grids the headline was chosen on: the trust study's two choosing grids, and two whose
#: records were read before the choice; every other grid but the main job's checks it
CHOSEN_ON = ("mlp7", "short14", "bigmlp7", "resmlp14")
#: the README main job's setting on ten draws (not a grid of settings: reported on its own)
MAIN_JOB = "mainjob"


def split_held_out(x_val: Tensor, y_val: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The held-out images in two halves (the split is already seeded and shuffled):
    ``(x_validation, y_validation, x_test, y_test)``."""
    half = x_val.shape[0] // 2
    return x_val[:half], y_val[:half], x_val[half:], y_val[half:]


def per_sample_terms(
    objective: study_trust.Objective, x: Tensor, y: Tensor, chunk: int = 128
) -> Iterator[tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]]:
    """Per chunk of ``(x, y)``: the logit Jacobians ``(b, C, P)``, probabilities, gradient rows
    ``(b, P)`` and each sample's NLL, ``‖gᵢ‖²``, ``Tr(Jᵢᵀ Λᵢ Jᵢ)``, error ``‖y − p‖²`` and
    uncertainty ``1 − ‖p‖²`` (float64)."""
    labels = y.split(chunk)
    for (jac, p), target in zip(study_trust._jacobians(objective, x, chunk), labels, strict=True):
        onehot = nn.functional.one_hot(target, p.shape[-1]).double()
        rows = torch.einsum("bcp,bc->bp", jac, p - onehot)
        pj = torch.einsum("bc,bcp->bp", p, jac)
        fisher_trace = (p * jac.square().sum(-1)).sum(-1) - pj.square().sum(-1)
        yield (
            jac,
            p,
            rows,
            {
                "nll": -torch.log(p.gather(1, target[:, None]).squeeze(1)),
                "grad_norm_sq": rows.square().sum(-1),
                "fisher_trace": fisher_trace,
                "error": (onehot - p).square().sum(-1),
                "uncertainty": 1 - p.square().sum(-1),
            },
        )


def exact_terms(model: nn.Module, x: Tensor, y: Tensor, x_val: Tensor, y_val: Tensor, lam: float):
    """Each split's per-sample terms (lists) and the regularized TICs with the exact Fisher."""
    objective = study_trust.Objective(model, x, y, lam)
    size, n = objective.theta.numel(), x.shape[0]
    fisher = torch.zeros(size, size, dtype=torch.float64)
    splits: dict[str, dict[str, list[float]]] = {}
    rows: dict[str, list[Tensor]] = {"train": [], "val": []}
    for split, (xs, ys) in {"train": (x, y), "val": (x_val, y_val)}.items():
        terms: dict[str, list[Tensor]] = {}
        for jac, p, chunk_rows, chunk_terms in per_sample_terms(objective, xs, ys):
            if split == "train":
                pj = torch.einsum("bc,bcp->bp", p, jac)
                weighted = p[..., None] * (jac - pj[:, None])
                fisher += jac.reshape(-1, size).T @ weighted.reshape(-1, size)
            rows[split].append(chunk_rows)
            for name, value in chunk_terms.items():
                terms.setdefault(name, []).append(value)
        splits[split] = {name: torch.cat(v).tolist() for name, v in terms.items()}
    fisher = fisher / n
    fisher.diagonal().add_(lam)
    factor = torch.linalg.cholesky(fisher)

    def tic(split: str) -> float:
        stacked = torch.cat(rows[split])
        whitened = torch.linalg.solve_triangular(factor, stacked.T, upper=False)
        return float(whitened.square().sum()) / stacked.shape[0] / n

    return splits, {"tic_train": tic("train"), "tic_val": tic("val")}


#: the report's fields every record keeps
REPORT_KEYS = (
    "soft_rank", "logdet", "trace_fisher", "trace_cov", "trace_fisher_val", "trace_cov_val",
    "trace_ratio_train", "trace_ratio_val", "train_nll", "val_nll", "observed_gap",
    "observed_gap_stderr", "error_uncertainty_train", "error_uncertainty_val", "train_accuracy",
    "val_accuracy", "trusted", "newton_decrement", "rank_bound", "structure", "seconds",
)  # fmt: skip


def one_run(run: dict, exact: bool = True) -> dict:
    """Train one model of ``run``, measure it with its validation half and return its record,
    with the test half's gap (and, with ``exact``, the exact per-sample terms and TICs)."""
    model, x, y, x_held, y_held = study_trust.untrained(run)
    x_val, y_val, x_test, y_test = split_held_out(x_held, y_held)
    start = time.perf_counter()
    history = study_trust.train(model, x, y, run)
    train_seconds = time.perf_counter() - start

    def batches(xs: Tensor, ys: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [(xs[i : i + 500], ys[i : i + 500]) for i in range(0, xs.shape[0], 500)]

    report = measure(
        model, batches(x, y), lam=run["lam"], num_train_samples=run["n"],
        val_batches=batches(x_val, y_val),
    )  # fmt: skip
    values = report.as_dict()
    test_losses = study_trust.sample_nll(model, x_test, y_test)
    train_losses = study_trust.sample_nll(model, x, y)
    start = time.perf_counter()
    samples, tics = exact_terms(model, x, y, x_val, y_val, run["lam"]) if exact else ({}, {})
    record = {
        **run,
        **{k: values[k] for k in REPORT_KEYS},
        **tics,
        "parameters": sum(p.numel() for p in model.parameters()),
        "test_nll": float(test_losses.mean()),
        "measured_gap": float(test_losses.mean() - train_losses.mean()),
        "measured_gap_stderr": math.sqrt(
            float(test_losses.var()) / test_losses.numel()
            + float(train_losses.var()) / train_losses.numel()
        ),
        "nll_drop": (history[-2] - history[-1]) / max(history[-1], 1e-12),
        "train_seconds": train_seconds,
        "exact_seconds": time.perf_counter() - start,
        "samples": samples,
    }
    return record


# ---------------------------------------------------------------------------------------------
# Candidate predictors: each a function of one record.


def _eq13(record: dict, ratio: float) -> float:
    return ratio * record["soft_rank"] / record["n"]


def _clipped_ratio(record: dict, split: str) -> float:
    """Tr(C)/Tr(F) with each sample's ``‖gᵢ‖²`` at most its own ``Tr(Fᵢ)·error/uncertainty``
    ceiling of 1: a sample counts at most as much gradient as its own Fisher trace carries."""
    terms = record["samples"].get(split)
    if terms is None:  # a draw recorded without the per-sample terms
        return math.nan
    clipped = [min(g, f) for g, f in zip(terms["grad_norm_sq"], terms["fisher_trace"], strict=True)]
    return statistics.fmean(clipped) / statistics.fmean(terms["fisher_trace"])


def _geometric(a: float, b: float) -> float:
    return math.sqrt(a * b) if a > 0 and b > 0 else math.nan


CANDIDATES: dict[str, Callable[[dict], float]] = {
    "**the headline: held-out ratio × rank/(n + rank)**": lambda r: headline_gap(
        r["trace_ratio_val"], r["trace_ratio_train"], r["soft_rank"], r["n"]
    ),
    "Eq. 13, training ratio (the headline before)": lambda r: _eq13(r, r["trace_ratio_train"]),
    "Eq. 13, held-out ratio": lambda r: _eq13(r, r["trace_ratio_val"]),
    "soft rank ÷ n": lambda r: r["soft_rank"] / r["n"],
    "Eq. 13, held-out Tr(C) ÷ training Tr(F)": lambda r: _eq13(
        r, r["trace_cov_val"] / r["trace_fisher"]
    ),
    "Eq. 13, held-out α (outputs)": lambda r: _eq13(r, r["error_uncertainty_val"]),
    "geometric mean of the two Eq. 13s": lambda r: _geometric(
        _eq13(r, r["trace_ratio_train"]), _eq13(r, r["trace_ratio_val"])
    ),
    "training ratio × rank/(n + rank)": lambda r: headline_gap(
        math.nan, r["trace_ratio_train"], r["soft_rank"], r["n"]
    ),
    "held-out Tr(C) ÷ training Tr(F) × rank/(n + rank)": lambda r: headline_gap(
        r["trace_cov_val"] / r["trace_fisher"], math.nan, r["soft_rank"], r["n"]
    ),
    "regularized TIC, training C": lambda r: r.get("tic_train", math.nan),
    "regularized TIC, held-out C": lambda r: r.get("tic_val", math.nan),
    "Eq. 13, held-out ratio of clipped gradients": lambda r: _eq13(r, _clipped_ratio(r, "val")),
    "held-out NLL − training NLL (no Fisher)": lambda r: r["observed_gap"],
}


def kendall(records: Sequence[dict], candidate: Callable[[dict], float]) -> float:
    """τ-b between a candidate and the measured gap over ``records``."""
    return kendall_tau_b([candidate(r) for r in records], [r["measured_gap"] for r in records])[0]


def bootstrap(records: Sequence[dict], candidate: Callable[[dict], float]) -> tuple[float, float]:
    """The bootstrap 90% interval of τ over the runs (resampled with replacement)."""
    return bootstrap_interval([candidate(r) for r in records], [r["measured_gap"] for r in records])


def within_2x(record: dict, candidate: Callable[[dict], float]) -> bool:
    """The candidate is within 2× of a positive measured gap."""
    gap, value = record["measured_gap"], candidate(record)
    return gap > 0 and 0.5 <= value / gap <= 2


def analyse(paths: Sequence[Path]) -> None:
    """Print the candidates' τ per grid and pooled, and their trusted runs within 2×; where
    draws are recorded, the same against each setting's expected gap."""
    everything = read_records(paths)
    main_job = [r for r in everything if r["grid"] == MAIN_JOB]
    everything = [r for r in everything if r["grid"] != MAIN_JOB]
    records = [r for r in everything if r.get("draw", 0) == 0]  # the grids' own runs
    grids = list(dict.fromkeys(r["grid"] for r in records))
    checking = [r for r in records if r["grid"] not in CHOSEN_ON + SHORT_GRIDS]
    print(f"{len(records)} runs; pooled: {len(checking)} trained runs of the checking grids\n")
    header = ["candidate", *grids, "pooled (90% interval)", "trusted within 2×"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, candidate in CANDIDATES.items():
        row = [name]
        for grid in grids:
            row.append(f"{kendall([r for r in records if r['grid'] == grid], candidate):+.2f}")
        if len(checking) > 2:
            low, high = bootstrap(checking, candidate)
            row.append(f"{kendall(checking, candidate):+.2f} ({low:+.2f}, {high:+.2f})")
        else:
            row.append("–")
        trusted = [r for r in checking if r["trusted"] >= 0.5]
        inside = sum(within_2x(r, candidate) for r in trusted)
        row.append(f"{inside} of {len(trusted)} ({len(trusted)} of {len(checking)} trusted)")
        print("| " + " | ".join(row) + " |")
    if len(everything) > len(records):
        print()
        expected_gap_table(everything)
    if main_job:
        print()
        main_job_line(main_job)


def main_job_line(runs: Sequence[dict]) -> None:
    """The main job's setting over its draws: the expected gap and each predictor's mean."""
    gaps = [r["measured_gap"] for r in runs]
    stderr = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else math.nan
    print(f"The main job's setting, {len(runs)} draws: expected gap "
          f"{statistics.fmean(gaps):.4f} ± {stderr:.4f}; trusted draws "
          f"{sum(r['trusted'] >= 0.5 for r in runs)}; trace ratios apart "
          f"{min(r['trace_ratio_val'] / r['trace_ratio_train'] for r in runs):.2f}–"
          f"{max(r['trace_ratio_val'] / r['trace_ratio_train'] for r in runs):.2f}")  # fmt: skip
    for name, candidate in list(CANDIDATES.items())[:3]:
        mean = statistics.fmean(candidate(r) for r in runs)
        print(f"- {name}: {mean:.4f} ({mean / statistics.fmean(gaps):.2f}× the expected gap)")


def setting_means(records: Sequence[dict]) -> list[dict]:
    """Per setting (``study_trust_draws.SETTING_KEYS``) with at least two draws: its draws, the
    mean measured gap (the expected gap) and that mean's standard error."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        key = tuple(record[k] for k in study_trust_draws.SETTING_KEYS)
        groups.setdefault(key, []).append(record)
    settings = []
    for runs in groups.values():
        if len(runs) < 2 or runs[0]["grid"] in SHORT_GRIDS:
            continue
        gaps = [r["measured_gap"] for r in runs]
        settings.append(
            {
                "grid": runs[0]["grid"],
                "runs": sorted(runs, key=lambda r: r.get("draw", 0)),
                "gap": statistics.fmean(gaps),
                "stderr": statistics.stdev(gaps) / math.sqrt(len(gaps)),
                "trusted": 2 * sum(r["trusted"] >= 0.5 for r in runs) >= len(runs),
            }
        )
    return settings


def expected_gap_table(records: Sequence[dict]) -> None:
    """Per candidate, against each setting's expected gap: τ of one run's prediction (draw 0)
    and of the mean prediction over the draws, on the checking grids, with bootstrap 90%
    intervals over the settings; trusted settings (resolved: the mean gap more than two
    standard errors above 0) whose mean prediction is within 2×, and trusted draws whose own
    prediction is."""
    settings = setting_means(records)
    checking = [s for s in settings if s["grid"] not in CHOSEN_ON]
    draws = statistics.median(len(s["runs"]) for s in settings)
    print(
        f"Against the expected gap: {len(settings)} settings ({len(checking)} of the checking "
        f"grids), a median {draws:g} draws each\n"
    )
    header = [
        *("candidate", "one run, checking grids", "mean over draws, checking grids"),
        *("trusted settings within 2× (resolved)", "trusted draws within 2×"),
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, candidate in CANDIDATES.items():
        cells = [name]
        for group, mean in ((checking, False), (checking, True)):
            if mean:
                values = [statistics.fmean(candidate(r) for r in s["runs"]) for s in group]
            else:
                values = [candidate(s["runs"][0]) for s in group]
            gaps = [s["gap"] for s in group]
            tau = kendall_tau_b(values, gaps)[0]
            low, high = bootstrap_interval(values, gaps)
            cells.append(f"{tau:+.2f} ({low:+.2f}, {high:+.2f})")
        trusted = [s for s in settings if s["trusted"]]
        means = [statistics.fmean(candidate(r) for r in s["runs"]) for s in trusted]
        inside = [
            s["gap"] > 0 and 0.5 <= v / s["gap"] <= 2 for v, s in zip(means, trusted, strict=True)
        ]
        clear = [s["gap"] > 2 * s["stderr"] for s in trusted]
        clear_inside = sum(a and b for a, b in zip(inside, clear, strict=True))
        own = [(r, s["gap"]) for s in trusted for r in s["runs"] if r["trusted"] >= 0.5]
        own_inside = sum(gap > 0 and 0.5 <= candidate(r) / gap <= 2 for r, gap in own)
        cells.append(
            f"{sum(inside)} of {len(trusted)} of {len(settings)} ({clear_inside} of {sum(clear)})"
        )
        cells.append(f"{own_inside} of {len(own)}")
        print("| " + " | ".join(cells) + " |")


def collect(grids: Sequence[str], output: Path, draws: int = 1, exact: bool = True) -> None:
    """Run every grid's runs not yet in ``output`` and append their records: the grids' own
    runs (with the exact per-sample terms unless ``exact`` is False), or with ``draws`` > 1
    draws 1 to ``draws − 1`` of every setting (without them)."""
    done = study_trust.recorded_keys(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if draws > 1:
        per_c = {c: draws for name in grids for c in study_trust.GRIDS[name].cs}
        runs = study_trust_draws.draw_runs(grids, per_c, first_draw=1)
    else:
        runs = [run for name in grids for run in study_trust.GRIDS[name].runs()]
    for run in runs:
        if study_trust.run_key(run) in done:
            continue
        name = run["grid"]
        start = time.perf_counter()
        record = one_run(run, exact=exact and draws <= 1)
        record["total_seconds"] = time.perf_counter() - start
        with output.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(
            f"{name} {run['architecture']} n={run['n']} c={run['c']} lr={run['lr']} "
            f"ep={run['epochs']} draw {run.get('draw', 0)}: gap {record['measured_gap']:.4f} "
            f"train {_eq13(record, record['trace_ratio_train']):.4f} held-out "
            f"{_eq13(record, record['trace_ratio_val']):.4f} ({record['total_seconds']:.0f} s)",
            flush=True,
        )


def main() -> None:
    parser = study_parser(__doc__, Path("runs/headline/records.jsonl"))
    parser.add_argument("--grids", default="mlp7,short14", help="comma-separated grid names")
    parser.add_argument("--draws", type=int, default=1, help="draws per setting (1: the grid's)")
    parser.add_argument("--no-exact", action="store_true", help="no exact per-sample terms")
    args = parser.parse_args()
    grids = args.grids.split(",")
    run_study(args, lambda: collect(grids, args.output, args.draws, not args.no_exact), analyse)


if __name__ == "__main__":
    main()
