"""The data plane's own refusals that a client should make again later: every 429 and 503 the
proxy answers itself carries `Retry-After`, in whole seconds.

An instance's own 429 or 503, relayed, keeps the instance's headers: only the instance knows
when it will take requests again.
"""

from __future__ import annotations

from typing import TypeVar

from cacheroute_proxy.http import HTTPError

E = TypeVar("E", bound=HTTPError)

# Seconds a client should wait, by the refusal's `error` code.
RETRY_AFTER_S = {
    "no_instance": 1,      # an instance that comes back is a candidate at its next heartbeat
    "queue_full": 1,       # a place in the queue frees as soon as one request is admitted
    "queue_timeout": 2,    # the queue did not move for PROXY_QUEUE_TIMEOUT_S: wait longer
    "worker_draining": 1,  # another worker of the port takes the retry at once
}


# The detail of a 503 `no_instance` when the directory has no alive instance at all.
NO_ALIVE_INSTANCE = "proxy has no alive instance"


def retry_after(code: str) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S[code])}


def no_instance(detail: str, kind: type[E] = HTTPError) -> E:  # type: ignore[assignment]
    """503 `no_instance`: nothing alive to send the request to, or nothing left after retries."""
    return kind(503, "no_instance", detail, retry_after("no_instance"))


class InstanceLeft(HTTPError):
    """The chosen instance left the table (unregistered, or re-registered as a new generation)
    before anything was sent to it: another instance may take the request."""


def instance_left() -> InstanceLeft:
    return no_instance("selected instance is no longer registered", InstanceLeft)


def queue_full(detail: str) -> HTTPError:
    return HTTPError(429, "queue_full", detail, retry_after("queue_full"))


def queue_timeout(detail: str) -> HTTPError:
    return HTTPError(503, "queue_timeout", detail, retry_after("queue_timeout"))
