"""The CLI's questions to the control plane: JSON over GET, with the bearer token when one is
configured, every failure turned into one ControlPlaneError whose text an operator can act on
(the address tried, the HTTP status and the server's own error detail)."""

from __future__ import annotations

import json
import urllib.error
from dataclasses import dataclass
from typing import Any

from .. import probe
from ..auth import load_token
from ..config import Settings

TIMEOUT_S = 3.0


class ControlPlaneError(Exception):
    """The control plane did not answer, or answered with an error (exit code 1)."""


@dataclass(frozen=True)
class ControlPlane:
    base_url: str
    token: str | None = None
    timeout_s: float = TIMEOUT_S

    @classmethod
    def configured(cls, url: str | None) -> "ControlPlane":
        """`--url` if given, else PROXY_CP_HOST/PROXY_CP_PORT; the token from
        PROXY_CP_TOKEN_FILE/PROXY_CP_TOKEN. Raises ConfigError/ValueError (a usage error)."""
        settings = Settings.from_env()
        base = url or local_url(settings.cp_host, settings.cp_port)
        return cls(base.rstrip("/"), load_token(settings.cp_token, settings.cp_token_file))

    def get(self, path: str) -> Any:
        url = self.base_url + path
        try:
            return probe.fetch(url, self.token, self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise ControlPlaneError(f"{url} answered HTTP {exc.code}{_detail(exc)}") from None
        except urllib.error.URLError as exc:
            raise ControlPlaneError(f"control plane unreachable at {self.base_url}: {exc.reason}") from None
        except OSError as exc:  # a timeout or a reset while reading the body
            raise ControlPlaneError(f"control plane unreachable at {self.base_url}: {exc}") from None
        except ValueError:
            raise ControlPlaneError(f"{url} did not answer JSON (is this a cacheroute control plane?)") from None


def local_url(host: str, port: int) -> str:
    """The URL of a control plane on this host: one that listens on every address
    (PROXY_CP_HOST=0.0.0.0 or ::) is asked on the loopback; an IPv6 address gets its brackets."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _detail(exc: urllib.error.HTTPError) -> str:
    """The proxy's error body (`{"error", "detail"}`), and what to do on a 401."""
    try:
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        body = {}
    parts = [str(body[k]) for k in ("error", "detail") if isinstance(body, dict) and body.get(k)]
    if exc.code == 401:
        parts.append("set PROXY_CP_TOKEN_FILE or PROXY_CP_TOKEN to the control plane's token")
    return f" ({': '.join(parts)})" if parts else ""
