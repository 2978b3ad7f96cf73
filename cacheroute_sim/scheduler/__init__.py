"""A simulated Scheduler control plane (docs/protocol.md, "Scheduler control plane"): what the
proxy's sidecar registers with.

``python -m cacheroute_sim.scheduler --port 7002``: register / heartbeat / unregister with the original
Scheduler's shapes, bodies validated (422 naming the field), 404 for heartbeats of unknown
ids, TTL expiry; debug routes listing proxies, the last ``pool_resource`` each sent and call
counts; fault knobs (fail with a status, hang) and ``POST /sim/restart`` (forget every proxy,
as a restarted Scheduler would).
"""
