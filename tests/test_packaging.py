"""What a deployment installs: the wheel holds the product and nothing else (no simulated
instance, KDN or Scheduler, no benchmarks, no tests), and the proxy runs from that wheel alone:
`cacheroute-proxy run` started where `cacheroute_sim` cannot be imported serves a request to an
instance that registered itself."""

from __future__ import annotations

import http.server as stdlib_http
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheroute_proxy.http1.chunk_pass import NATIVE_CHUNK_PASS
from cacheroute_proxy.routing.least_load import NATIVE_SELECTION
from shm_schema.counters import NATIVE_UPDATES
from shm_schema.events import NATIVE_RING
from tests.harness import ROOT, Process, SupervisorPorts, get, http, post, wait_until

# One parallel test worker runs them all: they share the module's wheel, built once.
pytestmark = pytest.mark.xdist_group(__name__)

PRODUCT = {"cacheroute_proxy", "shm_schema", "sidecar", "proxy_workers", "instance_agent"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ and *.egg-info in the tree it builds.
    source = tmp_path_factory.mktemp("source") / "tree"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".cache", "build", "*.egg-info", "__pycache__", "results"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("cacheroute_proxy-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel alone, installed into its own directory (its dependencies come from the
    environment the tests run in)."""
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def test_the_wheel_holds_the_product_and_its_data_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == PRODUCT
    assert "proxy_workers/predictors/profiles/llama3-70b-8x5090.json" in names
    assert "sidecar/dashboard/index.html" in names
    for vendored in ("uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE", "VENDORED.md"):
        assert f"sidecar/dashboard/vendor/{vendored}" in names, vendored
    assert "cacheroute_proxy/http1/server.py" in names
    assert not any("uvicorn" in name for name in names)  # the simulators' server, not the product's
    # Each compiled part beside the Python it mirrors (built here: this machine has a compiler).
    built = {name.split(".")[0] for name in names if name.endswith(".so")}
    assert built == ({"shm_schema/_lanes"} if NATIVE_UPDATES else set()) | (
        {"shm_schema/_ring"} if NATIVE_RING else set()) | (
        {"cacheroute_proxy/routing/_least_load"} if NATIVE_SELECTION else set()) | (
        {"cacheroute_proxy/http1/_chunk_pass"} if NATIVE_CHUNK_PASS else set())


class Backend(stdlib_http.ThreadingHTTPServer):
    """A bare OpenAI-style instance in the test process: what a deployment's engine is to the
    proxy, without anything of this repository."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.port = self.server_address[1]


class _Answer(stdlib_http.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"id": "x", "object": "chat.completion",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def backend() -> Iterator[Backend]:
    server = Backend()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_proxy_runs_from_the_wheel_without_the_doubles(installed: Path, backend: Backend,
                                                           tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u, proxy_workers as p; "
         "print(p.__file__); print(u.find_spec('cacheroute_sim') is None)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    where, no_doubles = probe.stdout.split()
    assert where.startswith(str(installed)) and no_doubles == "True", probe.stderr

    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    launcher = Process(["-m", "cacheroute_proxy", "run"],
                       {**ports.supervisor_env("least_load"), "PYTHONPATH": str(installed)},
                       tmp_path / "launcher.log", cwd=tmp_path)
    try:
        for index in range(ports.workers):
            wait_until(lambda i=index: get(f"{ports.worker_url(i)}/healthz", timeout=1)["ok"], 30,
                       message=f"worker {index}\n{launcher.tail()}")
        post(f"{ports.cp_url}/v1/instance/register",
             {"instance_id": "engine", "host": "127.0.0.1", "port": backend.port})
        wait_until(lambda: all(get(f"{ports.worker_url(i)}/debug/instance_loads")["instances"]
                               for i in range(ports.workers)), 10, message="every worker sees it")
        status, answer, headers = http("POST", f"{ports.dp_url}/v1/chat/completions",
                                       {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == "hi"
        assert answer["_cacheroute_meta"]["trace"]["instance_id"] == "engine"
        assert headers["x-cacheroute-instance"] == "engine"
        # Every dashboard file is package data (a missing one makes /dashboard a 503).
        assert http("GET", f"{ports.cp_url}/dashboard")[0] == 200
        assert http("GET", f"{ports.cp_url}/dashboard/vendor/uPlot.iife.min.js")[0] == 200
    finally:
        code = launcher.stop(signal.SIGINT, timeout=45)
    assert code == 0, launcher.tail()
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")
