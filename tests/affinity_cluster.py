"""What the kv_aware end-to-end tests share: a simulated KDN whose every id has prebuilt KV
(`--kv-ready-ratio 1`, so each kvcache request asks its instance for an inject the KDN counts),
the requests they send, and each worker's view of the affinity index
(`/debug/instance_loads?knowledge=...` or `?prompt=...`)."""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from typing import Any, AsyncIterator

import aiohttp

from cacheroute_sim.processes import free_port
from tests.aio import OpenStream, meta_of
from tests.harness import Process, get, http, wait_until

KV_AWARE = {"PROXY_INSTANCE_STRATEGY": "kv_aware"}


class Kdn:
    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.process = Process(["-m", "cacheroute_sim.kdn", "--port", str(self.port), "--time-scale",
                                "0.05", "--kv-ready-ratio", "1"], {}, tmp_path / "kdn.log")
        wait_until(lambda: get(f"http://{self.addr}/healthz", timeout=1), 15, message="kdn up")

    def injects(self) -> int:
        return get(f"http://{self.addr}/sim/stats")["injects"]

    def stop(self) -> None:
        self.process.stop()


def knowledge_body(kdn: Kdn, kids: list[str], tokens_each: int = 1000) -> dict[str, Any]:
    return {"Request_ID": 1, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 3,
                                        "max_tokens": 2, "stream": True},
            "Service": {"Enable_know_injection": True, "Injection_type": "kvcache",
                        "Knowledge_List": kids, "Knowledge_length": tokens_each * len(kids)},
            "Task": {"KDN_server_addr": kdn.addr}}


def ask(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request's cacheroute_meta, from a stream's last event or a JSON answer's member."""
    status, text, _ = http("POST", f"{url}/v1/chat/completions", body, timeout=20)
    assert status == 200, text
    if body.get("stream", body.get("Prompt", {}).get("stream")):
        return meta_of(text.encode())
    return (text if isinstance(text, dict) else json.loads(text))["_cacheroute_meta"]


def affinity_rows(cluster, worker: int | None, **query: str) -> dict[str, dict[str, Any]]:
    base = cluster.cp_url if worker is None else cluster.worker_url(worker)
    loads = get(f"{base}/debug/instance_loads?{urllib.parse.urlencode(query)}")
    return {row["instance_id"]: row["affinity"] for row in loads["instances"]}


def resident_everywhere(cluster, instance_id: str, kids: list[str]) -> bool:
    """Every worker's view names exactly `kids` resident on the instance."""
    query = {"knowledge": ",".join(kids)}
    return all(affinity_rows(cluster, w, **query)[instance_id]["resident_knowledge"] == kids
               for w in range(cluster.workers))


def knowledge_count(cluster, worker: int, instance_id: str) -> int:
    return affinity_rows(cluster, worker, knowledge="k0000")[instance_id]["resident_counts"]["knowledge"]


def heartbeat(cluster, instance_id: str, **fields: Any) -> tuple[int, Any]:
    status, body, _ = http("POST", f"{cluster.cp_url}/v1/instance/heartbeat",
                           {"instance_id": instance_id, **fields})
    return status, body


SYSTEM = "You answer questions about the shared corpus. " * 20  # ~900 characters: 3 blocks


def prefix_body(question: str, stream: bool = True, max_tokens: int = 2, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "sim", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def served_by(cluster, body: dict[str, Any]) -> str:
    return ask(cluster.dp_url, body)["trace"]["instance_id"]


async def hold(cluster, count: int, max_tokens: int = 2) -> list[OpenStream]:
    session = aiohttp.ClientSession()
    streams = [await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions",
                                     prefix_body(f"q{i}", max_tokens=max_tokens))
               for i in range(count)]
    for stream in streams:
        stream.session = session  # type: ignore[attr-defined]
    return streams


@contextlib.asynccontextmanager
async def held_streams(sim) -> AsyncIterator[list[OpenStream]]:
    """Streams the caller adds (by hold) while `sim` holds their answers; at the end the sim
    lets them go, each is read to its end and every session is closed."""
    held: list[OpenStream] = []
    try:
        yield held
    finally:
        sim.release()
        for stream in held:
            await stream.finish()
        for session in {id(s.session): s.session for s in held}.values():  # type: ignore[attr-defined]
            await session.close()


def prompt_query(system: str = SYSTEM) -> dict[str, str]:
    rendered = f"<|system|>{system}<|user|>x"
    return {"prompt": rendered}
