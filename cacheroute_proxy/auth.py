"""An optional bearer token for the control plane (and, if asked, the debug endpoints).

Without it anyone who reaches the control port could register an instance and receive
traffic, or unregister the real ones, as with the original Proxy. The
comparison is constant-time; the token is never logged.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from .config import ENV_NAMES, ConfigError
from .http import HTTPError
from .value_rules import read_token_file


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The configured token: PROXY_CP_TOKEN_FILE (preferred: not in the environment) or
    PROXY_CP_TOKEN; None when neither is set."""
    if token_file:
        try:
            return read_token_file(token_file)
        except ValueError as exc:
            raise ConfigError(f"{ENV_NAMES['cp_token_file']}: {exc}") from None
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
