"""The exit statuses the roles share, so the supervisor (and systemd's RestartPreventExitStatus=)
tells a process that cannot start -- restarting it would only loop -- from one that crashed; and
a free-port check the supervisor runs before it starts anything."""

from __future__ import annotations

import errno
import socket

CANNOT_START = 2  # bad configuration, a segment it must not use, no free worker row
SERVER_FAILED = 3  # uvicorn did not start serving
SERVICE_ADDRESS_IN_USE = 4  # a worker: the shared service address (PROXY_DP_HOST:PROXY_DP_PORT)
PRIVATE_ADDRESS_IN_USE = 5  # a worker: its private address (PROXY_WORKER_PRIVATE_*)
CONTROL_ADDRESS_IN_USE = 6  # the sidecar: the control plane (PROXY_CP_HOST:PROXY_CP_PORT)
ADDRESS_IN_USE = frozenset({SERVICE_ADDRESS_IN_USE, PRIVATE_ADDRESS_IN_USE, CONTROL_ADDRESS_IN_USE})
NOT_RESTARTED = frozenset({CANNOT_START}) | ADDRESS_IN_USE


def host_port(host: str, port: int) -> str:
    """host:port as a URL writes it ([::1]:8001 for IPv6)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_error(host: str, port: int, *, reuse_port: bool) -> OSError | None:
    """Whether a listener could bind (host, port) now, with the options the role will use:
    the error it would get (EADDRINUSE: someone else listens there), or None. Binds without
    listening and closes at once, so no connection is ever queued on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        return None
    except OSError as exc:
        return exc
    finally:
        sock.close()


def in_use_message(host: str, port: int, what: str, exc: OSError) -> str:
    reason = "another process listens there" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return f"cannot bind the {what} on {host_port(host, port)}: {reason}"
