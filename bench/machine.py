"""What a results file records about where it ran, and what a contender costs: the CPU seconds
and resident memory of its process trees, the machine, the tools' versions; and the writing of
the file."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

_ROOT = Path(__file__).resolve().parent.parent


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_record(module: str, argv: list[str] | None, started_at: str, machine: dict[str, Any]) -> dict[str, Any]:
    """What a results file opens with: the command that made it (quoted for a shell: an argument
    may hold a space), when, and on what machine."""
    return {"command": f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv),
            "started_at": started_at, "finished_at": utc_now(), "machine": machine}


def git_commit(ref: str = "HEAD") -> str | None:
    """The checkout's commit (short hash) of `ref`; None outside a git checkout."""
    done = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short", ref],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def uncommitted_changes() -> bool:
    """Whether the checkout's tracked files differ from its commit (the code that ran is not
    exactly the commit's)."""
    done = subprocess.run(["git", "-C", str(_ROOT), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True, check=False)
    return bool(done.stdout.strip())


def write_report(out: Path, report: dict[str, Any]) -> None:
    """A benchmark's results file: indented JSON, its directory made if needed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def process_tree(pids: list[int]) -> list["psutil.Process"]:
    """The processes of these roots and all their descendants that are alive right now."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue  # a root that already ended costs nothing more
    return list(found.values())


def tree_cpu_s(pids: list[int]) -> float:
    """user + system CPU seconds of every live process in the trees (take a delta over a window:
    a child that ends inside the window takes its seconds with it)."""
    import psutil

    total = 0.0
    for proc in process_tree(pids):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


RoleOf = Callable[["psutil.Process", set[int]], str]


def tree_by_role(pids: list[int], role_of: RoleOf) -> dict[str, list["psutil.Process"]]:
    """The live processes of these trees by role: `role_of(process, root pids)` names each
    one's role (say, from its command line)."""
    import psutil

    roots, found = set(pids), {}
    for proc in process_tree(pids):
        try:
            role = role_of(proc, roots)
        except psutil.Error:
            continue
        found.setdefault(role, []).append(proc)
    return found


def tree_cpu_s_by_role(pids: list[int], role_of: RoleOf) -> dict[str, float]:
    """tree_cpu_s split by role (tree_by_role); seconds are summed per role (take deltas, as
    above)."""
    import psutil

    totals: dict[str, float] = {}
    for role, procs in tree_by_role(pids, role_of).items():
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def tree_rss_bytes(pids: list[int]) -> int:
    """Resident set size summed over the trees (shared pages are counted once per process)."""
    import psutil

    total = 0
    for proc in process_tree(pids):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


# --- machine and versions (what a results file records) -------------------------------------------
def machine_info() -> dict[str, Any]:
    """nproc, CPU model, kernel, memory, load average and CPU pressure right now."""
    import platform

    info: dict[str, Any] = {"nproc": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "kernel": platform.release(), "machine": platform.machine(),
                            "python": sys.version.split()[0],
                            "loadavg": [round(x, 2) for x in os.getloadavg()]}
    for key, path, pick in (("cpu_model", "/proc/cpuinfo", "model name"),
                            ("mem_total", "/proc/meminfo", "MemTotal")):
        try:
            line = next(ln for ln in Path(path).read_text().splitlines() if ln.startswith(pick))
            info[key] = line.split(":", 1)[1].strip()
        except (OSError, StopIteration):
            info[key] = None
    try:  # "some avg10=... avg60=..." lines: how long runnable tasks waited for a CPU
        info["pressure_cpu"] = Path("/proc/pressure/cpu").read_text().strip().splitlines()
    except OSError:
        info["pressure_cpu"] = None
    return info


def tool_versions(packages: tuple[str, ...] = (), commands: tuple[tuple[str, ...], ...] = ()) -> dict[str, Any]:
    """Installed versions of these Python packages and the first output line of these commands
    (e.g. ("nginx", "-v")); None for what is missing."""
    from importlib import metadata

    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    for argv in commands:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
            text = (done.stdout or done.stderr).strip().splitlines()
            out[argv[0]] = text[0] if text else None
        except (OSError, subprocess.TimeoutExpired):
            out[argv[0]] = None
    return out


