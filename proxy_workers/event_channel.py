"""This worker's side of the event channel: reserve / first-token / complete events for the
sidecar's timelines, and a full re-announcement of live requests when the sidecar restarts.

A request key (shm_schema.bitfields.RequestKey) names this worker's row and a per-worker
sequence, so it is unique on the host while the row is held.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import msgspec

from cacheroute_proxy.clock import now_us
from cacheroute_proxy.doorbell import Bell
from shm_schema import Segment, WorkerRow, header
from shm_schema.bitfields import RequestKey
from shm_schema.events import EventWriter


class LiveRequest(msgspec.Struct, gc=False):
    """A request the sidecar has heard of, kept to re-announce it to a new one. A Struct out of
    the collector's sight: one per request, built without a Python-level __init__."""

    slot: int
    generation: int
    reserved_at_us: int
    service_us: int
    decode_us: int
    decode_tokens: int
    prompt_tokens: int
    first_token_us: int | None = None


class EventChannelWriter:
    """Writes this worker's events for the sidecar: a key per request, its reserve, first token
    and completion, the KV an instance now holds; and re-announces the live ones to a new sidecar."""

    def __init__(self, seg: Segment, row: WorkerRow, spill_limit: int = 65536,
                 ring_requests: bool = True) -> None:
        self._bell = Bell(seg.name)
        # ring_requests=False (PROXY_SIDECAR_WAKE=heartbeat): a request's events wake no sidecar.
        self._writer = EventWriter(seg, row.row, spill_limit, wake=self._bell.ring,
                                   ring_requests=ring_requests)
        # Consecutive keys of this row, from sequence 1: one C call per request.
        self._next_key = itertools.count(RequestKey.pack(row.row, 1)).__next__
        self._live: dict[int, LiveRequest] = {}
        # Read before every event, inline in the per-request ones (`_check_epoch` elsewhere).
        self._read_epoch = header.sidecar_epoch_reader(seg)
        self._epoch = self._read_epoch()
        self.resyncs = 0
        self._bell.ring()  # a new worker row: the sidecar looks at once (its reaper watches it)

    @property
    def writer(self) -> EventWriter:
        return self._writer

    def new_key(self) -> int:
        return self._next_key()

    def reserve(self, key: int, slot: int, generation: int, service_ms: float, decode_ms: float,
                decode_tokens: int, prompt_tokens: int, at_us: int | None = None) -> None:
        """Released to ready at `at_us` (now, if not given)."""
        live = LiveRequest(slot, generation, now_us() if at_us is None else at_us, int(service_ms * 1000),
                           int(decode_ms * 1000), decode_tokens, prompt_tokens)
        self._live[key] = live
        if self._read_epoch() != self._epoch:
            self._resync()
        self._writer.reserve(self._epoch, key, slot, generation, live.reserved_at_us,
                             live.service_us, live.decode_us, decode_tokens, prompt_tokens)

    def first_token(self, key: int) -> None:
        live = self._live.get(key)
        if live is not None and live.first_token_us is None:
            live.first_token_us = now_us()
            if self._read_epoch() != self._epoch:
                self._resync()
            self._writer.first_token(self._epoch, key, live.slot, live.generation, live.first_token_us)

    def complete(self, key: int, failed: bool) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            if self._read_epoch() != self._epoch:
                self._resync()
            self._writer.complete(self._epoch, key, live.slot, live.generation, now_us(), failed)

    def residency(self, slot: int, generation: int, keys: Sequence[int], tokens_each: int,
                  prefix: bool, prompt_blocks: int = 0) -> None:
        """Keys whose KV the instance now holds (acknowledged knowledge, or prefix blocks it was
        sent), three to an event. Not re-sent to a new sidecar: it keeps the published index."""
        self._check_epoch()
        write = self._writer.prefix if prefix else self._writer.resident
        t_us = now_us()
        for start in range(0, len(keys), 3):
            # A prompt's first event names it: it carries the prompt's size in blocks.
            named = (0 if start else prompt_blocks,) if prefix else ()
            write(self._epoch, slot, generation, t_us, tuple(keys[start:start + 3]), tokens_each, *named)

    def tick(self) -> None:
        """Periodic: move spilled events into the ring; re-announce after a sidecar restart."""
        self._check_epoch()
        self._writer.flush()

    @property
    def spilled(self) -> bool:
        """Events wait in the spill: ticks are due often, to move them into the ring."""
        return bool(self._writer.spilled)

    @property
    def live(self) -> bool:
        """Requests are live: a new sidecar must hear of them, if no event's own write (which
        checks the epoch) tells it first."""
        return bool(self._live)

    def _check_epoch(self) -> None:
        if self._read_epoch() != self._epoch:
            self._resync()

    def _resync(self) -> None:
        """A new sidecar discards what was written for the old one: replace it with the state of
        every request still in flight."""
        epoch = self._epoch = self._read_epoch()
        self._writer.discard_spill()
        self.resyncs += 1
        for key, live in self._live.items():
            self._writer.resync(epoch, key, live.slot, live.generation, live.reserved_at_us,
                                live.service_us, live.decode_us, live.decode_tokens,
                                live.prompt_tokens)
            if live.first_token_us is not None:
                self._writer.first_token(epoch, key, live.slot, live.generation,
                                         live.first_token_us)
