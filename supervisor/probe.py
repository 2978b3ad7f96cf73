"""The supervisor's one HTTP question to its children: does this URL answer with JSON?"""

from __future__ import annotations

import json
import urllib.request


def get_json(url: str, timeout_s: float = 1.0) -> object | None:
    """The decoded body, or None if nothing (or no JSON) answered in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
