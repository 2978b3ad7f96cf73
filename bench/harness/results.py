"""What a results file records about its run (the command that made it, the machine and its
load at the start and the end, the tools' versions) and the writing of the file. A date and a
commit may be recorded in the file; BENCHMARKS.md renders neither."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from cacheroute_sim.processes import ROOT

# A list of plain numbers (samples, series) written on one line, not one line per number.
_NUMBER_LIST = re.compile(r"\[\s*((?:-?[0-9.eE+-]+,?\s*)+)\]")


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_record(module: str, argv: list[str] | None, started_at: str, machine: dict[str, Any]) -> dict[str, Any]:
    """What a results file opens with: the command that made it (quoted for a shell: an argument
    may hold a space), when, and on what machine, with its load now that the run ends."""
    machine = {**machine, "at_end": machine.get("at_end") or load_now()}
    return {"command": f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv),
            "started_at": started_at, "finished_at": utc_now(), "machine": machine}


class Run:
    """One benchmark run's provenance: when it started and the machine then; `record()` at
    its end gives what its results file opens with (run_record)."""

    def __init__(self, module: str, argv: list[str] | None) -> None:
        self.module, self.argv = module, argv
        self.started_at, self.machine = utc_now(), machine_info()

    def record(self) -> dict[str, Any]:
        return run_record(self.module, self.argv, self.started_at, self.machine)


def git_commit(ref: str = "HEAD") -> str | None:
    """The checkout's commit (short hash) of `ref`; None outside a git checkout."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def uncommitted_changes() -> bool:
    """Whether the checkout's tracked files differ from its commit (the code that ran is not
    exactly the commit's)."""
    done = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True, check=False)
    return bool(done.stdout.strip())


def write_report(out: Path, report: dict[str, Any], *, indent: int = 2, compact_numbers: bool = False) -> None:
    """A benchmark's results file, replaced in one step (a reader never sees half of it), its
    directory made if needed; compact_numbers: lists of plain numbers on one line."""
    text = json.dumps(report, indent=indent)
    if compact_numbers:
        text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text + "\n")
    partial.replace(out)
    print(f"wrote {out}")


# --- machine and versions (what a results file records) -------------------------------------------
def machine_info() -> dict[str, Any]:
    """nproc, CPU model, kernel, memory, load average and CPU pressure right now."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "kernel": platform.release(), "machine": platform.machine(),
                            "python": sys.version.split()[0],
                            **load_now()}
    for key, path, pick in (("cpu_model", "/proc/cpuinfo", "model name"),
                            ("mem_total", "/proc/meminfo", "MemTotal")):
        try:
            line = next(ln for ln in Path(path).read_text().splitlines() if ln.startswith(pick))
            info[key] = line.split(":", 1)[1].strip()
        except (OSError, StopIteration):
            info[key] = None
    return info


def load_now() -> dict[str, Any]:
    """The load average and the CPU pressure ("some avg10=... avg60=..." lines: how long
    runnable tasks waited for a CPU) right now."""
    try:
        pressure: list[str] | None = Path("/proc/pressure/cpu").read_text().strip().splitlines()
    except OSError:
        pressure = None
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "pressure_cpu": pressure}


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
