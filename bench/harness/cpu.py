"""What a contender costs while it is measured: the CPU seconds (user + system, read from /proc
through psutil) and the resident memory of its process trees, whole or split by the role of
each process, and `charged`, which runs a load and charges the contender what it spent on it."""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import psutil

RoleOf = Callable[[psutil.Process, set[int]], str]


def process_tree(pids: list[int]) -> list[psutil.Process]:
    """The processes of these roots and all their descendants that are alive right now."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue  # a root that already ended costs nothing more
    return list(found.values())


def user_system_s(proc: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of one process so far; zeros for one that has ended."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0, 0.0
    return times.user, times.system


def cpu_s(proc: psutil.Process) -> float:
    """user + system CPU seconds of one process so far; 0 for one that has ended."""
    return sum(user_system_s(proc))


def tree_cpu_s(pids: list[int]) -> float:
    """user + system CPU seconds of every live process in the trees (take a delta over a window:
    a child that ends inside the window takes its seconds with it)."""
    return sum(cpu_s(proc) for proc in process_tree(pids))


def tree_by_role(pids: list[int], role_of: RoleOf) -> dict[str, list[psutil.Process]]:
    """The live processes of these trees by role: `role_of(process, root pids)` names each
    one's role (say, from its command line)."""
    roots: set[int] = set(pids)
    found: dict[str, list[psutil.Process]] = {}
    for proc in process_tree(pids):
        try:
            role = role_of(proc, roots)
        except psutil.Error:
            continue
        found.setdefault(role, []).append(proc)
    return found


def tree_rss_bytes(pids: list[int]) -> int:
    """Resident set size summed over the trees (shared pages are counted once per process)."""
    total = 0
    for proc in process_tree(pids):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


class Charged(Protocol):
    """What `charged` needs of a contender (bench/harness/contenders.py's Contender)."""

    def cpu_seconds(self) -> float: ...

    def cpu_seconds_by_role(self) -> dict[str, float]: ...

    def rss_mb(self) -> float: ...


def charged(contender: Charged, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `load()` and add to its result the contender's CPU seconds over it (`cpu_s`, and
    `cpu_s_by_role` where the contender has roles), the wall time (`wall_s`) and its RSS after it
    (`rss_mb`)."""
    roles_before = contender.cpu_seconds_by_role()
    cpu_before, started = contender.cpu_seconds(), time.monotonic()
    result = load()
    result["cpu_s"] = round(contender.cpu_seconds() - cpu_before, 4)
    result["wall_s"] = round(time.monotonic() - started, 3)
    roles_after = contender.cpu_seconds_by_role()
    if roles_after:
        result["cpu_s_by_role"] = {role: round(seconds - roles_before.get(role, 0.0), 4)
                                   for role, seconds in sorted(roles_after.items())}
    result["rss_mb"] = round(contender.rss_mb(), 1)
    return result


def per_1k(result: dict[str, Any], done: int | None) -> dict[str, Any]:
    """CPU seconds per 1,000 of what was done (requests or streams), whole tree and by role."""
    return per_unit(result, done, 1000, "1k")


def per_unit(result: dict[str, Any], done: int | None, scale: float, unit: str) -> dict[str, Any]:
    """CPU seconds per `scale` of what was done, whole tree and by role, as `cpu_s_per_<unit>`
    and `cpu_s_per_<unit>_by_role`."""
    if done:
        result[f"cpu_s_per_{unit}"] = round(result["cpu_s"] / done * scale, 4)
        if "cpu_s_by_role" in result:
            result[f"cpu_s_per_{unit}_by_role"] = {role: round(s / done * scale, 4)
                                                   for role, s in result["cpu_s_by_role"].items()}
    return result
