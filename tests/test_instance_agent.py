"""The instance agent (`cacheroute-proxy instance-agent`) beside an engine that registers nothing
itself: a simulated instance started with --no-register stands in for a plain `vllm serve` (the
same against a real vLLM is in tests/real_engine/)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from cacheroute_proxy.config import ConfigError
from cacheroute_proxy.engine_probe import EngineInfo, kv_capacity_from_metrics
from cacheroute_sim.processes import free_port
from cacheroute_sim.scheduler.requests import scheduler_body
from cacheroute_proxy.instance_wire import RegisterReply
from instance_agent import agent as agent_module
from instance_agent.agent import register_request
from instance_agent.config import parse
from instance_agent.proxy_client import Heartbeat
from tests.harness import Agent, Engine, Process, alive, chat_body, get, http, listed, post, wait_until


# --- options -------------------------------------------------------------------------------------
def test_options_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("PROXY_CP_URL", "http://10.0.0.5:8002")
    monkeypatch.setenv("PROXY_CP_TOKEN_FILE", str(token))
    monkeypatch.setenv("INSTANCE_KDN_TARGETS", "127.0.0.1:9101, kdn-b:9102")
    config = parse(["--instance-url", "http://127.0.0.1:8000", "--max-num-seqs", "4"])
    assert config.proxy_cp_url == "http://10.0.0.5:8002" and config.cp_token == "s3cret"
    assert config.kdn_targets == ("127.0.0.1:9101", "kdn-b:9102") and config.max_num_seqs == 4
    assert config.resolved_instance_id == "hp_127.0.0.1:8000"


@pytest.mark.parametrize("argv, named", [
    ([], "--instance-url"),
    (["--instance-url", "127.0.0.1:8000"], "INSTANCE_URL"),
    (["--instance-url", "http://h:1", "--max-num-seqs", "many"], "INSTANCE_MAX_NUM_SEQS"),
    (["--instance-url", "http://h:1", "--kdn-targets", "nohost"], "INSTANCE_KDN_TARGETS"),
    (["--instance-url", "http://h:1", "--health-interval", "0"], "INSTANCE_HEALTH_INTERVAL_S"),
    (["--instance-url", "http://h:1", "--log-format", "xml"], r"--log-format \(PROXY_LOG_FORMAT\)"),
])
def test_a_bad_option_is_refused_naming_it(argv: list[str], named: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INSTANCE_URL", raising=False)
    with pytest.raises(ConfigError, match=named):
        parse(argv)


def test_what_the_proxy_is_told_of_an_engine() -> None:
    config = parse(["--instance-url", "http://127.0.0.1:8000", "--max-num-seqs", "4"])
    request = register_request(config, EngineInfo(model_id="tiny", max_model_len=1024, version="0.32.0"))
    assert (request.host, request.port, request.instance_id) == ("127.0.0.1", 8000, "hp_127.0.0.1:8000")
    assert request.meta["max_num_seqs"] == 4 and request.meta["max_model_len"] == 1024
    assert request.capabilities is not None and request.capabilities.model.identifier == "tiny"
    assert request.capabilities.runtime.vllm_version == "0.32.0"
    assert request.capabilities.pulls_kv() is False  # no KV inject served: text only
    assert "kv_capacity_tokens" not in request.meta  # the engine did not say
    sized = register_request(config, EngineInfo(model_id="tiny", kv_capacity_tokens=5120))
    assert sized.meta["kv_capacity_tokens"] == 5120  # bounds the affinity index's model of it
    # Every id the engine's /v1/models lists (vLLM lists its LoRA adapters there too): the
    # proxy's /v1/models lists them all.
    adapters = register_request(config, EngineInfo(model_id="tiny", models=("tiny", "tiny-sql-lora")))
    assert adapters.meta["served_models"] == ["tiny", "tiny-sql-lora"]
    assert "served_models" not in request.meta  # the engine listed none


# vLLM 0.32's series (abridged), and an older one without kv_cache_size_tokens.
CACHE_INFO = ('vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
              'enable_prefix_caching="True",engine="0",kv_cache_memory_bytes="1073741824",'
              'kv_cache_size_tokens="5120",num_cpu_blocks="None",num_gpu_blocks="40",'
              'num_gpu_blocks_override="40",sliding_window="None"} 1.0')


@pytest.mark.parametrize("text, tokens", [
    ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n" + CACHE_INFO, 5120),
    (CACHE_INFO.replace('kv_cache_size_tokens="5120",', "").replace('num_gpu_blocks="40"', 'num_gpu_blocks="64"'),
     64 * 128),
    (CACHE_INFO.replace('kv_cache_size_tokens="5120",', "").replace('num_gpu_blocks="40"', 'num_gpu_blocks="None"'),
     None),
    ('vllm:num_requests_running{engine="0"} 0.0', None),
    ("", None),
])
def test_the_kv_capacity_is_what_vllms_cache_config_info_states(text: str, tokens: int | None) -> None:
    assert kv_capacity_from_metrics(text) == tokens


# --- against a real cluster ------------------------------------------------------------------------
def test_the_agent_registers_a_plain_engine_and_leaves_on_sigterm(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(workers=2)
    engine = Engine(tmp_path)
    agent = Agent(cluster, engine, "--max-num-seqs", "3")
    try:
        wait_until(lambda: "waiting for the engine" in agent.log(), 10, message="the agent waits")
        assert listed(cluster, agent.instance_id) is None  # nothing registered before /health answers
        engine.start()
        wait_until(lambda: alive(cluster, agent.instance_id), 20, message=f"registered\n{agent.log()}")
        row = listed(cluster, agent.instance_id)
        assert row is not None
        assert row["capabilities"]["model"]["identifier"] == "sim-model"
        assert row["meta"]["max_num_seqs"] == 3 and row["meta"]["agent"] == "cacheroute-instance-agent"
        status, answer, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
        assert status == 200 and headers["x-cacheroute-instance"] == agent.instance_id, answer
    finally:
        code = agent.process.stop(signal.SIGTERM)
        engine.stop()
    assert code == 0, agent.log()
    assert listed(cluster, agent.instance_id) is None, "unregistered on SIGTERM"


def test_knowledge_goes_in_as_text_to_an_instance_that_cannot_pull_kv(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(workers=1, env={"PROXY_INJECTION_STRATEGY": "iws"})
    engine = Engine(tmp_path).start()
    kdn_port = free_port()
    kdn = Process(["-m", "cacheroute_sim.kdn", "--host", "127.0.0.1", "--port", str(kdn_port)], {},
                  tmp_path / "kdn.log")
    agent = Agent(cluster, engine)
    try:
        wait_until(lambda: alive(cluster, agent.instance_id), 20, message=f"registered\n{agent.log()}")
        wait_until(lambda: get(f"http://127.0.0.1:{kdn_port}/healthz")["ok"], 20, message="kdn up")
        body = scheduler_body(3, stream=False)
        body["Service"].update({"Enable_know_injection": True, "Injection_type": "kvcache",
                                "Knowledge_List": ["k0001", "k0002"], "Knowledge_length": 4000})
        body["Task"]["KDN_server_addr"] = f"127.0.0.1:{kdn_port}"
        status, answer, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body)
        assert status == 200, answer
        trace = answer["_cacheroute_meta"]["trace"]
        assert trace["injection_mode"] == "text" and trace["iws_reason"] == "instance_cannot_pull_kv"
        assert "kv_ack_start_ms" not in trace  # no KV inject was asked of it
    finally:
        agent.process.stop(signal.SIGTERM)
        kdn.stop()
        engine.stop()


def test_the_agent_registers_again_when_the_proxy_forgot_it(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(workers=1)
    engine = Engine(tmp_path).start()
    agent = Agent(cluster, engine)
    try:
        wait_until(lambda: alive(cluster, agent.instance_id), 20, message=f"registered\n{agent.log()}")
        first = listed(cluster, agent.instance_id)
        post(f"{cluster.cp_url}/v1/instance/unregister", {"instance_id": agent.instance_id})  # a purge
        wait_until(lambda: alive(cluster, agent.instance_id), 5, message="registered again")
        again = listed(cluster, agent.instance_id)
        assert again is not None and first is not None
        assert again["slot_generation"] != first["slot_generation"]  # a new registration
        assert "registering again" in agent.log()
    finally:
        agent.process.stop(signal.SIGTERM)
        engine.stop()


def test_the_agent_resends_capabilities_to_a_restarted_sidecar(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(workers=1)
    engine = Engine(tmp_path).start()
    agent = Agent(cluster, engine)
    try:
        wait_until(lambda: alive(cluster, agent.instance_id), 20, message=f"registered\n{agent.log()}")
        sidecar = cluster.status()["sidecar"]["pid"]
        os.kill(sidecar, signal.SIGKILL)
        wait_until(lambda: cluster.status()["sidecar"]["pid"] != sidecar, 15, message="sidecar restarted")
        # The new sidecar adopts the slot from the segment, without the capabilities; the
        # agent's next heartbeat is asked for them and sends them.
        wait_until(lambda: (listed(cluster, agent.instance_id) or {}).get("capabilities"), 10,
                   message=f"capabilities again\n{agent.log()}")
        assert listed(cluster, agent.instance_id)["capabilities"]["model"]["identifier"] == "sim-model"
        assert "resending them" in agent.log()
    finally:
        agent.process.stop(signal.SIGTERM)
        engine.stop()


def test_an_engine_that_stops_answering_is_out_within_two_seconds_and_back_when_it_answers(
        make_cluster, tmp_path: Path) -> None:
    """SIGKILL (connections refused) and SIGSTOP (a hung engine: the /health probe times out):
    both leave the candidate set of every worker within ~2 s, far inside the 30 s TTL, and no
    request fails meanwhile (a refused forward is retried on the other engine)."""
    cluster = make_cluster(workers=2, strategy="least_load")
    engines = [Engine(tmp_path).start() for _ in range(2)]
    agents = [Agent(cluster, engine) for engine in engines]
    victim, other = agents[0].instance_id, agents[1].instance_id

    def out_everywhere() -> bool:
        return all(not any(r["instance_id"] == victim and r["is_alive"]
                           for r in cluster.loads(w)["instances"]) for w in range(cluster.workers))

    try:
        wait_until(lambda: alive(cluster, victim) and alive(cluster, other), 20,
                   message=f"both registered\n{agents[0].log()}")
        for stop, resume in ((signal.SIGKILL, None), (signal.SIGSTOP, signal.SIGCONT)):
            assert engines[0].process is not None
            os.kill(engines[0].process.pid, stop)
            wait_until(out_everywhere, 2.5, interval=0.02, message=f"out after {stop.name}\n{agents[0].log()}")
            for _ in range(6):
                status, answer, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions",
                                               chat_body(stream=False))
                assert status == 200 and headers["x-cacheroute-instance"] == other, answer
            assert listed(cluster, victim) is not None  # out of the candidate set, still registered
            if resume is None:
                engines[0].start()  # the same port: the agent sees it answer again
            else:
                os.kill(engines[0].process.pid, resume)
            wait_until(lambda: alive(cluster, victim), 10, message=f"back after {stop.name}\n{agents[0].log()}")
    finally:
        for agent in agents:
            agent.process.stop(signal.SIGTERM)
        for engine in engines:
            engine.stop()


def _stop_during_the_upsert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                            upsert: Callable[[], Awaitable[None]]) -> list[str]:
    """Runs an agent against a fake proxy until it registers again an engine that went and came
    back, and stops it while that upsert is on its way: the proxy reads it ("register"), does
    `upsert()` with it, not cancelled with the agent's call, then "applied". The calls as the
    proxy saw them."""
    calls: list[str] = []

    async def apply(work: Callable[[], Awaitable[None]]) -> None:
        await work()
        calls.append("applied")

    class FakeProxy:  # the agent's proxy client
        def __init__(self, *args: object) -> None:
            pass

        async def register(self, request: Any) -> RegisterReply:
            calls.append("register")
            work = upsert if calls.count("register") > 1 else asyncio.sleep
            await asyncio.shield(asyncio.ensure_future(apply(lambda: work(0))))
            return RegisterReply(request.instance_id, 1, 10.0, None)

        async def heartbeat(self, request: Any) -> Heartbeat:
            calls.append("heartbeat")
            return Heartbeat.ACCEPTED

        async def unregister(self, instance_id: str) -> bool:
            calls.append("unregister")
            return True

        async def report(self, path: str, body: Any) -> bool:
            return True

    monkeypatch.setattr(agent_module, "ProxyClient", FakeProxy)
    engine = Engine(tmp_path).start()
    config = parse(["--instance-url", engine.url, "--health-interval", "0.1", "--heartbeat-interval", "0.2"])

    async def until(predicate: Any, what: str) -> None:
        for _ in range(300):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {calls}")

    async def scenario() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(agent_module.Agent(config).run(stop))
        await until(lambda: "heartbeat" in calls, "the first heartbeat")
        engine.stop()  # the engine goes, comes back: the agent registers it again
        await asyncio.sleep(0.5)
        engine.start()
        await until(lambda: calls.count("register") == 2, "the upsert")
        stop.set()
        await asyncio.wait_for(run, 10)

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()
    return calls


def test_a_stop_while_the_agent_registers_again_still_unregisters(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The stop can come while the agent registers an engine that came back (the upsert is on
    its way, or due): the proxy holds the instance all the while, so the agent must unregister
    it on its way out (once, an agent that stopped in that window left its instance behind).
    Here the proxy never answers the upsert."""
    calls = _stop_during_the_upsert(monkeypatch, tmp_path, lambda _: asyncio.Event().wait())
    assert calls[-1] == "unregister", calls


def test_a_stop_during_a_register_unregisters_once_it_is_applied(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The proxy applies a register it has read whether or not the agent waits for the answer.
    An agent that stopped waiting and unregistered at once could see its unregister applied
    first and the register after it: the instance stayed registered after the agent had gone.
    Here the proxy applies the upsert 0.5 s after reading it, like a busy control plane."""
    calls = _stop_during_the_upsert(monkeypatch, tmp_path, lambda _: asyncio.sleep(0.5))
    assert [c for c in calls if c in ("applied", "unregister")] == ["applied", "applied", "unregister"], calls
