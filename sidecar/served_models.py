"""The models the instances serve, as OpenAI's `GET /v1/models` lists them: what every worker's
`/v1/models` answers, asked of the sidecar (proxy_workers/model_list.py).

An instance serves the model its capabilities name (`capabilities.model.identifier`, what an
instance of the original protocol sends) and every id of `meta.served_models` (a list of
strings: what the agent and the static prober register from the engine's own `/v1/models`,
where vLLM lists its LoRA adapters beside the base model).
"""

from __future__ import annotations

from typing import Any, Iterable

from .registry import InstanceRecord

OWNED_BY = "cacheroute-proxy"


def served_models(record: InstanceRecord) -> tuple[str, ...]:
    """The ids `record` serves, its capabilities' first; none if it said nothing."""
    ids: list[str] = []
    model = record.capabilities.model if record.capabilities is not None else None
    if model is not None and model.identifier:
        ids.append(model.identifier)
    listed = record.meta.get("served_models")
    if isinstance(listed, list):
        ids += [name for name in listed if isinstance(name, str) and name]
    return tuple(dict.fromkeys(ids))


def model_list(records: Iterable[InstanceRecord]) -> dict[str, Any]:
    """The union over `records` (the alive ones, in registration order): each model once, in the
    order first seen, `created` when its first instance registered, with the instances serving it."""
    models: dict[str, dict[str, Any]] = {}
    for record in records:
        for model_id in served_models(record):
            entry = models.setdefault(model_id, {"id": model_id, "object": "model",
                                                 "created": int(record.registered_at),
                                                 "owned_by": OWNED_BY, "instances": []})
            entry["created"] = min(entry["created"], int(record.registered_at))
            entry["instances"].append(record.instance_id)
    return {"object": "list", "data": list(models.values())}
