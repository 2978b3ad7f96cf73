"""An optional bearer token for the control plane (and, if asked, the debug endpoints).

Without it anyone who reaches the control port could register an instance and receive
traffic, or unregister the real ones, as with the original Proxy. The
comparison is constant-time; the token is never logged.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.requests import Request

from .config import ConfigError
from .http import HTTPError


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The configured token: PROXY_CP_TOKEN_FILE (preferred: not in the environment) or
    PROXY_CP_TOKEN; None when neither is set."""
    if token_file:
        try:
            value = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"PROXY_CP_TOKEN_FILE: cannot read {token_file}: {exc.strerror}") from None
        if not value:
            raise ConfigError(f"PROXY_CP_TOKEN_FILE: {token_file} is empty")
        return value
    return token or None


class TokenGuard:
    def __init__(self, token: str | None) -> None:
        self._expected = None if token is None else token.encode()

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def check(self, request: Request) -> None:
        """HTTPError 401 unless the request carries the token (no-op when none is set)."""
        if self._expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._expected):
            raise HTTPError(401, "unauthorized", "missing or wrong bearer token",
                            {"WWW-Authenticate": "Bearer"})
