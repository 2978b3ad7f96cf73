"""The supervisor's one HTTP question to its children: does this URL answer with JSON?"""

from __future__ import annotations

import json
import urllib.request


def get_json(url: str, timeout_s: float = 1.0, token: str | None = None) -> object | None:
    """The decoded body, or None if nothing (or no JSON) answered in time."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
