"""Shared helpers for the shared-memory tests: private segments that are always unlinked,
child processes started with the "spawn" context and stopped by pid, and the child-side
programs those processes run (they must live in an importable module for "spawn").

Children talk to the test over their own `Pipe` (no lock shared between children) and
synchronise through lock-free `RawValue` flags: a child that is SIGKILLed must never leave a
multiprocessing lock (a POSIX semaphore) held, or every other process would block on it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import time
from typing import Any, Iterator, Sequence

from shm_schema import CounterWord, Segment, WorkerRow, layout, process_identity
from shm_schema.repair import row_contributions
from shm_schema.snapshot import SnapshotReader, record_at
from tests.harness import private_segment_name

SPAWN = multiprocessing.get_context("spawn")


unique_name = private_segment_name


@contextlib.contextmanager
def segment_with_row(instance_capacity: int = 64, worker_capacity: int = 2,
                     ring_capacity: int = 64) -> Iterator[tuple[str, Segment, WorkerRow]]:
    """(name, segment, worker row 0) of a new private segment; the row released, the segment
    closed and unlinked on exit."""
    name = unique_name()
    seg = Segment.create_or_attach(name, instance_capacity, worker_capacity, ring_capacity)
    row = WorkerRow.claim(seg, 0)
    try:
        yield name, seg, row
    finally:
        row.release()
        seg.close()
        Segment.unlink(name)


@contextlib.contextmanager
def fresh_segment(instance_capacity: int = 8, worker_capacity: int = 8,
                  ring_capacity: int = layout.DEFAULT_RING_CAPACITY) -> Iterator[Segment]:
    """A newly created segment under a unique name; closed and unlinked on exit."""
    name = unique_name()
    seg = Segment.create_or_attach(name, instance_capacity, worker_capacity, ring_capacity)
    try:
        assert seg.created, f"{name} already existed"
        yield seg
    finally:
        with contextlib.suppress(Exception):
            seg.close()
        Segment.unlink(name)


def count_of(seg: Segment, slot: int) -> int:
    return CounterWord.count(seg.load(seg.geometry.inflight_offset(slot)))


def word_of(seg: Segment, slot: int) -> tuple[int, int]:
    word = seg.load(seg.geometry.inflight_offset(slot))
    return CounterWord.generation(word), CounterWord.count(word)


def share_of(seg: Segment, row: int, slot: int, generation: int) -> int:
    """A row's own count on a slot under `generation` (0 if none or another generation)."""
    gen, count = row_contributions(seg, row).get(slot, (generation, 0))
    return count if gen == generation else 0


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:raw.rfind(b")") + 3].decode()


def wait_for(predicate, timeout: float, interval: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Children:
    """Processes started by one test; `stop_all` kills any still running, by pid."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def start(self, target, *args) -> multiprocessing.process.BaseProcess:
        proc = SPAWN.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.pid is None:
                continue
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)


@contextlib.contextmanager
def children() -> Iterator[Children]:
    group = Children()
    try:
        yield group
    finally:
        group.stop_all()


def recv(conn, timeout: float = 30.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child within {timeout} s")
    return conn.recv()


# --- child programs ------------------------------------------------------------------------

def child_identity(conn) -> None:
    """Report this process's identity and exit (to get the identity of a dead process)."""
    conn.send(process_identity.own_identity())
    conn.close()


def mixed_ops_worker(name: str, worker_index: int, slot_gens: Sequence[tuple[int, int]],
                     seed: int, n_ops: int, targets: Sequence[int], barrier, conn) -> None:
    """Test 1: `n_ops` seeded random begin/end on shared slots (never ending more than it
    began), then settle at `targets` held per slot, report, and wait for "release"."""
    seg = Segment.attach(name, wait_s=10)
    try:
        row = WorkerRow.claim(seg, worker_index)
        rng = random.Random(seed)
        held = [0] * len(slot_gens)
        failures = 0
        n = len(slot_gens)
        begin, end = row.begin, row.end
        barrier.wait(timeout=60)
        t_start = time.monotonic_ns()
        for _ in range(n_ops):
            k = rng.randrange(n)
            slot, gen = slot_gens[k]
            if held[k] and rng.random() < 0.5:
                ok = end(slot, gen)
                held[k] -= 1
            else:
                ok = begin(slot, gen)
                held[k] += 1
            failures += not ok
        t_end = time.monotonic_ns()
        extra = _settle(row, slot_gens, held, targets)
        failures += extra[1]
        conn.send({"pid": os.getpid(), "row": row.row, "held": held, "ops": n_ops + extra[0],
                   "failures": failures, "t_start": t_start, "t_end": t_end})
        if recv(conn, 120) == "release":
            conn.send(row.release())
    finally:
        seg.close()


def _settle(row: WorkerRow, slot_gens, held: list[int], targets) -> tuple[int, int]:
    ops = failures = 0
    for k, (slot, gen) in enumerate(slot_gens):
        while held[k] > targets[k]:
            failures += not row.end(slot, gen)
            held[k] -= 1
            ops += 1
        while held[k] < targets[k]:
            failures += not row.begin(slot, gen)
            held[k] += 1
            ops += 1
    return ops, failures


def churn_worker(name: str, worker_index: int, slot_gens: Sequence[tuple[int, int]], seed: int,
                 targets: Sequence[int], go, stop, conn) -> None:
    """Test 3: begin/end on shared slots until `stop` is set (a lock-free RawValue; this
    process may be SIGKILLed at any moment of the loop), then settle at `targets`, report,
    and wait for "release"."""
    seg = Segment.attach(name, wait_s=10)
    try:
        row = WorkerRow.claim(seg, worker_index)
        conn.send(("ready", os.getpid(), row.row))
        while not go.value:
            time.sleep(0.0005)
        rng = random.Random(seed)
        held = [0] * len(slot_gens)
        n = len(slot_gens)
        failures = ops = 0
        begin, end = row.begin, row.end
        while not stop.value:
            for _ in range(64):
                k = rng.randrange(n)
                slot, gen = slot_gens[k]
                # Bias towards a small number held, so ends are frequent too.
                if held[k] and rng.random() < 0.5 + 0.05 * held[k]:
                    failures += not end(slot, gen)
                    held[k] -= 1
                else:
                    failures += not begin(slot, gen)
                    held[k] += 1
            ops += 64
        extra = _settle(row, slot_gens, held, targets)
        conn.send({"pid": os.getpid(), "row": row.row, "held": held, "ops": ops + extra[0],
                   "failures": failures + extra[1]})
        if recv(conn, 120) == "release":
            conn.send(row.release())
    finally:
        seg.close()


def row_agent(name: str, worker_index: int, conn) -> None:
    """A worker driven step by step over its pipe. Commands (tuples):
    ("begin"|"end", slot, gen, n) -> list of results
    ("churn", slot_gens, seed, n_ops, stale, targets) -> dict; `stale` = [(slot, gen, n)]
        ends of stale leases interleaved with the churn, results reported
    ("release",) -> subtracted dict;  ("exit",) -> ends the process cleanly."""
    seg = Segment.attach(name, wait_s=10)
    try:
        row = WorkerRow.claim(seg, worker_index)
        conn.send(("ready", os.getpid(), row.row, row.identity))
        while True:
            cmd, *args = recv(conn, 120)
            if cmd in ("begin", "end"):
                slot, gen, n = args
                op = row.begin if cmd == "begin" else row.end
                conn.send([op(slot, gen) for _ in range(n)])
            elif cmd == "churn":
                slot_gens, seed, n_ops, stale, targets = args
                conn.send(_churn_with_stale(row, slot_gens, seed, n_ops, stale, targets))
            elif cmd == "release":
                conn.send(row.release())
            elif cmd == "exit":
                conn.send("bye")
                return
            else:
                raise ValueError(cmd)
    finally:
        seg.close()


def _churn_with_stale(row: WorkerRow, slot_gens, seed: int, n_ops: int, stale, targets) -> dict:
    rng = random.Random(seed)
    held = [0] * len(slot_gens)
    stale_todo = [(slot, gen) for slot, gen, n in stale for _ in range(n)]
    stale_results = []
    failures = 0
    every = max(1, n_ops // (len(stale_todo) + 1))
    for i in range(n_ops):
        if stale_todo and i % every == every - 1:
            slot, gen = stale_todo.pop()
            stale_results.append(row.end(slot, gen))
        k = rng.randrange(len(slot_gens))
        slot, gen = slot_gens[k]
        if held[k] and rng.random() < 0.5 + 0.1 * held[k]:
            failures += not row.end(slot, gen)
            held[k] -= 1
        else:
            failures += not row.begin(slot, gen)
            held[k] += 1
    while stale_todo:
        slot, gen = stale_todo.pop()
        stale_results.append(row.end(slot, gen))
    extra = _settle(row, slot_gens, held, targets)
    return {"held": held, "failures": failures + extra[1], "stale_results": stale_results}


def published(reader: SnapshotReader, slot: int, generation: int) -> Any:
    """The slot's published pressure record if it describes `generation` (else None), as a
    worker's reads find it."""
    return record_at(reader.records(slot + 1), slot, generation)
