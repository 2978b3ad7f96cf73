"""The KDN -> instance link a KV transfer is estimated over (proxy_workers/kdn_links.py): the
lookup order (the instance's measured link, the merged measured one, PROXY_KDN_LINKS_JSON, the
default), the estimate IWS and the KV reservation share, and the background refresh from the
sidecar against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from cacheroute_proxy.config import ConfigError, Settings
from proxy_workers.iws import decide
from proxy_workers.kdn_links import (
    KdnLink,
    LinkRefresher,
    LinkTable,
    MeasuredLinks,
    kdn_keys,
    links_from,
    measured_from,
    sidecar_links_url,
)
from proxy_workers.knowledge import KnowledgePreparer, LinkTimeline
from proxy_workers.predictors import get_predictors
from proxy_workers.request_model import Endpoint, recover
from proxy_workers.trace import Knowledge, Trace
from shm_schema import InstanceSlot

PREDICTORS = get_predictors("llama3-70b-8x5090")
KDN = "10.0.0.5:9101"
STATIC = {"kdn://10.0.0.5:9101": {"bandwidth_mbps": 400, "latency_ms": 2.0}}


def _measured(merged: dict[str, Any], per_instance: dict[str, dict[str, Any]] | None = None) -> MeasuredLinks:
    body = json.dumps({"kdn_links": merged, "per_instance": per_instance or {}}).encode()
    return measured_from(body)


# --- the lookup -------------------------------------------------------------------------------

def test_the_lookup_order_instance_then_merged_then_static_then_default():
    table = LinkTable(STATIC, default_bandwidth_mbps=1000)
    assert table.link_for("inst-a", KDN) == KdnLink(400.0, 2.0, "static")
    assert table.link_for("inst-a", "10.0.0.6:9101") == KdnLink(1000.0, 0.0, "default")
    table.replace(_measured(
        {"kdn://10.0.0.5:9101": {"bandwidth_mbps": 25000, "latency_ms": 0.2, "reported_by": "inst-b"}},
        {"inst-a": {"kdn://10.0.0.5:9101": {"bandwidth_mbps": 10000, "latency_ms": 0.4}},
         "inst-b": {"kdn://10.0.0.5:9101": {"bandwidth_mbps": 25000, "latency_ms": 0.2}}}))
    assert table.link_for("inst-a", KDN) == KdnLink(10000.0, 0.4, "measured")  # its own link
    assert table.link_for("inst-c", KDN) == KdnLink(25000.0, 0.2, "measured")  # no own: the best
    assert table.link_for("inst-a", "10.0.0.6:9101").source == "default"
    table.replace(MeasuredLinks({}, {}))  # nothing measured any more: static again
    assert table.link_for("inst-a", KDN).source == "static"


def test_a_kdn_is_found_under_each_key_an_instance_may_report():
    assert kdn_keys("10.0.0.5:9101") == ("kdn://10.0.0.5:9101", "10.0.0.5:9101", "http://10.0.0.5:9101")
    assert kdn_keys(" http://10.0.0.5:9101/") == kdn_keys("10.0.0.5:9101") and kdn_keys("") == ()
    for key in kdn_keys(KDN):
        table = LinkTable({key: {"bandwidth_mbps": 50}}, 1000)
        assert table.link_for("i", KDN) == KdnLink(50.0, None, "static"), key
    assert LinkTable(STATIC, 1000).link_for("i", "").source == "default"  # no KDN address


@pytest.mark.parametrize("metrics, expected", [
    ({"bandwidth_mbps": 100, "latency_ms": 1.5, "iface": "eth0"}, KdnLink(100.0, 1.5, "measured")),
    ({"bandwidth_mbps": 100, "rtt_ms": 3}, KdnLink(100.0, 3.0, "measured")),
    ({"bandwidth_mbps": 100, "latency_ms": "fast", "rtt_ms": 3}, KdnLink(100.0, 3.0, "measured")),
    ({"bandwidth_mbps": 100, "latency_ms": -1}, KdnLink(100.0, None, "measured")),
    ({"bandwidth_mbps": 0, "latency_ms": 1}, None),
    ({"bandwidth_mbps": -5}, None),
    ({"bandwidth_mbps": "1000"}, None),
    ({"bandwidth_mbps": True}, None),
    ({"bandwidth_mbps": float("nan")}, None),
    ({"latency_ms": 1}, None),
    ("not a dict", None),
])
def test_a_link_counts_only_with_a_positive_bandwidth(metrics, expected):
    assert links_from({"k": metrics}, "measured").get("k") == expected


def test_the_answer_of_a_bad_shape_is_refused_whole():
    with pytest.raises(msgspec.ValidationError):
        measured_from(b'{"kdn_links": [1, 2]}')
    with pytest.raises(msgspec.DecodeError):
        measured_from(b"<html>")
    assert measured_from(b"{}") == MeasuredLinks({}, {})


# --- the estimate -------------------------------------------------------------------------------

def test_the_estimate_is_rtt_plus_the_kv_over_the_bandwidth():
    link = KdnLink(800.0, 4.0, "measured")
    assert link.transfer_ms(PREDICTORS, 2560) == pytest.approx(4.0 + PREDICTORS.kv_transfer_ms(2560, 800.0))
    assert KdnLink(800.0, None, "static").transfer_ms(PREDICTORS, 2560) == PREDICTORS.kv_transfer_ms(2560, 800.0)
    assert KdnLink(800.0, 4.0, "measured").transfer_ms(PREDICTORS, 0) == 4.0


def _request(knowledge_tokens: int = 4000):
    body = {"Prompt": {"model": "m", "user_prompt": "q" * 200, "token_length": 50},
            "Service": {"Enable_know_injection": True, "Injection_type": "text",
                        "Knowledge_List": ["k1"], "Knowledge_length": knowledge_tokens},
            "Task": {"KDN_server_addr": KDN}}
    return recover(Endpoint.CHAT, json.dumps(body).encode())


def test_iws_decides_by_the_link_it_is_given():
    settings = Settings()
    fast = decide(_request(), 0.0, 0.0, KdnLink(1000.0, 0.0, "default"), PREDICTORS, settings)
    slow = decide(_request(), 0.0, 0.0, KdnLink(100.0, 0.0, "measured"), PREDICTORS, settings)
    far = decide(_request(), 0.0, 0.0, KdnLink(1000.0, 30_000.0, "measured"), PREDICTORS, settings)
    assert fast.mode == "kvcache" and (slow.mode, slow.reason) == ("text", "text_score_better")
    # The whole knowledge's KV moves (4000 tokens), not only the aligned 3840 that spare prefill.
    assert slow.kvcache_total_ms - fast.kvcache_total_ms == pytest.approx(
        PREDICTORS.kv_transfer_ms(4000, 100.0) - PREDICTORS.kv_transfer_ms(4000, 1000.0))
    # Both paths fetch from the KDN, so both pay its RTT (no ready wait to hide it here): a far
    # KDN makes both slower and tips nothing.
    assert far.text_total_ms - fast.text_total_ms == pytest.approx(30_000.0)
    assert far.kvcache_total_ms - fast.kvcache_total_ms == pytest.approx(30_000.0)
    assert far.mode == fast.mode


class _HeldSession:
    """The instance's KV inject, held until `go` is set (so the reservation can be read)."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    def post(self, url: str, json: dict[str, Any], timeout: Any, headers: Any = None) -> Any:
        session = self

        class _Answer:
            status = 200

            async def __aenter__(self) -> _Answer:
                await session.go.wait()
                return self

            async def __aexit__(self, *exc: object) -> None:
                return None

            async def read(self) -> bytes:
                return b'{"ok": true}'

        return _Answer()


class _Upstream:
    def __init__(self) -> None:
        self.session = _HeldSession()


def test_the_kv_reservation_uses_the_same_estimate_and_says_which_link():
    async def run() -> tuple[float, float, Trace]:
        links = LinkTable(STATIC, 1000)
        links.replace(_measured({}, {"inst-a": {f"kdn://{KDN}": {"bandwidth_mbps": 200, "latency_ms": 7}}}))
        upstream = _Upstream()
        preparer = KnowledgePreparer(Settings(), upstream, PREDICTORS, links)
        request, trace, result = _request(2600), Trace(), Knowledge(kv_ready_kids=["k1"])
        instance = InstanceSlot(slot=0, generation=1, instance_id="inst-a", host="127.0.0.1", port=9001,
                                alive=True, registered_at_ms=0, last_seen_ms=0, qps_1m=None)
        started = LinkTimeline.clock()
        task = asyncio.create_task(preparer._kv_inject(request, instance, result, trace))
        await asyncio.sleep(0.05)
        predicted_end = preparer.link("inst-a", KDN).free_at
        upstream.session.go.set()
        await task
        return predicted_end - started, LinkTimeline.clock() - started, trace

    reserved_s, took_s, trace = asyncio.run(run())
    expected_s = (7 + PREDICTORS.kv_transfer_ms(2600, 200.0)) / 1000  # the whole KV, not the aligned 2560
    assert expected_s > 1  # a slow link: far longer than the test takes
    assert expected_s <= reserved_s <= expected_s + took_s
    assert trace.kdn_link_source == "measured" and trace.kvcache_actual_path == "kv_injected"


# --- the refresh ---------------------------------------------------------------------------------

class _Sidecar:
    """A stand-in for the sidecar's route: answers what `reply` says, records the headers."""

    def __init__(self) -> None:
        self.reply: tuple[int, bytes] = (200, b"{}")
        self.authorizations: list[str | None] = []
        self.url = ""

    async def __aenter__(self) -> _Sidecar:
        async def handle(request: web.Request) -> web.Response:
            self.authorizations.append(request.headers.get("Authorization"))
            assert request.query.get("per_instance") == "true"
            status, body = self.reply
            return web.Response(status=status, body=body, content_type="application/json")

        app = web.Application()
        app.router.add_get("/v1/topology/kdn_links", handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = sidecar_links_url(Settings(cp_host="0.0.0.0", cp_port=port, cp_token="t"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def test_the_refresh_replaces_the_table_and_a_failure_keeps_the_last_one(caplog):
    caplog.set_level(logging.INFO, logger="cacheroute.worker")
    measured = {"kdn_links": {f"kdn://{KDN}": {"bandwidth_mbps": 300, "latency_ms": 1}}}

    async def run() -> list[str]:
        table = LinkTable({}, 1000)
        async with _Sidecar() as sidecar, aiohttp.ClientSession() as session:
            refresher = LinkRefresher(table, lambda: session, sidecar.url, "tok", interval_s=5)
            sidecar.reply = (200, json.dumps(measured).encode())
            assert await refresher.refresh()
            assert table.link_for("inst-a", KDN) == KdnLink(300.0, 1.0, "measured")
            seen = [table.link_for("inst-a", KDN).source]
            for reply in ((500, b"{}"), (200, b'{"kdn_links": 7}'), (404, b"")):
                sidecar.reply = reply
                assert not await refresher.refresh()
                seen.append(table.link_for("inst-a", KDN).source)  # the last table stays
            sidecar.reply = (200, b'{"kdn_links": {}}')
            assert await refresher.refresh()
            seen.append(table.link_for("inst-a", KDN).source)
            assert sidecar.authorizations == ["Bearer tok"] * 5
        return seen

    assert asyncio.run(run()) == ["measured", "measured", "measured", "measured", "default"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "500" in warnings[0].getMessage()  # once, not per refresh
    assert sum("answers again" in r.getMessage() for r in caplog.records) == 1


def test_the_refresh_gives_up_on_a_silent_sidecar_within_its_bound():
    async def run() -> tuple[bool, float]:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                refresher = LinkRefresher(LinkTable({}, 1000), lambda: session,
                                          f"http://127.0.0.1:{port}/v1/topology/kdn_links", None,
                                          interval_s=0.3)
                started = time.monotonic()
                return await refresher.refresh(), time.monotonic() - started
        finally:
            server.close()

    ok, took = asyncio.run(run())
    assert not ok and took < 2.0


# --- the settings --------------------------------------------------------------------------------

def test_the_settings_refresh_interval_and_static_links_are_checked_at_start():
    env = {"PROXY_KDN_LINKS_REFRESH_S": "0.5", "PROXY_KDN_LINKS_JSON": json.dumps(STATIC)}
    settings = Settings.from_env(env)
    assert settings.kdn_links_refresh_s == 0.5 and settings.kdn_links == STATIC
    for bad in ({"PROXY_KDN_LINKS_REFRESH_S": "0"},
                {"PROXY_KDN_LINKS_JSON": '{"kdn://a:1": {"bandwidth_mbps": "10G"}}'},
                {"PROXY_KDN_LINKS_JSON": '{"kdn://a:1": {"bandwidth_mbps": 0}}'},
                {"PROXY_KDN_LINKS_JSON": '{"kdn://a:1": {"latency_ms": -2}}'}):
        with pytest.raises((ConfigError, ValueError)) as refused:
            Settings.from_env(bad)
        assert next(iter(bad)) in str(refused.value)
    assert sidecar_links_url(Settings(cp_host="::", cp_port=8002, cp_token="t")) == \
        "http://[::1]:8002/v1/topology/kdn_links?per_instance=true"
