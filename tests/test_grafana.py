"""deploy/grafana/cacheroute-proxy.json against a live `/metrics`.

The dashboard's structure is checked (schema version, the `datasource` and `instance`
variables, every panel with a datasource, a grid position and PromQL targets); then every
series selector each expression uses is taken out of the PromQL (functions, `by (...)`
clauses, range selectors and numbers stripped; the label matchers kept) and matched against
the samples of a real cluster's `/metrics` after traffic that makes every family appear: a
non-streaming request retried away from a failing instance (retry + ejection), a 400, streams
(TTFT), one held while another waits for admission, and a 429 from a full queue. A selector
with no matching sample fails the test, and so does a label its `by (...)` groups on that the
series do not carry. The `/metrics` text itself is checked line by line and against the
Prometheus naming conventions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.aio import OpenStream
from tests.harness import ROOT, chat_body, http, wait_until

REPORT_ENV = "CACHEROUTE_GRAFANA_REPORT"

DASHBOARD = ROOT / "deploy" / "grafana" / "cacheroute-proxy.json"
# What Grafana puts in place of its variables when the test evaluates an expression.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$instance": ".*"}


# --- PromQL: the series selectors of an expression ----------------------------------------------
@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str

    def matches(self, labels: dict[str, str]) -> bool:
        actual = labels.get(self.label, "")  # an absent label is the empty string in PromQL
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        found = re.fullmatch(self.value, actual) is not None  # PromQL regexes are anchored
        return found if self.op == "=~" else not found


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...]
    has_range: bool

    def __str__(self) -> str:
        inner = ", ".join(f'{m.label}{m.op}"{m.value}"' for m in self.matchers)
        return f"{self.metric}{{{inner}}}" if inner else self.metric


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels of by/without/on/ignoring clauses


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}
_TOKENS = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<clause>\b(?:by|without|on|ignoring|group_left|group_right))\s*\((?P<labels>[^)]*)\)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?P<matchers>\{[^}]*\})?\s*(?P<range>\[[^\]]*\])?\s*(?P<call>\(|(?=(?:by|without)\s*\())?
  | (?P<bare>\{[^}]*\})
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_query(expr: str) -> Query:
    """The selectors and grouping labels of a PromQL expression (the subset dashboards use)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    query = Query()
    for token in _TOKENS.finditer(expr):
        if token["clause"]:
            query.grouping |= {label.strip() for label in token["labels"].split(",") if label.strip()}
        elif token["bare"]:
            raise ValueError(f"a selector without a metric name in {expr!r}")
        elif token["name"] and token["call"] is None and token["name"] not in _KEYWORDS:
            query.selectors.append(Selector(token["name"], _matchers(token["matchers"] or "{}"),
                                            token["range"] is not None))
    return query


def _matchers(block: str) -> tuple[Matcher, ...]:
    inner, found, position = block[1:-1], [], 0
    while inner[position:].strip():
        match = _MATCHER.match(inner, position)
        if match is None:
            raise ValueError(f"cannot read the label matchers {block!r}")
        found.append(Matcher(match[1], match[2], match[3]))
        position = match.end()
    return tuple(found)


def test_the_promql_reader_finds_names_matchers_and_grouping():
    query = parse_query('histogram_quantile(0.99, sum by (le, route) (rate('
                        'cacheroute_x_seconds_bucket{instance_id=~"$instance", status!="200"}[$__rate_interval]))) '
                        '/ on (route) group_left max without (job) (cacheroute_up)')
    assert [str(s) for s in query.selectors] == [
        'cacheroute_x_seconds_bucket{instance_id=~".*", status!="200"}', "cacheroute_up"]
    assert [s.has_range for s in query.selectors] == [True, False]
    assert query.grouping == {"le", "route", "job"}
    with pytest.raises(ValueError):
        parse_query('sum({instance_id="a"})')


# --- /metrics: samples, families, conventions --------------------------------------------------
@dataclass
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]
    family_of: dict[str, tuple[str, str]]  # sample name -> (family name, type)

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def matching(self, selector: Selector) -> list[dict[str, str]]:
        return [labels for name, labels, _ in self.samples
                if name == selector.metric and all(m.matches(labels) for m in selector.matchers)]

    def labels_of(self, metric: str) -> set[str]:
        return {label for name, labels, _ in self.samples if name == metric for label in labels}


_LINE = re.compile(r'^(?:# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .+'
                   r'|# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (?:counter|gauge|histogram|summary|untyped)'
                   r'|[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})?'
                   r' (?:[-+]?(?:\d+(?:\.\d*)?(?:e[-+]?\d+)?|Inf|NaN)))$')
_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
# Prometheus attaches these to every scraped series: exposing them would rename ours.
_TARGET_LABELS = {"instance", "job"}


def parse_metrics(text: str) -> Scrape:
    """`text` parsed strictly: every line well-formed, one HELP and TYPE per family, then the
    prometheus_client parser; and the naming conventions checked per family."""
    bad = [line for line in text.splitlines() if line and not _LINE.match(line)]
    assert not bad, f"malformed /metrics lines: {bad[:5]}"
    _check_families(text)
    samples, family_of = [], {}
    for family in text_string_to_metric_families(text):
        _check_conventions(family)
        for sample in family.samples:
            samples.append((sample.name, dict(sample.labels), sample.value))
            family_of[sample.name] = (family.name, family.type)
    return Scrape(samples, family_of)


_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def _check_families(text: str) -> None:
    """As exposed: each family's HELP and TYPE once, before its samples; a counter named
    `..._total`; every sample named as its family's type says."""
    typed: dict[str, str] = {}
    helped: set[str] = set()
    current: tuple[str, str] | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in helped, f"{name}: HELP twice"
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in typed, f"{name}: TYPE twice"
            assert name in helped, f"{name}: TYPE without HELP"
            assert kind != "counter" or name.endswith("_total"), f"counter {name} does not end in _total"
            typed[name] = kind
            current = (name, kind)
        elif line:
            sample = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)[0]  # type: ignore[index]
            assert current is not None, f"{sample}: a sample before any TYPE"
            assert sample in {current[0] + suffix for suffix in _SUFFIXES.get(current[1], ())}, \
                f"{sample}: not a sample of the {current[1]} {current[0]}"


def _check_conventions(family: Any) -> None:
    name, kind = family.name, family.type
    assert name.startswith("cacheroute_"), f"{name}: no cacheroute_ prefix"
    assert family.documentation.strip(), f"{name}: no HELP text"
    assert kind in ("counter", "gauge", "histogram"), f"{name}: type {kind}"
    assert not re.search(r"_(ms|milliseconds|us|microseconds|minutes|hours|kb|mb|kilobytes|megabytes)(_|$)", name), \
        f"{name}: not in a base unit (seconds, bytes)"
    if kind == "gauge":
        assert not re.search(r"_(total|count|sum|bucket)$", name), f"gauge {name}: a counter/histogram suffix"
    for sample in family.samples:
        for label in sample.labels:
            assert label == "le" and kind == "histogram" or _LABEL.match(label), f"{sample.name}: label {label}"
            assert label not in _TARGET_LABELS, f"{sample.name}: label {label} is Prometheus' target label"
    if kind == "histogram":
        _check_buckets(family)


def _check_buckets(family: Any) -> None:
    series: dict[tuple, dict[str, Any]] = {}
    for sample in family.samples:
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": []})
        if sample.name.endswith("_bucket"):
            entry["buckets"].append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_count"):
            entry["count"] = sample.value
    for key, entry in series.items():
        buckets = sorted(entry["buckets"])
        assert buckets and math.isinf(buckets[-1][0]), f"{family.name}{key}: no +Inf bucket"
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), f"{family.name}{key}: buckets not cumulative"
        assert counts[-1] == entry.get("count"), f"{family.name}{key}: +Inf bucket != _count"


# --- the dashboard ---------------------------------------------------------------------------
def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queried_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, those inside collapsed rows too."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def test_the_dashboard_is_an_importable_grafana_dashboard():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["datasource"]["uid"] == "${datasource}"
    assert re.fullmatch(r"label_values\((cacheroute_\w+), instance_id\)", instance["definition"])
    assert instance["query"]["query"] == instance["definition"] and instance["includeAll"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
    for panel in queried_panels(dashboard):
        title = panel["title"]
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}, title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"] and panel.get("description"), title
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), title
            assert parse_query(target["expr"]).selectors, f"{title}: {target['expr']} selects nothing"


def check_dashboard(dashboard: dict[str, Any], scrape: Scrape) -> tuple[list[str], list[str]]:
    """(report lines, problems): every selector of every panel against the scrape."""
    report, problems = [], []
    for panel in queried_panels(dashboard):
        for target in panel["targets"]:
            query = parse_query(target["expr"])
            for selector in query.selectors:
                where = f"{panel['title']} [{target['refId']}]"
                matched = scrape.matching(selector)
                family = scrape.family_of.get(selector.metric, ("?", "?"))
                if selector.metric not in scrape.names():
                    problems.append(f"{where}: {selector.metric} is not in /metrics")
                elif not matched:
                    problems.append(f"{where}: no series matches {selector}")
                if selector.has_range and family[1] not in ("counter", "histogram", "?"):
                    problems.append(f"{where}: rate/increase over the {family[1]} {selector.metric}")
                missing = query.grouping - scrape.labels_of(selector.metric) - {"job", "instance"}
                if selector.metric in scrape.names() and missing:
                    problems.append(f"{where}: {selector.metric} has no label {sorted(missing)}")
                report.append(f"{'ok ' if matched else 'MISSING'} {len(matched):3d} series  "
                              f"{str(selector):100s} {family[1]:9s} {where}")
    return report, problems


# --- the live cluster -----------------------------------------------------------------------------
def scrape(url: str) -> Scrape:
    status, text, headers = http("GET", f"{url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), text
    return parse_metrics(text)


def gauge(url: str, name: str, instance_id: str) -> float:
    for sample, labels, value in scrape(url).samples:
        if sample == name and labels.get("instance_id") == instance_id:
            return value
    return -1.0


def test_every_series_the_dashboard_queries_is_in_a_live_metrics(make_cluster):
    # One ready lane and a one-request queue per instance: a held stream plus a waiting one
    # fill them, and the next request is a 429. One failure ejects (for longer than the test).
    cluster = make_cluster(workers=2, env={"READY_CONCURRENCY": "1", "PROXY_MAX_QUEUE_PER_INSTANCE": "1",
                                           "PROXY_EJECT_AFTER_FAILURES": "1", "PROXY_EJECT_S": "120",
                                           "PROXY_RETRY_ATTEMPTS": "1"})
    good = cluster.add_instance("--hold-streams")
    bad = cluster.add_instance("--fail-status", "503")
    proxy = cluster.worker_url(0)
    url = f"{proxy}/v1/chat/completions"
    # Round robin over two: within two requests one goes to the failing instance, is retried
    # on the other (200) and ejects the failing one from this worker.
    for _ in range(2):
        assert http("POST", url, chat_body(stream=False))[0] == 200
    assert http("POST", url, raw=b"not json")[0] == 400

    async def traffic() -> None:
        async with aiohttp.ClientSession() as session:
            held = await OpenStream.open(session, url, chat_body())  # its first token: a TTFT
            assert held.response.status == 200
            waiting = asyncio.create_task(session.post(url, json=chat_body()))
            await asyncio.to_thread(wait_until, lambda: gauge(proxy, "cacheroute_instance_ready_queue_depth",
                                                              good.instance_id) >= 1,
                                    10, message="a stream waiting for admission")
            status, body, _ = await asyncio.to_thread(http, "POST", url, chat_body(stream=False))
            assert status == 429 and body["error"] == "queue_full", body
            good.configure(hold_streams=False)
            good.release()
            await held.finish()
            second = await asyncio.wait_for(waiting, 10)
            assert second.status == 200
            await asyncio.wait_for(second.read(), 10)
            second.close()

    asyncio.run(traffic())
    # Worker 1 served nothing: what it reports is every worker's sum. A request is counted as
    # its worker finishes it, which may be just after its client read the answer.
    ok = (("instance_id", good.instance_id), ("route", "chat/completions"), ("status", "200"))
    wait_until(lambda: _value(scrape(cluster.worker_url(1)), "cacheroute_requests_total", ok) >= 4, 10,
               message="the answered requests counted")
    live = scrape(cluster.worker_url(1))
    report, problems = check_dashboard(load_dashboard(), live)
    if os.environ.get(REPORT_ENV):  # the list of series checked, for a reader
        Path(os.environ[REPORT_ENV]).write_text("\n".join(report) + "\n")
    assert not problems, "\n".join(problems)
    _assert_counted_once(live, good.instance_id, bad.instance_id)

    # The check can fail: a panel querying an unknown name, or a label the series lack.
    broken = load_dashboard()
    broken["panels"].append({"id": 999, "type": "timeseries", "title": "bogus", "gridPos": {}, "targets": [
        {"refId": "A", "expr": 'sum by (instance) (rate(cacheroute_no_such_thing_total[5m]))'},
        {"refId": "B", "expr": 'sum by (instance_name) (cacheroute_instance_inflight)'},
        {"refId": "C", "expr": 'rate(cacheroute_instance_inflight[5m])'}]})
    _, problems = check_dashboard(broken, live)
    assert problems == ["bogus [A]: cacheroute_no_such_thing_total is not in /metrics",
                        "bogus [B]: cacheroute_instance_inflight has no label ['instance_name']",
                        "bogus [C]: rate/increase over the gauge cacheroute_instance_inflight"], problems


# What the dashboard queries that can only exist once an instance is registered: every series of
# these carries the instance's id. Everything else it queries is exported from the start.
PER_INSTANCE = {
    "cacheroute_time_to_first_token_seconds_bucket", "cacheroute_retries_total",
    "cacheroute_outlier_ejections_total", "cacheroute_admission_rejections_total",
    "cacheroute_instance_alive", "cacheroute_instance_inflight", "cacheroute_instance_active_prepare",
    "cacheroute_instance_prepare_queue_depth", "cacheroute_instance_active_ready",
    "cacheroute_instance_ready_queue_depth", "cacheroute_instance_predicted_backlog_seconds",
    "cacheroute_instance_pending_prefills", "cacheroute_instance_active_decodes",
}


# Statuses answered only once an instance was chosen (a 429 is its queue's).
STATUSES_ON_AN_INSTANCE_ONLY = {"200", "429", "502", "504"}


def _needs_an_instance(selector: Selector) -> bool:
    return selector.metric in PER_INSTANCE or any(
        m.label == "status" and m.op == "=" and m.value in STATUSES_ON_AN_INSTANCE_ONLY for m in selector.matchers)


def _selectors(dashboard: dict[str, Any]) -> list[Selector]:
    return [selector for panel in queried_panels(dashboard) for target in panel["targets"]
            for selector in parse_query(target["expr"]).selectors]


def test_a_fresh_proxy_exports_every_series_the_dashboard_queries_at_zero(make_cluster):
    """Prometheus' advice, avoid missing metrics: a healthy proxy that has seen no retry,
    ejection, admission rejection or stream yet shows 0 on those panels, not "No data". Every
    series whose label values are known is exported at 0 from the start; an instance's as soon
    as it registers. The selectors come from the dashboard itself, so the test follows it."""
    cluster = make_cluster(workers=2)
    url = cluster.worker_url(1)
    fresh = wait_until(lambda: scrape(url) if "cacheroute_pressure_snapshot_age_seconds" in scrape(url).names()
                       else None, 10, message="the sidecar's first pressure snapshot")
    selectors = _selectors(load_dashboard())
    unmatched = {str(selector) for selector in selectors if not fresh.matching(selector)}
    assert unmatched == {str(selector) for selector in selectors if _needs_an_instance(selector)}, unmatched
    assert all(value == 0 for name, _, value in fresh.samples if not name.startswith("cacheroute_pressure")), \
        [s for s in fresh.samples if s[2]]
    requests = {(labels["route"], labels["status"]) for name, labels, _ in fresh.samples
                if name == "cacheroute_requests_total" and labels["instance_id"] == ""}
    assert requests == {(route, status) for route in ("chat/completions", "completions")
                        for status in ("400", "405", "413", "422", "499", "503")}

    instance = cluster.add_instance()

    def every_selector_matched() -> Scrape | None:
        live = scrape(url)
        return live if not check_dashboard(load_dashboard(), live)[1] else None
    live = wait_until(every_selector_matched, 10, message="every series the dashboard queries")
    counted = [(name, labels, value) for name, labels, value in live.samples
               if not name.startswith(("cacheroute_instance_", "cacheroute_pressure"))]
    assert counted and all(value == 0 for _, _, value in counted), [s for s in counted if s[2]]
    assert ("cacheroute_admission_rejections_total", {"instance_id": instance.instance_id, "reason": "queue_timeout"},
            0.0) in live.samples


def _value(live: Scrape, name: str, labels: tuple[tuple[str, str], ...]) -> float:
    return next((value for sample, sample_labels, value in live.samples
                 if sample == name and tuple(sorted(sample_labels.items())) == labels), 0.0)


def _assert_counted_once(live: Scrape, good: str, bad: str) -> None:
    """What the traffic above did, each thing counted once, under the instance it concerns."""
    values = {(name, tuple(sorted(labels.items()))): value for name, labels, value in live.samples}
    route = ("route", "chat/completions")
    assert values[("cacheroute_retries_total", (("instance_id", bad), route))] == 1
    assert values[("cacheroute_outlier_ejections_total", (("instance_id", bad),))] == 1
    assert values[("cacheroute_admission_rejections_total", (("instance_id", good), ("reason", "queue_full")))] == 1
    assert values[("cacheroute_requests_total", (("instance_id", good), route, ("status", "429")))] == 1
    assert values[("cacheroute_requests_total", (("instance_id", ""), route, ("status", "400")))] == 1
    assert values[("cacheroute_requests_total", (("instance_id", good), route, ("status", "200")))] == 4
    assert values[("cacheroute_time_to_first_token_seconds_count", (("instance_id", good), route))] == 2
    assert values[("cacheroute_event_channel_dropped_events_total", ())] == 0
    assert not any(name == "cacheroute_requests_total" and dict(labels)["instance_id"] == bad and value
                   for (name, labels), value in values.items()), \
        "the retried request is counted under the instance that answered"


def test_the_conventions_check_refuses_what_it_should():
    good = ("# HELP cacheroute_x_seconds a time\n# TYPE cacheroute_x_seconds gauge\n"
            'cacheroute_x_seconds{instance_id="a"} 1.0\n')
    assert parse_metrics(good).names() == {"cacheroute_x_seconds"}
    for bad in (good.replace("x_seconds", "x_ms"), good.replace("instance_id", "instance"),
                good.replace("x_seconds", "x_count"), good.replace('"a"} 1.0', '"a"} one'),
                "# HELP cacheroute_n things\n# TYPE cacheroute_n counter\ncacheroute_n 1.0\n"):
        with pytest.raises(AssertionError):
            parse_metrics(bad)
