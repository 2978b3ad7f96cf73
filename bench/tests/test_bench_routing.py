"""The routing-quality bench (bench/routing): its seeded schedule, its figures and checks, the
simulated instance's inflight gauge it samples, and one real short run through the harness."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from dataclasses import replace

import aiohttp
import pytest

from bench.harness.backends import InstanceSpec, SimInstances
from bench.routing import summary, uncertainty
from bench.routing.__main__ import main as routing_main
from bench.routing.run import measure
from bench.routing.sampler import Samples
from bench.routing.scenario import Scenario, contender_defs
from bench.routing.schedule import ScheduleSpec, build_schedule
from tests.harness import post, wait_until


def test_the_schedule_is_seeded_bursty_and_bounded() -> None:
    spec = ScheduleSpec(duration_s=20.0, seed=3)
    arrivals = build_schedule(spec)
    assert arrivals == build_schedule(spec)
    assert arrivals != build_schedule(replace(spec, seed=4))
    assert all(0 < a.at_s < spec.duration_s for a in arrivals)
    sizes: dict[int, set[float]] = {}
    for a in arrivals:
        sizes.setdefault(a.burst, set()).add(a.at_s)
    assert all(len(times) == 1 for times in sizes.values())  # a burst fires at one instant
    counts = [sum(1 for a in arrivals if a.burst == b) for b in sizes]
    assert min(counts) >= spec.burst_size[0] and max(counts) <= spec.burst_size[1]
    assert {a.max_tokens for a in arrivals} <= {v for v, _ in spec.max_tokens_mix}
    assert {a.prompt_tokens for a in arrivals} <= {v for v, _ in spec.prompt_tokens_mix}


def _contender(name: str, p99: float | None) -> dict:
    return {"name": name, "kind": "nginx" if name == summary.NGINX else "proxy",
            "median": {"ttft_p99_ms": p99, "errors": 0, "worker_cpu_peak": 0.2}}


def test_checks_compare_medians_and_fail_when_a_contender_is_missing() -> None:
    contenders = [_contender(summary.REFERENCE, 1000.0), _contender(summary.SHARED, 1101.0),
                  _contender(summary.PER_WORKER, 1101.0), _contender(summary.ROUND_ROBIN, 2000.0)]
    within, per_worker, rr = summary.checks(contenders)
    assert (within["value"], within["pass"]) == (1.101, False)   # 10.1 % worse than the reference
    assert (per_worker["value"], per_worker["pass"]) == (1.0, False)  # a tie does not beat
    assert (rr["value"], rr["pass"]) == (0.5505, True)
    # A claim about a contender that failed requests fails, however good its TTFTs look.
    contenders[1] = {**_contender(summary.SHARED, 500.0), "runs": [{"errors": 0}, {"errors": 2}]}
    within_failed = summary.checks(contenders)[0]
    assert (within_failed["value"], within_failed["pass"], within_failed["failed_requests"]) == (0.5, False, 2)
    missing = summary.checks(contenders[:2])
    assert [c["pass"] for c in missing] == [False, None, None]  # not measured: neither
    assert missing[1]["value"] is None


def _runs(scale: float, noise: list[float], skip: int | None = None) -> list[dict]:
    """One run per repeat: 100 TTFTs (1..100 ms) x noise of that repeat x scale."""
    runs = []
    for repeat, factor in enumerate(noise):
        samples = [v * factor * scale for v in range(1, 101)]
        runs.append({"repeat": repeat, "start_error": "x"} if repeat == skip else
                    {"repeat": repeat, "errors": 0, "ttft_samples_ms": samples,
                     "ttft_p99_ms": samples[98], "worker_cpu_peak": 0.1})
    return runs


def test_intervals_pair_repeats_and_bracket_the_ratio() -> None:
    noise = [1.0, 1.7, 0.6, 1.3, 0.9]
    a = {"name": summary.SHARED, "runs": _runs(1.2, noise, skip=3)}
    b = {"name": summary.REFERENCE, "runs": _runs(1.0, noise)}
    pairs = uncertainty.paired_repeats(a, b)
    assert [x["repeat"] for x, _ in pairs] == [0, 1, 2, 4]  # repeat 3 did not start for a
    # The same repeats of both, so the repeat-to-repeat noise cancels: every resample says 1.2.
    for figure in uncertainty.STATISTICS.values():
        ratio, low, high = uncertainty.ratio_interval(pairs, figure, random.Random(1), resamples=200)
        assert ratio == pytest.approx(1.2) and low == pytest.approx(1.2) and high == pytest.approx(1.2)
    # Noise that does not cancel widens the interval around the ratio over every repeat.
    a["runs"] = _runs(1.0, [1.1, 1.9, 0.5, 1.2, 1.0])
    ratio, low, high = uncertainty.ratio_interval(uncertainty.paired_repeats(a, b),
                                                  uncertainty.STATISTICS[uncertainty.MEDIAN_OF_P99],
                                                  random.Random(1), resamples=500)
    assert low < ratio < high and low < 1.0 < high
    # Two pairs are too few to resample: a ratio, no interval.
    assert uncertainty.ratio_interval(pairs[:2], uncertainty.STATISTICS["pooled TTFT p99"],
                                      random.Random(1))[1:] == (None, None)


def test_a_results_file_is_reanalysed_from_its_runs(tmp_path, capsys) -> None:
    noise = [1.0, 1.4, 0.8]
    contenders = [{"name": name, "kind": "proxy", "workers": 4, "runs": _runs(scale, noise),
                   "median": {}, "stale": True}
                  for name, scale in ((summary.REFERENCE, 1.0), (summary.SHARED, 1.05),
                                      (summary.PER_WORKER, 1.5), (summary.ROUND_ROBIN, 6.0))]
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"command": "x", "instance_labels": [], "contenders": contenders}))
    assert routing_main(["--reanalyse", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["command"] == "x" and results["contenders"][0]["stale"] is True  # kept
    assert [c["pass"] for c in results["checks"]] == [True, True, True]
    assert results["checks"][0]["value"] == pytest.approx(1.05)
    rows = {(tuple(r["compares"]), r["statistic"]): r for r in results["uncertainty"]["rows"]}
    row = rows[((summary.SHARED, summary.PER_WORKER), "pooled TTFT p95")]
    assert (row["ratio"], row["low"], row["high"], row["repeats"]) == (0.7, 0.7, 0.7, 3)
    assert "ratios with intervals" in capsys.readouterr().out
    path.write_text("{}")
    assert routing_main(["--reanalyse", str(path)]) == 2
    assert "not a routing results file" in capsys.readouterr().err


def test_spread_statistics_cover_only_the_arrival_window() -> None:
    samples = Samples(times_s=[0.0, 1.0, 2.0, 3.0], inflight=[[0, 0], [1, 3], [2, 2], [9, 0]])
    s = summary.summarize_samples(samples, in_window=3)
    assert s["inflight_spread_mean"] == pytest.approx(2 / 3, abs=1e-3)
    assert s["inflight_spread_max"] == 2
    assert s["series"]["inflight"][-1] == [9, 0]  # the drain stays in the plotted series


def test_the_instance_reports_its_own_inflight() -> None:
    with SimInstances([InstanceSpec(extra_args=("--hold-streams",))], time_scale=0.01) as inst:
        url = inst.urls[0]
        done = threading.Event()

        async def one_stream() -> None:
            async with aiohttp.ClientSession() as session:
                body = {"model": "m", "stream": True, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                    await response.read()
            done.set()

        client = threading.Thread(target=asyncio.run, args=(one_stream(),), daemon=True)
        client.start()
        wait_until(lambda: inst.stats(0)["inflight"] == 1, 20, message="inflight 1 while held")
        # Released until it ends: inflight counts the request a moment before it reaches the
        # hold gate, so a single early release can find nothing held yet.
        wait_until(lambda: post(f"{url}/sim/release", {}) is not None and done.wait(0.2), 20,
                   message="the stream ended")
        wait_until(lambda: inst.stats(0)["inflight"] == 0, 20, message="inflight back to 0")
        client.join(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_short_run_through_a_real_proxy() -> None:
    """The real harness against a 1-worker proxy for 2 s of bursts: every request answered,
    counted at the instances, sampled, and the worker's CPU measured."""
    scenario = Scenario(time_scale=0.05, schedule=ScheduleSpec(duration_s=2.0, seed=11),
                        drain_timeout_s=60.0)
    arrivals = build_schedule(scenario.schedule)
    reference = next(d for d in contender_defs(scenario) if d.name == summary.REFERENCE)
    labels = scenario.instance_labels()
    with SimInstances(scenario.instance_specs(), time_scale=scenario.time_scale) as instances:
        run = measure(reference, instances, arrivals, scenario, labels)
    assert run["requests"] == len(arrivals) > 0
    assert run["errors"] == 0, run["error_kinds"]
    assert sum(run["instance_requests"].values()) == len(arrivals)
    assert run["ttft_p99_ms"] is not None and run["ttft_p99_ms"] <= run["total_p99_ms"]
    assert run["inflight_samples"] > 0 and run["worker_cpu_peak"] is not None
    assert len(run["worker_pids"]) == 1
