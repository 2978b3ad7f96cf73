"""CacheRoute Proxy, multi-process edition: what its roles share, and how it is started.

The roles are top-level packages of their own: `sidecar` (the single owner of the instance
directory and the queue timelines) and `proxy_workers` (the data plane, N processes), both on
`shm_schema` (the shared-memory contract). This package is what they have in common and what
an operator runs:

- `config` (every setting, from PROXY_* environment variables and flags), `logs`, `clock`,
  `http` and `auth` (the JSON error shape and the bearer token of both planes);
- `routing` (instance selection: the policies, what they read of the shared table,
  /debug/instance_loads);
- `http1`, `serving` and `systemd` (the HTTP/1.1 server every role serves on, running it and
  telling systemd);
- `supervisor` (the arbiter behind `cacheroute-proxy run`: sidecar first, then N workers,
  restarts, rolling restart, ordered stop) and `cli` (the `cacheroute-proxy` command).

It imports neither role: the launcher starts them as programs (`python -m sidecar`,
`python -m proxy_workers`). The simulated instance, KDN and Scheduler live in `cacheroute_sim`,
which nothing here imports.
"""
