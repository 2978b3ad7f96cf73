"""vLLM engines' own account of their prefix cache, fed into the affinity index: one ZMQ
subscriber per engine that publishes KV cache events.

Followed only when the workers name prompt blocks as the engines do (PROXY_AFFINITY_TOKENIZER):
otherwise no event could name a block the workers look up. Where an engine publishes comes
from PROXY_KV_EVENTS (`instance_id=tcp://host:port`, for any instance) or from its
registration's `meta.kv_events_endpoint`, which an agent and the static prober read from the
engine's `GET /kv_event_sources` (cacheroute_proxy/engine_probe.py).
`KvEventFeeds.reconcile` (every second) subscribes to the alive instances that have one and
unsubscribes from those that left. Each batch goes to the instance's current registration:
BlockStored adds its blocks as prefix entries, BlockRemoved takes them out, AllBlocksCleared
empties them. Only the engine's own cache counts (medium unset or "GPU", which vLLM's CPU build
reports too); offloaded tiers are not followed.

vLLM reports a block once, when it is first stored. A message lost between engine and sidecar
(a sequence gap; ZMQ drops what a slow subscriber cannot take) or a restarted engine (the
sequence starts again) leaves the prefix entries unknowable, so they are emptied, and refill as
the engine stores blocks again. An engine whose block size is not PROXY_AFFINITY_BLOCK_TOKENS
can never match the workers' keys: the sidecar says so in its log, once per feed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cacheroute_proxy.affinity_keys import engine_block_key

from .affinity import AffinityModels
from .kv_event_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, FrameError, \
    KvEvent, block_number, decode
from .registry import InstanceRecord, InstanceRegistry

log = logging.getLogger("cacheroute.sidecar.kv_events")

RECONCILE_S = 1.0
RETRY_S = 30.0  # after a subscription failed (a bad endpoint): tried again this much later
_OWN_CACHE = (None, "GPU")  # vLLM's name for its own KV cache, on CPU builds too


@dataclass
class FeedStats:
    endpoint: str
    batches: int = 0
    events: int = 0
    skipped_events: int = 0  # kinds this sidecar does not know, or of another medium
    bad_messages: int = 0
    gaps: int = 0
    engine_restarts: int = 0
    last_seq: int | None = None
    last_batch_at: float | None = None
    block_size: int | None = None

    def describe(self) -> dict[str, Any]:
        age = None if self.last_batch_at is None else round(time.monotonic() - self.last_batch_at, 1)
        return {"endpoint": self.endpoint, "batches": self.batches, "events": self.events,
                "skipped_events": self.skipped_events, "bad_messages": self.bad_messages,
                "gaps": self.gaps, "engine_restarts": self.engine_restarts,
                "last_seq": self.last_seq, "last_batch_age_s": age, "block_size": self.block_size}


@dataclass
class EngineFeed:
    """One engine's events, applied to whatever registration its instance id has now."""

    instance_id: str
    endpoint: str
    models: AffinityModels
    lookup: Callable[[str], InstanceRecord | None]
    block_tokens: int
    stats: FeedStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = FeedStats(self.endpoint)

    def receive(self, frames: list[bytes]) -> None:
        """One ZMQ message."""
        try:
            seq, events, skipped = decode(frames)
        except FrameError as error:
            self.stats.bad_messages += 1
            if self.stats.bad_messages == 1:
                log.warning("KV events of %s from %s: %s (further ones are only counted)",
                            self.instance_id, self.endpoint, error)
            return
        record = self.lookup(self.instance_id)
        if record is None:
            return
        where = (record.slot, record.generation)
        self._follow_sequence(seq, where)
        self.stats.batches += 1
        self.stats.events += len(events)
        self.stats.skipped_events += skipped
        self.stats.last_batch_at = time.monotonic()
        for event in events:
            self._apply(event, where)

    def _follow_sequence(self, seq: int, where: tuple[int, int]) -> None:
        last, self.stats.last_seq = self.stats.last_seq, seq
        if last is None or seq == last + 1:
            return
        if seq <= last:
            self.stats.engine_restarts += 1
            why = f"its sequence went from {last} back to {seq} (the engine restarted)"
        else:
            self.stats.gaps += 1
            why = f"{seq - last - 1} of its event batches were lost"
        log.warning("KV events of %s: %s; its prefix entries are emptied until it reports again",
                    self.instance_id, why)
        self.models.engine_cleared(*where)

    def _apply(self, event: KvEvent, where: tuple[int, int]) -> None:
        if event.medium not in _OWN_CACHE:
            self.stats.skipped_events += 1
        elif isinstance(event, BlockStored):
            self._check_block_size(event.block_size)
            self.models.engine_stored(*where, _keys(event.block_hashes),
                                      event.block_size or self.block_tokens)
        elif isinstance(event, BlockRemoved):
            self.models.engine_removed(*where, _keys(event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            self.models.engine_cleared(*where)

    def _check_block_size(self, size: int) -> None:
        if size and size != self.stats.block_size:
            self.stats.block_size = size
            if size != self.block_tokens:
                log.error("KV events of %s: the engine's blocks are %d tokens, but "
                          "PROXY_AFFINITY_BLOCK_TOKENS is %d: no prompt will match them; set it to %d",
                          self.instance_id, size, self.block_tokens, size)


def _keys(blocks: list[BlockHash]) -> list[int]:
    """The index keys of the blocks an event names."""
    return [engine_block_key(block_number(block)) for block in blocks]


MISSING_EXTRA = "KV cache events need pyzmq, of the engine-kv extra (pip install 'cacheroute-proxy[engine-kv]')"


def zmq_missing() -> str | None:
    """Why no engine can be subscribed to, or None."""
    try:
        import zmq.asyncio  # noqa: F401
    except ImportError:
        return MISSING_EXTRA
    return None


class KvEventFeeds:
    """The subscriptions: one task per engine with a publisher."""

    def __init__(self, registry: InstanceRegistry, models: AffinityModels,
                 configured: dict[str, str], block_tokens: int, enabled: bool = True) -> None:
        self.enabled = enabled  # the workers hash prompts as the engines do
        self._registry = registry
        self._models = models
        self._configured = configured
        self._block_tokens = block_tokens
        self._feeds: dict[str, tuple[EngineFeed, asyncio.Task[None]]] = {}
        self._context: Any = None
        self._zmq_ok: bool | None = None  # pyzmq is imported once an instance has an endpoint
        self._failed_at: dict[str, float] = {}

    def wanted(self) -> dict[str, str]:
        """Instance id -> endpoint, for the alive instances that publish."""
        wanted: dict[str, str] = {}
        if not self.enabled:
            return wanted
        for record in self._registry.records(include_dead=False):
            endpoint = self._configured.get(record.instance_id) or record.meta.get("kv_events_endpoint")
            if isinstance(endpoint, str) and endpoint.startswith(("tcp://", "ipc://")):
                wanted[record.instance_id] = endpoint
        return wanted

    def reconcile(self) -> None:
        wanted = self.wanted()
        if wanted and not self._zmq_usable(wanted):
            return
        now = time.monotonic()
        for instance_id, (feed, task) in list(self._feeds.items()):
            if task.done():  # it failed, and said why
                self._failed_at[instance_id] = now
            elif wanted.get(instance_id) == feed.endpoint:
                continue
            task.cancel()
            del self._feeds[instance_id]
            log.info("KV events of %s: unsubscribed from %s", instance_id, feed.endpoint)
        for instance_id, endpoint in wanted.items():
            if instance_id not in self._feeds and now - self._failed_at.get(instance_id, -RETRY_S) >= RETRY_S:
                feed = EngineFeed(instance_id, endpoint, self._models, self._registry.get,
                                  self._block_tokens)
                self._feeds[instance_id] = (feed, asyncio.create_task(self._run(feed)))
                log.info("KV events of %s: subscribed to %s", instance_id, endpoint)

    def _zmq_usable(self, wanted: dict[str, str]) -> bool:
        if self._zmq_ok is None:
            missing = zmq_missing()
            self._zmq_ok = missing is None
            if missing:  # an agent's meta.kv_events_endpoint; PROXY_KV_EVENTS is checked at start
                log.error("%s: not subscribing to %s", missing, ", ".join(sorted(wanted)))
        return self._zmq_ok

    async def run(self) -> None:
        try:
            while True:
                try:
                    self.reconcile()
                except Exception:  # a bug here must not stop the sidecar's other loops
                    log.exception("KV event feeds failed to reconcile")
                await asyncio.sleep(RECONCILE_S)
        finally:
            for _, task in self._feeds.values():
                task.cancel()
            await asyncio.gather(*(task for _, task in self._feeds.values()), return_exceptions=True)
            self._feeds.clear()
            if self._context is not None:
                self._context.term()

    async def _run(self, feed: EngineFeed) -> None:
        import zmq
        import zmq.asyncio

        if self._context is None:
            self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            socket.connect(feed.endpoint)  # ZMQ reconnects by itself while the engine is away
            while True:
                feed.receive(await socket.recv_multipart())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events of %s from %s: the subscription failed", feed.instance_id,
                          feed.endpoint)
        finally:
            socket.close()

    def describe(self) -> dict[str, Any]:
        return {instance_id: feed.stats.describe() for instance_id, (feed, _) in self._feeds.items()}
