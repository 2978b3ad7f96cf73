"""The ``/sim`` control routes tests drive both simulators with.

- ``GET /sim/config`` / ``POST /sim/config`` (partial JSON update of the knobs, validated) /
  ``POST /sim/config/reset`` (back to the start-time knobs);
- ``POST /sim/release``: let every currently held request go on -> ``{"released": n}``;
- ``GET /sim/stats`` / ``POST /sim/stats/reset``.
What a simulator's stats hold and how it words a bad /sim/config body stay its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.common.responses import json_response
from cacheroute_sim.common.validation import ConfigError


class Controlled(Protocol):
    """What the routes need from a simulator's shared state."""

    @property
    def knobs(self) -> KnobStore[Any]: ...

    def release_held(self) -> int: ...

    def stats_snapshot(self) -> dict[str, Any]: ...

    def reset_stats(self) -> None:
        """Zero the counters (gauges describing the present stay)."""


class BadBody(Exception):
    """Raised by a PatchReader: the body is no JSON object; answer 400 with ``payload``."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.payload = payload


# Reads the JSON object a POST /sim/config carries, or raises BadBody.
PatchReader = Callable[[Request], Awaitable[dict[str, Any]]]


async def read_json_object(request: Request) -> dict[str, Any]:
    """The usual PatchReader: invalid JSON and non-objects are BadBody."""
    try:
        patch = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        raise BadBody({"error": "invalid_json"}) from None
    if not isinstance(patch, dict):
        raise BadBody({"error": "invalid_request", "detail": "body must be a JSON object"})
    return patch


def control_routes(state: Controlled, read_patch: PatchReader) -> list[Route]:
    async def get_config(request: Request) -> Response:
        return json_response(state.knobs.current.to_dict())

    async def update_config(request: Request) -> Response:
        try:
            knobs = state.knobs.update(await read_patch(request))
        except BadBody as exc:
            return json_response(exc.payload, 400)
        except ConfigError as exc:
            return json_response({"error": "invalid_request", "detail": str(exc)}, 400)
        return json_response(knobs.to_dict())

    async def reset_config(request: Request) -> Response:
        return json_response(state.knobs.reset().to_dict())

    async def release(request: Request) -> Response:
        return json_response({"released": state.release_held()})

    async def get_stats(request: Request) -> Response:
        return json_response(state.stats_snapshot())

    async def reset_stats(request: Request) -> Response:
        state.reset_stats()
        return json_response(state.stats_snapshot())

    return [
        Route("/sim/config", get_config, methods=["GET"]),
        Route("/sim/config", update_config, methods=["POST"]),
        Route("/sim/config/reset", reset_config, methods=["POST"]),
        Route("/sim/release", release, methods=["POST"]),
        Route("/sim/stats", get_stats, methods=["GET"]),
        Route("/sim/stats/reset", reset_stats, methods=["POST"]),
    ]
