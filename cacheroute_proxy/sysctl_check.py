"""The sysctl check: the machine's kernel settings the proxy depends on, checked and said once
per start of the proxy, by the sidecar (the one role a machine runs once, first, under
`cacheroute-proxy run` and under systemd alike), never by each worker at each of its starts
and restarts.

Said at debug level: a machine without the sysctl file (a laptop running the demo, a test
machine) would otherwise print the same warning at every start; installing the file is a step
of docs/INSTALL.md."""

from __future__ import annotations

import logging

log = logging.getLogger("cacheroute.host")  # the name log filters already know

MIGRATE_REQ_PATH = "/proc/sys/net/ipv4/tcp_migrate_req"


def note_about_sysctls(migrate_req_path: str = MIGRATE_REQ_PATH) -> None:
    note_if_queued_connections_may_reset(migrate_req_path)


def note_if_queued_connections_may_reset(path: str = MIGRATE_REQ_PATH) -> None:
    """One debug line if a worker's restart would reset connections queued on its closing listener."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return  # not Linux >= 5.14: nothing to say that an operator could change
    if value == "0":
        log.debug("net.ipv4.tcp_migrate_req is 0: a worker that restarts resets the connections "
                  "still queued on its listener; see deploy/sysctl/90-cacheroute-proxy.conf")
