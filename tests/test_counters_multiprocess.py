"""Host-wide inflight counters across real processes: exactness under contention, stale
generations, crashes between the two writes of a begin/end, pid reuse and stopped workers.

Every cross-process test uses the "spawn" context; each child attaches to the segment by
name. Segments are private to the test and always unlinked; every child is stopped by pid.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from shm_schema import (CounterWord, DirectoryWriter, WorkerRow, layout, process_identity,
                        read_rows, row_contributions)
from shm_schema.bitfields import JournalWord, ProcessIdentity
from sidecar.reaper import WorkerReaper
from tests.shm_helpers import (SPAWN, child_identity, children, churn_worker, count_of,
                               fresh_segment, mixed_ops_worker, proc_state, recv, row_agent,
                               share_of, wait_for, word_of)

COUNT_LIMIT = 1 << 31  # a count above this would be a wrapped "negative" one


def settle_reaper(seg, reaper: WorkerReaper, timeout: float = 5.0) -> int:
    """Tick until no claimed row is dead and no reconcile is pending; returns the ticks."""
    deadline = time.monotonic() + timeout
    ticks = 0
    while True:
        reaper.tick()
        ticks += 1
        dead = [r for r in read_rows(seg) if not process_identity.is_alive(r.identity)]
        if not dead and not reaper._pending_reconcile:
            return ticks
        if time.monotonic() > deadline:
            raise AssertionError(f"reaper did not settle in {timeout} s: dead rows {dead}, "
                                 f"pending reconcile {reaper._pending_reconcile}")
        time.sleep(0.001)


def allocate(seg, n: int) -> list[tuple[int, int]]:
    writer = DirectoryWriter(seg)
    return [(s.slot, s.generation) for s in
            (writer.allocate(f"inst-{i}", "127.0.0.1", 9000 + i) for i in range(n))]


# --- 1. exactness: 4 processes x 200k mixed begin/end on 3 shared slots -------------------------

def test_four_processes_mixed_begin_end_are_exact():
    n_procs, n_ops = 4, 200_000
    with fresh_segment(instance_capacity=8, worker_capacity=8) as seg, children() as group:
        slot_gens = allocate(seg, 3)
        barrier = SPAWN.Barrier(n_procs)
        targets = [[(i + k) % 4 + 1 for k in range(3)] for i in range(n_procs)]
        conns = []
        for i in range(n_procs):
            parent, child = SPAWN.Pipe()
            group.start(mixed_ops_worker, seg.name, i, slot_gens, 1000 + i, n_ops, targets[i],
                        barrier, child)
            conns.append(parent)
        reports = [recv(c, 90) for c in conns]

        for i, rep in enumerate(reports):
            assert rep["failures"] == 0, rep
            assert rep["ops"] >= n_ops
            assert rep["held"] == targets[i]
        # The barrier made the loops really overlap: every loop started before any ended.
        assert max(r["t_start"] for r in reports) < min(r["t_end"] for r in reports)

        for k, (slot, gen) in enumerate(slot_gens):
            assert word_of(seg, slot) == (gen, sum(t[k] for t in targets))
        for rep in reports:
            contributions = row_contributions(seg, rep["row"])
            assert contributions == {slot: (gen, rep["held"][k])
                                     for k, (slot, gen) in enumerate(slot_gens)}
        assert all(r.pending_slot is None for r in read_rows(seg))

        # A clean exit gives back exactly what each process held.
        for conn, rep in zip(conns, reports):
            conn.send("release")
            assert recv(conn) == {(slot, layout.LANE_INFLIGHT): rep["held"][k]
                                  for k, (slot, _) in enumerate(slot_gens)}
        for proc in group.procs:
            proc.join(10)
            assert proc.exitcode == 0
        assert [count_of(seg, slot) for slot, _ in slot_gens] == [0, 0, 0]
        assert read_rows(seg) == []


# --- 2. stale generation -----------------------------------------------------------------------

def test_freed_and_reallocated_slot_ignores_old_generation_ends():
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg, children() as group:
        writer = DirectoryWriter(seg)
        a = writer.allocate("inst-a", "127.0.0.1", 9001)
        b = writer.allocate("inst-b", "127.0.0.1", 9002)
        conns, rows = [], []
        for i in range(2):
            parent, child = SPAWN.Pipe()
            group.start(row_agent, seg.name, i, child)
            conns.append(parent)
        for conn in conns:
            tag, _pid, row, _identity = recv(conn)
            assert tag == "ready"
            rows.append(row)
        holder, churner = conns

        holder.send(("begin", a.slot, a.generation, 5))
        assert recv(holder) == [True] * 5
        assert word_of(seg, a.slot) == (a.generation, 5)

        writer.free(a.slot)
        freed_gen, freed_count = word_of(seg, a.slot)
        assert freed_count == 0 and freed_gen not in (0, a.generation)
        # Freed, not yet reused: old-generation ends and begins are no-ops.
        holder.send(("end", a.slot, a.generation, 1))
        assert recv(holder) == [False]
        holder.send(("begin", a.slot, a.generation, 1))
        assert recv(holder) == [False]
        assert word_of(seg, a.slot) == (freed_gen, 0)

        c = writer.allocate("inst-c", "127.0.0.1", 9003)
        assert c.slot == a.slot
        assert c.generation not in (0, a.generation, freed_gen)
        assert word_of(seg, c.slot) == (c.generation, 0)

        # Both churn the new generation; the holder interleaves its 4 remaining old ends.
        slot_gens = [(c.slot, c.generation), (b.slot, b.generation)]
        holder.send(("churn", slot_gens, 7, 60_000, [(a.slot, a.generation, 4)], [3, 1]))
        churner.send(("churn", slot_gens, 8, 60_000, [], [2, 0]))
        seen = set()
        max_count = 0
        while not (holder.poll() and churner.poll()):
            gen, count = word_of(seg, c.slot)
            seen.add(gen)
            max_count = max(max_count, count)
        held_h, held_c = recv(holder), recv(churner)
        assert seen == {c.generation}
        assert max_count < COUNT_LIMIT, "the count wrapped below zero"
        assert held_h["failures"] == 0 and held_c["failures"] == 0
        assert held_h["stale_results"] == [False] * 4
        assert word_of(seg, c.slot) == (c.generation, 3 + 2)
        assert word_of(seg, b.slot) == (b.generation, 1)
        assert share_of(seg, rows[0], c.slot, c.generation) == 3
        assert share_of(seg, rows[1], c.slot, c.generation) == 2

        # Old ends at a count of 0 change nothing and cannot go below zero.
        churner.send(("end", c.slot, c.generation, 2))
        assert recv(churner) == [True, True]
        holder.send(("end", c.slot, c.generation, 3))
        assert recv(holder) == [True] * 3
        holder.send(("end", a.slot, a.generation, 3))
        assert recv(holder) == [False] * 3
        assert word_of(seg, c.slot) == (c.generation, 0)
        for conn in conns:
            conn.send(("exit",))
            assert recv(conn) == "bye"


# --- 3. crash between the two writes -----------------------------------------------------------

def test_sigkill_at_random_moments_then_reaper_restores_exact_counts(capsys):
    """Each round: 3 workers churn 3 shared slots, one is SIGKILLed at a random moment, the
    survivors settle at known holdings, then the reaper runs. (Reaping while the survivors
    still serve loses ends: see test_live_end_is_not_lost_while_a_mid_end_death_awaits_reconcile.)"""
    rounds, n_children = 8, 3
    rng = random.Random(20240611)
    summary = {"rounds": rounds, "journal_pending_at_kill": 0, "global_off_from_rows": 0,
               "subtracted": 0, "corrections": 0}
    with fresh_segment(instance_capacity=4, worker_capacity=8) as seg, children() as group:
        slot_gens = allocate(seg, 3)
        reaper = WorkerReaper(seg)
        for rnd in range(rounds):
            go, stop = SPAWN.RawValue("b", 0), SPAWN.RawValue("b", 0)
            targets = [[(rnd + i + k) % 3 for k in range(3)] for i in range(n_children)]
            procs, conns = [], []
            for i in range(n_children):
                parent, child = SPAWN.Pipe()
                procs.append(group.start(churn_worker, seg.name, i, slot_gens, rnd * 100 + i,
                                         targets[i], go, stop, child))
                conns.append(parent)
            ready = [recv(c) for c in conns]
            assert all(r[0] == "ready" for r in ready)
            victim = rng.randrange(n_children)
            victim_row = ready[victim][2]

            go.value = 1
            time.sleep(rng.uniform(0.005, 0.12))
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].join(10)
            assert procs[victim].exitcode == -signal.SIGKILL
            (state,) = [r for r in read_rows(seg) if r.row == victim_row]
            summary["journal_pending_at_kill"] += state.pending_slot is not None

            time.sleep(rng.uniform(0.005, 0.03))  # the survivors keep serving a little
            stop.value = 1
            survivors = [i for i in range(n_children) if i != victim]
            reports = {i: recv(conns[i]) for i in survivors}
            for i in survivors:
                assert reports[i]["failures"] == 0 and reports[i]["held"] == targets[i], \
                    (rnd, reports[i], reaper.stats)
            # Quiescent and not yet reaped: did the kill land between the global CAS and the
            # row write (global != sum of every row's share, the dead one's included)?
            off = False
            for slot, gen in slot_gens:
                rows_sum = sum(share_of(seg, r.row, slot, gen) for r in read_rows(seg))
                off |= count_of(seg, slot) != rows_sum
            summary["global_off_from_rows"] += off
            assert not off or state.pending_slot is not None

            before = (reaper.stats.subtracted, reaper.stats.corrections)
            settle_reaper(seg, reaper)
            summary["subtracted"] += reaper.stats.subtracted - before[0]
            summary["corrections"] += reaper.stats.corrections - before[1]

            for k, (slot, gen) in enumerate(slot_gens):
                expected = sum(targets[i][k] for i in survivors)
                assert word_of(seg, slot) == (gen, expected), (rnd, slot, summary)
            assert victim_row not in {r.row for r in read_rows(seg)}

            for i in survivors:
                conns[i].send("release")
                recv(conns[i])
                procs[i].join(10)
                assert procs[i].exitcode == 0
            assert [count_of(seg, slot) for slot, _ in slot_gens] == [0, 0, 0]
            assert read_rows(seg) == []
        assert reaper.stats.reaped == rounds
        assert seg.load(layout.H_REAPED_WORKERS) == rounds
    with capsys.disabled():
        print(f"\n[crash rounds] {summary}")


def test_reconcile_audit_during_churn_never_corrupts_counts():
    """The audit (reconcile of every active slot) running back to back while live workers
    churn must only act at quiescent moments: no correction, exact counts."""
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg, children() as group:
        slot_gens = allocate(seg, 2)
        reaper = WorkerReaper(seg, audit_interval_s=0.0)
        go, stop = SPAWN.RawValue("b", 0), SPAWN.RawValue("b", 0)
        targets = [[1, 2], [3, 0]]
        conns = []
        for i in range(2):
            parent, child = SPAWN.Pipe()
            group.start(churn_worker, seg.name, i, slot_gens, 77 + i, targets[i], go, stop, child)
            conns.append(parent)
        for conn in conns:
            assert recv(conn)[0] == "ready"
        go.value = 1
        ticks = 0
        until = time.monotonic() + 0.6
        while time.monotonic() < until:
            reaper.tick()
            ticks += 1
        stop.value = 1
        reports = [recv(c) for c in conns]
        assert all(r["failures"] == 0 for r in reports)
        assert sum(r["ops"] for r in reports) > 10_000
        settle_reaper(seg, reaper)
        assert reaper.stats.corrections == 0
        assert seg.load(layout.H_RECONCILE_COUNT) == 0
        assert [count_of(seg, s) for s, _ in slot_gens] == [4, 2]
        assert ticks > 50
        for conn in conns:
            conn.send("release")
            recv(conn)


@pytest.fixture
def dead_identity():
    """The identity of a process that has exited (spawned, reported, joined)."""
    with children() as group:
        parent, child = SPAWN.Pipe()
        proc = group.start(child_identity, child)
        identity = recv(parent)
        proc.join(10)
        assert proc.exitcode == 0
    assert identity != process_identity.own_identity()
    assert not process_identity.is_alive(identity)
    return identity


def _set_journal(seg, row: int, slot: int | None, seq: int = 4242, is_end: bool = False) -> None:
    journal = (JournalWord.idle(seq) if slot is None
               else JournalWord.pending(seq, slot, layout.LANE_INFLIGHT, is_end))
    seg.store(seg.geometry.row_offset(row) + layout.R_JOURNAL, journal)


# With the direction in the journal, the reaper can only leave a slot one too high (an
# overcount reconcile lowers), never too low: a too-low count would make live ends hit the floor.
@pytest.mark.parametrize("case, is_end, survivor_share, dead_share, global_delta, correction", [
    ("begin: after global +1, before own row", False, 2, 3, +1, -1),
    ("begin: journal written, before the CAS", False, 2, 3, 0, 0),
    ("end: after global -1, before own row", True, 2, 3, -1, 0),
    ("end: journal written, before the CAS", True, 2, 3, 0, -1),
    ("end: nothing else held (floors at 0)", True, 0, 3, -1, 0),
])
def test_death_mid_update_is_reconciled_exactly(dead_identity, case, is_end, survivor_share,
                                               dead_share, global_delta, correction):
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        (slot, gen), (other, other_gen) = allocate(seg, 2)
        survivor = WorkerRow.claim(seg, 0)
        dead = WorkerRow.claim(seg, 1, identity=dead_identity)
        for _ in range(survivor_share):
            assert survivor.begin(slot, gen)
        for _ in range(dead_share):
            assert dead.begin(slot, gen)
        assert dead.begin(other, other_gen)
        # The dead worker was killed inside begin/end on `slot`: journal names the slot, and the
        # global word may already carry its change while its own row does not.
        _set_journal(seg, dead.row, slot, is_end=is_end)
        if global_delta:
            seg.fetch_add(seg.geometry.inflight_offset(slot), global_delta & ((1 << 64) - 1))
        assert [r.pending_slot for r in read_rows(seg) if r.row == dead.row] == [slot]

        reaper = WorkerReaper(seg)
        settle_reaper(seg, reaper)
        assert word_of(seg, slot) == (gen, survivor_share)
        assert word_of(seg, other) == (other_gen, 0)
        assert [r.row for r in read_rows(seg)] == [survivor.row]
        assert reaper.stats.reaped == 1
        assert reaper.stats.last_reaped[-1]["died_mid_update"] is True
        assert reaper.stats.corrections == (1 if correction else 0)
        assert seg.load(layout.H_RECONCILE_COUNT) == (1 if correction else 0)
        assert seg.load(layout.H_REAPED_WORKERS) == 1
        survivor.release()


def test_reconcile_waits_for_a_quiescent_moment(dead_identity):
    """While a live worker is itself mid-operation, the dead worker's slot is not re-derived
    (the live worker's half-done change would be lost); it is once the journal clears."""
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        ((slot, gen),) = allocate(seg, 1)
        live = WorkerRow.claim(seg, 0)
        dead = WorkerRow.claim(seg, 1, identity=dead_identity)
        for _ in range(2):
            assert live.begin(slot, gen)
            assert dead.begin(slot, gen)
        _set_journal(seg, dead.row, slot)
        seg.fetch_add(seg.geometry.inflight_offset(slot), 1)  # dead: CAS done, row not
        _set_journal(seg, live.row, slot, seq=1)  # live: mid-begin, CAS done, row not yet
        seg.fetch_add(seg.geometry.inflight_offset(slot), 1)
        reaper = WorkerReaper(seg)
        for _ in range(5):
            reaper.tick()
        assert reaper.stats.reaped == 1
        assert reaper._pending_reconcile == {(slot, layout.LANE_INFLIGHT)}
        assert count_of(seg, slot) == 2 + 1 + 1  # dead share subtracted, nothing re-derived
        # The live worker finishes its begin (own row +1, journal cleared) ...
        seg.store(seg.geometry.contribution_offset(live.row, slot), CounterWord.pack(gen, 3))
        _set_journal(seg, live.row, None, seq=1)
        settle_reaper(seg, reaper)
        assert count_of(seg, slot) == 3
        assert reaper.stats.corrections == 1


def test_live_end_is_not_lost_while_a_mid_end_death_awaits_reconcile(dead_identity):
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        (slot, gen), (other, _) = allocate(seg, 2)
        live = WorkerRow.claim(seg, 0)
        busy = WorkerRow.claim(seg, 1)
        dead = WorkerRow.claim(seg, 2, identity=dead_identity)
        assert live.begin(slot, gen)
        for _ in range(2):
            assert dead.begin(slot, gen)
        # The dead worker was killed inside end(): its global -1 landed, its own row did not.
        _set_journal(seg, dead.row, slot, is_end=True)
        seg.fetch_add(seg.geometry.inflight_offset(slot), (1 << 64) - 1)
        assert count_of(seg, slot) == 1 + 2 - 1
        # At the reaper's tick another live worker is mid-operation (on another instance), so
        # the slot cannot be reconciled in this tick.
        _set_journal(seg, busy.row, other, seq=1)
        reaper = WorkerReaper(seg)
        reaper.tick()
        assert reaper.stats.reaped == 1
        # Meanwhile the live worker's request on `slot` finishes.
        ended = live.end(slot, gen)
        _set_journal(seg, busy.row, None, seq=1)
        settle_reaper(seg, reaper)
        try:
            assert ended is True, "a live worker's end was dropped"
            assert share_of(seg, live.row, slot, gen) == 0
            assert count_of(seg, slot) == 0, "phantom inflight left on the instance"
        finally:
            live.release()
            busy.release()


# --- 4. pid reuse and stopped processes --------------------------------------------------------

def test_same_pid_other_start_time_counts_as_dead():
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        ((slot, gen),) = allocate(seg, 1)
        me = process_identity.own_identity()
        pid, ticks = ProcessIdentity.unpack(me)
        assert pid == os.getpid()
        impostor = ProcessIdentity.pack(pid, ticks + 1)  # a previous holder of our pid
        assert not process_identity.is_alive(impostor)
        live = WorkerRow.claim(seg, 0)
        recycled = WorkerRow.claim(seg, 1, identity=impostor)
        assert live.begin(slot, gen)
        for _ in range(4):
            assert recycled.begin(slot, gen)
        reaper = WorkerReaper(seg)
        settle_reaper(seg, reaper)
        assert reaper.stats.reaped == 1
        assert reaper.stats.last_reaped[-1]["pid"] == pid
        assert [r.identity for r in read_rows(seg)] == [me]
        assert count_of(seg, slot) == 1
        live.release()


def test_stopped_worker_is_kept_then_released_exactly_once():
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg, children() as group:
        ((slot, gen),) = allocate(seg, 1)
        mine = WorkerRow.claim(seg, 0)
        for _ in range(2):
            assert mine.begin(slot, gen)
        parent, child = SPAWN.Pipe()
        proc = group.start(row_agent, seg.name, 1, child)
        tag, pid, row, _identity = recv(parent)
        parent.send(("begin", slot, gen, 3))
        assert recv(parent) == [True] * 3
        assert count_of(seg, slot) == 5

        reaper = WorkerReaper(seg)
        os.kill(pid, signal.SIGSTOP)
        assert wait_for(lambda: proc_state(pid) == "T", 5)
        for _ in range(5):
            reaper.tick()
        assert reaper.stats.reaped == 0
        assert row in {r.row for r in read_rows(seg)}
        assert count_of(seg, slot) == 5
        assert share_of(seg, row, slot, gen) == 3

        os.kill(pid, signal.SIGCONT)
        parent.send(("end", slot, gen, 1))
        assert recv(parent) == [True]
        parent.send(("release",))
        assert recv(parent) == {(slot, layout.LANE_INFLIGHT): 2}
        parent.send(("exit",))
        assert recv(parent) == "bye"
        proc.join(10)
        assert proc.exitcode == 0
        assert proc_state(pid) is None
        for _ in range(5):
            reaper.tick()
        assert reaper.stats.reaped == 0 and reaper.stats.subtracted == 0
        assert seg.load(layout.H_REAPED_WORKERS) == 0
        assert count_of(seg, slot) == 2  # only this process's share, subtracted once
        assert [r.row for r in read_rows(seg)] == [mine.row]
        mine.release()
        assert count_of(seg, slot) == 0


def test_reap_after_a_stale_scan_leaves_the_rows_new_owner_alone(dead_identity):
    """tick() scans the rows, then checks liveness and reaps row by row. If the worker it saw
    exits cleanly (release: shares given back, row freed) and a new worker claims that row in
    between, reaping on the stale scan must not subtract the new worker's shares."""
    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        ((slot, gen),) = allocate(seg, 1)
        leaving = WorkerRow.claim(seg, 0, identity=dead_identity)
        for _ in range(2):
            assert leaving.begin(slot, gen)
        (scanned,) = read_rows(seg)  # the first step of WorkerReaper.tick
        leaving.release()  # clean exit
        newcomer = WorkerRow.claim(seg, 1)  # a restarted worker takes the freed row
        assert newcomer.row == scanned.row
        for _ in range(3):
            assert newcomer.begin(slot, gen)
        reaper = WorkerReaper(seg)
        assert not process_identity.is_alive(scanned.identity)  # the rest of that tick ...
        reaper._reap(scanned.row, scanned.identity, scanned.pid, scanned.worker_index)
        try:
            assert count_of(seg, slot) == 3
            assert share_of(seg, newcomer.row, slot, gen) == 3
        finally:
            newcomer.release()


def test_without_pidfds_the_reaper_watches_nothing_and_its_ticks_still_reap(dead_identity, monkeypatch,
                                                                             caplog):
    """Where no pidfd can be opened (an older kernel, a sandbox), the reaper says so once,
    watches no worker, and finds the dead at its ticks as before."""
    import asyncio
    import errno

    def no_pidfd(pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        ((slot, gen),) = allocate(seg, 1)
        alive = WorkerRow.claim(seg, 0)  # this process
        dead = WorkerRow.claim(seg, 1, identity=dead_identity)
        assert dead.begin(slot, gen)
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)

        async def tick_once() -> WorkerReaper:
            reaper = WorkerReaper(seg)
            reaper.watch_exits(asyncio.get_running_loop())
            reaper.tick()
            reaper.close()
            return reaper

        try:
            reaper = asyncio.run(tick_once())
            assert reaper.watched == 0 and reaper.stats.reaped == 1
            assert caplog.text.count("cannot watch worker exits") == 1
            assert count_of(seg, slot) == 0
        finally:
            alive.release()
