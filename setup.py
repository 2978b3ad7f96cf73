"""The one compiled part: WorkerRow's counter-lane update (shm_schema/_lanes.c). Optional: where
no compiler is found the install goes on and shm_schema.counters runs its Python closures."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shm_schema._lanes", ["shm_schema/_lanes.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"])])
