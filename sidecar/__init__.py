"""The sidecar: the single owner of what needs one serial writer.

It creates (or re-attaches to) the shared segment, serves the control plane (`app`: instance
registration, heartbeats, the debug routes and the dashboard), keeps the instance directory
(`registry`, published into the segment), turns the workers' events into per-instance queue
timelines and publishes pressure snapshots (`pressure`, `timelines`, `pace`), reaps dead
workers' shares (`reaper`) and registers the proxy with the Scheduler (`scheduler_link`,
`scheduler_wire`, `pool_resource`).
"""
