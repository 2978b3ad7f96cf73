"""bench/wakeup_cost.py: the empty poller at every interval, then an idle proxy's processes by
role; everything it started is stopped."""

from __future__ import annotations

import os
import re

from bench import wakeup_cost


def test_a_short_run_reports_each_interval_and_each_role_and_stops_the_proxy(capsys) -> None:
    before = set(os.listdir("/dev/shm"))
    assert wakeup_cost.main(["--seconds", "0.3"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)ms\s+(\d+)\s+[\d.]+\s+\d+$", out, re.M)
    assert [interval for interval, _ in rows] == ["1", "5", "20", "50"], out
    assert int(rows[0][1]) > int(rows[-1][1]) > 0, out  # shorter intervals wake more often
    assert len(re.findall(r"^\s+sidecar\s+pid \d+:", out, re.M)) == 1, out
    assert len(re.findall(r"^\s+workers\s+pid \d+:", out, re.M)) == 2, out
    assert not {n for n in set(os.listdir("/dev/shm")) - before if "cacheroute_bench" in n}
