"""`cacheroute-proxy status` and `cacheroute-proxy loads`: what an operator looks at first,
read from the control plane's debug endpoints and printed as text; and `show`, the one refresh
loop of every watching command (`loads --watch`, `watch`, the console's `:watch`)."""

from __future__ import annotations

import time
import urllib.error
from typing import Any, Callable, TextIO

from .control_client import ControlPlaneError
from .pool_view import scheduler_line
from .text import printable


def format_status(status: dict[str, Any]) -> str:
    seg, channel, reaper = status["segment"], status.get("event_channel", {}), status["reaper"]
    lines = [
        f"instances   {status['alive_instances']} alive / {status['total_instances']} registered "
        f"(ttl {status['ttl_s']:g}s)",
        f"sidecar     pid {status['sidecar']['pid']}, epoch {status['sidecar']['epoch']}",
        f"segment     {seg['name']} layout v{seg['layout_version']}, {seg['total_size']} bytes, "
        f"capacity {seg['instance_capacity']} instances / {seg['worker_capacity']} workers",
        f"events      consumed {channel.get('events_consumed', 0)}, dropped "
        f"{channel.get('events_dropped_by_workers', 0)}, pending reservations "
        f"{channel.get('pending_reservations', 0)}, decoding {channel.get('decoding', 0)}",
        f"reaper      reaped {reaper['reaped']}, subtracted {reaper['subtracted']}, "
        f"corrections {reaper['corrections']}",
        f"scheduler   {scheduler_line(status.get('scheduler') or {'enabled': False})}",
        *_kv_event_lines(status.get("kv_event_feeds") or {}),
        "workers",
    ]
    for w in sorted(status["workers"], key=lambda w: w["worker_index"]):
        lines.append(f"  w{w['worker_index']:<3} pid {w['pid']:<8} {'alive' if w['alive'] else 'DEAD':<6}"
                     f" heartbeat {w['heartbeat_age_ms']} ms ago, events pending {w.get('events_pending', 0)}")
    return "\n".join(lines)


def _kv_event_lines(feeds: dict[str, Any]) -> list[str]:
    """One line an engine whose KV cache events the sidecar follows."""
    lines = []
    for instance_id, feed in sorted(feeds.items()):
        age = feed.get("last_batch_age_s")
        lines.append(f"kv events   {printable(instance_id)} {printable(feed['endpoint'])}: {feed['batches']} batches"
                     f" (last {'never' if age is None else f'{age:g}s ago'}), {feed['gaps']} gaps, "
                     f"{feed['engine_restarts']} engine restarts")
    return lines


COLUMNS = (("instance", "instance_id", 24), ("alive", "is_alive", 5), ("inflight", "inflight", 8),
           ("ready", "active_ready", 5), ("prep", "active_prepare", 4), ("q_ready", "ready_queue_depth", 7),
           ("pending", "pending_prefill_count", 7), ("decode", "active_decode_count", 6),
           ("backlog_ms", "predicted_total_backlog_ms", 10))


def format_loads(loads: dict[str, Any]) -> str:
    header = "  ".join(f"{title:>{width}}" for title, _, width in COLUMNS) + "  score"
    rows = [f"strategy {loads['strategy']}, predicted pressure {loads['metric_source'].get('predicted_pressure')}"
            f", snapshot age {_num(loads.get('snapshot_age_ms'))} ms", header]
    for row in loads["instances"]:
        cells = [f"{_num(row.get(key)):>{width}}"[-width:] if key != "instance_id" else f"{printable(row[key]):>{width}}"[-width:]
                 for _, key, width in COLUMNS]
        rows.append("  ".join(cells) + f"  {_num(row['least_load_score']['total'])}")
    return "\n".join(rows)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def show(render: Callable[[], str], out: TextIO, watch_s: float | None, rounds: int | None = None) -> int:
    """Print once, or every `watch_s` seconds (until interrupted or `rounds` are done)."""
    done = 0
    while True:
        try:
            text = render()
        except (ControlPlaneError, urllib.error.URLError, OSError) as exc:
            text = str(exc) if isinstance(exc, ControlPlaneError) else f"control plane unreachable: {exc}"
            if watch_s is None:
                print(text, file=out)
                return 1
        if watch_s is not None:
            out.write("\033[2J\033[H")  # clear the terminal between refreshes
        print(text, file=out, flush=True)
        done += 1
        if watch_s is None or (rounds is not None and done >= rounds):
            return 0
        time.sleep(watch_s)
