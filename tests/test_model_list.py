"""A worker's `GET /v1/models` asks the sidecar, but not per request: one answer serves every
request while the directory stays the same, for at most `fresh_s`; concurrent requests share
one ask; nothing is asked while no instance is alive; a sidecar that does not answer is said so,
unless what it said last still holds for the same directory."""

from __future__ import annotations

import asyncio

from cacheroute_proxy.http import HTTPError
from proxy_workers.model_list import ModelList
from proxy_workers.sidecar_reads import SidecarAnswer
from shm_schema import DirectorySnapshot, InstanceSlot

BODY = b'{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"cacheroute-proxy"}]}'


def _snapshot(seq: int, alive: int = 1) -> DirectorySnapshot:
    instances = tuple(InstanceSlot(slot=i, generation=1, instance_id=f"i{i}", host="127.0.0.1", port=9000 + i,
                                   alive=True, registered_at_ms=0, last_seen_ms=0, qps_1m=None)
                      for i in range(alive))
    return DirectorySnapshot(seq=seq, instances=instances, alive=instances, slot_span=alive, stable=True)


class Sidecar:
    """The ask, counted; it answers `BODY`, or what `fail` says."""

    def __init__(self) -> None:
        self.asked = 0
        self.fail: HTTPError | None = None
        self.status = 200

    async def __call__(self) -> SidecarAnswer:
        self.asked += 1
        await asyncio.sleep(0.01)  # the others arrive while this one waits for the sidecar
        if self.fail is not None:
            raise self.fail
        return SidecarAnswer(self.status, BODY, "application/json")


def _list(directory: list[DirectorySnapshot], sidecar: Sidecar, now: list[float]) -> ModelList:
    return ModelList(lambda: directory[0], sidecar, fresh_s=2.0, clock=lambda: now[0])


def test_one_ask_serves_every_request_until_the_directory_changes_or_the_answer_ages():
    directory, sidecar, now = [_snapshot(2)], Sidecar(), [100.0]
    models = _list(directory, sidecar, now)

    async def scenario() -> None:
        answers = await asyncio.gather(*(models.answer() for _ in range(20)))
        assert sidecar.asked == 1
        assert all((a.status_code, a.body, a.media_type) == (200, BODY, "application/json") for a in answers)
        now[0] = 101.9
        await models.answer()
        assert sidecar.asked == 1
        directory[0] = _snapshot(4, alive=2)  # an instance came
        await models.answer()
        assert sidecar.asked == 2
        now[0] = 104.0  # as old as fresh_s: a heartbeat may have changed an instance's model
        await models.answer()
        assert sidecar.asked == 3

    asyncio.run(scenario())


def test_no_alive_instance_is_503_with_retry_after_and_asks_nothing():
    directory, sidecar, now = [_snapshot(6, alive=0)], Sidecar(), [0.0]
    answer = asyncio.run(_list(directory, sidecar, now).answer())
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert b'"no_instance"' in answer.body and sidecar.asked == 0


def test_a_sidecar_that_does_not_answer_is_said_so_unless_its_last_answer_still_holds():
    directory, sidecar, now = [_snapshot(2)], Sidecar(), [0.0]
    models = _list(directory, sidecar, now)
    sidecar.fail = HTTPError(502, "sidecar_unreachable", "the sidecar's control plane did not answer")

    async def scenario() -> None:
        refused = await models.answer()
        assert refused.status_code == 502 and b"sidecar_unreachable" in refused.body
        sidecar.fail = None
        assert (await models.answer()).body == BODY
        sidecar.fail = HTTPError(504, "sidecar_timeout", "no answer within 2s")
        now[0] = 10.0  # aged, the same directory: the last list is still the best there is
        kept = await models.answer()
        assert (kept.status_code, kept.body) == (200, BODY) and sidecar.asked == 3
        directory[0] = _snapshot(3, alive=2)  # the directory changed: the last list may be wrong
        assert (await models.answer()).status_code == 504
        sidecar.fail, sidecar.status = None, 500  # the sidecar's own error: relayed, not kept
        assert (await models.answer()).status_code == 500
        sidecar.status = 200
        assert (await models.answer()).status_code == 200 and sidecar.asked == 6

    asyncio.run(scenario())
