"""A compressed soak (bench/soak/): about a minute of mixed load through the real supervisor
(4 workers, least_load and again kv_aware with shared system prompts, 3 simulated instances)
with every kind of chaos at least once — the flapper's 503 knob on twice (10 s each), one
stop/restart of the flapper process, one worker SIGKILLed — then the end invariants.

Acceptable outcomes of a request (`bench.soak.outcomes.classify`), everything else fails the test:
- `ok`: 200 with a complete body (JSON whose `_cacheroute_meta.error` is null, or a stream that
  ends with a clean `cacheroute_meta` and `data: [DONE]`);
- `client_cancelled`: the client itself closed the connection (before the response or
  mid-stream), ~10 % of requests by design;
- `expected_worker_kill`: a connection error or truncated body from the SIGKILLed worker (its pid
  in `x-cacheroute-worker`), or a connection error before any response head while the kill
  happened (request started at most `kill_grace_s` after it); at most one per client, since a
  client has one request in flight;
- `expected_flap`: the documented upstream errors of the flapping instance only — its own 503
  passed through (`x-cacheroute-instance` = the flapper, an error code that is not the proxy's)
  while its 503 knob was on, or a 502 `upstream_unavailable` / `upstream_failed` or a truncated
  stream from it while it was being restarted.
So no proxy-made 429/503/504, no 5xx from a healthy instance, no client timeout, no stray
connection error, no 200 carrying a meta error.

RSS growth is not asserted here (a minute is too short to tell growth from warm-up); the
10-minute `make soak` checks it.
"""

from __future__ import annotations

import os

import pytest

from bench.harness.results import Run
from bench.soak.config import SoakConfig
from bench.soak.outcomes import ACCEPTABLE_CATEGORIES, classify
from bench.soak.report import summary_lines
from bench.soak.run import run_soak

FLAPPER = "soak-sim-0"
KILL = {"t": 20.0, "pid": 111, "worker_index": 0}


def _rec(outcome: str, t_start: float = 5.0, t_end: float = 6.0, **kw: object) -> dict[str, object]:
    return {"outcome": outcome, "t_start": t_start, "t_end": t_end, "worker_pid": kw.pop("pid", 222),
            "instance": kw.pop("instance", "soak-sim-1"), "status": kw.pop("status", None),
            "error_code": kw.pop("code", None), **kw}


@pytest.mark.parametrize("rec, expected", [
    (_rec("ok", status=200), "ok"),
    (_rec("client_cancelled"), "client_cancelled"),
    (_rec("client_cancelled_mid_stream", status=200), "client_cancelled"),
    # the killed worker's own responses, and headless resets at the moment of the kill
    (_rec("conn_error_ClientPayloadError", 19.0, 20.0, pid=111, status=200), "expected_worker_kill"),
    (_rec("stream_truncated", 19.0, 20.1, pid=111, status=200), "expected_worker_kill"),
    (_rec("conn_error_ServerDisconnectedError", 20.5, 20.6, pid=None), "expected_worker_kill"),
    # a reset far from any kill, or from another worker, is not
    (_rec("conn_error_ServerDisconnectedError", 40.0, 40.1, pid=None), "unexpected"),
    (_rec("conn_error_ClientPayloadError", 19.0, 20.5, pid=222, status=200), "unexpected"),
    # the flapper's own 503 while its knob is on (window 10..20); not outside it, not another's
    (_rec("http_503_upstream_error", 12.0, 12.1, instance=FLAPPER, status=503, code="service_unavailable"),
     "expected_flap"),
    (_rec("http_503_None", 12.0, 12.1, instance=FLAPPER, status=503), "expected_flap"),
    (_rec("http_503_x", 25.0, 25.1, instance=FLAPPER, status=503, code="x"), "unexpected"),
    (_rec("http_503_x", 12.0, 12.1, instance="soak-sim-1", status=503, code="x"), "unexpected"),
    # the proxy's own 503s are never acceptable, even from the flapper during its window
    (_rec("http_503_queue_timeout", 12.0, 12.1, instance=FLAPPER, status=503, code="queue_timeout"),
     "unexpected"),
    (_rec("http_503_no_instance", 12.0, 12.1, instance=None, status=503, code="no_instance"), "unexpected"),
    # while the flapper restarts (window 30..34): its 502s and truncated streams
    (_rec("http_502_upstream_unavailable", 31.0, 31.1, instance=FLAPPER, status=502,
          code="upstream_unavailable"), "expected_flap"),
    (_rec("stream_truncated", 30.0, 31.0, instance=FLAPPER, status=200), "expected_flap"),
    (_rec("http_502_upstream_failed", 45.0, 45.1, instance=FLAPPER, status=502, code="upstream_failed"),
     "unexpected"),
    (_rec("http_504_upstream_timeout", 31.0, 31.1, instance=FLAPPER, status=504, code="upstream_timeout"),
     "unexpected"),
    (_rec("http_429_queue_full", status=429, code="queue_full"), "unexpected"),
    (_rec("client_timeout"), "unexpected"),
    (_rec("ok_with_meta_error", status=200), "unexpected"),
])
def test_classify(rec: dict[str, object], expected: str) -> None:
    assert classify(rec, [KILL], [(10.0, 20.0)], [(30.0, 34.0)], FLAPPER, kill_grace_s=2.0) == expected


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["least_load", "kv_aware"])
def test_soak_under_chaos_ends_clean(tmp_path, strategy: str) -> None:
    cfg = SoakConfig(
        duration_s=55, warmup_s=10, clients=16, flap_interval_s=10, restart_every=3,
        kill_offset_s=22, kill_jitter_s=0, kill_interval_s=1000, max_kills=1, chaos_quiet_tail_s=5,
        check_rss=False, quiesce_timeout_s=45, request_timeout_s=60, strategy=strategy,
        log_dir=str(tmp_path / "logs"))
    report = run_soak(cfg, Run("bench.soak", ["--duration", "55", "--strategy", strategy]))
    summary = "\n".join(summary_lines(report)) + f"\nlogs: {tmp_path / 'logs'}"
    req, chaos, checks = report["requests"], report["chaos"], report["end_checks"]

    # The chaos really happened: 503 windows at 10..20 s and 40..50 s, a restart at 30 s, a kill at 22 s.
    assert chaos["worker_kills"] == 1, summary
    assert chaos["flapper_restarts"] == 1, summary
    assert chaos["flap_503_windows"] == 2, summary
    assert checks["chaos_ran_cleanly"]["pass"], (checks["chaos_ran_cleanly"], summary)
    assert checks["reaper"]["pass"] and checks["reaper"]["reaped"] >= 1, (checks["reaper"], summary)
    assert checks["workers_all_alive"]["pass"], (checks["workers_all_alive"], summary)

    # Traffic flowed, and only acceptable outcomes occurred.
    categories = req["categories"]
    assert req["total"] >= 100 and categories["ok"] >= 0.5 * req["total"], summary
    assert categories["client_cancelled"] > 0, summary
    assert set(categories) == {*ACCEPTABLE_CATEGORIES, "unexpected"}
    assert categories["unexpected"] == 0, (req["unexpected_by_outcome"], req["unexpected_samples"], summary)
    assert req["http_5xx_unexpected"] == 0, (req["http_5xx"], summary)
    assert categories["expected_worker_kill"] <= cfg.clients, summary

    # End invariants: nothing in flight anywhere, no event lost, timelines drained.
    lanes = checks["inflight_and_lanes_zero_everywhere"]
    assert lanes["pass"], (lanes["nonzero"], summary)
    assert lanes["sources"] == ["control_plane", "worker0", "worker1", "worker2", "worker3"]
    assert checks["every_instance_alive"]["pass"], (checks["every_instance_alive"], summary)
    dropped = checks["no_event_dropped"]
    assert dropped["pass"] and dropped["events_dropped_by_workers"] == 0, (dropped, summary)
    drained = checks["timelines_drained"]
    assert drained["pending_reservations"] == 0 and drained["decoding"] == 0, (drained, summary)
    assert checks["reaper"]["corrections"] is not None
    assert checks["sidecar_never_restarted"]["pass"], summary
    if strategy == "kv_aware":  # its claims, homes and shared keys were at work throughout
        channel = report["final_status"]["event_channel"]
        assert channel["affinity"]["prefix_blocks"] > 0 and channel["prompt_homes"]["prompts"] > 0, summary

    # Everything it started is gone, the segment too.
    stop = checks["clean_stop"]
    assert stop["pass"], (stop, summary)
    assert not os.path.exists(f"/dev/shm{report['setup']['shm_name']}")
    assert report["passed"], (report["failed_checks"], summary)
