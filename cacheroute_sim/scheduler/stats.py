"""Call counts the tests read through ``GET /sim/stats`` and ``GET /debug/proxies``."""

from __future__ import annotations

from typing import Any

import msgspec

_GAUGES = frozenset({"held"})


class Stats(msgspec.Struct, kw_only=True):
    register_calls: int = 0      # every POST /v1/proxy/register received
    heartbeat_calls: int = 0
    unregister_calls: int = 0
    registered: int = 0          # accepted registrations
    heartbeats_ok: int = 0
    heartbeats_unknown: int = 0  # answered 404: unknown proxy id
    unregistered: int = 0        # unregister of a known id
    invalid: int = 0             # rejected with 422
    failed: int = 0              # answered with the fail_status knob
    restarts: int = 0            # POST /sim/restart
    held: int = 0                # hung requests waiting for /sim/release now

    def reset(self) -> None:
        for name in self.__struct_fields__:
            if name not in _GAUGES:
                setattr(self, name, 0)

    def snapshot(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)
