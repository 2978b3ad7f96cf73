"""The worker's selection and lease path over a real segment."""

from __future__ import annotations


import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from cacheroute_proxy.routing.policy import Choice
from proxy_workers.refusals import NO_ALIVE_INSTANCE
from proxy_workers.router import Router
from shm_schema import DirectoryWriter, InstanceSlot, Segment, WorkerRow
from tests.harness import private_segment_name


@pytest.fixture
def table():
    name = private_segment_name()
    seg = Segment.create_or_attach(name, 8, 4)
    try:
        yield name, seg
    finally:
        seg.close()
        Segment.unlink(name)


def _router(name: str, seg: Segment, strategy: str = "least_load") -> Router:
    return Router(Settings(shm_name=name, instance_strategy=strategy), seg, WorkerRow.claim(seg, 0))


def _first_choice_is(router: Router, chosen: InstanceSlot) -> None:
    """The router's first choice is `chosen` (as if made just before it left the table); a
    choice that excludes an instance is the router's own."""
    real_choose = router._choose
    router._choose = lambda exclude, request: (  # type: ignore[method-assign]
        real_choose(exclude, request) if exclude else Choice(chosen))


def test_no_alive_instance_is_503(table):
    name, seg = table
    with pytest.raises(HTTPError) as info:
        _router(name, seg).acquire()
    assert (info.value.status, info.value.code) == (503, "no_instance")
    assert info.value.headers == {"Retry-After": "1"}


def test_instance_vanishing_between_select_and_begin_is_503_and_leaks_nothing(table):
    name, seg = table
    writer = DirectoryWriter(seg)
    slot = writer.allocate("a", "127.0.0.1", 9001)
    router = _router(name, seg)
    chosen = router.choose()
    writer.free(slot.slot)  # the sidecar purges it right after the selection
    _first_choice_is(router, chosen)
    with pytest.raises(HTTPError) as info:
        router.acquire()
    assert info.value.detail == NO_ALIVE_INSTANCE  # chosen again without it: none is left
    assert info.value.headers == {"Retry-After": "1"}
    assert router.row.own_words(8) == (0,) * 8


def test_an_instance_vanishing_between_select_and_begin_leaves_the_request_to_another(table):
    name, seg = table
    writer = DirectoryWriter(seg)
    gone = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    router = _router(name, seg)
    chosen = next(i for i in router.view.directory.snapshot().alive if i.instance_id == "a")
    writer.free(gone.slot)
    _first_choice_is(router, chosen)
    lease = router.acquire()
    assert lease.instance.instance_id == "b" and lease.release()


def test_lease_release_is_idempotent_and_least_load_sees_it(table):
    name, seg = table
    writer = DirectoryWriter(seg)
    writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    router = _router(name, seg)
    first = router.acquire()
    second = router.acquire()
    assert {first.instance.instance_id, second.instance.instance_id} == {"a", "b"}
    assert first.release() and not first.release()
    assert router.acquire().instance.instance_id == first.instance.instance_id
