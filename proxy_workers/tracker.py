"""This worker's side of the event channel: reserve / first-token / complete events for the
sidecar's timelines, and a full re-announcement of live requests when the sidecar restarts.

A request key is `row << 48 | sequence`, unique on the host while the row is held.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheroute_proxy.clock import now_us
from shm_schema import Segment, WorkerRow, layout
from shm_schema.events import EventKind, EventWriter

ROW_SHIFT = 48


@dataclass
class LiveRequest:
    slot: int
    generation: int
    reserved_at_us: int
    service_us: int
    decode_us: int
    decode_tokens: int
    prompt_tokens: int
    first_token_us: int | None = None


class RequestTracker:
    def __init__(self, seg: Segment, row: WorkerRow, spill_limit: int = 65536) -> None:
        self._seg = seg
        self._writer = EventWriter(seg, row.row, spill_limit)
        self._prefix = row.row << ROW_SHIFT
        self._seq = 0
        self._live: dict[int, LiveRequest] = {}
        self._epoch = seg.load(layout.H_SIDECAR_EPOCH)
        self.resyncs = 0

    @property
    def writer(self) -> EventWriter:
        return self._writer

    def new_key(self) -> int:
        self._seq += 1
        return self._prefix | self._seq

    def reserve(self, key: int, slot: int, generation: int, service_ms: float, decode_ms: float,
                decode_tokens: int, prompt_tokens: int) -> None:
        live = LiveRequest(slot, generation, now_us(), int(service_ms * 1000), int(decode_ms * 1000),
                           decode_tokens, prompt_tokens)
        self._live[key] = live
        self._emit(EventKind.RESERVE, key, live, live.reserved_at_us)

    def first_token(self, key: int) -> None:
        live = self._live.get(key)
        if live is not None and live.first_token_us is None:
            live.first_token_us = now_us()
            self._emit(EventKind.FIRST_TOKEN, key, live, live.first_token_us)

    def complete(self, key: int, failed: bool) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            self._emit(EventKind.COMPLETE, key, live, now_us(), a=int(failed))

    def tick(self) -> None:
        """Periodic: move spilled events into the ring; re-announce after a sidecar restart."""
        self._check_epoch()
        self._writer.flush()

    def _emit(self, kind: int, key: int, live: LiveRequest, t_us: int, a: int | None = None) -> None:
        self._check_epoch()
        if a is None:
            self._writer.write(kind, self._epoch, key, live.slot, live.generation, t_us,
                               live.service_us, live.decode_us, live.decode_tokens, live.prompt_tokens)
        else:
            self._writer.write(kind, self._epoch, key, live.slot, live.generation, t_us, a)

    def _check_epoch(self) -> None:
        epoch = self._seg.load(layout.H_SIDECAR_EPOCH)
        if epoch == self._epoch:
            return
        # A new sidecar discards what was written for the old one: replace it with the state of
        # every request still in flight.
        self._epoch = epoch
        self._writer.discard_spill()
        self.resyncs += 1
        for key, live in self._live.items():
            self._writer.write(EventKind.RESYNC, epoch, key, live.slot, live.generation,
                               live.reserved_at_us, live.service_us, live.decode_us,
                               live.decode_tokens, live.prompt_tokens)
            if live.first_token_us is not None:
                self._writer.write(EventKind.FIRST_TOKEN, epoch, key, live.slot, live.generation,
                                   live.first_token_us)

