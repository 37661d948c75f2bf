"""The code base stays ruff clean (lint and format), as the project's style asks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the dev extra")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    completed = subprocess.run(
        ["ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
