"""The trust rule against the *expected* gap: every setting of the trained grids on several draws
of its data (docs/RESULTS.md, "Predictor and trust rule", the draws).

Eq. 13 predicts the expected generalization gap over training sets. One run's observed gap
differs from it by the training and held-out means' own sampling errors (``σ_train/√n`` and
``σ_val/√m``), on the grids of ``benchmarks/study_trust.py`` as large as the gap itself, so
"within 2× of one run's observed gap" is partly a test of the draw. Here every setting of the
chosen grids (architecture, n, c, learning rate, epochs) is trained on ``K`` draws of its data
(training set, held-out set and initialization from one seed per draw; draw 0 is the grid's own
run) and the mean observed gap over the draws, with its standard error, is the measured
expected gap. The rule is the package's ``trusted`` as it stands (nothing is chosen here): a
setting counts as trusted when at least half of its draws are.

Usage::

    python benchmarks/study_trust_draws.py --grids mlp7,cnn7 --draws 100:8,1:4 \\
        --output runs/study_trust/draws_a.jsonl
    python benchmarks/study_trust_draws.py --analyse runs/study_trust/draws_a.jsonl
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import study_trust
from _common import read_records, run_study, study_parser

#: what identifies a setting: a run's keys without its seed
SETTING_KEYS = ("grid", "architecture", "hidden", "image_size", "n", "c", "lr", "epochs")


def parse_draws(text: str) -> dict[float, int]:
    """``"100:8,1:4"`` -> ``{100.0: 8, 1.0: 4}``: draws per value of c."""
    draws = {}
    for item in text.split(","):
        c, count = item.split(":")
        draws[float(c)] = int(count)
    return draws


def draw_runs(
    grid_names: Sequence[str], draws: dict[float, int], first_draw: int = 0
) -> list[dict]:
    """Every run of the grids' settings at the given c's, ``draws[c]`` draws each from draw
    ``first_draw`` on, ordered draw by draw (so an interrupted collection has the first draws of
    every setting)."""
    runs = []
    for name in grid_names:
        for c, count in draws.items():
            grid = dataclasses.replace(study_trust.GRIDS[name], cs=(c,), repeats=count)
            for run in grid.runs():
                runs.append(dict(run, role="draws", draw=(run["seed"] - grid.seed) // 100))
    return sorted([r for r in runs if r["draw"] >= first_draw], key=lambda run: run["draw"])


def collect(runs: list[dict], output: Path) -> None:
    """Run every run not yet in ``output`` and append its record."""
    done = study_trust.recorded_keys(output)
    for run in runs:
        if study_trust.run_key(run) in done:
            continue
        record = study_trust.record_run(run, output, tic=False)
        print(
            f"{run['grid']} {run['architecture']} n={run['n']} c={run['c']} lr={run['lr']} "
            f"seed={run['seed']}: pred {record['predicted_gap_train']:.4f} obs "
            f"{record['observed_gap']:.4f} trusted {record['trusted']:.0f} "
            f"({record['total_seconds']:.0f} s)",
            flush=True,
        )


@dataclasses.dataclass
class Setting:
    """One setting's draws, summarized."""

    key: tuple
    draws: int
    trusted_draws: int
    mean_gap: float
    gap_stderr: float
    mean_predicted: float
    predicted_low: float
    predicted_high: float
    single_within: int
    #: trusted draws whose own Eq. 13 is within 2× of the mean observed gap
    trusted_within_mean: int

    @property
    def trusted(self) -> bool:
        """At least half of the draws are trusted."""
        return 2 * self.trusted_draws >= self.draws

    @property
    def ratio(self) -> float:
        """Mean prediction ÷ mean observed gap (+inf where the mean gap is ≤ 0)."""
        return self.mean_predicted / self.mean_gap if self.mean_gap > 0 else math.inf

    @property
    def within(self) -> bool:
        """The mean prediction is within 2× of the mean observed gap."""
        return 0.5 <= self.ratio <= 2.0

    @property
    def resolved(self) -> bool:
        """The mean observed gap is more than two standard errors from 0."""
        return self.mean_gap > 2 * self.gap_stderr

    @property
    def consistent(self) -> bool:
        """Some gap within two standard errors of the mean is within 2× of the prediction."""
        spread = 2 * self.gap_stderr
        return (
            self.mean_gap + spread >= self.mean_predicted / 2
            and self.mean_gap - spread <= 2 * self.mean_predicted
        )


def settings(records: list[dict]) -> list[Setting]:
    """The records grouped by setting (:data:`SETTING_KEYS`), in order of first appearance."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(record[k] for k in SETTING_KEYS), []).append(record)
    summaries = []
    for key, runs in groups.items():
        gaps = [r["observed_gap"] for r in runs]
        predicted = [r["predicted_gap_train"] for r in runs]
        stderr = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else math.inf
        mean_gap = statistics.mean(gaps)
        own = [r["predicted_gap_train"] / mean_gap for r in runs if r["trusted"] >= 0.5]
        summaries.append(
            Setting(
                key=key,
                draws=len(runs),
                trusted_draws=sum(r["trusted"] >= 0.5 for r in runs),
                mean_gap=mean_gap,
                gap_stderr=stderr,
                mean_predicted=statistics.mean(predicted),
                predicted_low=min(predicted),
                predicted_high=max(predicted),
                single_within=sum(study_trust.within(r, "predicted_gap_train") for r in runs),
                trusted_within_mean=sum(mean_gap > 0 and 0.5 <= x <= 2 for x in own),
            )
        )
    return summaries


def setting_table(summaries: list[Setting]) -> str:
    """One line per setting."""
    header = [
        *("grid", "arch", "n", "c", "lr", "ep", "draws", "trusted draws", "observed gap"),
        *("Eq. 13 (mean, range)", "÷ observed", "single draws within 2×"),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        grid, arch, _, _, n, c, lr, epochs = s.key
        row = [
            grid, arch, n, f"{c:g}", f"{lr:g}", epochs, s.draws, s.trusted_draws,
            f"{s.mean_gap:.4f} ± {s.gap_stderr:.4f}",
            f"{s.mean_predicted:.4f} ({s.predicted_low:.4f}–{s.predicted_high:.4f})",
            f"{s.ratio:.2f}", f"{s.single_within} of {s.draws}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def grid_table(summaries: list[Setting]) -> str:
    """Per grid: trusted settings, how many within 2× of the mean observed gap (and among the
    resolved ones, and consistent within two standard errors), against single draws."""
    header = [
        *("grid", "settings", "trusted", "within 2× of the mean gap", "resolved: within 2×"),
        *("consistent", "trusted draws: own Eq. 13 within 2× of the mean gap"),
        *("their draws within 2× of their own gap", "untrusted within 2×"),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    names = list(dict.fromkeys(s.key[0] for s in summaries))
    for name in [*names, "all"]:
        group = [s for s in summaries if name in ("all", s.key[0])]
        trusted = [s for s in group if s.trusted]
        clear = [s for s in trusted if s.resolved]
        untrusted = [s for s in group if not s.trusted]
        single = sum(s.single_within for s in trusted)
        row = [
            name, len(group), len(trusted), _share(sum(s.within for s in trusted), len(trusted)),
            _share(sum(s.within for s in clear), len(clear)),
            _share(sum(s.consistent for s in trusted), len(trusted)),
            _share(sum(s.trusted_within_mean for s in group), sum(s.trusted_draws for s in group)),
            _share(single, sum(s.draws for s in trusted)),
            f"{sum(s.within for s in untrusted)} of {len(untrusted)}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def _share(count: int, total: int) -> str:
    return f"{count} of {total} ({count / total:.0%})" if total else "–"


def analyse(paths: Sequence[Path]) -> None:
    """Print the per-setting and per-grid tables of records files."""
    records = read_records(paths)
    summaries = settings(records)
    print(f"{len(records)} runs, {len(summaries)} settings from {', '.join(map(str, paths))}\n")
    print(setting_table(summaries), "\n")
    print(grid_table(summaries))


def main() -> None:
    parser = study_parser(__doc__, Path("runs/study_trust/draws.jsonl"))
    parser.add_argument("--grids", default="mlp7", help="comma-separated grid names")
    parser.add_argument("--draws", default="100:8,1:4", help="c:draws pairs, comma-separated")
    parser.add_argument(
        "--first-draw", type=int, default=0, help="leave out the draws before this one"
    )
    args = parser.parse_args()
    runs = draw_runs(args.grids.split(","), parse_draws(args.draws), args.first_draw)
    run_study(args, lambda: collect(runs, args.output), analyse)


if __name__ == "__main__":
    main()
