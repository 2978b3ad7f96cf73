"""Prompt homes: the table the sidecar publishes (shm_schema/homes.py) and how it balances the
prompts' homes by their traffic (sidecar/prompt_homes.py), over a real segment."""

from __future__ import annotations

import pytest

from cacheroute_proxy.affinity_keys import rendezvous_home
from shm_schema import layout
from shm_schema.events import Event, EventKind
from shm_schema.homes import HOME_ENTRIES, HomeReader, HomeWriter
from sidecar.prompt_homes import MIN_REQUESTS, ROUND_S, STAY_S, Candidate, PromptHomes, speed_classes
from tests.shm_helpers import fresh_segment

A, B = Candidate((0, 1), "inst-a", 1.0), Candidate((1, 1), "inst-b", 1.0)


@pytest.fixture
def seg():
    with fresh_segment(4, 2) as segment:
        yield segment


def picked_for(key: int) -> Candidate:
    """The candidate a test key stands for: its rendezvous one of a and b."""
    return (A, B)[rendezvous_home(key, [A.instance_id, B.instance_id])]


def keys_homed_on(candidate: Candidate, count: int) -> list[int]:
    keys = [k for k in range(1, 10_000) if picked_for(k).instance_id == candidate.instance_id]
    return keys[:count]


def named(key: int, blocks: int = 7, where: tuple[int, int] | None = None) -> Event:
    """The PREFIX event that names a prompt (its first block) and its size in blocks, of a
    request sent to `where`: by default the candidate the key was picked for (keys_homed_on)."""
    where = picked_for(key).where if where is None else where
    return Event(EventKind.PREFIX, 1, blocks, where[0], where[1], 0, service_us=key)


def homes_over(seg, tolerance: float = 0.1, halflife_s: float = 20) -> PromptHomes:
    """The sidecar's prompt homes over `seg`, in blocks of 128 tokens."""
    return PromptHomes(seg, halflife_s=halflife_s, tolerance=tolerance, block_tokens=128)


def run(homes: PromptHomes, requests: dict[int, int], rounds: int, candidates=(A, B),
        start: float = 100.0) -> float:
    """`requests` per prompt key in each round, then the round; returns when the next is due."""
    for n in range(rounds):
        for key, count in requests.items():
            for _ in range(count):
                homes.observe(named(key))
        homes.tick(start + n * ROUND_S, lambda: list(candidates))
    return start + rounds * ROUND_S


def work_on(seg, requests: dict[int, int], candidates=(A, B)) -> dict[str, int]:
    """Each candidate's requests a round, by the homes the workers read."""
    reader, names = HomeReader(seg), [c.instance_id for c in candidates]
    work = dict.fromkeys(names, 0)
    for key, count in requests.items():
        moved = reader.home_of(key)
        home = next(c.instance_id for c in candidates if c.where == moved) if moved \
            else names[rendezvous_home(key, names)]
        work[home] += count
    return work


def test_the_table_round_trips_and_a_reader_decodes_it_again_only_when_it_changed(seg) -> None:
    writer, reader = HomeWriter(seg), HomeReader(seg)
    assert reader.home_of(5) is None
    writer.publish({5: (1, 7), 0: (2, 2), 6: (3, 9)})  # a key of 0 names no prompt
    assert reader.homes() == {5: (1, 7), 6: (3, 9)} and writer.read() == {5: (1, 7), 6: (3, 9)}
    copy = reader.homes()
    assert reader.homes() is copy  # the seqlock word did not move: nothing decoded
    writer.publish({key: (0, 1) for key in range(1, HOME_ENTRIES + 10)})
    assert len(reader.homes()) == HOME_ENTRIES
    # The next home is a word of its own: a rewrite of the table keeps it.
    assert reader.next_home() is None  # never named (an older segment's reserved word)
    writer.set_next_home((3, 9))
    writer.publish({5: (1, 7)})
    assert reader.next_home() == (3, 9) and reader.homes() == {5: (1, 7)}
    writer.set_next_home(None)
    assert reader.next_home() is None


def test_a_reader_keeps_its_copy_while_a_writer_left_the_table_half_written(seg) -> None:
    writer, reader = HomeWriter(seg), HomeReader(seg)
    writer.publish({5: (1, 7)})
    assert reader.home_of(5) == (1, 7)
    at = seg.geometry.homes_offset + layout.HT_SEQ
    seg.store(at, seg.load(at) + 1)  # odd: a writer killed mid-rewrite
    assert reader.home_of(5) == (1, 7) and reader.torn_reads == 1
    writer.publish({5: (2, 3)})  # the next sidecar rewrites it whole
    assert reader.home_of(5) == (2, 3)


def test_each_new_prompt_is_homed_where_its_first_request_went_the_next_home_named_by_the_work(seg) -> None:
    homes, reader = homes_over(seg), HomeReader(seg)
    homes.tick(100.0, lambda: [A])
    assert reader.next_home() is None  # one candidate: nothing to choose
    homes.tick(100.1, lambda: [A, B])  # b came: named at once, not a round later
    assert reader.next_home() == A.where  # no work anywhere yet: the first candidate
    hot, warm, cool = keys_homed_on(B, 3)  # their rendezvous home is b: it plays no part
    for _ in range(6):
        homes.observe(named(hot, where=A.where))
    assert reader.next_home() == B.where  # 42 blocks on a, none on b
    for _ in range(3):
        homes.observe(named(warm, where=B.where))
    assert reader.next_home() == B.where  # 21 < 42
    for _ in range(4):
        homes.observe(named(cool, where=B.where))
    assert reader.next_home() == A.where  # 49 > 42
    homes.tick(102.0, lambda: [A, B])
    assert reader.homes() == {hot: A.where, warm: B.where, cool: B.where}
    assert homes.stats["moves"] == 0 and homes.describe()["next_home"] == A.instance_id


def test_the_next_home_has_room_for_one_more_prompt_and_follows_the_speeds(seg) -> None:
    homes, reader = homes_over(seg), HomeReader(seg)
    homes.tick(100.0, lambda: [A_KV, B_KV])
    for key in range(1, 9):  # eight cold prompts fill a's room (8 x 7 of its 60 blocks)
        homes.observe(named(key, where=A.where))
    for _ in range(4):  # one hot prompt on b
        homes.observe(named(9, where=B.where))
    assert reader.next_home() == B.where  # a does less work, but holds no ninth prompt
    fast_b = B._replace(speed=3.0)  # due three times a's share
    again = homes_over(seg)
    again.tick(200.0, lambda: [A, fast_b])
    again.observe(named(10, where=A.where))
    for _ in range(2):
        again.observe(named(11, where=B.where))
    assert reader.next_home() == B.where  # twice a's work, within three times its share


def test_a_new_prompt_sent_where_it_does_not_fit_is_homed_at_the_next_home_and_listed_at_once(seg) -> None:
    homes, reader = homes_over(seg), HomeReader(seg)
    homes.tick(100.0, lambda: [A_KV, B_KV])
    for key in range(1, 9):  # a holds eight prompts: its room is full
        homes.observe(named(key, where=A.where))
    assert reader.next_home() == B.where
    # Two new prompts' first requests both go to a: one spilled, one sent while a was still
    # the next home (before the sidecar took the prompt before it).
    homes.observe(named(9, where=A.where))
    homes.observe(named(10, where=A.where))
    homes.tick(100.5, lambda: [A_KV, B_KV])  # not a round: the homes are listed all the same
    assert reader.home_of(9) == reader.home_of(10) == B.where
    assert len(reader.homes()) == 10 and homes.stats["moves"] == 0


def test_a_prompt_the_table_does_not_list_yet_lives_where_its_requests_go(seg) -> None:
    homes, reader = homes_over(seg), HomeReader(seg)
    homes.tick(100.0, lambda: [A, B])
    key = keys_homed_on(A, 1)[0]
    homes.observe(named(key, where=A.where))
    homes.observe(named(key, where=B.where))  # a worker found it held on b (its holder) only
    homes.tick(101.0, lambda: [A, B])
    assert reader.homes() == {key: B.where}
    homes.observe(named(key, where=A.where))  # a spill, once listed, does not move its home
    homes.tick(102.0, lambda: [A, B])
    assert reader.homes() == {key: B.where}


def test_prompts_move_off_the_overloaded_instance_until_the_work_is_within_the_tolerance(seg) -> None:
    # Four prompts homed on a, drawing 4:3:2:1 of the requests; b has none of its own.
    requests = dict(zip(keys_homed_on(A, 4), (16, 12, 8, 4)))
    homes = homes_over(seg)
    now = run(homes, requests, rounds=1)
    work = work_on(seg, requests)
    assert work == {"inst-a": 20, "inst-b": 20}, work  # the 16, then the 4: 12+8 and 16+4
    assert homes.stats["moves"] == 2
    run(homes, requests, rounds=5, start=now)
    assert homes.stats["moves"] == 2  # balanced: nothing moves back and forth


def test_no_move_within_the_tolerance_or_before_enough_requests(seg) -> None:
    a_keys, b_keys = keys_homed_on(A, 1), keys_homed_on(B, 1)
    homes = homes_over(seg, 0.25)
    run(homes, {a_keys[0]: 11, b_keys[0]: 9}, rounds=5)  # a carries 1.1x its share
    assert homes.stats["moves"] == 0
    few = homes_over(seg)
    run(few, {keys_homed_on(A, 2)[1]: int(MIN_REQUESTS) - 1}, rounds=1)
    assert few.stats["moves"] == 0


def test_a_faster_instance_takes_a_larger_share(seg) -> None:
    fast_b = B._replace(speed=3.0)  # its pace is a third of the profile's: three times a's share
    requests = dict.fromkeys(keys_homed_on(A, 8), 5)
    homes = homes_over(seg)
    run(homes, requests, rounds=10, candidates=(A, fast_b))
    assert work_on(seg, requests, (A, fast_b)) == {"inst-a": 10, "inst-b": 30}


def test_paces_a_little_apart_count_as_one_speed_so_their_drift_moves_no_prompt(seg) -> None:
    # a draws 62 % of the requests; b learned a pace 1.25x faster. As two speeds a would be due
    # 44 % and carry 1.39x its share, past a tolerance of 0.3: a prompt would move to b. As one
    # class each is due half, and a's 1.24x is within it.
    requests = {**dict.fromkeys(keys_homed_on(A, 2), 31), **dict.fromkeys(keys_homed_on(B, 2), 19)}
    homes = homes_over(seg, tolerance=0.3)
    run(homes, requests, rounds=5, candidates=(A, B._replace(speed=1.25)))
    assert homes.stats["moves"] == 0
    # An instance twice as fast is another class: it takes its larger share.
    run(homes, requests, rounds=5, candidates=(A, B._replace(speed=2.0)), start=106.0)
    assert homes.stats["moves"] >= 1


def test_a_moved_prompt_stays_a_while_before_the_work_moves_it_again(seg) -> None:
    # Three prompts homed on a, drawing 16, 12 and 12: the 16 moves to b. Then b reads four
    # times slower (a pace disturbed by the misses the move caused): the work alone would send
    # the 16 straight back. It stays STAY_S first.
    hot, *rest = keys_homed_on(A, 3)
    requests = {hot: 16, **dict.fromkeys(rest, 12)}
    homes = homes_over(seg)
    now = run(homes, requests, rounds=1)
    assert homes.stats["moves"] == 1 and work_on(seg, requests) == {"inst-a": 24, "inst-b": 16}
    slow_b = (A, B._replace(speed=0.25))
    now = run(homes, requests, rounds=int(STAY_S / ROUND_S) - 1, candidates=slow_b, start=now)
    assert homes.stats["moves"] == 1 and HomeReader(seg).home_of(hot) == B.where
    run(homes, requests, rounds=2, candidates=slow_b, start=now)
    assert homes.stats["moves"] == 2 and work_on(seg, requests) == {"inst-a": 40, "inst-b": 0}


def test_speeds_are_classed_within_the_band_at_their_geometric_mean() -> None:
    assert speed_classes([1.0, 1.25]) == pytest.approx([1.25 ** 0.5] * 2)
    assert speed_classes([0.5, 1.0, 1.2]) == pytest.approx([0.5, 1.2 ** 0.5, 1.2 ** 0.5])
    assert speed_classes([2.0]) == [2.0]


def test_homes_on_an_instance_that_left_and_of_prompts_no_longer_seen_are_dropped(seg) -> None:
    requests = dict.fromkeys(keys_homed_on(A, 2), 30)
    homes = homes_over(seg, halflife_s=1)
    now = run(homes, requests, rounds=1)
    assert sorted(HomeReader(seg).homes().values()) == [A.where, B.where]  # one moved to b
    homes.tick(now, lambda: [A])  # b left
    assert list(HomeReader(seg).homes().values()) == [A.where]
    now = run(homes, requests, rounds=1, start=now + ROUND_S)  # its next request names it again
    assert len(HomeReader(seg).homes()) == 2
    homes.tick(now + 20, lambda: [A, B])  # silent for 20 half-lives: forgotten
    assert HomeReader(seg).homes() == {} and homes.describe()["prompts"] == 0


# Two engines as on the real-engine bench: 64 KV blocks of 128 tokens, 4 requests at once each:
# room for 60 blocks of prompts, 8 of 7 blocks.
A_KV, B_KV = A._replace(kv_capacity_tokens=64 * 128, slots=4), B._replace(kv_capacity_tokens=64 * 128, slots=4)


def homed_prompts(seg, keys: list[int], candidates=(A_KV, B_KV)) -> dict[str, int]:
    return work_on(seg, dict.fromkeys(keys, 1), candidates)


def balance_with_room(seg, a: tuple[int, int], b: tuple[int, int], rounds: int) -> dict[int, int]:
    """`a`, `b`: (prompts whose rendezvous home it is, requests each draws a round); the homes
    balanced for `rounds` with a cache of room for 8 prompts on each; returns the requests."""
    requests = {**dict.fromkeys(keys_homed_on(A, a[0]), a[1]), **dict.fromkeys(keys_homed_on(B, b[0]), b[1])}
    run(homes_over(seg), requests, rounds, candidates=(A_KV, B_KV))
    return requests


def test_prompts_move_off_an_instance_whose_cache_they_overflow(seg) -> None:
    # Ten prompts homed on a (70 blocks, past its 60), six on b; b's draw more, so by the work
    # alone prompts would move to a.
    requests = balance_with_room(seg, (10, 2), (6, 5), rounds=3)
    assert homed_prompts(seg, list(requests)) == {"inst-a": 8, "inst-b": 8}
    assert work_on(seg, requests, (A_KV, B_KV)) == {"inst-a": 25, "inst-b": 25}
    # Without capacities (not known), the same traffic moves prompts the other way.
    run(homes_over(seg), requests, rounds=3)
    assert homed_prompts(seg, list(requests))["inst-a"] > 10


def test_a_move_for_the_work_never_overflows_a_cache_two_homes_swap_instead(seg) -> None:
    # Eight prompts each, a's drawing three times b's: moving one more prompt to b would take
    # it past its room, so a hot prompt of a and a cold one of b swap homes.
    requests = balance_with_room(seg, (8, 6), (8, 2), rounds=6)
    assert homed_prompts(seg, list(requests)) == {"inst-a": 8, "inst-b": 8}
    assert work_on(seg, requests, (A_KV, B_KV)) == {"inst-a": 32, "inst-b": 32}


def test_a_move_for_the_work_counts_the_prompts_that_have_not_come_back_yet(seg) -> None:
    # b's room holds its eight prompts, each seen once so far (their second requests may come
    # any time); a's four draw nearly all the work. Moving one to b (the closest split) would
    # make nine there: prompts swap instead.
    hot, cold = keys_homed_on(A, 4), keys_homed_on(B, 8)
    homes = homes_over(seg, tolerance=0.3)  # one move brings a within it
    run(homes, {**dict.fromkeys(hot, 10), **dict.fromkeys(cold, 1)}, rounds=1, candidates=(A_KV, B_KV))
    assert homes.stats["moves"] == 1
    assert homed_prompts(seg, hot + cold) == {"inst-a": 4, "inst-b": 8}


def test_a_prompt_seen_once_takes_no_room(seg) -> None:
    # Eight prompts that came back fill a's room; forty one-off prompts homed there as well do
    # not make it overflow, so nothing moves for room.
    hot, once = keys_homed_on(A, 48)[:8], keys_homed_on(A, 48)[8:]
    b_keys = keys_homed_on(B, 8)
    homes = homes_over(seg, 10.0)
    run(homes, {**dict.fromkeys(hot + b_keys, 4), **dict.fromkeys(once, 1)}, rounds=1,
        candidates=(A_KV, B_KV))
    assert homes.stats["moves"] == 0


def test_a_restarted_sidecar_keeps_the_published_homes(seg) -> None:
    requests = dict.fromkeys(keys_homed_on(A, 2), 20)
    run(homes_over(seg), requests, rounds=1)
    published = HomeReader(seg).homes()
    again = homes_over(seg)
    assert again.adopt() == 2
    again.tick(200.0, lambda: [A, B])  # a round before any request: the homes stay
    assert HomeReader(seg).homes() == published
    run(again, requests, rounds=3, start=201.0)
    assert HomeReader(seg).homes() == published and again.stats["moves"] == 0
