"""The compiled parts, all optional (where no compiler is found the install goes on and the
Python twin of each runs): WorkerRow's counter-lane update (shm_schema/_lanes.c), a worker's
event-ring write (shm_schema/_ring.c), the
least_load selector (cacheroute_proxy/routing/_least_load.c) and a relayed stream's whole
chunks passed to the client as they came (cacheroute_proxy/http1/_chunk_pass.c; its twin is
the ordinary path, which parses them)."""

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add, so the C selector's floats are least_load's Python ones.
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off"]

setup(ext_modules=[
    Extension("shm_schema._lanes", ["shm_schema/_lanes.c"], optional=True, extra_compile_args=FLAGS),
    Extension("shm_schema._ring", ["shm_schema/_ring.c"], optional=True, extra_compile_args=FLAGS),
    Extension("cacheroute_proxy.routing._least_load", ["cacheroute_proxy/routing/_least_load.c"],
              optional=True, extra_compile_args=FLAGS),
    Extension("cacheroute_proxy.http1._chunk_pass", ["cacheroute_proxy/http1/_chunk_pass.c"],
              optional=True, extra_compile_args=FLAGS),
])
