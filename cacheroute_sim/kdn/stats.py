"""Counters the tests read through ``GET /sim/stats`` (single event loop: plain ints)."""

from __future__ import annotations

from typing import Any

import msgspec

_GAUGES = frozenset({"active_transfers", "queued_transfers", "held"})


class Stats(msgspec.Struct, kw_only=True):
    searches: int = 0             # valid search requests answered (or being answered)
    search_items: int = 0         # items returned
    search_misses: int = 0        # ids returned in "miss"
    search_bytes: int = 0         # reply body bytes of searches
    injects: int = 0              # valid inject requests received
    injected_kids: int = 0
    text_only_kids: int = 0
    miss_kids: int = 0
    keys_injected: int = 0
    payload_bytes: int = 0        # KV bytes transferred (completed transfers)
    failed: int = 0               # answered with the fail_status knob
    invalid: int = 0              # rejected with 400
    active_transfers: int = 0     # KV transfers on a link now
    queued_transfers: int = 0     # KV transfers waiting for their link now
    max_active_transfers: int = 0
    held: int = 0                 # hung requests waiting for /sim/release now

    def reset(self) -> None:
        """Zero the counters; gauges describe the present and stay."""
        for name in self.__struct_fields__:
            if name not in _GAUGES:
                setattr(self, name, 0)
        self.max_active_transfers = self.active_transfers

    def snapshot(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)
