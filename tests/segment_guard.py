"""A pytest plugin (`-p tests.segment_guard` in pyproject's addopts): the test module that
leaves a shared-memory file behind fails, names it, and the file is removed.

Two kinds are watched. The product's test segments (`cacheroute_test_*`) are checked after
each module, because a module's fixtures may hold one across its tests. vLLM's own files
(`psm_*`, `sem.mp-*`, hundreds of MB each) are checked once at the end of the session, because
the real-engine suite shares its engines across modules.

Only files that no live process maps count: a suite running beside this one (another
checkout, a benchmark) keeps its own. A parallel test worker (pytest-xdist) watches only the
segments it names (`cacheroute_test_gwN_*`): another worker's test may leave one unmapped for a
while on purpose (a SIGKILLed sidecar's, for the next start or `shm unlink` to find)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheroute_sim.processes import segment_prefix
from tests import harness

SHM = Path("/dev/shm")
ENGINE_FILES = ("psm_", "sem.mp-")
# A sidecar unlinks its segment as it exits, a moment after the test's last request.
SETTLE_S = 5.0


def shm_files(prefixes: tuple[str, ...]) -> set[str]:
    return {path.name for path in SHM.iterdir() if path.name.startswith(prefixes)}


def mapped_anywhere() -> set[str]:
    """Names of the /dev/shm files some live process has mapped."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        names.update(line.rsplit("/dev/shm/", 1)[1].removesuffix(" (deleted)")
                     for line in text.splitlines() if "/dev/shm/" in line)
    return names


# A file younger than this may be another process's, created a moment before it maps it
# (a multiprocessing semaphore is created, then opened): never taken for an orphan.
YOUNG_S = 2.0


def orphans(before: set[str], prefixes: tuple[str, ...]) -> set[str]:
    """Files new since `before` that no process maps and that are not brand new."""
    now = time.time()
    return {name for name in shm_files(prefixes) - before - mapped_anywhere()
            if now - _mtime(SHM / name) >= YOUNG_S}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # gone meanwhile: counted, and unlinking it again is harmless


def left_behind(before: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The files new since `before` that no process maps, still there after SETTLE_S, removed."""
    deadline = time.monotonic() + SETTLE_S
    while (new := orphans(before, prefixes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name in new:
        (SHM / name).unlink(missing_ok=True)
    return sorted(new)


def watched_segments() -> tuple[str, ...]:
    """The test segments this process's tests name (with the parallel worker's name in it)."""
    return (segment_prefix(harness.TEST_SEGMENTS),)


@pytest.fixture(scope="module", autouse=True)
def no_test_segment_left() -> Iterator[None]:
    watched = watched_segments()
    before = shm_files(watched)
    yield
    if leaked := left_behind(before, watched):
        pytest.fail(f"this module left shared-memory segments behind (now removed): {leaked}")


@pytest.fixture(scope="session", autouse=True)
def no_engine_shm_left() -> Iterator[None]:
    before = shm_files(ENGINE_FILES)
    yield
    if leaked := left_behind(before, ENGINE_FILES):
        pytest.fail(f"vLLM's shared memory was left behind (now removed): {leaked}")
