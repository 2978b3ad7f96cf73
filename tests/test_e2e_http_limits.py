"""What every listener of the product's HTTP/1.1 server refuses of a request head, and a
chunked body that does not parse, with raw sockets against real processes: a worker's data
plane, the sidecar's control plane and its dashboard listener.

Each refusal is answered with its status and `Connection: close`, the connection is closed,
and a normal request on a new connection right after is answered as usual. The head timeout
is set short (PROXY_HEAD_TIMEOUT_S=0.5) so the slow-trickle case is quick; the size and count
limits are the defaults."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import pytest

from tests.harness import Cluster, free_port
from tests.test_http1_server import closed, read_response

# One parallel test worker runs them all: they share the module's cluster.
pytestmark = pytest.mark.xdist_group(__name__)

HEAD_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ui_port = free_port()
    c = Cluster(tmp_path_factory.mktemp("limits"), workers=1,
                env={"PROXY_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
                     "PROXY_UI_LISTEN": f"127.0.0.1:{ui_port}"})
    c.ui_port = ui_port  # type: ignore[attr-defined]
    c.start()
    try:
        yield c
    finally:
        c.stop()


# listener -> (its port, a normal request answered 200 there)
def _listeners(cluster: Cluster) -> dict[str, tuple[int, str]]:
    return {"worker": (cluster.dp_port, "/healthz"), "control": (cluster.cp_port, "/healthz"),
            "dashboard": (cluster.ui_port, "/dashboard")}  # type: ignore[attr-defined]


def _head(port: int, target: str = "/healthz", method: str = "GET", extra: bytes = b"") -> bytes:
    # The Host the control plane and the dashboard accept without a token: their own address.
    return b"%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s" % (method.encode(), target.encode(),
                                                           port, extra)


def _refused(sock: socket.socket, status: int) -> None:
    got, headers, _ = read_response(sock, bytearray())
    assert (got, headers.get("connection")) == (status, "close"), (got, headers)
    assert closed(sock)


def _still_serves(port: int, path: str) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_head(port, path) + b"\r\n")
        assert read_response(sock, bytearray())[0] == 200


LISTENERS = ["worker", "control", "dashboard"]


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("case, status", [
    ("101 headers", 431),
    ("one 64 KiB header line", 431),
    ("40 KiB of headers", 431),
    ("a 9 KiB request target", 414),
    ("a malformed chunk size", 400),
])
def test_a_head_past_its_limits_is_refused_and_closed(cluster: Cluster, listener: str, case: str,
                                                      status: int) -> None:
    port, path = _listeners(cluster)[listener]
    raw = {
        "101 headers": _head(port, path, extra=b"".join(b"x-h%d: v\r\n" % i for i in range(101))),
        "one 64 KiB header line": _head(port, path, extra=b"x-big: " + b"v" * 65536 + b"\r\n"),
        "40 KiB of headers": _head(port, path, extra=b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 1024)
                                                              for i in range(40))),
        "a 9 KiB request target": _head(port, path + "?" + "q" * 9216),
        "a malformed chunk size": _head(port, "/v1/instance/register", "POST",
                                        b"transfer-encoding: chunked\r\n") + b"\r\nzz\r\nabc\r\n",
    }[case]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if case != "a malformed chunk size":
            raw += b"\r\n"
        sock.sendall(raw)
        _refused(sock, status)
    _still_serves(port, path)


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_head_that_trickles_in_past_the_timeout_is_408(cluster: Cluster, listener: str) -> None:
    """One header line every 0.1 s, for ever: answered 408 once the head is
    PROXY_HEAD_TIMEOUT_S old (5 s is the test's patience, 10x the timeout)."""
    port, path = _listeners(cluster)[listener]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_head(port, path))
        sock.settimeout(0.1)
        deadline = time.monotonic() + 10 * HEAD_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, "still trickling after 10x the head timeout"
            try:
                sock.recv(1, socket.MSG_PEEK)
                break  # an answer (or the close) is there
            except TimeoutError:
                pass
            try:
                sock.sendall(b"x-trickle: 1\r\n")
            except OSError:
                break  # closed by the server meanwhile
        sock.settimeout(5)
        _refused(sock, 408)
    _still_serves(port, path)
