"""bench/flow_profile.py: what a py-spy sample is charged to, and a short real run over the
proxy and the relay floor."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bench import flow_profile
from bench.flow_profile import EVENT_LOOP, LIBRARIES, LOOP, PRODUCT, RELAY, Frame, RequestCpu, own_time, parse_raw
from bench.report.flow_profile import section
from cacheroute_sim.processes import segment_prefix

RUN = "_run_module_as_main (<frozen runpy>:198);main (proxy_workers/__main__.py:29);Runner.run (asyncio/runners.py:118)"
RAW = "\n".join([
    f"{RUN};uv__io_poll (linux.c:1546);epoll_pwait (libc.so.6) 50",  # waiting: not CPU
    f"{RUN};uv__io_poll (linux.c:1546);uv__stream_io (stream.c:1210);uv__read (stream.c:1063);read (libc.so.6) 7",
    f"{RUN};Handle__run (loop.c:100);ProxyExchange.run (proxy_workers/exchange.py:130);"
    "encode_meta (proxy_workers/trace.py:130);json_encode (_core.c:10) 6",  # msgspec's C: the caller's
    f"{RUN};Handle__run (loop.c:100);Connection.on_headers_complete (cacheroute_proxy/http1/connection.py:200) 2",
    f"{RUN};Handle__run (loop.c:100);Connection.write (cacheroute_proxy/http1/connection.py:310);"
    "UVStream_write (loop.c:9);write (libc.so.6) 30",  # in the kernel: system time, counted apart
    f"{RUN};Handle__run (loop.c:100);Connection.write (cacheroute_proxy/http1/connection.py:310);"
    "UVStream_write (loop.c:9) 1",  # uvloop's own part of a write: the loop's
    f"{RUN};task_step_impl (_asynciomodule.c:1) 1",
    f"{RUN};Handle__run (loop.c:100);WeakSet.add (_weakrefset.py:80) 0",
    "not a stack line",
])


def test_each_sample_is_charged_to_what_spent_it() -> None:
    stacks = parse_raw(RAW)
    assert len(stacks) == 8 and stacks[0][1] == 50
    assert stacks[2][0][-2] == Frame("encode_meta", "proxy_workers/trace.py")
    profile = own_time(stacks, RequestCpu(user_us=10.0, system_us=4.0))
    assert profile["user_samples"] == 10 and profile["kernel_samples"] == 87
    layers = {row["layer"]: row for row in profile["layers"]}
    assert layers["kernel (system time)"]["us"] == 4.0 and layers["kernel (system time)"]["share"] is None
    assert layers[PRODUCT] == {"layer": PRODUCT, "share": 0.6, "us": 6.0}
    assert layers[RELAY]["share"] == 0.2 and layers[LOOP]["share"] == 0.2 and layers[LIBRARIES]["share"] == 0
    functions = {row["function"]: row for row in profile["functions"]}
    assert functions["encode_meta (proxy_workers/trace.py)"]["us"] == 6.0
    assert functions[EVENT_LOOP.label]["share"] == 0.2
    assert "Connection.write (cacheroute_proxy/http1/connection.py)" not in functions
    assert own_time(stacks, None)["layers"][1]["us"] is None  # no CPU measured: shares only


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed")
@pytest.mark.skipif(flow_profile.find_py_spy() is None, reason="py-spy not installed (the bench extra)")
@pytest.mark.parametrize("load", ["plain", "stream"])
def test_a_short_run_profiles_the_proxy_and_the_floor(tmp_path: Path, load: str) -> None:
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "flow.json"
    assert flow_profile.main(["--load", load, "--seconds", "4", "--rate", "100", "--top", "10",
                              "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["load"] == load
    assert set(data["points"]) == {"proxy-w2-ll", "relay-floor-w2"}
    assert all(p["unprofiled"]["errors"] == 0 and p["unprofiled"]["requests"] > 0 for p in data["points"].values())
    workers = data["profiles"]["proxy-w2-ll workers"]
    floor = data["profiles"]["relay-floor-w2 relay"]
    assert workers["user_samples"] > 0 and floor["user_samples"] > 0
    share = {name: {row["layer"]: row["share"] for row in p["layers"]} for name, p in
             (("proxy", workers), ("floor", floor))}
    assert share["proxy"][PRODUCT] > share["floor"][PRODUCT]  # the product's work is the proxy's own
    assert len(workers["functions"]) <= 10
    ours = segment_prefix("cacheroute_bench")  # this test process's segments, not a neighbour's
    assert not {name for name in set(os.listdir("/dev/shm")) - before if name.startswith(ours)}
    text = section(data, "flow_profile.json")
    assert "| `proxy-w2-ll` | workers |" in text and "By layer, µs per request:" in text
    assert text.startswith("## Where a stream's CPU goes" if load == "stream" else "## Where a plain request's")
