"""Property-based fuzz of both planes against real processes (hypothesis).

One cluster for the module: the supervisor with the sidecar and 2 workers, one simulated
instance (`--time-scale 0.02`) and a simulated KDN, instance table capacity 8. Properties:

* data plane: generated bodies (valid, mutated, wrong endpoint, non-object, random bytes,
  truncated, invalid UTF-8, lone surrogates, trailing garbage, nested garbage, megabyte pads)
  on the shared port and both private ports, one at a time and in concurrent bursts with
  client disconnects. Per request: never a 5xx other than 502/503/504, and not even those for
  a valid body (200, a complete stream); every non-2xx is `{"error": str, "detail": str}`;
  refusals name the field; every response names its worker; nothing hangs (10 s client
  timeout). After every example the counters are back to 0.
* control plane: sequences of register / heartbeat / unregister / garbage against a model of
  the table: never a 5xx, invalid -> 4xx naming a field and nothing changes, valid registers
  are listed (control plane and every worker agree on id, slot, generation), 507 exactly when
  the table is full, unregistering leaves only the fixture's instance.
* cross plane: every host the control plane accepts can be routed to (502 at worst, no 500).
* after the run: inflight and every queue lane 0 everywhere, every worker's
  /debug/instance_loads agrees with the control plane's, no worker restarted, no audit
  correction.

Reproducible: `derandomize=True` (examples depend only on this source) and no example
database. Longer runs:

    FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz.py -q -p no:cacheprovider \\
        -o timeout=3600                          # every property gets 2000 examples
    FUZZ_SEED=123 .venv/bin/python -m pytest tests/test_fuzz.py -q   # other examples than CI's

Bugs found are kept below as regression tests (they were strict xfails until fixed)
and the exclusion.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import select
import socket
import tempfile
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, note, seed, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from cacheroute_proxy.instance_wire import Capabilities, fingerprint
from tests import fuzz_strategies as fz
from tests.harness import (
    Cluster,
    Process,
    SimInstance,
    free_port,
    get,
    http,
    wait_until,
)

# One parallel test worker runs them all: they share the module's cluster, and the
# last test checks it after all the others.
pytestmark = pytest.mark.xdist_group(__name__)

CAPACITY = 8
FIXTURE_ID = "fuzz-sim"
CLIENT_TIMEOUT_S = 10.0
UPSTREAM_5XX = {502, 503, 504}        # the proxy's only 5xx for upstream conditions
WORKER_RE = re.compile(r"w\d+-pid\d+")
LANES = ("active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth")
CLUSTER_ENV = {
    "PROXY_SHM_INSTANCE_CAPACITY": str(CAPACITY),
    # Bound every wait well below the client timeout, so a stuck request is a documented 503
    # (queue_timeout) instead of a client-side hang, and a dead KDN costs at most 2 s.
    "PROXY_QUEUE_TIMEOUT_S": "6",
    "PROXY_KDN_TIMEOUT_S": "2",
    "PROXY_KV_INJECT_TIMEOUT_S": "3",
    "PROXY_UPSTREAM_CONNECT_TIMEOUT_S": "1",
    "PROXY_LOG_LEVEL": "warning",
}

# Hypothesis keeps a cache (.hypothesis/) in the working directory by default; this module
# uses no example database, so keep that out of the (shared) checkout.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"cacheroute-hypothesis-{os.getuid()}")

_SCALE = os.environ.get("FUZZ_EXAMPLES")
_SEED = os.environ.get("FUZZ_SEED")


def fuzz(default_examples: int):  # type: ignore[no-untyped-def]
    """hypothesis settings for one property: bounded, reproducible, no example database."""
    examples = int(_SCALE) if _SCALE else default_examples
    config = settings(max_examples=examples, deadline=None, derandomize=_SEED is None, database=None,
                      print_blob=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                              HealthCheck.filter_too_much])

    def wrap(test):  # type: ignore[no-untyped-def]
        test = config(test)
        return seed(int(_SEED))(test) if _SEED else test
    return wrap


# --- the cluster -----------------------------------------------------------------------------------
@dataclass
class Env:
    cluster: Cluster
    sim: SimInstance
    kdn_addr: str
    closed_port: int
    pids: dict[int, int]

    @property
    def targets(self) -> list[str]:
        return [self.cluster.dp_url] + [self.cluster.worker_url(i) for i in range(self.cluster.workers)]

    @property
    def cp(self) -> str:
        return self.cluster.cp_url


@pytest.fixture(scope="module")
def env(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("fuzz")
    cluster = Cluster(tmp, workers=2, env=CLUSTER_ENV)
    kdn: Process | None = None
    # Bound, never listening, held for the module: connections to it are refused, and no server
    # started later can take the port (a port merely found free once could be reused).
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        cluster.start()
        kdn_port = free_port()
        kdn = Process(["-m", "cacheroute_sim.kdn", "--host", "127.0.0.1", "--port", str(kdn_port), "--time-scale", "0.02"],
                      {}, tmp / "kdn.log")
        wait_until(lambda: get(f"http://127.0.0.1:{kdn_port}/healthz", timeout=1), 20, message="sim KDN up")
        sim = cluster.add_instance(time_scale=0.02, instance_id=FIXTURE_ID)
        yield Env(cluster, sim, f"127.0.0.1:{kdn_port}", closed.getsockname()[1], cluster.worker_pids())
    finally:
        closed.close()
        if kdn is not None:
            kdn.stop()
        cluster.stop()
    assert not os.path.exists(f"/dev/shm{cluster.shm_name}"), "segment left behind"


# --- observations -----------------------------------------------------------------------------------
def send(url: str, raw: bytes, timeout: float = CLIENT_TIMEOUT_S) -> tuple[int, Any, dict[str, str]]:
    try:
        return http("POST", url, raw=raw, timeout=timeout)
    except (TimeoutError, urllib.error.URLError) as exc:
        if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, TimeoutError):
            raise
        raise AssertionError(f"POST {url} ({len(raw)} bytes) hung: no answer within {timeout}s") from exc


def loads_by_source(env: Env) -> dict[str, list[dict[str, Any]]]:
    """Every instance row as the control plane and each worker see it."""
    sources = {"sidecar": get(f"{env.cp}/debug/instance_loads", timeout=5)["instances"]}
    for index in range(env.cluster.workers):
        sources[f"w{index}"] = get(f"{env.cluster.worker_url(index)}/debug/instance_loads", timeout=5)["instances"]
    return sources


def identity(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["instance_id"], row["slot"], row["slot_generation"], row["is_alive"], row["inflight"])


def quiescence_problems(env: Env, extra_lanes: tuple[str, ...] = ()) -> list[str]:
    problems = []
    sources = loads_by_source(env)
    listed = {(r["instance_id"], r["slot"], r["slot_generation"], r["is_alive"], r["load"]["inflight"])
              for r in get(f"{env.cp}/v1/instance/list?include_dead=true", timeout=5)}
    for name, rows in sources.items():
        for row in rows:
            busy = {k: row[k] for k in ("inflight", *LANES, *extra_lanes) if row[k] != 0}
            if busy:
                problems.append(f"{name}: {row['instance_id']} not idle: {busy}")
        if {identity(r) for r in rows} != listed:
            problems.append(f"{name} disagrees with /v1/instance/list: {sorted(map(identity, rows))} vs {sorted(listed)}")
    return problems


def wait_quiescent(env: Env, timeout: float = 3.0, extra_lanes: tuple[str, ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        problems = quiescence_problems(env, extra_lanes)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not problems, f"not quiescent after {timeout:g}s:\n" + "\n".join(problems)


def assert_error_shape(status: int, body: Any, headers: dict[str, str], where: str) -> None:
    assert headers.get("content-type", "").startswith("application/json"), (where, status, headers, body)
    assert isinstance(body, dict) and set(body) == {"error", "detail"}, (where, status, body)
    assert isinstance(body["error"], str) and isinstance(body["detail"], str), (where, status, body)


def check_data_response(case: fz.DataCase, status: int, body: Any, headers: dict[str, str]) -> None:
    where = f"{case.label}: {status}"
    assert status < 500 or status in UPSTREAM_5XX, (where, body)
    assert WORKER_RE.fullmatch(headers.get("x-cacheroute-worker", "")), (where, headers)
    if status >= 300:
        assert_error_shape(status, body, headers, where)
    if case.expect == "ok":
        assert status == 200, (where, body)
        assert headers.get("x-cacheroute-instance") == FIXTURE_ID, (where, headers)
        if case.stream:
            assert headers["content-type"].startswith("text/event-stream"), (where, headers)
            assert isinstance(body, str) and "event: cacheroute_meta" in body, (where, body)
            assert body.endswith("data: [DONE]\n\n") and body.count("data: [DONE]") == 1, (where, body[-500:])
        else:
            assert isinstance(body, dict) and "_cacheroute_meta" in body and "choices" in body, (where, body)
    elif case.expect == "reject":
        assert status in case.statuses and body["error"] in case.codes, (where, body)
        if case.names:
            assert any(name in body["detail"] for name in case.names), (where, case.names, body)
    else:
        assert status == 200 or 400 <= status < 500, (where, body)


# --- data plane ------------------------------------------------------------------------------------
def _one_request(env: Env, data: st.DataObject, family: str) -> None:
    case = data.draw(fz.data_case(env.kdn_addr, fz.FAMILIES[family]), label="case")
    target = data.draw(st.sampled_from(env.targets), label="target")
    event(case.label.split(" (")[0] if not case.label.startswith("mutate") else "mutate")
    status, body, headers = send(target + case.path, case.raw)
    note(f"answer: {status} {str(body)[:500]}")
    check_data_response(case, status, body, headers)
    wait_quiescent(env)


@fuzz(200)
@given(data=st.data())
def test_data_plane_valid_bodies(env: Env, data: st.DataObject) -> None:
    """OpenAI chat/completions and Scheduler bodies (knowledge on and off, live and dead KDN)."""
    _one_request(env, data, "valid")


@fuzz(150)
@given(data=st.data())
def test_data_plane_invalid_fields(env: Env, data: st.DataObject) -> None:
    """One field of a valid body made wrong: type, null, missing, out of range, wrong endpoint."""
    _one_request(env, data, "invalid_fields")


@fuzz(120)
@given(data=st.data())
def test_data_plane_malformed_bytes(env: Env, data: st.DataObject) -> None:
    """Invalid UTF-8, raw control bytes, lone surrogates, truncation, trailing bytes, non-objects."""
    _one_request(env, data, "malformed")


@fuzz(60)
@given(data=st.data())
def test_data_plane_garbage_and_huge_bodies(env: Env, data: st.DataObject) -> None:
    """Nested garbage in any field, megabyte pads up to just under 8 MiB, huge wrong values."""
    _one_request(env, data, "garbage_and_huge")


def _disconnect_early(url: str, raw: bytes) -> None:
    """Send the request, read at most the first bytes of the answer, hang up."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    path = "/" + url.split("//")[1].split("/", 1)[1]
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (path.encode(), len(raw)) + raw)
        if select.select([sock], [], [], 0.05)[0]:
            sock.recv(64)


@fuzz(60)
@given(data=st.data())
def test_data_plane_concurrent_bursts_and_disconnects(env: Env, data: st.DataObject) -> None:
    jobs = data.draw(st.lists(st.tuples(fz.data_case(env.kdn_addr), st.sampled_from(env.targets),
                                        st.sampled_from(["wait", "wait", "wait", "disconnect"])),
                              min_size=2, max_size=8), label="burst")

    def run(job: tuple[fz.DataCase, str, str]) -> Any:
        case, target, how = job
        if how == "disconnect":
            return _disconnect_early(target + case.path, case.raw)
        return send(target + case.path, case.raw)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (case, _, how), result in zip(jobs, results):
        if how == "wait":
            check_data_response(case, *result)
    wait_quiescent(env, timeout=5)


def test_body_exactly_at_the_limit_is_served_one_byte_more_is_413(env: Env) -> None:
    """The one explicit case over PROXY_MAX_BODY_BYTES (8 MiB), and the boundary below it."""
    head = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    at_limit = head + b" " * (fz.BODY_LIMIT - len(head))      # trailing whitespace is valid JSON
    status, body, _ = send(env.cluster.dp_url + fz.CHAT, at_limit)
    assert status == 200 and "choices" in body, (status, str(body)[:300])
    for target in env.targets:
        # Declared length over the limit: refused before the body is read.
        reply = _raw_exchange(target, b"Content-Length: %d\r\n" % (fz.BODY_LIMIT + 1), at_limit + b" ")
        _assert_413(reply)
        # No declared length (chunked): refused while reading, as soon as the limit is passed.
        reply = _raw_exchange(target, b"Transfer-Encoding: chunked\r\n", at_limit + b" ", chunked=True)
        _assert_413(reply)
    wait_quiescent(env)


def _raw_exchange(target: str, framing: bytes, payload: bytes, chunked: bool = False) -> bytes:
    port = int(target.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + framing + b"\r\n")
        reply = b""
        step = 256 * 1024
        try:
            for offset in range(0, len(payload), step):
                piece = payload[offset:offset + step]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if select.select([sock], [], [], 0)[0]:
                    break          # answered before the whole body was sent
            else:
                if chunked:
                    sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
            head, _, rest = reply.partition(b"\r\n\r\n")
            if rest.rstrip().endswith(b"}") or (b"chunked" in head.lower() and rest.endswith(b"0\r\n\r\n")):
                break
    return reply


def _assert_413(reply: bytes) -> None:
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:500]
    assert re.search(rb"(?im)^x-cacheroute-worker: w\d+-pid\d+", head), head
    if b"chunked" in head.lower():
        size, _, rest = rest.partition(b"\r\n")
        rest = rest[:int(size, 16)]
    body = json.loads(rest)
    assert set(body) == {"error", "detail"} and body["error"] == "payload_too_large", body


# --- control plane -----------------------------------------------------------------------------------
def _listed(env: Env) -> list[dict[str, Any]]:
    return get(f"{env.cp}/v1/instance/list?include_dead=true", timeout=5)


def _remove_all_but_fixture(env: Env) -> None:
    for row in _listed(env):
        if row["instance_id"] != FIXTURE_ID:
            http("POST", f"{env.cp}/v1/instance/unregister", {"instance_id": row["instance_id"]})


def _check_cp_answer(status: int, body: Any, headers: dict[str, str], op: fz.Op) -> None:
    assert status < 500 or status == 507, (op, status, body)
    if status >= 300:
        assert_error_shape(status, body, headers, f"{op.kind} {status}")
    if op.invalid:
        assert status in (400, 422), (op, status, body)
        assert body["error"] in ("invalid_payload", "invalid_json"), (op, body)
        if op.invalid != {"*"}:
            assert any(name in body["detail"] for name in op.invalid), (op, body)


def _tables_agree(env: Env, model: dict[str, dict[str, Any]]) -> None:
    rows = _listed(env)
    assert len(rows) <= CAPACITY, rows
    by_id = {r["instance_id"]: r for r in rows}
    assert set(by_id) == set(model) | {FIXTURE_ID}, (sorted(by_id), sorted(model))
    for instance_id, expected in model.items():
        row = by_id[instance_id]
        assert (row["host"], row["port"], row["is_alive"]) == (expected["host"], expected["port"], True), (row, expected)
    directory = {(r["instance_id"], r["slot"], r["slot_generation"], r["is_alive"]) for r in rows}
    for index in range(env.cluster.workers):
        seen = {(r["instance_id"], r["slot"], r["slot_generation"], r["is_alive"])
                for r in env.cluster.loads(index)["instances"]}
        assert seen == directory, (f"worker {index}", sorted(seen), sorted(directory))


@fuzz(150)
@given(data=st.data())
def test_control_plane_sequences(env: Env, data: st.DataObject) -> None:
    ops = data.draw(fz.control_ops(FIXTURE_ID), label="ops")
    model: dict[str, dict[str, Any]] = {}       # what this example registered and did not remove
    ever: list[str] = []                         # ids registered so far (targets of `ref`)
    try:
        for op in ops:
            _run_op(env, op, model, ever)
        _tables_agree(env, model)
        for instance_id in list(model):
            status, body, _ = http("POST", f"{env.cp}/v1/instance/unregister", {"instance_id": instance_id})
            assert (status, body) == (200, {"ok": True}), (instance_id, status, body)
            del model[instance_id]
        _tables_agree(env, {})
    finally:
        _remove_all_but_fixture(env)


def _run_op(env: Env, op: fz.Op, model: dict[str, dict[str, Any]], ever: list[str]) -> None:
    if op.kind == "garbage":
        status, body, headers = http("POST", f"{env.cp}/v1/instance/{op.notes['endpoint']}", raw=op.raw)
        _check_cp_answer(status, body, headers, op)
        return
    payload = dict(op.payload)
    if op.ref is not None:
        payload["instance_id"] = ever[op.ref % len(ever)] if ever else "fuzz-never-registered"
    status, body, headers = http("POST", f"{env.cp}/v1/instance/{op.kind}", payload)
    note(f"{op.kind} -> {status} {str(body)[:300]}")
    event(f"{op.kind}: {'invalid ' + '/'.join(sorted(op.invalid)) if op.invalid else 'valid'}")
    _check_cp_answer(status, body, headers, op)
    if op.invalid:
        return
    if op.kind == "register":
        instance_id = fz.resolved_id(payload)
        if instance_id in model or 1 + len(model) < CAPACITY:
            assert status == 200 and body["instance_id"] == instance_id, (op, status, body)
            model[instance_id] = {"host": payload["host"], "port": payload["port"],
                                  "fp": body["capability_fingerprint"]}
            ever.append(instance_id)
        else:
            assert status == 507 and body["error"] == "instance_table_full", (op, status, body)
            event("register: 507, table full")
    elif op.kind == "heartbeat":
        record = model.get(payload["instance_id"])
        assert status == 200, (op, status, body)
        if record is None:
            assert body == {"ok": False}, (op, body)
            return
        caps, reported = payload.get("capabilities"), payload.get("capability_fingerprint")
        if caps is None and reported is not None and reported != record["fp"]:
            assert body["ok"] is False and body["requires_capabilities"] is True, (op, body)
        else:
            assert body == {"ok": True}, (op, body)
            if caps is not None:
                record["fp"] = fingerprint(msgspec.convert(caps, Capabilities))
    else:
        assert status == 200 and body == {"ok": payload["instance_id"] in model}, (op, status, body)
        model.pop(payload["instance_id"], None)


def test_table_full_is_507_and_changes_nothing(env: Env) -> None:
    try:
        for i in range(CAPACITY - 1):
            status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                                   {"host": "127.0.0.1", "port": 1000 + i, "instance_id": f"fill-{i}"})
            assert status == 200, (i, status, body)
        before = _listed(env)
        status, body, headers = http("POST", f"{env.cp}/v1/instance/register",
                                     {"host": "127.0.0.1", "port": 2000, "instance_id": "one-too-many"})
        assert status == 507 and body["error"] == "instance_table_full", (status, body)
        assert_error_shape(status, body, headers, "507")
        # An upsert of a registered id still works when the table is full.
        status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                               {"host": "127.0.0.1", "port": 3000, "instance_id": "fill-0"})
        assert status == 200, (status, body)
        after = {r["instance_id"]: (r["slot"], r["slot_generation"]) for r in _listed(env)}
        assert after == {r["instance_id"]: (r["slot"], r["slot_generation"]) for r in before}
    finally:
        _remove_all_but_fixture(env)
    assert [r["instance_id"] for r in _listed(env)] == [FIXTURE_ID]
    wait_quiescent(env)


# --- cross plane -----------------------------------------------------------------------------------------
VALID_CHAT = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode()


@fuzz(40)
@given(host=fz.routable_hosts)
def test_every_accepted_host_is_routable(env: Env, host: str) -> None:
    """Whatever host the control plane accepts, requests routed to it fail as 502/503/504 at
    worst (the instance is unreachable), never as a 500, and leave no count behind."""
    status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                           {"host": host, "port": env.closed_port, "instance_id": "fuzz-xplane"})
    assert status == 200, (host, status, body)
    try:
        for target in env.targets[1:] * 2:    # round-robin: each worker reaches both instances
            status, body, headers = send(target + fz.CHAT, VALID_CHAT)
            assert status == 200 or status in UPSTREAM_5XX, (host, status, body)
            assert WORKER_RE.fullmatch(headers.get("x-cacheroute-worker", "")), headers
            if status != 200:
                assert_error_shape(status, body, headers, host)
    finally:
        http("POST", f"{env.cp}/v1/instance/unregister", {"instance_id": "fuzz-xplane"})
    wait_quiescent(env)


# --- regressions: bugs the fuzz found, fixed; kept so they stay fixed ----------------------------------
def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("raw", [_deep(5000).encode(),
                                 b'{"messages": [{"role": "user", "content": "x"}], "x": ' + _deep(5000).encode() + b"}"],
                         ids=["top-level", "inside-a-valid-body"])
def test_regression_deeply_nested_json_is_a_400_on_the_data_plane(env: Env, raw: bytes) -> None:
    status, body, headers = send(env.cluster.dp_url + fz.CHAT, raw)
    assert status == 400 and body["error"] == "invalid_json", (status, body)
    assert_error_shape(status, body, headers, "deep")


@pytest.mark.parametrize("endpoint, raw", [
    ("register", b'{"host": "127.0.0.1", "port": 5, "meta": {"a": ' + _deep(5000).encode() + b"}}"),
    ("heartbeat", b'{"instance_id": "x", "capabilities": {"tokenizer": {"a": ' + _deep(5000).encode() + b"}}}"),
], ids=["register-meta", "heartbeat-capabilities"])
def test_regression_deeply_nested_json_is_a_4xx_on_the_control_plane(env: Env, endpoint: str, raw: bytes) -> None:
    try:
        status, body, headers = http("POST", f"{env.cp}/v1/instance/{endpoint}", raw=raw)
        assert status in (400, 422), (status, body)
        assert_error_shape(status, body, headers, "deep")
    finally:
        _remove_all_but_fixture(env)


def test_regression_host_with_trailing_newline_is_refused(env: Env) -> None:
    try:
        status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                               {"host": "127.0.0.1\n", "port": 9, "instance_id": "fuzz-newline"})
        assert status == 422 and "host" in body["detail"], (status, body)
    finally:
        _remove_all_but_fixture(env)


@pytest.mark.parametrize("host", ["..", "a..b", ".x", "h" * 64], ids=["dots", "empty-label", "leading-dot", "64-char-label"])
def test_regression_unencodable_host_is_never_a_500(env: Env, host: str) -> None:
    status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                           {"host": host, "port": env.closed_port, "instance_id": "fuzz-idna"})
    if status in (400, 422):
        return                                 # fixed in the control plane: refused, naming the host
    assert status == 200, (status, body)
    try:
        seen = [send(target + fz.CHAT, VALID_CHAT)[0] for target in env.targets[1:] * 2]
        assert all(s == 200 or s in UPSTREAM_5XX for s in seen), seen
    finally:
        _remove_all_but_fixture(env)
        wait_quiescent(env)


def test_regression_plain_ipv6_instance_is_reachable(env: Env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    v6 = Process(["-m", "cacheroute_sim.instance", "--host", "::1", "--port", str(port), "--no-register",
                  "--time-scale", "0.02", "--instance-id", "fuzz-v6"], {}, tmp_path / "v6.log")
    try:
        wait_until(lambda: get(f"http://[::1]:{port}/healthz", timeout=1), 20, message="IPv6 sim up")
        status, body, _ = http("POST", f"{env.cp}/v1/instance/register",
                               {"host": "::1", "port": port, "instance_id": "fuzz-v6"})
        assert status == 200, (status, body)
        served = [send(target + fz.CHAT, VALID_CHAT)[2].get("x-cacheroute-instance") for target in env.targets[1:] * 2]
        assert "fuzz-v6" in served, served     # round-robin: two of the four go to it
    finally:
        _remove_all_but_fixture(env)
        v6.stop()
        wait_quiescent(env)


def test_regression_large_knowledge_length_does_not_block_the_kv_link(env: Env) -> None:
    # "localhost:<port>" is the same KDN under another name: its own link, so the poisoned
    # link cannot affect the other tests of this module.
    kdn = "localhost:" + env.kdn_addr.rsplit(":", 1)[1]
    def body(length: int) -> bytes:
        return json.dumps({"Prompt": {"model": "m", "user_prompt": "hi", "max_tokens": 2, "stream": False},
                           "Service": {"Enable_know_injection": True, "Injection_type": "kvcache",
                                       "Knowledge_List": [f"k{i:04d}" for i in range(6)],
                                       "Knowledge_length": length},
                           "Task": {"KDN_server_addr": kdn}}).encode()
    worker = env.cluster.worker_url(0)
    status, first, _ = send(worker + fz.CHAT, body(100_000_000))
    assert status == 200 and first["_cacheroute_meta"]["kv_ready_kids"], (status, str(first)[:500])
    started = time.monotonic()
    status, second, _ = send(worker + fz.CHAT, body(512))
    assert status == 200, (status, second, round(time.monotonic() - started, 1))


# --- after the run ---------------------------------------------------------------------------------------
def test_zz_after_the_run_everything_is_quiescent_and_consistent(env: Env) -> None:
    _remove_all_but_fixture(env)
    wait_quiescent(env, timeout=5, extra_lanes=("pending_prefill_count", "active_decode_count"))
    assert [r["instance_id"] for r in _listed(env)] == [FIXTURE_ID]
    assert env.cluster.worker_pids() == env.pids, "a worker crashed and was restarted during the fuzz"
    status = env.cluster.status()
    assert status["reaper"]["corrections"] == 0, status["reaper"]
    assert all(w.get("events_dropped", 0) == 0 for w in status["workers"]), status["workers"]
    # The simulated instance answered every request it was sent and is still healthy.
    assert get(f"{env.sim.url}/healthz")["ok"] is True
