"""The KDN's replies as the proxy decodes them (cacheroute_proxy/kdn_wire.py): a well-formed reply
keeps everything the proxy reads, keys it does not read are ignored, and a reply of the wrong
shape is refused with a message naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from cacheroute_proxy.kdn_wire import (
    KdnReplyError,
    KnowledgeItem,
    decode_inject_ack,
    decode_search_reply,
)


def test_a_search_reply_keeps_what_the_proxy_reads_and_ignores_the_rest() -> None:
    reply = decode_search_reply(msgspec.json.encode({
        "items": [{"id": "k0001", "knowledge_id": "K0001", "content": "alpha", "kv_ready": True,
                   "length": 12, "rel_path": "a.txt", "kv_dumped_keys": ["x"], "embedding": [0.5]},
                  {"kid": "k0002", "content": "beta", "kv_ready": False},
                  {"id": "k0003", "content": None, "kv_ready": None}],
        "miss": ["k0004"]}))
    assert [(item.key, item.content, item.kv_ready) for item in reply.found] == [
        ("K0001", "alpha", True), ("k0002", "beta", False), ("k0003", None, None)]
    assert reply.missing == ["k0004"]


def test_an_items_id_is_its_knowledge_id_else_kid_else_id() -> None:
    assert KnowledgeItem(knowledge_id="a", kid="b", id="c").key == "a"
    assert KnowledgeItem(knowledge_id="", kid="b", id="c").key == "b"
    assert KnowledgeItem(id="c").key == "c"
    assert KnowledgeItem(content="no id").key is None


def test_a_search_reply_with_null_or_absent_lists_has_none() -> None:
    for body in (b"{}", b'{"items": null, "miss": null}'):
        reply = decode_search_reply(body)
        assert (reply.found, reply.missing) == ([], [])


def test_an_inject_ack_is_read_and_kept_whole() -> None:
    sent = {"ok": True, "injected_kids": ["k1"], "payload_bytes": 4096, "resident_kids": [],
            "detail": None}
    ack, as_sent = decode_inject_ack(msgspec.json.encode(sent))
    assert (ack.ok, ack.detail) == (True, None)
    assert as_sent == sent  # relayed as cacheroute_meta.kv_ack: nothing dropped
    refused, _ = decode_inject_ack(b'{"ok": false, "detail": ["no redis"]}')
    assert (refused.ok, refused.detail) == (False, ["no redis"])
    assert decode_inject_ack(b"{}")[0].ok is False


@pytest.mark.parametrize("decode, reply, body, where", [
    *[(decode_search_reply, "KDN search reply", body, where) for body, where in (
        (b"[]", "Expected `object`, got `array`"),
        (b'{"items": "k1"}', "at `$.items`"),
        (b'{"items": ["k1"]}', "at `$.items[0]`"),
        (b'{"items": [{"id": 7}]}', "at `$.items[0].id`"),
        (b'{"items": [{"id": "k1", "content": 7}]}', "at `$.items[0].content`"),
        (b'{"items": [{"id": "k1", "kv_ready": "no"}]}', "at `$.items[0].kv_ready`"),
        (b'{"miss": [1]}', "at `$.miss[0]`"),
        (b"<html>502</html>", "JSON is malformed"))],
    *[(decode_inject_ack, "KV inject reply", body, where) for body, where in (
        (b'{"ok": "yes"}', "at `$.ok`"),
        (b'{"ok": 1}', "at `$.ok`"),
        (b'["ok"]', "Expected `object`, got `array`"),
        (b"Bad Gateway", "JSON is malformed"))],
])
def test_a_reply_of_the_wrong_shape_is_refused_naming_the_field(
        decode: Callable[[bytes], Any], reply: str, body: bytes, where: str) -> None:
    with pytest.raises(KdnReplyError, match=f"^{reply}: ") as refused:
        decode(body)
    assert where in str(refused.value)
