"""The ports the tests and benchmarks hand out (cacheroute_sim/processes.py): free when picked,
outside the kernel's ephemeral range, and never handed out twice in a while. A port is only
taken when its server binds it; picked one by one, a supervisor's control plane once got
worker 1's private port, and a test read the sidecar's /healthz as the worker's."""

from __future__ import annotations

import socket

from cacheroute_sim.processes import SupervisorPorts, _listen_window, free_port, free_port_range


def test_a_supervisors_ports_are_one_free_range_outside_the_ephemeral_range():
    """One range checked free as a whole, so no two of them can be the same port."""
    window = _listen_window()
    for workers in (1, 2, 4, 16):
        for _ in range(50):
            ports = SupervisorPorts(workers, "cacheroute_test")
            every = [ports.dp_port, ports.cp_port, *(ports.private_base + i for i in range(workers))]
            assert every == list(range(every[0], every[0] + len(every))), every
            assert every[0] in window and every[-1] in window
            with socket.socket() as probe:  # free now: the one picked last can be bound
                probe.bind(("127.0.0.1", every[-1]))


def test_no_port_is_handed_out_twice_before_anything_binds_it():
    """Nothing binds these: every pick is free, and only the memory of what was handed out
    keeps them apart (2,250 random picks from ~22,000 ports would repeat one almost surely)."""
    handed: list[int] = []
    for n in range(300):
        handed.append(free_port())
        base = free_port_range(1 + n % 12)
        handed.extend(range(base, base + 1 + n % 12))
    assert len(handed) == len(set(handed))
