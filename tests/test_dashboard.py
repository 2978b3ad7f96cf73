"""The sidecar's browser dashboard, driven in headless Chromium against a real cluster.

Real supervisor, sidecar, workers and simulated instances (held streams give known inflight);
the page is loaded in a real browser over the DevTools protocol (tests/chromium.py) and what it
shows is read back from the DOM through its data-* attributes.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests.aio import OpenStream
from tests.chromium import Chromium, find_chromium
from tests.harness import chat_body, free_port, get, http, post, wait_until

K = 5
TOKEN = "dashboard-test-token-7f3a"
# An id a registration can carry: had the page used innerHTML, this would add an <img> and run.
NASTY_ID = '<img src=x onerror="window.__pwned=1">&amp;"\''

# One read of everything the assertions need, from the page's data-* attributes.
READ_PAGE = r"""(() => {
  const cells = (tr) => Object.fromEntries([...tr.querySelectorAll('td[data-field]')]
      .map((td) => [td.dataset.field, td.dataset.value !== undefined ? td.dataset.value : td.textContent]));
  const canvas = document.getElementById('chart');
  return {
    state: document.body.dataset.state,
    updates: Number(document.body.dataset.updates),
    epoch: document.getElementById('sidecar-epoch').dataset.value,
    authVisible: !document.getElementById('auth').hidden,
    authMessage: document.getElementById('auth-message').textContent,
    instances: [...document.querySelectorAll('#instances tbody tr[data-instance-id]')].map((tr) => ({
      id: tr.dataset.instanceId, liveness: tr.dataset.liveness, inflight: Number(tr.dataset.inflight),
      shown: tr.querySelector('.id').textContent, fields: cells(tr)})),
    workers: [...document.querySelectorAll('#workers tbody tr[data-pid]')].map((tr) => ({
      pid: Number(tr.dataset.pid), index: Number(tr.dataset.workerIndex), alive: tr.dataset.alive,
      held: Number(tr.dataset.inflightHeld)})),
    channel: Object.fromEntries([...document.querySelectorAll('#channel dd')]
      .map((dd) => [dd.dataset.field, dd.textContent])),
    snapshotAge: document.getElementById('snapshot-age').dataset.value,
    chart: {points: Number(canvas.dataset.points), series: Number(canvas.dataset.series)},
    legend: [...document.querySelectorAll('#legend li')].map((li) => li.dataset.instanceId),
    injected: document.querySelectorAll('main img, main script').length,
    pwned: window.__pwned === 1,
  };
})()"""

# Pixels of the first series' colour (#2457c5) on the canvas: the line was really drawn.
FIRST_SERIES_PIXELS = r"""(() => {
  const c = document.getElementById('chart');
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


def test_dashboard_shows_loads_workers_liveness_and_chart(make_cluster, browser):
    cluster = make_cluster(workers=3, env={"PROXY_INSTANCE_TTL_S": "12"})
    first = cluster.add_instance("--hold-streams")
    second = cluster.add_instance("--hold-streams")
    pids = cluster.worker_pids()
    epoch = cluster.status()["sidecar"]["epoch"]

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
                              and {w["index"]: w["held"] for w in p["workers"]} == per_worker,
                              "the page shows the held streams per instance and per worker")
            _check_live_page(page, pids, epoch, [first.instance_id, second.instance_id])
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


def _check_escaping_and_liveness(cluster, browser: Chromium) -> None:
    """An instance registered by hand with markup in its id, which never heartbeats: shown as
    text, then stale (past half the TTL), then dead (past the TTL)."""
    post(f"{cluster.cp_url}/v1/instance/register",
         {"host": "127.0.0.1", "port": free_port(), "instance_id": NASTY_ID})
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
    assert page["injected"] == 0 and not page["pwned"]


def _check_unhealthy_is_shown(cluster, browser: Chromium) -> None:
    """An instance out because its heartbeat said so is shown unhealthy, not dead, and alive
    again when it says it is healthy."""
    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": free_port(), "instance_id": "sick"})
    post(f"{cluster.cp_url}/v1/instance/heartbeat", {"instance_id": "sick", "healthy": False})
    _wait_page(browser, lambda p: _rows(p).get("sick", {}).get("liveness") == "unhealthy", "sick shown unhealthy")
    post(f"{cluster.cp_url}/v1/instance/heartbeat", {"instance_id": "sick", "healthy": True})
    _wait_page(browser, lambda p: _rows(p).get("sick", {}).get("liveness") == "alive", "sick shown alive again")


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
