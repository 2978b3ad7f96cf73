"""bench/harness: the pieces every benchmark shares. Statistics, order and the results file
without processes; the proxy's launcher (Supervisor, here as bench_pressure starts the demo)
with real ones, everything stopped afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
from pathlib import Path

import aiohttp
import psutil
import pytest

from bench import bench_pressure
from bench.harness.baseline import _copy_built_extensions, launcher_command
from bench.harness.cli import name_values
from bench.harness.contenders import rotated
from bench.harness.cpu import charged, per_1k
from bench.harness.processes import http_json, wait_for
from bench.harness.results import Run, git_commit, run_record, write_report
from bench.harness.stats import median, ratio
from bench.harness.streamed import meta_of, stream_chat
from cacheroute_sim.processes import ROOT


def test_a_median_leaves_unknown_values_out_and_a_ratio_needs_a_positive_base() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0 and median([None, None]) is None
    assert median([1.0, 2.0], None) == 1.5 and median([1 / 3], 2) == 0.33
    assert ratio(1.0, 4.0) == 0.25 and ratio(2.0, 3.0, 3) == 0.667
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None and ratio(0.2, -0.1) is None  # an added latency under zero


def test_each_repeat_starts_with_the_next_contender() -> None:
    names = ["direct", "proxy", "nginx"]
    assert [rotated(names, r)[0] for r in range(4)] == ["direct", "proxy", "nginx", "direct"]
    assert sorted(rotated(names, 5)) == sorted(names) and rotated([], 3) == []


def test_a_load_is_charged_the_contenders_cpu_over_it_and_its_rss_after_it() -> None:
    class Fake:
        spent = 1.0

        def cpu_seconds(self) -> float:
            return self.spent

        def cpu_seconds_by_role(self) -> dict[str, float]:
            return {"workers": self.spent * 0.75, "sidecar": self.spent * 0.25}

        def rss_mb(self) -> float:
            return 123.45

    fake = Fake()

    def load() -> dict[str, float]:
        fake.spent += 2.0
        return {"requests": 4000}

    result = per_1k(charged(fake, load), 4000)
    assert result["cpu_s"] == 2.0 and result["cpu_s_by_role"] == {"sidecar": 0.5, "workers": 1.5}
    assert result["cpu_s_per_1k"] == 0.5 and result["cpu_s_per_1k_by_role"]["workers"] == 0.375
    assert result["rss_mb"] == 123.5 and result["wall_s"] >= 0


def test_the_results_file_names_its_command_and_machine_and_is_written_whole(tmp_path: Path) -> None:
    record = run_record("bench.x", ["--note", "two words"], "t0", {"nproc": 2})
    assert record["command"] == "python -m bench.x --note 'two words'"
    assert shlex.split(record["command"])[-1] == "two words"
    assert record["machine"]["nproc"] == 2 and "loadavg" in record["machine"]["at_end"]
    run = Run("bench.x", [])
    assert run.machine["nproc"] == os.cpu_count() and run.record()["started_at"] == run.started_at
    out = tmp_path / "deeper" / "x.json"
    write_report(out, {"samples": [1.5, 2, 3], "name": "x"}, indent=1, compact_numbers=True)
    assert json.loads(out.read_text()) == {"samples": [1.5, 2, 3], "name": "x"}
    assert '"samples": [1.5, 2, 3]' in out.read_text()
    assert [p.name for p in out.parent.iterdir()] == ["x.json"]  # no partial file left


def test_settings_on_the_command_line_are_name_value_pairs() -> None:
    assert name_values(["PROXY_A=1", "PROXY_B=x=y"]) == {"PROXY_A": "1", "PROXY_B": "x=y"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        name_values(["=1"])


def test_a_baseline_tree_runs_its_own_launcher_from_inside_it(tmp_path: Path) -> None:
    (tmp_path / "cacheroute_proxy").mkdir()
    (tmp_path / "cacheroute_proxy" / "__main__.py").write_text("")
    args, program = launcher_command(tmp_path)
    assert program == "/bin/sh" and args[1].startswith(f"cd {tmp_path} && exec ")
    assert args[1].endswith("-m cacheroute_proxy run")
    assert launcher_command(tmp_path / "older")[0][1].endswith("-m supervisor run")
    assert launcher_command(tmp_path, "/opt/other/bin/python")[0][1].endswith(
        "&& exec /opt/other/bin/python -m cacheroute_proxy run")  # an interpreter A/B


def test_a_baseline_tree_gets_the_built_extensions_whose_source_it_holds_unchanged(tmp_path: Path) -> None:
    root, tree = tmp_path / "root", tmp_path / "tree"
    for base in (root, tree):
        for package in ("pkg", "pkg/sub"):
            (base / package).mkdir(parents=True, exist_ok=True)
    for where, source in (("pkg/_a", b"a"), ("pkg/sub/_b", b"b"), ("pkg/sub/_c", b"c")):
        (root / f"{where}.c").write_bytes(source)
        (root / f"{where}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"built " + source)
    (tree / "pkg/_a.c").write_bytes(b"a")
    (tree / "pkg/sub/_b.c").write_bytes(b"b")
    (tree / "pkg/sub/_c.c").write_bytes(b"c, as it was")  # changed since: not copied
    _copy_built_extensions(tree, root)
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*.so")) == [
        "pkg/_a.cpython-311-x86_64-linux-gnu.so", "pkg/sub/_b.cpython-311-x86_64-linux-gnu.so"]


def test_a_baseline_ref_is_recorded_as_the_commit_it_names_when_the_run_starts() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert head.startswith(git_commit("HEAD"))  # not "HEAD", which moves with the next commit
    assert git_commit("no-such-ref") is None  # (baseline_tree refuses it, naming it)


def test_the_meta_is_read_from_the_end_of_a_stream_or_not_at_all() -> None:
    stream = (b'data: {"x": 1}\n\nevent: cacheroute_meta\ndata: {"trace": {"a": 1}}\n\n'
              b"data: [DONE]\n\n")
    assert meta_of(stream) == {"trace": {"a": 1}}
    assert meta_of(b"data: [DONE]\n\n") is None
    assert meta_of(b'event: cacheroute_meta\ndata: {"trace": ') is None  # cut short


@pytest.mark.slow
def test_the_demo_launcher_comes_up_with_its_instances_and_leaves_nothing(tmp_path: Path) -> None:
    with bench_pressure.simulated_proxy(tmp_path) as proxy:
        assert proxy.child is not None
        launcher = psutil.Process(proxy.child.pid)
        tree = [launcher, *launcher.children(recursive=True)]
        assert len(tree) >= 5  # the demo: the proxy's launcher, sidecar and 2 workers, 2 instances
        assert os.path.exists(f"/dev/shm{proxy.shm_name}")

        def predicted(worker: int) -> bool:
            _, loads = http_json("GET", f"{proxy.worker_url(worker)}/debug/instance_loads")
            return all(row["predicted_total_backlog_ms"] is not None for row in loads["instances"])
        # A request is predicted once the sidecar's snapshot holds its instance: published a
        # moment after the workers see the instance registered (later still on a busy host).
        for worker in range(proxy.workers):
            wait_for(lambda w=worker: predicted(w), 15, f"worker {worker} reads the predicted layer")

        async def one() -> object:
            async with aiohttp.ClientSession() as session:
                return await stream_chat(session, proxy.dp_url, bench_pressure.body(
                    bench_pressure.Workload("sim", (50,), (4, 4), 1.0, 1.0, {}), 50, 4))

        streamed = asyncio.run(one())
        assert streamed.error is None and streamed.finished, streamed
        assert "predict_error_ms" in streamed.meta["trace"] and "snapshot_age_ms" in streamed.meta["trace"]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
    assert not os.path.exists(f"/dev/shm{proxy.shm_name}")
