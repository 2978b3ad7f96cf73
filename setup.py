"""The compiled parts, both optional (where no compiler is found the install goes on and the
Python twin of each runs): WorkerRow's counter-lane update (shm_schema/_lanes.c) and the
least_load plan's choice (proxy_workers/_select.c)."""

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add, so the C plan's floats are the generated Python's.
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off"]

setup(ext_modules=[
    Extension("shm_schema._lanes", ["shm_schema/_lanes.c"], optional=True, extra_compile_args=FLAGS),
    Extension("proxy_workers._select", ["proxy_workers/_select.c"], optional=True, extra_compile_args=FLAGS),
])
