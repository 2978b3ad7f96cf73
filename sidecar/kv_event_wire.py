"""What a vLLM engine publishes about its KV cache (vLLM 0.32 `--kv-events-config
'{"enable_kv_cache_events": true}'`), as the sidecar reads it (docs/protocol.md, "vLLM's KV cache
events").

Each ZMQ message has three frames: a topic, an 8-byte big-endian sequence number, and a msgpack
batch `[timestamp, [event, ...], data_parallel_rank]`. An event is a map tagged by `type`;
fields at their default are left out, and fields this module does not name are ignored. A
block is named by the low 64 bits of its digest (an int), or by the digest's bytes when the
engine runs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from cacheroute_proxy.engine_prefix import published_hash

# An unsigned 64-bit name, or a digest (msgspec refuses anything else, and the event is skipped).
BlockHash = Annotated[int, msgspec.Meta(ge=0)] | bytes  # msgpack holds no int past 2**64 - 1


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    # Raw, each decoded on its own: an event kind a newer engine adds is skipped, not fatal.
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(EventBatch)
_event = msgspec.msgpack.Decoder(KvEvent)


class FrameError(ValueError):
    """A message that is not a KV event batch."""


def decode(frames: list[bytes]) -> tuple[int, list[KvEvent], int]:
    """(sequence, the events this module knows, how many it skipped) of one message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise FrameError(f"expected [topic, 8-byte sequence, batch], got {len(frames)} frames")
    try:
        batch = _batch.decode(frames[2])
    except msgspec.DecodeError as error:
        raise FrameError(f"not a KV event batch: {error}") from None
    events: list[KvEvent] = []
    for raw in batch.events:
        try:
            events.append(_event.decode(raw))
        except msgspec.DecodeError:
            continue
    return int.from_bytes(frames[1], "big"), events, len(batch.events) - len(events)


def block_number(block: BlockHash) -> int:
    """A block's name as the int form publishes it."""
    return published_hash(block) if isinstance(block, bytes) else block
