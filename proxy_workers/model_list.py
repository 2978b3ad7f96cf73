"""`GET /v1/models` on a worker: the union of the models the alive instances serve, in OpenAI's
list format.

The models an instance serves are in its registration (capabilities and meta), which the
sidecar keeps in memory; the shared table has no room for them. So a worker asks the sidecar
(`GET /v1/models` on its control plane, sidecar/served_models.py) and keeps the answer: it
serves every request while the directory's sequence is unchanged (no instance came, went, or
left the candidate set), for at most `fresh_s` (a re-registration or a heartbeat can change an
instance's model without touching the directory). Requests arriving while an ask is under way
wait for it rather than asking again, so a worker asks at most once per `fresh_s` whatever the
request rate. With no alive instance in the directory nothing is asked: 503 `no_instance`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, NamedTuple

from starlette.responses import Response

from cacheroute_proxy.http import HTTPError, from_http_error
from shm_schema import DirectorySnapshot

from .refusals import NO_ALIVE_INSTANCE, no_instance
from .sidecar_reads import SidecarAnswer

MODELS_FRESH_S = 2.0


class _Kept(NamedTuple):
    directory_seq: int
    asked_at: float
    body: bytes


class ModelList:
    def __init__(self, directory: Callable[[], DirectorySnapshot], ask: Callable[[], Awaitable[SidecarAnswer]],
                 fresh_s: float = MODELS_FRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._directory = directory
        self._ask = ask
        self._fresh_s = fresh_s
        self._clock = clock
        self._kept: _Kept | None = None
        self._asking = asyncio.Lock()

    async def answer(self) -> Response:
        snapshot = self._directory()
        if not snapshot.alive:
            return from_http_error(no_instance(NO_ALIVE_INSTANCE))
        kept = self._fresh(snapshot.seq)
        if kept is None:
            async with self._asking:  # one ask at a time; who waited finds its answer kept
                kept = self._fresh(snapshot.seq)
                if kept is None:
                    return await self._ask_sidecar(snapshot.seq)
        return _listed(kept.body)

    def _fresh(self, seq: int) -> _Kept | None:
        kept = self._kept
        if kept is None or kept.directory_seq != seq or self._clock() - kept.asked_at >= self._fresh_s:
            return None
        return kept

    async def _ask_sidecar(self, seq: int) -> Response:
        try:
            answer = await self._ask()
        except HTTPError as exc:  # the sidecar did not answer: its last list, if it still holds
            kept = self._kept
            return _listed(kept.body) if kept is not None and kept.directory_seq == seq else from_http_error(exc)
        if answer.status != 200:
            return Response(answer.body, status_code=answer.status, media_type=answer.content_type)
        self._kept = _Kept(seq, self._clock(), answer.body)
        return _listed(answer.body)


def _listed(body: bytes) -> Response:
    return Response(body, media_type="application/json")
