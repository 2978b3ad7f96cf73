"""A KDN whose replies are malformed, against real workers and a simulated instance: the request
is served without that knowledge and `cacheroute_meta` names the field that was wrong; a
well-formed reply, with keys the proxy does not read, still serves its knowledge, and the KV
inject's answer reaches `kv_ack` whole."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.aio import meta_of
from tests.background_http import BackgroundHTTPServer, answer_json
from tests.harness import http, wait_until

SEARCH = "/knowledge/search/text"
INJECT = "/knowledge/inject_ready_kv"
GOOD_SEARCH = {"items": [{"id": kid, "knowledge_id": kid, "content": f"the context of {kid}",
                          "kv_ready": True, "length": 5, "embedding": [0.25, 0.5]} for kid in ("k1", "k2")],
               "miss": []}


class ScriptedKdn(BackgroundHTTPServer):
    """A KDN on 127.0.0.1 that answers each route with the bytes the test set for it."""

    def __init__(self) -> None:
        self.replies: dict[str, bytes] = {SEARCH: json.dumps(GOOD_SEARCH).encode(),
                                          INJECT: b'{"ok": true}'}
        self.calls: list[str] = []
        self._lock = threading.Lock()
        super().__init__(self._handler())

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.bound_port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        kdn = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with kdn._lock:
                    kdn.calls.append(self.path)
                    reply = kdn.replies[self.path]
                answer_json(self, reply)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def _ask(cluster: Any, kdn: ScriptedKdn, injection: str, kid: str = "k1") -> dict[str, Any]:
    body = {"Request_ID": 7, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 20,
                                        "max_tokens": 2, "stream": True},
            "Service": {"Enable_know_injection": True, "Injection_type": injection,
                        "Knowledge_List": [kid], "Knowledge_length": 1024},
            "Task": {"KDN_server_addr": kdn.addr}}
    status, text, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=30)
    assert status == 200, text
    return meta_of(text.encode())


def test_a_malformed_search_reply_is_named_and_the_request_goes_on_without_it(make_cluster):
    cluster = make_cluster(workers=1)
    inst = cluster.add_instance()
    with ScriptedKdn() as kdn:
        meta = _ask(cluster, kdn, "text")  # well-formed, with keys the proxy does not read
        assert meta["error"] is None and meta["text_only_kids"] == [] and meta["kv_ready_kids"] == ["k1"]
        for reply, where in ((b'{"items": "k1"}', "`$.items`"),
                             (b'{"items": [{"id": "k1", "content": 7}]}', "`$.items[0].content`"),
                             (b'{"items": [{"id": "k1", "kv_ready": "no"}]}', "`$.items[0].kv_ready`"),
                             (b"[]", "Expected `object`, got `array`")):
            kdn.replies[SEARCH] = reply
            meta = _ask(cluster, kdn, "kvcache")
            assert meta["error"].startswith("prepare_failed: KdnReplyError: KDN search reply: "), meta
            assert where in meta["error"], meta["error"]
            assert meta["kv_ready_kids"] == meta["text_only_kids"] == []
        assert INJECT not in kdn.calls and inst.stats()["kv_injects"] == 0  # nothing was pulled
    wait_until(lambda: all(v == 0 for v in cluster.inflight().values()), 5, message="inflight 0")


def test_a_malformed_inject_answer_is_named_and_the_instance_recomputes(make_cluster):
    cluster = make_cluster(workers=1)
    cluster.add_instance()
    with ScriptedKdn() as kdn:
        # The instance relays the KDN's answer as its own: every key reaches kv_ack.
        kdn.replies[INJECT] = b'{"ok": true, "injected_kids": ["k1"], "payload_bytes": 4096}'
        meta = _ask(cluster, kdn, "kvcache")
        assert meta["kv_ack"] == {"ok": True, "injected_kids": ["k1"], "payload_bytes": 4096}
        assert meta["trace"]["kvcache_actual_path"] == "kv_injected"
        # Another id: k1's KV is resident on the instance now, and would not be pulled again.
        kdn.replies[INJECT] = b'{"ok": "yes", "injected_kids": ["k2"]}'
        meta = _ask(cluster, kdn, "kvcache", "k2")
        ack = meta["kv_ack"]
        assert ack["ok"] is False and ack["detail"].startswith("KdnReplyError: KV inject reply: "), ack
        assert "`$.ok`" in ack["detail"]
        assert meta["trace"]["kvcache_actual_path"] == "recompute" and meta["error"] is None
    wait_until(lambda: all(v == 0 for v in cluster.inflight().values()), 5, message="inflight 0")
