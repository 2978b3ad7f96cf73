"""Benchmarks: each one measures, bounded in time, against real processes on 127.0.0.1, and
writes a results file that `python -m bench.report` turns into BENCHMARKS.md. Their own tests
are in bench/tests/."""
