"""How a benchmark sends its requests, whatever they are: open loop (each at its planned time,
whether or not the ones before have been answered) or closed loop (a fixed number in flight, the
next sent as one ends)."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def open_loop(planned: Iterable[tuple[float, T]], send: Callable[[T], Awaitable[R]]) -> list[R]:
    """`send(item)` at each (seconds after the start, item), in plan order; the results in plan
    order."""
    begin, tasks = time.monotonic(), []
    for at_s, item in planned:
        delay = at_s - (time.monotonic() - begin)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(item)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(items: Iterator[T], concurrency: int, send: Callable[[T], Awaitable[R]],
                      seconds: float | None = None) -> list[R]:
    """`concurrency` senders, each sending the next item as its last one ends, until `items` is
    used up or `seconds` have passed; the results in the order they ended."""
    begin = time.monotonic()
    results: list[R] = []

    async def sender() -> None:
        for item in items:
            results.append(await send(item))
            if seconds is not None and time.monotonic() - begin >= seconds:
                return

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return results
