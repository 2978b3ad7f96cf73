"""The KDN -> instance link a KV transfer is estimated over (docs/protocol.md, "The KV link"): by
IWS when it weighs kvcache against text, and for the reservation on the link's timeline. The KDN
(Knowledge Delivery Network) is the server that holds each knowledge id's text and prebuilt KV;
IWS (the Injection Willingness Strategy, proxy_workers/iws.py) picks text or kvcache.

Where a link comes from, in this order, for the chosen instance and the request's
`Task.KDN_server_addr`:

1. "measured": what instances reported to the sidecar (`POST /v1/topology/report`: the NIC's
   bandwidth, the mean RTT of pings to the KDN). The chosen instance's own report first, else
   the best link over every instance (the sidecar's merge). Each worker refreshes its copy in
   the background (`LinkRefresher`), so the request path reads a local dict;
2. "static": `PROXY_KDN_LINKS_JSON`;
3. "default": `KDN_DEFAULT_BANDWIDTH_MBPS`, RTT 0.

A link counts only if it names a positive `bandwidth_mbps`; its RTT is `latency_ms` (else
`rtt_ms`, else 0). A KDN is looked up under `kdn://host:port` (what instances report
besides the KDN's own id), `host:port` and `http://host:port`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import aiohttp
import msgspec

from cacheroute_proxy.config import Settings

from .upstream import base_url

log = logging.getLogger("cacheroute.worker")

MEASURED, STATIC, DEFAULT = "measured", "static", "default"
# The sidecar's route; `per_instance` asks for each instance's own links too.
KDN_LINKS_PATH = "/v1/topology/kdn_links?per_instance=true"
REFRESH_TIMEOUT_S = 2.0


class KdnLink(NamedTuple):
    bandwidth_mbps: float | None
    latency_ms: float | None
    source: str  # MEASURED, STATIC or DEFAULT

    def transfer_ms(self, predictors: Any, tokens: int) -> float:
        """RTT + the KV of `tokens` knowledge tokens over the link's bandwidth."""
        assert self.bandwidth_mbps, "link_for returns only links with a bandwidth"
        return (self.latency_ms or 0.0) + predictors.kv_transfer_ms(tokens, self.bandwidth_mbps)


class MeasuredLinks(NamedTuple):
    merged: dict[str, KdnLink]  # KDN key -> the best link over every instance
    per_instance: dict[str, dict[str, KdnLink]]  # instance id -> KDN key -> its own link


NO_MEASUREMENTS = MeasuredLinks({}, {})


class LinkTable:
    """This worker's view of every link: the last measured table and the static one."""

    def __init__(self, static: Mapping[str, Mapping[str, Any]], default_bandwidth_mbps: float) -> None:
        self._static = links_from(static, STATIC)
        self._default = KdnLink(default_bandwidth_mbps, 0.0, DEFAULT)
        self._measured = NO_MEASUREMENTS

    @classmethod
    def from_settings(cls, settings: Settings) -> LinkTable:
        return cls(settings.kdn_links, settings.kdn_default_bandwidth_mbps)

    def replace(self, measured: MeasuredLinks) -> None:
        self._measured = measured

    def link_for(self, instance_id: str, kdn_addr: str) -> KdnLink:
        keys = kdn_keys(kdn_addr)
        measured = self._measured
        for table in (measured.per_instance.get(instance_id), measured.merged, self._static):
            if table:
                for key in keys:
                    link = table.get(key)
                    if link is not None:
                        return link
        return self._default


def sidecar_links_url(settings: Settings) -> str:
    """Where this worker reads the measured links: the sidecar's control plane, on loopback
    when it listens on every address."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.cp_host, settings.cp_host)
    return base_url(host, settings.cp_port) + KDN_LINKS_PATH


def kdn_keys(kdn_addr: str) -> tuple[str, ...]:
    """The keys a KDN `host:port` may be reported under."""
    address = kdn_addr.strip().removeprefix("http://").removeprefix("kdn://").rstrip("/")
    if not address:
        return ()
    return f"kdn://{address}", address, f"http://{address}"


def links_from(raw: Mapping[str, Any], source: str) -> dict[str, KdnLink]:
    """{key: metrics} -> {key: KdnLink}, keeping the entries that name a positive bandwidth
    (the sidecar stores what instances report: a value that is no number is left out, not
    trusted)."""
    links = {}
    for key, metrics in raw.items():
        if not isinstance(metrics, Mapping):
            continue
        bandwidth = _number(metrics.get("bandwidth_mbps"))
        if bandwidth is None or bandwidth <= 0:
            continue
        latency = _number(metrics.get("latency_ms"))
        if latency is None or latency < 0:
            latency = _number(metrics.get("rtt_ms"))
        links[str(key)] = KdnLink(bandwidth, latency if latency is not None and latency >= 0 else None,
                                  source)
    return links


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class KdnLinksAnswer(msgspec.Struct):
    """The sidecar's `GET /v1/topology/kdn_links?per_instance=true`:
    the merged links, and each instance's own. The metrics inside are the instances' own
    words, checked one by one (`links_from`)."""

    kdn_links: dict[str, Any] = {}
    per_instance: dict[str, dict[str, Any]] = {}


_decode_answer = msgspec.json.Decoder(KdnLinksAnswer).decode


def measured_from(body: bytes) -> MeasuredLinks:
    """The sidecar's answer as this worker's measured table (msgspec errors on a bad shape)."""
    answer = _decode_answer(body)
    return MeasuredLinks(links_from(answer.kdn_links, MEASURED),
                         {iid: links_from(links, MEASURED) for iid, links in answer.per_instance.items()
                          if isinstance(links, Mapping)})


class LinkRefresher:
    """Copies the sidecar's measured links into `table` every `interval_s`, in the background
    (never on a request). A failed refresh keeps the last table; it is logged once, when the
    refreshes start failing, and once when they work again."""

    def __init__(self, table: LinkTable, session: Callable[[], aiohttp.ClientSession], url: str,
                 token: str | None, interval_s: float) -> None:
        self._table = table
        self._session = session  # the worker's pooled session, there once the worker started
        self._url = url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._interval_s = interval_s
        self._failing = False

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval_s)

    async def refresh(self) -> bool:
        try:
            async with self._session().get(self._url, headers=self._headers, timeout=aiohttp.ClientTimeout(
                    total=min(REFRESH_TIMEOUT_S, self._interval_s))) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"answered {resp.status}: {body[:200]!r}")
            measured = measured_from(body)
        except Exception as exc:  # whatever went wrong, the last table is still the best guess
            if not self._failing:
                self._failing = True
                log.warning("KDN links: cannot read %s (%s: %s); IWS keeps the last measured "
                            "links, else PROXY_KDN_LINKS_JSON, else KDN_DEFAULT_BANDWIDTH_MBPS",
                            self._url, type(exc).__name__, exc)
            return False
        if self._failing:
            self._failing = False
            log.info("KDN links: %s answers again", self._url)
        self._table.replace(measured)
        return True
