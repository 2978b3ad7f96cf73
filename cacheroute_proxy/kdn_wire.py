"""The replies of a KDN (Knowledge Delivery Network: the server that holds each knowledge id's
text and prebuilt KV) as the proxy reads them (docs/protocol.md §5, §3.8), one msgspec Struct
per payload: a worker decodes the search and the KV inject's answer, an instance agent the
topology hello.

Decoding validates: a reply of the wrong shape is refused with msgspec's message, which names
the field (``Expected `str | null`, got `int` - at `$.items[0].content```), as a KdnReplyError.
Keys the proxy does not read are ignored: a KDN sends the need_fields it is asked for, and more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec


class KdnReplyError(ValueError):
    """A reply the proxy cannot read; the message names the reply and the field."""


class KnowledgeItem(msgspec.Struct):
    """One id the search found. KDNs differ in which name they give its id (`key`)."""

    knowledge_id: str | None = None
    kid: str | None = None
    id: str | None = None
    content: str | None = None
    kv_ready: bool | None = None  # its KV is prebuilt: it can be pulled instead of prefilled

    @property
    def key(self) -> str | None:
        return self.knowledge_id or self.kid or self.id


class SearchReply(msgspec.Struct):
    """`POST /knowledge/search/text`'s answer: the ids found, and those the KDN does not hold."""

    items: list[KnowledgeItem] | None = None  # null or absent: none
    miss: list[str] | None = None

    @property
    def found(self) -> list[KnowledgeItem]:
        return self.items or []

    @property
    def missing(self) -> list[str]:
        return self.miss or []


class InjectAck(msgspec.Struct):
    """What the proxy reads of the answer to a KV inject (the KDN's `inject_ready_kv` answer,
    which the instance relays as its own); the whole object goes to `cacheroute_meta.kv_ack`."""

    ok: bool = False
    detail: Any = None


class TopologyHello(msgspec.Struct):
    """`POST /v1/topology/hello`'s answer: the KDN's own id for the links measured to it."""

    ok: bool = False
    kdn_id: str | None = None


_decode_search = msgspec.json.Decoder(SearchReply).decode
_decode_hello = msgspec.json.Decoder(TopologyHello).decode


def decode_search_reply(body: bytes) -> SearchReply:
    with _refused_as("KDN search reply"):
        return _decode_search(body)


def decode_inject_ack(body: bytes) -> tuple[InjectAck, dict[str, Any]]:
    """The answer read, and the object as it was sent (nothing dropped)."""
    with _refused_as("KV inject reply"):
        as_sent = msgspec.json.decode(body)
        return msgspec.convert(as_sent, InjectAck), as_sent


def decode_hello(body: bytes) -> TopologyHello:
    with _refused_as("KDN topology hello"):
        return _decode_hello(body)


@contextlib.contextmanager
def _refused_as(what: str) -> Iterator[None]:
    try:
        yield
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise KdnReplyError(f"{what}: {exc}") from None
