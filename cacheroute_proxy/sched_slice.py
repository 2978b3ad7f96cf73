"""A short time slice from the kernel (EEVDF, Linux 6.12+), so that a worker or the sidecar runs
as soon as a socket or its ring wakes it, on a host whose cores are busy with engines.

EEVDF lets a waking task preempt the running one when its virtual deadline -- its vruntime plus
its slice -- comes first. Every task gets the kernel's base slice (a few ms on a small host) unless
it asks for another with sched_setattr's sched_runtime: a proxy process that runs tens of µs per
wake-up and asks for a short one preempts a CPU-bound engine at once instead of queueing behind
it, on every request and every relayed token. Its share of the CPU stays the same: only when it
runs changes. The kernel clamps the slice to 100 µs .. 100 ms; kernels before EEVDF accept the
call and ignore the value. Threads and children started later inherit it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct

log = logging.getLogger("cacheroute.sched_slice")

# sched_setattr(2): no wrapper in Python's os module.
_SYSCALL = {"x86_64": 314, "aarch64": 274}
# struct sched_attr, SCHED_ATTR_SIZE_VER0: size, policy, flags, nice, priority, runtime,
# deadline, period.
_ATTR = struct.Struct("IIQiIQQQ")
_FAIR_POLICIES = (os.SCHED_OTHER, os.SCHED_BATCH)


def request_slice(slice_us: int) -> str | None:
    """Ask for a `slice_us` slice for this thread and those it starts; its policy and nice are
    kept (the call sets all three). None when done, else why not (the process runs as before)."""
    number = _SYSCALL.get(platform.machine())
    if number is None:
        return f"sched_setattr is not known on {platform.machine()}"
    policy = os.sched_getscheduler(0)
    if policy not in _FAIR_POLICIES:  # real-time or idle, as the operator chose: left alone
        return f"the scheduling policy is {policy}, not a fair one"
    attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, policy, 0, os.getpriority(os.PRIO_PROCESS, 0),
                                                  0, slice_us * 1000, 0, 0), _ATTR.size)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, attr, 0) != 0:
        return f"sched_setattr: {os.strerror(ctypes.get_errno())}"
    return None


def apply(slice_us: int) -> None:
    """PROXY_SCHED_SLICE_US at a role's start (0: nothing asked); a refusal is logged, not fatal."""
    if not slice_us:
        return
    problem = request_slice(slice_us)
    if problem is None:
        log.info("time slice of %d µs requested", slice_us)
    else:
        log.warning("time slice of %d µs not requested: %s", slice_us, problem)
