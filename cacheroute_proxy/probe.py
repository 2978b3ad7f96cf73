"""The supervisor's HTTP questions to its children and to the control plane: JSON over GET,
with the bearer token when the debug endpoints require one."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def fetch(url: str, token: str | None = None, timeout: float = 3.0) -> Any:
    """The decoded body; raises OSError / ValueError if nothing (or no JSON) answered."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get_json(url: str, timeout_s: float = 1.0, token: str | None = None) -> object | None:
    """The decoded body, or None if nothing (or no JSON) answered in time."""
    try:
        return fetch(url, token, timeout_s)
    except (OSError, ValueError):
        return None
