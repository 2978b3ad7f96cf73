"""Routing quality with many workers: `python -m bench.routing --out bench/results/routing.json`.

The claim under test: N proxy workers sharing one load table route like one process that sees
everything. The scenario that stresses exactly that: heterogeneous simulated instances (one
several times slower, with fewer slots, so it is genuinely worse under load), bursty open-loop
arrivals (bursts with Poisson gaps: many requests land on different workers at the same
moment) and streaming requests of mixed lengths. The same seeded schedule is replayed against
every contender over the same instance processes; contenders are interleaved and repeated.

Modules, one job each: `schedule` (the seeded arrivals), `client` (the open-loop streaming
client), `sampler` (instance inflight and worker CPU sampled over time), `scenario` (instances
and contenders), `summary` (per-run figures, medians, checks), `run` (orchestration),
`__main__` (the command line).
"""
