"""What the two simulators (cacheroute_sim.instance, .kdn) share, so one fix serves both.

Both are test doubles driven the same way: typed start-time config, run-time knobs behind
``/sim/config``, a release gate for hung requests, ``/sim/stats`` counters, the same CLI and log
shape. Each module here does one of those jobs; what differs (the knobs themselves, the
routes a simulator serves, its stats) stays in the simulator.
"""
