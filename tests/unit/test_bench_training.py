"""The training benchmark's report: rerunning one scenario keeps the other scenarios' numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulations.benchmarks import training as bench_training

pytestmark = pytest.mark.timeout(60)


def fake_runner(result: str) -> Any:
    def run(plan: bench_training.Plan, folder: Path) -> dict[str, Any]:
        return {"status": "ok", "met": True, "rows": [{"variant": "x", "result": result, "met": True}]}

    return run


def test_rerunning_one_scenario_keeps_the_others_and_replaces_its_own(tmp_path: Path, monkeypatch) -> None:
    report = tmp_path / "training.json"
    runners = dict.fromkeys(bench_training.SCENARIOS, fake_runner("1st"))
    monkeypatch.setattr(bench_training, "RUNNERS", runners)
    args = ["--json", str(report), "--workdir", str(tmp_path / "w")]
    assert bench_training.main([*args, "--scenario", "equivalence,utilization", "--quick"]) == 0
    monkeypatch.setitem(bench_training.RUNNERS, "utilization", fake_runner("2nd"))
    assert bench_training.main([*args, "--scenario", "utilization", "--quick"]) == 0

    results = json.loads(report.read_text())["results"]
    assert [r["scenario"] for r in results] == ["equivalence", "utilization"]  # the benchmark's order
    assert [r["rows"][0]["result"] for r in results] == ["1st", "2nd"]
    assert results[0]["command"].endswith("--scenario equivalence --quick")  # what measured each

    # A full-size run does not mix with a quick report's numbers.
    assert bench_training.main([*args, "--scenario", "heterogeneity"]) == 0
    assert [r["scenario"] for r in json.loads(report.read_text())["results"]] == ["heterogeneity"]
