"""The run files that ship in configs/ parse, and the default one is the built-in default run."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.config import RunConfig, load_config
from p2ptrain.tasks import load_task

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_run_file_is_valid(path: Path) -> None:
    config = load_config(path)
    task = load_task(config.task.name, config.task.options)
    assert task.name and config.run.id


def test_the_default_run_file_is_the_built_in_default() -> None:
    config = load_config(CONFIGS / "tiny-gpt.toml")
    default = RunConfig()
    assert config.replace("task", options={}) == default
    # The file spells out the task's options; they are its defaults, so the model is the same.
    assert load_task(config.task.name, config.task.options).info == load_task(default.task.name).info


def test_the_readme_task_example_is_the_one_the_tests_load() -> None:
    """The docs' 'bring your own task' module is exactly the module test_tasks.py writes and trains."""
    tests = (Path(__file__).parent / "test_tasks.py").read_text()
    marker = "EXAMPLE_TASK = '''\\\n"
    begin = tests.index(marker) + len(marker)
    example = tests[begin : tests.index("'''", begin)]
    readme = (CONFIGS.parent / "docs" / "own-script.md").read_text()
    start = readme.index('"""example_task.py')
    block = readme[start : readme.index("```", start)]
    assert block.strip() == example.strip()
