"""A pytest plugin (`-p tests.parallel` in pyproject's addopts): how the suite runs on parallel
workers (`make test`: pytest-xdist, `--dist loadgroup`).

Each test goes to whichever worker is free, except the tests of a module marked
`pytest.mark.xdist_group(__name__)`: those share processes a module-scoped fixture starts (or
state their last test checks) and run on one worker, as in a serial run. In a worker, the tests
marked `slow` come first: started last, one long test would run alone at the end while the
other workers wait.

Ports and segment names are kept apart per worker by cacheroute_sim/processes.py; the
leftover-segment check (tests/segment_guard.py) watches its own worker's."""

from __future__ import annotations

import pytest

from cacheroute_sim.processes import parallel_worker


def slow_first(items: list[pytest.Item]) -> None:
    """Reorder in place: the `slow` tests first, each kind in its collected order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Only in a parallel worker: run serially, the order makes no difference to the time, and
    # moved out of its module a test would make its module's fixtures start twice.
    if parallel_worker()[1] > 1:
        slow_first(items)
