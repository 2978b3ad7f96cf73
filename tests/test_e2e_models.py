"""What OpenAI clients and probes ask first, on every worker: `GET /v1/models`, the union of the
models the alive instances serve, and `GET /health`, whether the proxy can serve a request now;
both 503 `no_instance` with `Retry-After` while no instance is alive."""

from __future__ import annotations

from tests.harness import get, http, post, wait_until

NO_INSTANCE = {"error": "no_instance", "detail": "proxy has no alive instance"}


def _model_ids(url: str) -> list[str]:
    listed = get(f"{url}/v1/models")
    assert listed["object"] == "list", listed
    return [model["id"] for model in listed["data"]]


def test_models_and_health_follow_the_alive_instances(make_cluster):
    cluster = make_cluster(workers=2)
    workers = [cluster.worker_url(w) for w in range(2)]
    for url in workers:
        for path in ("/v1/models", "/health"):
            status, body, headers = http("GET", f"{url}{path}")
            assert (status, body) == (503, NO_INSTANCE), (path, body)
            assert headers["retry-after"] == "1" and headers["x-cacheroute-worker"].startswith("w")
        assert get(f"{url}/healthz")["ok"]  # the worker itself is fine: liveness is not readiness

    first = cluster.add_instance("--model", "model-a")
    for url in workers:
        listed = get(f"{url}/v1/models")
        assert listed["object"] == "list" and len(listed["data"]) == 1, listed
        model = listed["data"][0]
        assert model == {"id": "model-a", "object": "model", "created": model["created"],
                         "owned_by": "cacheroute-proxy", "instances": [first.instance_id]}
        assert isinstance(model["created"], int) and model["created"] > 1_600_000_000
        assert get(f"{url}/health") == {"ok": True, "alive_instances": 1}

    # One that serves several (meta.served_models: what the agent registers for an engine whose
    # /v1/models lists LoRA adapters too), and a second serving model-a.
    register = f"{cluster.cp_url}/v1/instance/register"
    post(register, {"instance_id": "multi", "host": "127.0.0.1", "port": 1,
                    "capabilities": {"model": {"identifier": "model-b"}},
                    "meta": {"served_models": ["model-b", "model-b-lora"]}})
    post(register, {"instance_id": "twin", "host": "127.0.0.1", "port": 2,
                    "capabilities": {"model": {"identifier": "model-a"}}})
    for url in workers:
        wait_until(lambda: _model_ids(url) == ["model-a", "model-b", "model-b-lora"], 10,
                   message="the union of every alive instance's models")
        by_id = {m["id"]: m for m in get(f"{url}/v1/models")["data"]}
        assert by_id["model-a"]["instances"] == [first.instance_id, "twin"]
        assert by_id["model-b-lora"]["instances"] == ["multi"]
        assert get(f"{url}/health") == {"ok": True, "alive_instances": 3}
    assert get(f"{cluster.cp_url}/v1/models") == get(f"{workers[0]}/v1/models")

    # Out of the candidate set: what it alone serves is no longer listed.
    assert post(f"{cluster.cp_url}/v1/instance/heartbeat", {"instance_id": "multi", "healthy": False})["ok"]
    for url in workers:
        wait_until(lambda: _model_ids(url) == ["model-a"], 10, message="model-b gone with its instance")
