"""Fixtures of the real-engine suite (`make test-vllm`): two vLLM engines shared by every test of
the session, and a proxy (tests.harness.Cluster) per test with engines registered on it.

The engines are session-scoped because each takes about a minute to start; a test that kills
or restarts one (VllmEngine.kill / restart) leaves it healthy again for the next. Each test gets
its own proxy, so no routing state carries over between tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Cluster
from tests.real_engine.engines import VllmEngine, missing_setup, start_engines, stop_engines
from tests.real_engine.registration import AgentRegistration, register_engine

ENGINES = 2


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmEngine]]:
    problem = missing_setup()
    if problem:
        pytest.fail(problem)
    # With their KV cache events on (tests/real_engine/test_kv_events.py reads them).
    started = start_engines(ENGINES, tmp_path_factory.mktemp("vllm"), kv_events=True)
    yield started
    stop_engines(started)


@pytest.fixture
def healthy_engines(engines: list[VllmEngine]) -> list[VllmEngine]:
    """The shared engines, each healthy (a test before may have restarted one)."""
    for engine in engines:
        if not engine.running():
            engine.start()
        engine.wait_healthy()
    return engines


@pytest.fixture
def proxy(make_cluster: Callable[..., Cluster], healthy_engines: list[VllmEngine],
          ) -> Iterator[Callable[..., Cluster]]:
    """proxy(engines=1, workers=2, strategy=...) -> a running Cluster with that many of the
    shared engines registered, each by its agent; the agents stop (and unregister) before the
    cluster stops."""
    registrations: list[AgentRegistration] = []

    def make(engines: int = 1, workers: int = 2, strategy: str = "least_load",
             env: dict[str, str] | None = None) -> Cluster:
        cluster = make_cluster(workers=workers, strategy=strategy, env=env)
        for engine in healthy_engines[:engines]:
            registrations.append(register_engine(cluster, engine))
        return cluster

    yield make
    for registration in registrations:
        registration.stop()


@pytest.fixture
def openai_module() -> Any:
    """The official client, from the real-engine extra (imported here, not at module level, so
    that `make test`, which collects these modules, does not need it)."""
    import openai

    return openai
