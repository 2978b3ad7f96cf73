"""Bounded soak under chaos: the real supervisor, steady mixed load, a flapping instance, a
worker SIGKILLed every minute; then the end invariants (nothing left in flight, no event lost,
timelines drained, worker RSS flat).

Run:  python -m bench.soak --duration 600 --out bench/results/soak.json     (make soak DURATION=600)

What it starts, on 127.0.0.1 only, with free ports and a private segment name, and stops by pid
(`processes`):
- `python -m cacheroute_proxy run`: sidecar + 4 workers (least_load; `--strategy kv_aware`, with
  most plain chats led by one of a few shared system prompts: make soak STRATEGY=kv_aware);
- 3 simulated instances (`python -m cacheroute_sim.instance ... --proxy-cp-url <cp> --time-scale 0.2`)
  that register themselves; instance 0 is the *flapper*.

Load (`load`): `--clients` closed-loop clients (default 20) with a little think time, each
sending one request at a time through the shared port: streaming and non-streaming chat, plain
OpenAI and Scheduler-shaped bodies, and ~10 % client cancels (connection closed before the
response, or mid-stream after the first token). One TCP connection per request, so the kernel
spreads them over the workers and a connection error can be tied to the worker that was killed.

Chaos (`chaos`; times from the start of the load):
- every `--flap-interval` s (20) the flapper's `fail_status` toggles 503 / none through
  `/sim/config`; every `--restart-every`-th (3rd) flap event instead stops that process
  (SIGTERM: it unregisters) and starts it again on the same port and id (it re-registers);
- every `--kill-interval` s (60, first at `--kill-offset` 45, each moved by up to
  `--kill-jitter` 10 s, seeded) one worker, in rotation, is
  SIGKILLed: its pid is read from its private port's `/healthz`, checked against
  `/debug/status` → `workers[]`, and the supervisor restarts it.

Outcomes of every request are classified (`outcomes.classify`):
- `ok`: 200 with a complete body (JSON with `_cacheroute_meta.error == null`; a stream ending
  with `data: [DONE]` and a clean `cacheroute_meta`);
- `client_cancelled`: the client closed the connection on purpose;
- `expected_worker_kill`: a connection error, truncated body or reset whose response came from
  the killed worker's pid, or that had no response head yet and was in progress at the kill
  (started at most `--kill-grace` s after it);
- `expected_flap`: the flapper's own 503 passed through (`x-cacheroute-instance` = flapper, an
  error code that is not one of the proxy's own) while its 503 knob was on; or, while the
  flapper was being restarted, a 502 `upstream_unavailable`/`upstream_failed` or a truncated
  stream from the flapper;
- everything else is `unexpected` (proxy 429/503/504, a 5xx from a healthy instance, a client
  timeout, a connection error nowhere near a kill, a 200 with a meta error, ...).

Measures: outcome counts, latency p50/p99 of `ok` requests (and TTFT of streams), worker RSS
per lineage (`monitor`: worker index + pid; a restarted worker is a new lineage with its own
baseline taken once it is `--warmup` s old; growth is reported for lineages that lived >= 60 s),
the events dropped by every worker lineage as seen while it lived (a killed worker's count leaves
`/debug/status` with its row), the chaos log, and at the end — after the load stops and the
counters settle (`--quiesce-timeout`) — the invariants checked by `checks.end_checks`.

Exit status 0 when every invariant holds, 1 otherwise; the JSON is written either way.

Modules, one job each:
- `config`     SoakConfig and the command line;
- `clock`      soak time (seconds since the load started) and the end of the load;
- `processes`  the supervisor and the simulated instances: start, reach, stop by pid;
- `load`       the clients and the record of each request;
- `chaos`      the flapping instance and the worker kills, and their log;
- `monitor`    worker lineages (RSS, events dropped) and the sidecar, sampled while it runs;
- `outcomes`   the category of each request and the request totals;
- `checks`     settling at the end, the final snapshot and the end invariants;
- `report`     the JSON report and the printed summary;
- `run`        one soak, start to end (`run_soak`); `__main__` the command.
"""
