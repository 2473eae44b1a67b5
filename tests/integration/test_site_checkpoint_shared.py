"""A site across hosts keeps its checkpoints in a folder every rank must see: rank 0 writes each one's
metadata and every rank reads it to resume. ``checkpoint.check_shared`` finds out at start: a folder
some rank does not see (each host its own) is refused on every rank with an error naming those ranks,
where before the first resume failed on another host; a shared folder passes and is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.training.site import checkpoint
from p2ptrain.training.site.launch import spawn

pytestmark = pytest.mark.timeout(300)


def _rank(rank: int, world: int, base: str, per_host: str) -> None:
    hosts = json.loads(per_host)  # rank -> the folder it sees the site's folder as
    folder = Path(base) / hosts[rank]
    try:
        checkpoint.check_shared(folder)
        outcome = "ok"
    except ConfigError as e:
        outcome = str(e)
    (Path(base) / f"outcome-{rank}").write_text(outcome)


@pytest.mark.parametrize(
    ("hosts", "blind"),
    [(["a", "a", "a"], []), (["a", "b", "a"], [1]), (["a", "b", "c"], [1, 2])],
    ids=["shared", "one-host-apart", "none-shared"],
)
def test_a_checkpoint_folder_that_some_rank_does_not_see_is_refused_on_every_rank(
    tmp_path: Path, hosts: list[str], blind: list[int]
) -> None:
    for name in set(hosts):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.PROBE).write_text("123")  # (an old probe: it must not count)
    spawn(_rank, len(hosts), str(tmp_path), json.dumps(hosts), timeout=120)
    outcomes = [(tmp_path / f"outcome-{r}").read_text() for r in range(len(hosts))]
    if not blind:
        assert outcomes == ["ok"] * len(hosts)
        assert not (tmp_path / "a" / checkpoint.PROBE).exists()  # (the probe is removed)
        return
    named = "rank(s) " + ", ".join(map(str, blind))
    for outcome in outcomes:
        assert "not shared by its hosts" in outcome and named in outcome, outcome
