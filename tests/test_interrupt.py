"""Ctrl-C during a long measurement ends the fit at once: the monitor neither swallows nor
defers the interrupt."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "interrupt_fit.py"


def test_ctrl_c_during_a_measurement_ends_the_fit():
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    starts = 0
    for line in process.stdout:
        starts += "measuring" in line
        if starts == 2:  # the fit-start trial, then the epoch-end measurement (minutes long)
            break
    assert starts == 2, "the measurement never started"
    time.sleep(1.0)
    interrupted = time.perf_counter()
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert time.perf_counter() - interrupted < 20
    assert process.returncode != 0 and "fit returned" not in rest
