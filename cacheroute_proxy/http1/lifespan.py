"""The ASGI lifespan protocol, just enough for Starlette's lifespan context."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

log = logging.getLogger("cacheroute.http")

ASGIApp = Callable[..., Any]


class Lifespan:
    """The ASGI lifespan protocol, just enough for Starlette's lifespan context."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._failed = False
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        if self._failed:
            log.error("the app failed to start")
        return not self._failed

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=10.0)

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self._app(scope, self._inbox.get, self._send)
        except BaseException as exc:
            if not self._started.is_set():
                log.error("lifespan startup failed", exc_info=exc)
                self._failed = True
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.failed":
            self._failed = True
            log.error("lifespan startup failed: %s", message.get("message", ""))
        if kind.startswith("lifespan.startup"):
            self._started.set()
        elif kind.startswith("lifespan.shutdown"):
            self._stopped.set()
