"""The sidecar's browser dashboard, driven in headless Chromium against a real cluster.

Real supervisor, sidecar, workers and simulated instances (held streams give known inflight);
the page is loaded in a real browser over the DevTools protocol (tests/chromium.py) and what it
shows is read back from the DOM through its data-* attributes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from cacheroute_proxy.config import Settings
from cacheroute_sim.processes import SupervisorPorts
from tests.aio import OpenStream
from tests.chromium import Chromium, find_chromium
from tests.harness import ROOT, chat_body, free_port, get, http, post, wait_until
from tests.test_e2e_resource_plane import agent_snapshot
from tests.test_scheduler_link import PROXY_ID, SimScheduler

K = 5
TOKEN = "dashboard-test-token-7f3a"
# An id a registration can carry: had the page used innerHTML, this would add an <img> and run.
NASTY_ID = '<img src=x onerror="window.__pwned=1">&amp;"\''
NASTY_KDN = '<svg onload="window.__pwned=1"><b id=x>kdn</b></svg>'

# One read of everything the assertions need, from the page's data-* attributes.
READ_PAGE = r"""(() => {
  const $ = (id) => document.getElementById(id);
  const fields = (node, selector) => Object.fromEntries([...node.querySelectorAll(selector)]
      .map((e) => [e.dataset.field, e.dataset.value !== undefined ? e.dataset.value : e.textContent]));
  const cells = (tr) => fields(tr, 'td[data-field]');
  const chart = $('chart');
  return {
    state: document.body.dataset.state,
    polling: document.body.dataset.polling,
    updates: Number(document.body.dataset.updates),
    requests: Number(document.body.dataset.requests || 0),
    epoch: $('sidecar-epoch').dataset.value,
    authVisible: !$('auth').hidden,
    authMessage: $('auth-message').textContent,
    cards: {health: $('health').dataset.value, scheduler: $('scheduler-state').dataset.value,
            alive: $('pool-alive').dataset.value, stale: $('pool-stale').dataset.value, out: $('pool-dead').dataset.value,
            backlog: $('sum-backlog').dataset.value, count: $('inst-count').textContent},
    instances: [...document.querySelectorAll('#instances tbody tr[data-instance-id]')].map((tr) => ({
      id: tr.dataset.instanceId, liveness: tr.dataset.liveness, inflight: Number(tr.dataset.inflight),
      shown: tr.querySelector('.id').textContent, fields: cells(tr)})),
    emptyRow: document.querySelector('#instances tbody tr.empty') ? document.querySelector('#instances tbody tr.empty').textContent : null,
    resources: [...document.querySelectorAll('#resources .rcard')].map((card) => ({
      id: card.dataset.instanceId, has: card.dataset.hasResource === 'true',
      shown: card.querySelector('.id').textContent, fields: fields(card, '[data-field]'),
      rx: card.querySelector('.net') ? card.querySelector('.net').dataset.rx : null})),
    provenance: [...document.querySelectorAll('#provenance-table tbody tr')].map((tr) => ({
      id: tr.dataset.instanceId, shown: tr.querySelector('.id').textContent,
      total: tr.querySelector('td[data-field=total]').dataset.value,
      segments: [...tr.querySelectorAll('.seg')].map((s) => s.dataset.component)})),
    components: [...document.querySelectorAll('#provenance .components li')].map((li) => li.dataset.component),
    kdn: [...document.querySelectorAll('#kdn-links tbody tr[data-kdn]')].map((tr) => ({
      key: tr.dataset.kdn, shown: tr.querySelector('code').textContent, fields: cells(tr)})),
    scheduler: fields($('scheduler'), 'dd'),
    pool: fields($('pool-resource'), 'dd'),
    workers: [...document.querySelectorAll('#workers tbody tr[data-pid]')].map((tr) => ({
      pid: Number(tr.dataset.pid), index: Number(tr.dataset.workerIndex), alive: tr.dataset.alive,
      held: Number(tr.dataset.inflightHeld)})),
    channel: fields($('channel'), 'dd'),
    snapshotAge: $('snapshot-age').dataset.value,
    chart: {points: Number(chart.dataset.points), series: Number(chart.dataset.series), windowS: chart.dataset.windowS},
    charts: Object.fromEntries([...document.querySelectorAll('.chart')].map((c) => [c.id, {
      points: Number(c.dataset.points), series: Number(c.dataset.series), canvas: !!c.querySelector('canvas')}])),
    legend: [...document.querySelectorAll('#legend li')].map((li) => li.dataset.instanceId),
    raw: $('raw-json').textContent,
    affinityHidden: $('affinity-panel').hidden,
    affinity: $('affinity').textContent,
    injected: document.querySelectorAll('main img, main script, main svg, main b[id], main iframe').length,
    pwned: window.__pwned === 1,
  };
})()"""

# Pixels of the first series' colour (#2457c5) on the inflight chart: the line was really drawn.
FIRST_SERIES_PIXELS = r"""(() => {
  const c = document.querySelector('#chart canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] === 0x24 && d[i + 1] === 0x57 && d[i + 2] === 0xc5) n++;
  return n;
})()"""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    if find_chromium() is None:
        if os.environ.get("CACHEROUTE_REQUIRE_CHROMIUM"):
            pytest.fail("chromium is required here (.ci/run installs it) but is not on PATH")
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    chromium = Chromium(tmp_path / "chromium-profile", tmp_path / "chromium.log")
    try:
        yield chromium
        assert chromium.problems() == [], "the page logged errors"
    finally:
        chromium.close()
        wait_until(lambda: not _live_in_group(chromium.group), 15, message="every chromium process gone")


def _live_in_group(group: int) -> list[int]:
    live = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == group and proc.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return live


def _page(browser: Chromium) -> dict[str, Any]:
    return browser.evaluate(READ_PAGE)


def _wait_page(browser: Chromium, check, message: str, timeout: float = 45) -> dict[str, Any]:
    """Poll the page until `check(page)` is true; the last page read is in the failure."""
    def ready() -> dict[str, Any] | None:
        page = _page(browser)
        return page if check(page) else None
    return wait_until(ready, timeout, interval=0.25, message=message)


def _rows(page: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in page["instances"]}


@pytest.mark.slow
def test_dashboard_shows_every_panel_from_a_live_cluster(make_cluster, browser, tmp_path):
    scheduler = SimScheduler(tmp_path).start()
    try:
        _every_panel(make_cluster, browser, scheduler)
    finally:
        scheduler.stop()


def _every_panel(make_cluster, browser: Chromium, scheduler: SimScheduler) -> None:
    cluster = make_cluster(workers=3, env={"PROXY_INSTANCE_TTL_S": "12", "SCHEDULER_CP_URL": scheduler.url,
                                           "PROXY_ID": PROXY_ID, "PROXY_SCHEDULER_BACKOFF_MAX_S": "1"})
    first = cluster.add_instance("--hold-streams")
    second = cluster.add_instance("--hold-streams")
    ids = [first.instance_id, second.instance_id]
    pids = cluster.worker_pids()
    epoch = cluster.status()["sidecar"]["epoch"]
    # Resource snapshots and topology reports as agents send them.
    for instance_id, cpu in zip(ids, (25.0, 70.0)):
        assert post(f"{cluster.cp_url}/v1/instance/resource_snapshot",
                    agent_snapshot(cpu, instance_id=instance_id)) == {"ok": True}
    for instance_id, kdn, latency in ((ids[0], "kdn-1", 3), (ids[1], "kdn-2", 1)):
        post(f"{cluster.cp_url}/v1/topology/report", {"instance_id": instance_id, "links": {
            kdn: {"bandwidth_mbps": 1000, "latency_ms": latency}}})
    # The ready line tells where the dashboard is (here: on the control plane).
    wait_until(lambda: f"dashboard {cluster.cp_url}/dashboard" in cluster.launcher_log(), 20,
               message=f"the ready line names the dashboard\n{cluster.launcher_log()[-2000:]}")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = [await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
                       for _ in range(K)]
            assert all(s.response.status == 200 for s in streams)
            # What the page must show, from the responses themselves.
            by_instance = collections.Counter(s.response.headers["x-cacheroute-instance"] for s in streams)
            by_worker = collections.Counter(int(re.match(r"w(\d+)-", s.worker).group(1)) for s in streams)
            per_instance = {i.instance_id: by_instance[i.instance_id] for i in (first, second)}
            per_worker = {index: by_worker[index] for index in range(cluster.workers)}
            assert sum(per_instance.values()) == K
            wait_until(lambda: cluster.inflight() == per_instance, 10, message="the sidecar sees the held streams")
            browser.navigate(f"{cluster.cp_url}/dashboard")
            page = _wait_page(browser, lambda p: p["state"] == "live" and p["chart"]["points"] >= 6
                              and {i: r["inflight"] for i, r in _rows(p).items()} == per_instance
                              and {w["index"]: w["held"] for w in p["workers"]} == per_worker
                              and p["cards"]["scheduler"] == "registered",
                              "the page shows the held streams per instance and per worker")
            _check_live_page(page, pids, epoch, ids)
            _check_resources_topology_scheduler(page, cluster, ids)
            browser.screenshot(cluster.tmp_path / "dashboard.png")  # for a look after a failure
            assert browser.evaluate(FIRST_SERIES_PIXELS) > 10, "the first instance's line is on the canvas"
            _check_escaping_and_liveness(cluster, browser)
            _check_unhealthy_is_shown(cluster, browser)
            for inst in (first, second):
                inst.release()
            for stream in streams:
                await stream.finish()
            _wait_page(browser, lambda p: all(_rows(p)[i.instance_id]["inflight"] == 0 for i in (first, second))
                       and all(w["held"] == 0 for w in p["workers"]), "inflight back to 0 on the page")

    asyncio.run(scenario())


def _check_live_page(page: dict[str, Any], pids: dict[int, int], epoch: int, ids: list[str]) -> None:
    rows = _rows(page)
    assert set(ids) <= set(rows), page["instances"]
    for instance_id in ids:
        row = rows[instance_id]
        assert row["liveness"] == "alive" and row["shown"] == instance_id
        assert row["fields"]["inflight"] == str(row["inflight"])
        # Held streams are past admission and decoding: the lanes and the snapshot say so.
        assert row["fields"]["active_ready"] == str(row["inflight"])
        assert row["fields"]["active_decode_count"] == str(row["inflight"])
        assert row["fields"]["predicted_total_backlog_ms"] != ""  # known, even if 0
    assert {w["index"]: w["pid"] for w in page["workers"]} == pids
    assert all(w["alive"] == "true" for w in page["workers"])
    assert page["epoch"] == str(epoch) and page["channel"]["epoch"] == str(epoch)
    assert int(page["channel"]["events_consumed"]) >= K  # one reservation per stream at least
    assert page["channel"]["events_dropped"] == "0"
    assert page["snapshotAge"] != ""
    assert page["chart"]["series"] >= 2 and set(ids) <= set(page["legend"])
    assert page["cards"]["health"] == "ok" and page["cards"]["alive"] == "2" and page["cards"]["out"] == "0"
    assert page["cards"]["backlog"] != ""


def _check_resources_topology_scheduler(page: dict[str, Any], cluster, ids: list[str]) -> None:
    rows = _rows(page)
    assert rows[ids[0]]["fields"]["cpu_util"] == "25" and rows[ids[1]]["fields"]["cpu_util"] == "70"
    assert rows[ids[0]]["fields"]["memory_pct"] == "50" and rows[ids[0]]["fields"]["gpu_util_avg"] == "60"
    cards = {c["id"]: c for c in page["resources"]}
    for instance_id, cpu in zip(ids, ("25", "70")):
        card = cards[instance_id]
        assert card["has"] and card["shown"] == instance_id
        assert card["fields"]["cpu_util"] == cpu and card["fields"]["memory_pct"] == "50"
        assert card["fields"]["gpu_util_avg"] == "60" and card["fields"]["admission_state"] == "accepting"
        assert card["rx"] == "1.5"
    # Score provenance: one row per instance, its total the one /debug/instance_loads gives.
    loads = {r["instance_id"]: r for r in cluster.loads()["instances"]}
    provenance = {r["id"]: r for r in page["provenance"]}
    assert set(ids) <= set(provenance)
    for instance_id in ids:
        score = loads[instance_id]["least_load_score"]
        assert float(provenance[instance_id]["total"]) == pytest.approx(score["total"])
        assert set(provenance[instance_id]["segments"]) == set(score["weighted_components"])
    assert page["components"] == list(loads[ids[0]]["least_load_score"]["weights"])
    links = {link["key"]: link for link in page["kdn"]}
    assert set(links) == {"kdn-1", "kdn-2"}
    assert links["kdn-1"]["fields"]["bandwidth_mbps"] == "1000" and links["kdn-1"]["fields"]["latency_ms"] == "3"
    assert links["kdn-2"]["fields"]["reporters"] == ids[1]
    assert page["scheduler"]["state"] == "registered" and page["scheduler"]["proxy_id"] == PROXY_ID
    assert page["pool"]["proxy_id"] == PROXY_ID and page["pool"]["instances.with_resource"] == "2"
    charts = page["charts"]
    for name in ("chart", "chart-backlog", "chart-queue", "chart-cpu", "chart-memory", "chart-gpu"):
        assert charts[name]["canvas"] and charts[name]["series"] >= 2 and charts[name]["points"] >= 2, name
    assert charts["chart-network"]["series"] >= 4  # rx and tx of each
    assert charts["chart-pool"]["series"] >= 1
    assert page["affinityHidden"]  # nothing to show yet: no empty panel
    raw = json.loads(page["raw"])
    assert {"status", "loads", "workers", "resources", "topology", "pool_resource"} <= set(raw)
    assert set(ids) <= {r["instance_id"] for r in raw["loads"]["instances"]}


def _check_escaping_and_liveness(cluster, browser: Chromium) -> None:
    """An instance registered by hand with markup in its id (and in the KDN key it reports),
    which never heartbeats: shown as text everywhere, then stale (past half the TTL), then dead
    (past the TTL)."""
    post(f"{cluster.cp_url}/v1/instance/register",
         {"host": "127.0.0.1", "port": free_port(), "instance_id": NASTY_ID})
    post(f"{cluster.cp_url}/v1/instance/resource_snapshot", agent_snapshot(5.0, instance_id=NASTY_ID))
    post(f"{cluster.cp_url}/v1/topology/report", {"instance_id": NASTY_ID, "links": {NASTY_KDN: {"bandwidth_mbps": 1}}})
    page = _wait_page(browser, lambda p: NASTY_ID in _rows(p) and any(link["key"] == NASTY_KDN for link in p["kdn"])
                      and NASTY_ID in {c["id"] for c in p["resources"]}, "the markup instance on every panel")
    assert {c["id"]: c["shown"] for c in page["resources"]}[NASTY_ID] == NASTY_ID
    assert {r["id"]: r["shown"] for r in page["provenance"]}[NASTY_ID] == NASTY_ID
    assert {link["key"]: link["shown"] for link in page["kdn"]}[NASTY_KDN] == NASTY_KDN
    assert page["injected"] == 0 and not page["pwned"]
    seen: list[str] = []

    def dead(page: dict[str, Any]) -> bool:
        row = _rows(page).get(NASTY_ID)
        if row is not None and (not seen or seen[-1] != row["liveness"]):
            seen.append(row["liveness"])
        return row is not None and row["liveness"] == "dead"

    page = _wait_page(browser, dead, "the silent instance shown dead", timeout=90)
    assert seen == ["alive", "stale", "dead"], seen
    assert _rows(page)[NASTY_ID]["shown"] == NASTY_ID
    assert NASTY_ID in page["legend"]
    assert page["cards"]["out"] == "1"
    assert page["injected"] == 0 and not page["pwned"]


def _check_unhealthy_is_shown(cluster, browser: Chromium) -> None:
    """An instance out because its heartbeat said so is shown unhealthy, not dead, and alive
    again when it says it is healthy."""
    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": free_port(), "instance_id": "sick"})
    post(f"{cluster.cp_url}/v1/instance/heartbeat", {"instance_id": "sick", "healthy": False})
    _wait_page(browser, lambda p: _rows(p).get("sick", {}).get("liveness") == "unhealthy", "sick shown unhealthy")
    post(f"{cluster.cp_url}/v1/instance/heartbeat", {"instance_id": "sick", "healthy": True})
    _wait_page(browser, lambda p: _rows(p).get("sick", {}).get("liveness") == "alive", "sick shown alive again")


def test_the_affinity_panel_shows_what_the_index_holds(make_cluster, browser):
    cluster = make_cluster(workers=2, strategy="kv_aware")
    inst = cluster.add_instance()
    browser.navigate(f"{cluster.cp_url}/dashboard")
    page = _wait_page(browser, lambda p: p["state"] == "live" and len(p["instances"]) == 1, "the page, live")
    assert page["affinityHidden"]  # the index holds nothing yet
    # The instance's own account of its KV (a heartbeat's resident_keys).
    status, body, _ = http("POST", f"{cluster.cp_url}/v1/instance/heartbeat",
                           {"instance_id": inst.instance_id, "resident_keys": ["k0001", "k0002"]})
    assert status == 200, body
    page = _wait_page(browser, lambda p: not p["affinityHidden"], "the affinity panel shown")
    shown = json.loads(page["affinity"])
    assert shown["instances"][inst.instance_id]["knowledge"] == 2, shown


def test_dashboard_asks_for_the_token_when_debug_reads_require_it(make_cluster, browser, tmp_path):
    token_file = tmp_path / "cp.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cluster = make_cluster(workers=2, env={"PROXY_CP_TOKEN_FILE": str(token_file),
                                           "PROXY_DEBUG_REQUIRES_TOKEN": "1"})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # The page carries no data and is served to anyone; its data endpoints are not.
    status, body, headers = http("GET", f"{cluster.cp_url}/dashboard")
    assert status == 200 and 'id="token-form"' in body
    assert "script-src 'self'" in headers["content-security-policy"]
    assert http("GET", f"{cluster.cp_url}/debug/workers")[0] == 401
    assert http("GET", f"{cluster.cp_url}/debug/dashboard")[0] == 401
    assert get(f"{cluster.cp_url}/debug/dashboard", headers=auth)["ok"]
    assert len(get(f"{cluster.cp_url}/debug/workers", headers=auth)["workers"]) == 2
    for path in ("/dashboard/missing.js", "/dashboard/..%2fapp.py", "/dashboard/%2e%2e%2fdashboard_routes.py"):
        assert http("GET", f"{cluster.cp_url}{path}")[0] == 404, path

    browser.navigate(f"{cluster.cp_url}/dashboard")
    page = _wait_page(browser, lambda p: p["state"] == "unauthorized" and p["authVisible"], "the token field")
    assert page["workers"] == [] and page["updates"] == 0
    browser.screenshot(tmp_path / "dashboard-token.png")

    _submit_token(browser, "wrong-token")
    _wait_page(browser, lambda p: "refused" in p["authMessage"] and p["state"] == "unauthorized",
               "a wrong token refused")

    _submit_token(browser, TOKEN)
    page = _wait_page(browser, lambda p: p["state"] == "live" and len(p["workers"]) == 2, "data with the token")
    assert not page["authVisible"]
    assert {w["index"]: w["pid"] for w in page["workers"]} == cluster.worker_pids()
    assert browser.evaluate("sessionStorage.getItem('cacheroute.dashboard.token')") == TOKEN
    assert browser.evaluate("localStorage.length + document.cookie.length") == 0
    assert TOKEN not in browser.evaluate("document.documentElement.outerHTML")
    # The 401s above are expected console noise; nothing else may have been logged.
    browser.drain_events()
    browser.events[:] = [e for e in browser.events if "401" not in str(e.get("params", {}))]


def _submit_token(browser: Chromium, token: str) -> None:
    browser.evaluate(f"""(() => {{
        document.getElementById('token-input').value = {token!r};
        document.getElementById('token-form').requestSubmit();
    }})()""")


# --- the controls ----------------------------------------------------------------------------
CPU_BY_ID = {"alpha-1": 50.0, "bravo-2": 10.0, "charlie-3": 90.0}


@pytest.mark.slow
def test_dashboard_controls_pause_search_filter_sort_theme_history_copy(make_cluster, browser):
    cluster = make_cluster(workers=1)
    for instance_id, cpu in CPU_BY_ID.items():
        post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": free_port(), "instance_id": instance_id})
        post(f"{cluster.cp_url}/v1/instance/resource_snapshot", agent_snapshot(cpu, instance_id=instance_id))
    browser.page("Network.enable")
    browser.page("Emulation.setFocusEmulationEnabled", enabled=True)  # the clipboard wants a focused page
    browser.call("Browser.grantPermissions", origin=cluster.cp_url,
                 permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
    browser.navigate(f"{cluster.cp_url}/dashboard")
    _wait_page(browser, lambda p: p["state"] == "live" and len(p["instances"]) == 3
               and all(c["has"] for c in p["resources"]), "three instances with their resources")

    _check_pause_stops_polling(browser)
    _check_search_and_filter(browser)
    _check_sort(browser)
    _check_theme(browser)
    _check_history_and_interval(browser)
    _check_raw_and_copy(browser, cluster)


def _click(browser: Chromium, selector: str) -> None:
    browser.evaluate(f"document.querySelector({json.dumps(selector)}).click()")


def _set(browser: Chromium, element_id: str, value: str) -> None:
    """Change a control as a user would: its value, then the input and change events."""
    browser.evaluate(f"""(() => {{ const e = document.getElementById({json.dumps(element_id)});
        e.value = {json.dumps(value)};
        e.dispatchEvent(new Event('input', {{bubbles: true}}));
        e.dispatchEvent(new Event('change', {{bubbles: true}})); }})()""")


def _data_requests(browser: Chromium) -> int:
    """Requests for the data route the browser itself sent (the DevTools network log)."""
    browser.drain_events()
    return sum(1 for e in browser.events if e["method"] == "Network.requestWillBeSent"
               and e["params"]["request"]["url"].endswith("/debug/dashboard"))


def _check_pause_stops_polling(browser: Chromium) -> None:
    wait_until(lambda: _data_requests(browser) >= 3, 20, message="polling")
    _click(browser, "#btn-pause")
    page = _page(browser)
    assert page["polling"] == "paused"
    # Every fetch the page started before the pause has reached the network log...
    wait_until(lambda: _data_requests(browser) == _page(browser)["requests"], 10,
               message="the network log caught up with the page")
    before, updates = _data_requests(browser), _page(browser)["updates"]
    time.sleep(3.5)  # ...and in three and a half polling intervals nothing more is sent.
    assert _data_requests(browser) == before
    assert _page(browser)["updates"] == updates
    assert browser.evaluate("document.getElementById('btn-pause').textContent") == "Resume"
    _click(browser, "#btn-pause")
    wait_until(lambda: _data_requests(browser) >= before + 2, 15, message="polling again after resume")
    assert _page(browser)["polling"] == "on"
    # Refresh while paused: exactly one request.
    _click(browser, "#btn-pause")
    wait_until(lambda: _data_requests(browser) == _page(browser)["requests"], 10, message="settled")
    before = _data_requests(browser)
    _click(browser, "#btn-refresh")
    wait_until(lambda: _data_requests(browser) == before + 1, 10, message="one refresh")
    _check_refresh_while_a_fetch_is_out(browser)
    _click(browser, "#btn-pause")


def _check_refresh_while_a_fetch_is_out(browser: Chromium) -> None:
    """Refresh clicked while a fetch is out (held here by the browser's Fetch domain): one more
    fetch follows it, so what is shown is newer than the click."""
    browser.page("Fetch.enable", patterns=[{"urlPattern": "*/debug/dashboard*"}])
    try:
        _click(browser, "#btn-refresh")
        first = wait_until(lambda: _held_fetch(browser), 10, message="the refresh held")
        _click(browser, "#btn-refresh")  # while the first is out
        browser.page("Fetch.continueRequest", requestId=first)
        second = wait_until(lambda: _held_fetch(browser, after=first), 10, message="a second fetch")
        browser.page("Fetch.continueRequest", requestId=second)
    finally:
        browser.page("Fetch.disable")


def _held_fetch(browser: Chromium, after: str | None = None) -> str | None:
    """The id of the last data request the Fetch domain holds (other than `after`), if any."""
    browser.drain_events()
    held = [e["params"]["requestId"] for e in browser.events if e["method"] == "Fetch.requestPaused"]
    held = [request for request in held if request != after]
    return held[-1] if held else None


def _order(page: dict[str, Any]) -> list[str]:
    return [row["id"] for row in page["instances"]]


def _check_search_and_filter(browser: Chromium) -> None:
    _set(browser, "search", "BRAVO")
    page = _page(browser)
    assert _order(page) == ["bravo-2"] and [c["id"] for c in page["resources"]] == ["bravo-2"]
    assert [r["id"] for r in page["provenance"]] == ["bravo-2"]
    assert page["cards"]["count"] == "showing 1 of 3"
    _set(browser, "search", "127.0.0.1")  # the address is searched too
    assert len(_page(browser)["instances"]) == 3
    _set(browser, "search", "")
    _set(browser, "filter-state", "out")
    page = _page(browser)
    assert page["instances"] == [] and "no instance matches" in page["emptyRow"]
    _set(browser, "filter-state", "alive")
    assert len(_page(browser)["instances"]) == 3
    _set(browser, "filter-state", "all")


def _check_sort(browser: Chromium) -> None:
    by_cpu = sorted(CPU_BY_ID, key=CPU_BY_ID.__getitem__)
    _click(browser, '#instances th[data-sort="cpu_util"]')
    assert _order(_page(browser)) == by_cpu
    assert browser.evaluate("document.querySelector('#instances th[data-sort=cpu_util]').getAttribute('aria-sort')") \
        == "ascending"
    _click(browser, '#instances th[data-sort="cpu_util"]')
    assert _order(_page(browser)) == by_cpu[::-1]
    # The order holds on the next refreshes, and applies to the resource cards too.
    updates = _page(browser)["updates"]
    page = _wait_page(browser, lambda p: p["updates"] >= updates + 2, "two more refreshes")
    assert _order(page) == by_cpu[::-1] and [c["id"] for c in page["resources"]] == by_cpu[::-1]
    _click(browser, '#instances th[data-sort="instance_id"]')
    _click(browser, '#instances th[data-sort="instance_id"]')
    assert _order(_page(browser)) == sorted(CPU_BY_ID, reverse=True)


BACKGROUND = "getComputedStyle(document.body).backgroundColor"


def _check_theme(browser: Chromium) -> None:
    assert browser.evaluate("document.documentElement.dataset.theme") == "light"
    light = browser.evaluate(BACKGROUND)
    _click(browser, "#btn-theme")
    assert browser.evaluate("document.documentElement.dataset.theme") == "dark"
    dark = browser.evaluate(BACKGROUND)
    assert dark != light and dark == "rgb(14, 19, 28)", (light, dark)
    assert json.loads(browser.evaluate("localStorage.getItem('cacheroute.dashboard.prefs')"))["theme"] == "dark"
    _click(browser, "#btn-theme")
    assert browser.evaluate(BACKGROUND) == light


def _check_history_and_interval(browser: Chromium) -> None:
    _set(browser, "history", "30")
    assert _page(browser)["chart"]["windowS"] == "30"
    _set(browser, "history", "900")
    assert _page(browser)["chart"]["windowS"] == "900"
    _set(browser, "interval", "5000")
    assert json.loads(browser.evaluate("localStorage.getItem('cacheroute.dashboard.prefs')"))["intervalMs"] == 5000
    _set(browser, "interval", "1000")


def _check_raw_and_copy(browser: Chromium, cluster) -> None:
    _set(browser, "raw-source", "topology")
    assert json.loads(_page(browser)["raw"]) == {"kdn_links": {}, "per_instance": {}, "configured": {}}
    _set(browser, "raw-source", "resources")
    shown = json.loads(_page(browser)["raw"])
    assert {r["instance_id"]: r["resource"]["cpu_util"] for r in shown} == CPU_BY_ID
    _click(browser, "#raw-copy")
    wait_until(lambda: browser.evaluate("document.getElementById('raw-copied').dataset.copied") == "resources", 10,
               message="copied")
    copied = json.loads(browser.evaluate("navigator.clipboard.readText()"))
    assert {r["instance_id"] for r in copied} == set(CPU_BY_ID)
    _click(browser, "#raw-copy-all")
    wait_until(lambda: browser.evaluate("document.getElementById('raw-copied').dataset.copied") == "all", 10,
               message="copied all")
    assert {"status", "loads", "resources", "topology"} <= set(json.loads(browser.evaluate("navigator.clipboard.readText()")))


# --- where it is served ----------------------------------------------------------------------
def test_proxy_ui_listen_serves_the_dashboard_and_only_it(make_cluster, browser):
    port = free_port()
    published = f"http://dash.localtest:{port}/"
    cluster = make_cluster(workers=1, env={"PROXY_UI_LISTEN": f"127.0.0.1:{port}", "PROXY_UI_URL": published})
    wait_until(lambda: f"dashboard {published}" in cluster.launcher_log(), 20,
               message=f"the ready line prints PROXY_UI_URL\n{cluster.launcher_log()[-2000:]}")
    ui = f"http://127.0.0.1:{port}"
    status, body, _ = http("GET", f"{ui}/")  # the original's address: redirected to the page
    assert status == 200 and 'id="token-form"' in body
    assert http("GET", f"{ui}/dashboard/vendor/uPlot.iife.min.js")[0] == 200
    assert get(f"{ui}/debug/dashboard")["status"]["sidecar"]["epoch"] == cluster.status()["sidecar"]["epoch"]
    # Nothing else of the control plane: no writes, no other reads.
    for method, path in (("POST", "/v1/instance/register"), ("POST", "/v1/instance/heartbeat"),
                         ("GET", "/debug/status"), ("GET", "/v1/instance/list"), ("GET", "/healthz")):
        assert http(method, f"{ui}{path}", {"host": "127.0.0.1", "port": 1} if method == "POST" else None)[0] \
            in (404, 405), path
    # No token configured: the control plane's Host rule holds (its own names and PROXY_UI_URL's).
    assert http("GET", f"{ui}/dashboard", headers={"Host": "evil.example"})[0] == 421
    assert http("GET", f"{ui}/dashboard", headers={"Host": f"dash.localtest:{port}"})[0] == 200
    cluster.add_instance()
    # A system in dark mode gets the dark theme until the user picks one (nothing stored).
    browser.page("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": "dark"}])
    browser.navigate(f"{ui}/dashboard")
    page = _wait_page(browser, lambda p: p["state"] == "live" and len(p["instances"]) == 1, "the page on PROXY_UI_LISTEN")
    assert page["instances"][0]["id"] == cluster.instances[0].instance_id
    assert browser.evaluate("document.documentElement.dataset.theme") == "dark"
    assert browser.evaluate("localStorage.length") == 0


def test_a_busy_proxy_ui_listen_port_fails_the_start_naming_it(tmp_path):
    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        ports = SupervisorPorts(1, "cacheroute_test")
        done = subprocess.run([sys.executable, "-m", "cacheroute_proxy", "run"], cwd=ROOT,
                              env={**os.environ, **ports.supervisor_env("round_robin"), "PROXY_UI_LISTEN": address},
                              capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert done.returncode != 0
    assert f"cannot bind the dashboard (PROXY_UI_LISTEN) on {address}: another process listens there" \
        in done.stderr, done.stderr
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")


def test_proxy_ui_settings_are_checked_and_name_the_dashboard_url():
    assert Settings.from_env({}).dashboard_url == "http://127.0.0.1:8002/dashboard"
    assert Settings.from_env({"PROXY_UI_LISTEN": "127.0.0.1:8202"}).dashboard_url == "http://127.0.0.1:8202/"
    assert Settings.from_env({"PROXY_UI_LISTEN": "127.0.0.1:8202",
                              "PROXY_UI_URL": "http://ui.example/"}).dashboard_url == "http://ui.example/"
    for env, words in (({"PROXY_UI_LISTEN": "8202"}, "HOST:PORT"),
                       ({"PROXY_UI_LISTEN": "127.0.0.1:8002"}, "already the control plane"),
                       ({"PROXY_UI_LISTEN": "0.0.0.0:8202"}, "needs a token"),
                       ({"PROXY_UI_URL": "ui.example:8202"}, "http(s) URL")):
        with pytest.raises(ValueError) as error:
            Settings.from_env(env)
        assert str(error.value).startswith(next(iter(env))) and words in str(error.value), error.value
    assert Settings.from_env({"PROXY_UI_LISTEN": "0.0.0.0:8202", "PROXY_CP_TOKEN": "t"}).ui_address == ("0.0.0.0", 8202)
