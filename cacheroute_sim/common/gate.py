"""The release gate behind the hang/hold knobs and ``POST /sim/release``."""

from __future__ import annotations

import asyncio
from typing import Protocol


class HeldGauge(Protocol):
    """Where the gate counts who is waiting: the simulator's Stats (``held`` in /sim/stats)."""

    held: int


class ReleaseGate:
    """Holds requests until ``release()``; releases only those waiting at that moment.

    Each release swaps in a fresh Event, so a request arriving afterwards under a still-set
    hold knob is held again instead of sailing through a permanently set event.
    """

    def __init__(self, gauge: HeldGauge) -> None:
        self._gauge = gauge
        self._event = asyncio.Event()

    async def hold(self) -> None:
        """Wait for ``release()``; cancelled (client gone) frees the hold at once."""
        self._gauge.held += 1
        try:
            await self._event.wait()
        finally:
            self._gauge.held -= 1

    def release(self) -> int:
        """Let every request waiting now go on; returns how many that was."""
        released = self._gauge.held
        self._event.set()
        self._event = asyncio.Event()
        return released
