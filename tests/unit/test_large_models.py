"""The README's large-model table is arithmetic on measured inputs: check that arithmetic."""

from __future__ import annotations

import pytest

from simulations.benchmarks.large_models import main, table_rows


def test_a_row_is_the_link_bound_over_the_measured_efficiency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--peers", "8", "--allreduce-efficiency", "0.8", "--sync-efficiency", "0.5"]) == 0
    out = capsys.readouterr().out
    assert '"benchmark": "large-models"' in out.splitlines()[0]
    rows = {(r["size"], r["mode"], r["compression"]): r for r in table_rows_from(8, 0.8, 0.5)}
    r = rows[("1B", "diloco", "fp16")]
    wire = 2 * 7 / 8 * 1e9 * 2  # bytes each way: 2 (N-1)/N of the fp16 vector
    assert r["round_bytes_each_way_gb"] == pytest.approx(wire / 1e9, abs=0.01)
    assert r["round_s_100mbit"] == pytest.approx(wire / (12.5e6 * 0.8), abs=0.1)
    assert r["state_sync_s_1000mbit"] == pytest.approx(8e9 / (125e6 * 0.5), abs=0.1)  # params + momentum
    assert rows[("1B", "sync", "none")]["state_gb"] == 12.0  # params + AdamW's two moments
    # DiLoCo's global parameters and outer momentum in a mapped file: in the page cache, not the RSS
    assert r["cpu_page_cache_gb"] == 8.0 and rows[("1B", "sync", "fp16")]["cpu_page_cache_gb"] == 0
    assert r["cpu_host_ram_gb"] == 11.8 * 4.0


def table_rows_from(peers: int, allreduce: float, sync: float) -> list[dict[str, object]]:
    import argparse

    args = argparse.Namespace(
        peers=peers, rss_sync=8.9, rss_diloco=11.8, allreduce_efficiency=allreduce, sync_efficiency=sync
    )
    return table_rows(args)
