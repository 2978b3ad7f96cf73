"""Instance selection, in one room.

- `policy`: what a policy is (`Policy`, one `choose`) and what a choice tells (`Choice`);
- `round_robin`, `least_load`, `kv_aware`: one policy a module; least_load's score is in
  Python there and in C beside it (`_least_load.c`), held equal bit for bit;
- `registry`: the policies by name and alias, and the one place that builds one;
- `load_view`: what a selection reads of the shared table (no lock, no syscall, no IPC);
- `report`: /debug/instance_loads, the same from every worker and from the sidecar.

A worker's router (proxy_workers/router.py) does what surrounds a choice: the candidates, the
lease, the retry elsewhere, kv_aware's claim. What a request would cost on each instance,
which needs the worker's affinity index, is the worker's too (proxy_workers/affinity.py),
handed to kv_aware as its pricing.
"""
