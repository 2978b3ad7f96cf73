"""Who is a process, in a way that survives pid reuse: pid plus kernel start time (packed
into one word by bitfields.ProcessIdentity).

The start time is field 22 of /proc/<pid>/stat, in clock ticks since boot. It never changes
for a process and a new process with a recycled pid gets a different one, so the pair names
exactly one process for the life of the machine.
"""

from __future__ import annotations

import os

from .bitfields import ProcessIdentity


def _stat_after_comm(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first), or
    None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:  # no such process (or not ours to read)
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(b")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks, or None if there is no such process."""
    fields = _stat_after_comm(pid)
    return None if fields is None else int(fields[19])  # field 22 overall


def own_identity() -> int:
    pid = os.getpid()
    ticks = start_ticks(pid)
    assert ticks is not None
    return ProcessIdentity.pack(pid, ticks)


def is_alive(identity: int) -> bool:
    """True if the process that `identity` names still runs (a zombie counts as dead)."""
    pid, ticks = ProcessIdentity.unpack(identity)
    fields = _stat_after_comm(pid)
    return fields is not None and int(fields[19]) == ticks and fields[0] not in (b"Z", b"X")
