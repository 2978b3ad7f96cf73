"""`instances` and `scheduler` as text: the instance pool from `/v1/instance/list` and the
Scheduler registration from `/debug/status`."""

from __future__ import annotations

import time
from typing import Any, Sequence

from .text import printable, render_table


def instance_state(row: dict[str, Any], ttl_s: float, now: float) -> str:
    """`healthy`, `unhealthy` or `expired` as the sidecar says, and
    `stale` for a healthy one silent for over half the TTL (as the dashboard shows it)."""
    health = str(row.get("health") or ("healthy" if row.get("is_alive") else "expired"))
    if health == "healthy" and not row.get("static") and now - float(row.get("last_seen_at") or now) > ttl_s / 2:
        return "stale"
    return health


INSTANCE_HEADERS = ("instance", "address", "state", "inflight", "qps_1m", "last seen", "registered")


def format_instances(rows: Sequence[dict[str, Any]], *, ttl_s: float, show_all: bool,
                     limit: int | None, now: float | None = None) -> str:
    """The pool as a table. `rows` are every registered instance (alive and not); without
    `show_all` only the alive ones (candidates for selection) are listed."""
    now = time.time() if now is None else now
    alive = [r for r in rows if r.get("is_alive")]
    listed = list(rows if show_all else alive)
    shown = listed if limit is None else listed[:limit]
    title = (f"instances   {len(alive)} alive / {len(rows)} registered (ttl {ttl_s:g}s); "
             f"listing {'all' if show_all else 'alive'}")
    if len(shown) < len(listed):
        title += f", first {len(shown)} of {len(listed)}"
    if not shown:
        return title + "\n  (none)"
    table = [[printable(r["instance_id"]), printable(f"{r['host']}:{r['port']}"),
              instance_state(r, ttl_s, now), _cell((r.get("load") or {}).get("inflight")),
              _cell((r.get("load") or {}).get("qps_1m")), _ago(r.get("last_seen_at"), now),
              _ago(r.get("registered_at"), now)] for r in shown]
    return title + "\n" + render_table(INSTANCE_HEADERS, table)


def scheduler_line(link: dict[str, Any]) -> str:
    """One line on the registration with the Scheduler, for `status` and `scheduler`."""
    if not link.get("enabled"):
        return "off (SCHEDULER_CP_URL is not set)"
    url, proxy_id = link.get("url"), link.get("proxy_id")
    if link.get("unregistered"):
        return f"unregistered {proxy_id} from {url} (the proxy is stopping)"
    if link.get("waiting_for_workers"):
        return f"waiting for a worker to serve before registering with {url}"
    if link.get("registered"):
        return (f"registered with {url} as {proxy_id}, last answer {_age_s(link.get('last_success_age_s'))}, "
                f"{link.get('heartbeats_ok', 0)} heartbeats")
    failures = link.get("consecutive_failures", 0)
    return (f"NOT registered with {url} as {proxy_id}: {failures} failure{'s' if failures != 1 else ''} "
            f"in a row, last error: {link.get('last_error') or '-'}")


def format_scheduler(link: dict[str, Any]) -> str:
    lines = [f"scheduler       {scheduler_line(link)}"]
    if not link.get("enabled"):
        return lines[0]
    interval, ttl = link.get("heartbeat_interval_s"), link.get("scheduler_ttl_s")
    lines += [
        f"url             {link.get('url')}",
        f"proxy_id        {link.get('proxy_id')} (advertised {link.get('advertised')})",
        f"heartbeat       {'every %gs' % interval if interval else '-'}, Scheduler ttl "
        f"{'%gs' % ttl if ttl else '-'}",
        f"last answer     {_age_s(link.get('last_success_age_s'))}",
        f"registrations   {link.get('registrations', 0)} ({link.get('re_registrations', 0)} again), "
        f"heartbeats ok {link.get('heartbeats_ok', 0)}",
        f"failures        {link.get('consecutive_failures', 0)} in a row, {link.get('failures_total', 0)} total",
        f"sent again      {link.get('resent_after_idle_close', 0)} "
        "(a kept-alive connection closed unanswered)",
        f"last error      {link.get('last_error') or '-'}",
    ]
    return "\n".join(lines)


def _age_s(age: Any) -> str:
    return "never" if age is None else f"{float(age):.1f}s ago"


def _ago(at: Any, now: float) -> str:
    return "-" if not at else f"{max(0.0, now - float(at)):.1f}s ago"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)
