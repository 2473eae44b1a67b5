"""Experiment trackers: used when installed, a warning (never a failure) when not."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.training.loop.trackers import open_tracker, scalars


def test_no_tracker_asked_for_is_none(tmp_path: Path) -> None:
    assert open_tracker(None, tmp_path, "run", {}) is None


def test_an_unknown_tracker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tracker"):
        open_tracker("wandb", tmp_path, "run", {})


def test_a_missing_package_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with caplog.at_level(logging.WARNING):
        assert open_tracker("mlflow", tmp_path, "run", {}) is None
    assert "not installed" in caplog.text and "p2ptrain[mlflow]" in caplog.text


def test_mlflow_gets_params_and_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    fake = types.ModuleType("mlflow")
    fake.start_run = lambda run_name: calls.append(("start", run_name))  # type: ignore[attr-defined]
    fake.log_params = lambda p: calls.append(("params", p))  # type: ignore[attr-defined]
    fake.log_metrics = lambda m, step: calls.append(("metrics", (step, m)))  # type: ignore[attr-defined]
    fake.end_run = lambda: calls.append(("end", None))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    tracker = open_tracker("mlflow", tmp_path, "r1", {"task": "tiny-gpt", "n": 3})
    assert tracker is not None
    tracker.log(7, {"loss": 2.5})
    tracker.close()
    assert calls == [
        ("start", "r1"),
        ("params", {"task": "tiny-gpt", "n": "3"}),
        ("metrics", (7, {"loss": 2.5})),
        ("end", None),
    ]


def test_tensorboard_writes_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            self.log_dir = log_dir

        def add_scalar(self, name: str, value: float, step: int) -> None:
            written.append((name, value, step))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            written.append(("closed", 0.0, 0))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    tracker = open_tracker("tensorboard", tmp_path, "r1", {})
    assert tracker is not None
    tracker.log(3, {"loss": 1.5, "lr": 0.1})
    tracker.close()
    assert written == [("loss", 1.5, 3), ("lr", 0.1, 3), ("closed", 0.0, 0)]


def test_scalars_keep_finite_numbers_only() -> None:
    got = scalars(
        {"loss": 2.0, "val_loss": None, "lr": float("nan"), "swarm_peers": 3, "bytes_sent": 10, "task": "x"}
    )
    assert got == {"loss": 2.0, "swarm_peers": 3.0, "bytes_sent": 10.0, "bytes_received": 0.0}
