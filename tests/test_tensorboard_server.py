"""A real TensorBoard server on 127.0.0.1 serves the flatness curves and the spectrum."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def fitted_logdir(tmp_path: Path) -> Path:
    seed_everything(0)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        logger=TensorBoardLogger(tmp_path / "logs", name="mlp"),
        callbacks=[FlatnessMonitor(max_samples=128, overhead_budget=None)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        FlatnessClassifier(weight_decay=1e-3),
        MNIST7DataModule(train_size=128, val_size=64, batch_size=32),
    )
    return tmp_path / "logs"


def test_tensorboard_serves_flatness_scalars_and_histogram(fitted_logdir: Path):
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(fitted_logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/data/plugin"
    try:
        deadline = time.monotonic() + 90
        scalars = {}
        while time.monotonic() < deadline:
            try:
                scalars = get_json(f"{base}/scalars/tags")
                if any("flatness/soft_rank" in tags for tags in scalars.values()):
                    break
            except OSError:
                pass
            time.sleep(1)
        (run,) = [run for run, tags in scalars.items() if "flatness/predicted_gap" in tags]
        series = get_json(f"{base}/scalars/scalars?run={run}&tag=flatness/soft_rank")
        assert len(series) == 2 and all(point[2] > 0 for point in series)
        histograms = get_json(f"{base}/histograms/tags")
        assert "flatness/spectrum_log10" in histograms[run]
        images = get_json(f"{base}/images/tags")
        assert "flatness/gap" in images[run]
    finally:
        server.terminate()
        server.wait(timeout=30)
