"""Sections for the results whose benchmark is gone: its question is settled and it guards no
regression, so its code went and its last result stays (blocks.settled says so in each):
a request's metrics against prometheus_client (metrics.json), CPU per request by the
scheduler's clock (peers_task_clock.json), the server and client the product was first built on
(stack_choice.json), and what waking up costs a poller (wakeup_cost.json)."""

from __future__ import annotations

from typing import Any

from bench.peers import targets
from bench.report import blocks
from bench.report.fmt import num, ratio, table
from bench.report.peers import backend_heading


def metrics_section(data: dict[str, Any]) -> str:
    """bench/results/metrics.json: a request's metrics, the product's file against
    prometheus_client's multiprocess values."""
    results = data.get("results") or {}
    rows = [[f"`{name}`", num(r.get("median_ns")), num(r.get("min_ns"))] for name, r in results.items()]
    parts = ["## A request's metrics (ns per call)",
             blocks.settled("the worker's own metrics file replaced prometheus_client's multiprocess "
                            "values; `make bench`'s pipeline_cost measures the metrics part in the "
                            "request path (`without metrics`)."),
             *blocks.header_blocks(data, "metrics.json")]
    if rows:
        ratios = data.get("prometheus_client_over_product") or {}
        parts.append(f"{num(data.get('repeats'))} interleaved loops of {num(data.get('calls'))} calls:\n\n"
                     + table(["case", "median (ns)", "fastest (ns)"], rows)
                     + "\n\nprometheus_client's multiprocess values over the product's: "
                     + "; ".join(f"`{k}` {num(v)}×" for k, v in ratios.items()))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def task_clock_section(data: dict[str, Any]) -> str:
    """bench/results/peers_task_clock.json: CPU per request as the scheduler counts it (perf
    task-clock over a wrk c32 run), per contender and, for this proxy, per role; ratios to
    vllm-router's."""
    parts = ["## CPU per request by the scheduler's clock (perf task-clock)",
             blocks.settled("bench-peers' CPU figures (user + system from /proc, which this kernel "
                            "charges by scheduler tick) were checked against the scheduler's own "
                            "runtime and found right in proportion."),
             *blocks.header_blocks(data, "peers_task_clock.json")]
    for name, medians in (data.get("backends") or {}).items():
        router = (medians.get(targets.ROUTER) or {}).get("task_clock_us_per_req")
        rows = []
        for contender, m in medians.items():
            split = ", ".join(f"{g} {num(v.get('task_clock_us_per_req'))}"
                              for g, v in (m.get("groups") or {}).items())
            mine = m.get("task_clock_us_per_req")
            rows.append([f"`{contender}`", num(m.get("rps")), num(mine),
                         ratio(mine / router if mine is not None and router else None),
                         ", ".join(num(v) for v in m.get("per_repeat_us") or []), split])
        parts.append(backend_heading(name) + "\n\n" + table(
            ["contender", "req/s c32", "µs CPU / request", "× vllm-router", "per repeat (µs)",
             "by group (µs)"], rows))
    return "\n\n".join(parts)


def stack_choice_section(data: dict[str, Any]) -> str:
    """bench/results/stack_choice.json: the ASGI servers and the upstream clients measured before
    the product was built on one of each; the file holds its own two tables."""
    meta = data.get("meta") or {}
    packages = (meta.get("machine") or {}).get("packages") or {}
    parts = ["## Stack choice: ASGI servers and upstream HTTP clients",
             blocks.settled("uvicorn with httptools and aiohttp were chosen; the data plane has since "
                            "moved to its own HTTP/1.1 server and forward client."),
             blocks.provenance(data, "stack_choice.json"), blocks.machine(data),
             blocks.versions({"versions": {**packages, "wrk": (meta.get("machine") or {}).get("wrk")}})]
    if data.get("asgi_servers_table_md"):
        parts.append("ASGI servers: a trivial Starlette app, one worker, pre-bound sockets; medians over "
                     f"{num(meta.get('repeats'))} repeats, ratios to uvicorn + httptools:\n\n"
                     + data["asgi_servers_table_md"])
    if data.get("upstream_clients_table_md"):
        parts.append("Upstream clients: a Starlette-on-uvicorn proxy forwarding to an aiohttp.web backend "
                     "over a pooled keep-alive connection; ratios to aiohttp:\n\n"
                     + data["upstream_clients_table_md"])
    if data.get("unavailable"):
        parts.append("Not measured: " + "; ".join(f"{k}: {num(v)}" for k, v in data["unavailable"].items()))
    return "\n\n".join(p for p in parts if p)


def wakeup_cost_section(data: dict[str, Any]) -> str:
    """bench/results/wakeup_cost.json: the CPU the kernel charges an empty poller per wake-up,
    and an idle proxy's processes per second."""
    rows = [[f"{num(r.get('interval_ms'))} ms", num(r.get("wakeups_per_s")), num(r.get("cpu_ms_per_s")),
             num(r.get("us_per_wakeup"))] for r in data.get("intervals") or []]
    idle = data.get("idle_proxy_cpu_ms_per_s") or {}
    parts = ["## What waking up costs a poller",
             blocks.settled("the sidecar's 5 ms poll is charged about its floor here; fewer wake-ups "
                            "would trade the snapshot's freshness."),
             *blocks.header_blocks(data, "wakeup_cost.json")]
    if data.get("source"):
        parts.append(f"Source of the figures: {data['source']}.")
    if rows:
        parts.append(table(["poll interval", "wake-ups / s", "CPU ms / s", "µs / wake-up"], rows))
    if idle:
        parts.append("An idle proxy (2 workers over 2 simulated instances, nothing sent), CPU ms a second: "
                     + ", ".join(f"{role} {num(ms)}" for role, ms in idle.items()))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)
