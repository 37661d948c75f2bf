"""Every value the monitor logs has a row in docs/guide.md's table ("What the callback logs and
how to read it") and in docs/math.md's "Logged quantities", so a user who sees a tag in
TensorBoard can look it up."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import random_data, tiny_model

from lightning_flatness import measure

ROOT = Path(__file__).resolve().parents[1]
#: logged by the monitor and the regularizer besides the report's fields
MONITOR_TAGS = (
    *("fill_in", "calibration", "overhead", "nll_drop", "penalty", "spectrum_log10", "gap"),
)


def _logged_tags() -> set[str]:
    model = tiny_model("mlp")
    inputs, targets = random_data(8)
    tags = set(MONITOR_TAGS)
    for structure in ("probe_kernel", "hutchinson"):
        report = measure(
            model,
            [(inputs, targets)],
            val_batches=[(inputs, targets)],
            lam=1e-2,
            num_train_samples=8,
            structure=structure,
        )
        tags |= set(report.as_dict()) - {"structure"}  # the structure is not a metric
    return tags


def _named(text: str) -> set[str]:
    """Names in backticks, with the guide's shorthands expanded (``*_accuracy``,
    ``a_train/val``, ``a_{x,y}``, and a ``_stderr`` twin for each)."""
    names = set()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks are not names
    for token in re.findall(r"`([^`\n]+)`", text):
        token = token.removeprefix("flatness/")
        if token.startswith("*_"):
            names |= {f"train{token[1:]}", f"val{token[1:]}"}
        elif token.endswith("_train/val"):
            names |= {token[: -len("/val")], token[: -len("train/val")] + "val"}
        elif match := re.fullmatch(r"(\w+)_\{([\w,]+)\}", token):
            names |= {f"{match[1]}_{part}" for part in match[2].split(",")}
        else:
            names.add(token)
    return names | {f"{name}_stderr" for name in names}


def _section(text: str, heading: str) -> str:
    """The section under ``heading`` (a level-2 heading), up to the next level-2 heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_every_logged_tag_is_in_the_guide_and_math():
    tags = _logged_tags()
    assert {"soft_rank", "hutchinson_trace_upper_stderr", "trace_fisher_val"} <= tags
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    math = (ROOT / "docs" / "math.md").read_text(encoding="utf-8")
    table = _section(guide, "## What the callback logs and how to read it")
    logged = _section(math, "## Logged quantities")
    assert not tags - _named(table), "not in docs/guide.md, What the callback logs"
    assert not tags - _named(logged), "not in docs/math.md, Logged quantities"
