"""The fixture can crash an engine and bring it back, as the agent's tests (an engine killed,
then restarted) need: SIGKILL reaches every process of the engine, the proxy answers for the
dead one without hanging, and the restarted engine serves through the proxy again."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import Cluster, http, wait_until
from tests.real_engine.engines import SERVED_MODEL, VllmEngine, group_alive
from tests.real_engine.registration import register_engine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

BODY = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def test_a_killed_engine_is_gone_whole_and_a_restarted_one_serves_again(
        make_cluster: Callable[..., Cluster], healthy_engines: list[VllmEngine]) -> None:
    engine = healthy_engines[-1]
    cluster = make_cluster(workers=2, strategy="least_load")
    registration = register_engine(cluster, engine)
    try:
        assert http("POST", f"{cluster.dp_url}/v1/chat/completions", BODY, timeout=30)[0] == 200
        pgid = engine.popen.pid
        engine.kill()
        assert not group_alive(pgid), "a process of the killed engine is still running"
        status, answer, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", BODY, timeout=30)
        assert (status, answer["error"]) == (502, "upstream_unavailable"), answer

        engine.start().wait_healthy()
        wait_until(lambda: http("POST", f"{cluster.dp_url}/v1/chat/completions", BODY, timeout=30)[0] == 200,
                   30, interval=0.5, message="the restarted engine serves through the proxy")
    finally:
        registration.stop()
