"""The measured link from this host to each KDN (Knowledge Delivery Network: the knowledge
server an instance pulls prebuilt KV from), as the original Instances reported it.

For a target host:port: `POST /v1/topology/hello` names the KDN (`kdn_id`), three
`GET /v1/topology/ping` round trips give `latency_ms` (their mean), and the speed of the
network interface that reaches the target gives `bandwidth_mbps` (the configured default when
the interface reports none, as a loopback or virtual one does). A link is reported under the
KDN's id and under `kdn://host:port`, so either name finds it. A target that does not answer
is left out of the report (and logged once per change), not reported as a zero link.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import aiohttp
import msgspec
import psutil

from cacheroute_proxy.kdn_wire import KdnReplyError, TopologyHello, decode_hello

log = logging.getLogger("cacheroute.agent.topology")

PINGS = 3
CALL_TIMEOUT_S = 2.0


class LinkMetrics(msgspec.Struct):
    bandwidth_mbps: float
    latency_ms: float
    iface: str | None
    measured_by: str = "cacheroute-instance-agent"


class LinkProbe:
    def __init__(self, session: aiohttp.ClientSession, default_mbps: float) -> None:
        self._session = session
        self._default_mbps = default_mbps
        self._failing: set[str] = set()

    async def links(self, targets: tuple[str, ...], instance_id: str) -> dict[str, LinkMetrics]:
        found: dict[str, LinkMetrics] = {}
        for target in targets:
            measured = await self._measure(target, instance_id)
            if measured is None:
                continue
            kdn_id, metrics = measured
            found[f"kdn://{target}"] = metrics
            if kdn_id:
                found[kdn_id] = metrics
        return found

    async def _measure(self, target: str, instance_id: str) -> tuple[str | None, LinkMetrics] | None:
        base = f"http://{target}"
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        try:
            async with self._session.post(f"{base}/v1/topology/hello", json={"instance_id": instance_id},
                                          timeout=timeout) as resp:
                hello = decode_hello(await resp.read()) if resp.status == 200 else TopologyHello()
            rtts = []
            for _ in range(PINGS):
                started = time.perf_counter()
                async with self._session.get(f"{base}/v1/topology/ping", timeout=timeout) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                rtts.append((time.perf_counter() - started) * 1000)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KdnReplyError) as exc:
            if target not in self._failing:
                self._failing.add(target)
                log.warning("KDN %s does not answer its topology probe (%s): left out of the report",
                            target, type(exc).__name__)
            return None
        if target in self._failing:
            self._failing.discard(target)
            log.info("KDN %s answers its topology probe again", target)
        iface, speed = interface_towards(target.rpartition(":")[0])
        return hello.kdn_id, LinkMetrics(bandwidth_mbps=float(speed or self._default_mbps),
                                         latency_ms=round(sum(rtts) / len(rtts), 3), iface=iface)


def interface_towards(host: str) -> tuple[str | None, int | None]:
    """(interface, its speed in Mbit/s or None) that the kernel would use to reach `host`."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
            local = sock.getsockname()[0]
    except OSError:
        return None, None
    stats = psutil.net_if_stats()
    for iface, addresses in psutil.net_if_addrs().items():
        if any(addr.address.split("%")[0] == local for addr in addresses):
            speed = stats[iface].speed if iface in stats else 0
            return iface, speed or None
    return None, None
