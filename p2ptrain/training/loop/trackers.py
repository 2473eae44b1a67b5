"""Optional experiment tracking: the per-step metrics also go to TensorBoard or MLflow.

Neither is a dependency (``pip install p2ptrain[tensorboard]`` or ``[mlflow]``). Asked for one that is
not installed, the node says so once and trains on without it: tracking is never a reason to stop.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "mlflow")


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    def __init__(self, mlflow: Any) -> None:
        self.mlflow = mlflow

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_tracker(kind: str | None, folder: Path, run_name: str, params: Mapping[str, Any]) -> Tracker | None:
    """The tracker asked for, or None (none asked, or its package is missing: logged once)."""
    if kind is None:
        return None
    if kind not in TRACKERS:
        raise ValueError(f"unknown tracker {kind!r}; known: {', '.join(TRACKERS)}")
    try:
        if kind == "tensorboard":
            tensorboard = importlib.import_module("torch.utils.tensorboard")
            return TensorBoardTracker(
                tensorboard.SummaryWriter(log_dir=str(folder / "tensorboard" / run_name))
            )
        mlflow = importlib.import_module("mlflow")
        mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v) for k, v in params.items()})
        return MLflowTracker(mlflow)
    except ImportError as e:
        log.warning(
            "--tracker %s: %s is not installed (pip install p2ptrain[%s]); not tracking", kind, e.name, kind
        )
        return None


def scalars(status: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a trainer status worth a chart (None and non-finite values left out)."""
    keys = (
        "loss",
        "val_loss",
        "lr",
        "samples_per_s",
        "swarm_samples_per_s",
        "swarm_peers",
        "compute_utilization",
    )
    out = {k: float(status[k]) for k in keys if isinstance(status.get(k), int | float)}
    out["bytes_sent"] = float(status.get("bytes_sent") or 0)
    out["bytes_received"] = float(status.get("bytes_received") or 0)
    return {k: v for k, v in out.items() if math.isfinite(v)}
