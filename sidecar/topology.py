"""Instance -> KDN (Knowledge Delivery Network: the knowledge server) links as the instances
measure them (docs/protocol.md, "Topology").

Each instance's report replaces its own map of links; the merged map keeps, for every KDN key,
the best link any instance reported (higher `bandwidth_mbps`, on a tie lower `latency_ms`),
tagged `reported_by`. Both are kept: the merged map is what the Scheduler is told (overlaid on
PROXY_KDN_LINKS_JSON), the per-instance maps are what a prediction for one chosen instance
should use. In the sidecar's memory only: after a restart the maps fill again as instances
report.
"""

from __future__ import annotations

import logging
from typing import Any

from .resource_snapshot import number

log = logging.getLogger("cacheroute.sidecar.topology")

Links = dict[str, dict[str, Any]]

MISSING_BANDWIDTH_MBPS = 0.0   # a link that names no bandwidth loses to any that does
MISSING_LATENCY_MS = 1e9       # and one that names no latency loses a bandwidth tie


class Topology:
    def __init__(self) -> None:
        self._by_instance: dict[str, Links] = {}
        self._merged: Links = {}
        # Bumped whenever the merged map changes: the Scheduler link sends it again then.
        self.version = 0

    def report(self, instance_id: str, links: dict[str, Any]) -> int:
        """Replace the instance's links (entries that are not objects are dropped); the number kept."""
        kept = {str(key): dict(metrics) for key, metrics in links.items() if isinstance(metrics, dict)}
        self._by_instance[instance_id] = kept
        self._rebuild()
        log.info("topology report from %s: %d links", instance_id, len(kept))
        return len(kept)

    def forget(self, instance_id: str) -> None:
        if self._by_instance.pop(instance_id, None) is not None:
            self._rebuild()

    def merged(self) -> Links:
        return {key: dict(link) for key, link in self._merged.items()}

    def per_instance(self) -> dict[str, Links]:
        return {iid: {key: dict(link) for key, link in links.items()}
                for iid, links in self._by_instance.items()}

    def _rebuild(self) -> None:
        best: Links = {}
        for instance_id, links in self._by_instance.items():
            for key, metrics in links.items():
                current = best.get(key)
                if current is None or is_better(metrics, current):
                    best[key] = {**metrics, "reported_by": instance_id}
        if best != self._merged:
            self._merged = best
            self.version += 1


def is_better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Higher bandwidth wins; on equal bandwidth, lower latency; a full tie keeps the old one."""
    new_bw, old_bw = _bandwidth(new), _bandwidth(old)
    if new_bw != old_bw:
        return new_bw > old_bw
    return _latency(new) < _latency(old)


def _bandwidth(link: dict[str, Any]) -> float:
    value = number(link.get("bandwidth_mbps"))
    return MISSING_BANDWIDTH_MBPS if value is None else value


def _latency(link: dict[str, Any]) -> float:
    value = number(link.get("latency_ms"))
    return MISSING_LATENCY_MS if value is None else value
