"""The ports the tests and benchmarks hand one `cacheroute-proxy run`: all different, all free
when picked, below the ephemeral range. Picked one by one they once collided (the control
plane took worker 1's private port, and a test read the sidecar's /healthz as the worker's)."""

from __future__ import annotations

import socket

from cacheroute_sim.processes import SupervisorPorts, _ephemeral_low


def test_a_supervisors_ports_are_one_free_range_below_the_ephemeral_range():
    """One range checked free as a whole, so no two of them can be the same port."""
    for workers in (1, 2, 4, 16):
        for _ in range(50):
            ports = SupervisorPorts(workers, "cacheroute_test")
            every = [ports.dp_port, ports.cp_port, *(ports.private_base + i for i in range(workers))]
            assert every == list(range(every[0], every[0] + len(every))), every
            assert max(every) < _ephemeral_low()
            with socket.socket() as probe:  # free now: the one picked last can be bound
                probe.bind(("127.0.0.1", every[-1]))
