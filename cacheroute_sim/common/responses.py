"""JSON responses, encoded by msgspec (the simulators never need Starlette's json module)."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status,
                    media_type="application/json")
