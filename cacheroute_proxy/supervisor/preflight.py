"""What `cacheroute-proxy run` checks before it starts anything (and before it imports the rest
of the launcher, so an answer comes in a fraction of a second): the service and control-plane
addresses (and the dashboard's own, when PROXY_UI_LISTEN sets one) must be free. A taken one is said with its address and the launch stops, instead of
after the sidecar and every worker have started and failed one by one."""

from __future__ import annotations

from ..config import Settings
from .. import exits


def taken_address(settings: Settings) -> str | None:
    """The message for the first address taken, or None. The service address is tried with
    SO_REUSEPORT, as the workers bind it."""
    s = settings
    addresses = [(s.cp_host, s.cp_port, "control plane (PROXY_CP_HOST/PORT)", False),
                 (s.dp_host, s.dp_port, "service address (PROXY_DP_HOST/PORT)", True)]
    if s.ui_address is not None:
        addresses.append((*s.ui_address, "dashboard (PROXY_UI_LISTEN)", False))
    for host, port, what, reuse_port in addresses:
        error = exits.bind_error(host, port, reuse_port=reuse_port)
        if error is not None:
            return exits.in_use_message(host, port, what, error)
    return None
