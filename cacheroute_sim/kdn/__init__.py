"""Simulated KDN (Knowledge Delivery Network: the knowledge server, which holds each knowledge
id's text and prebuilt KV), for the demo and the test suite. No Redis needed.

Run: ``python -m cacheroute_sim.kdn --port 9101 [--knowledge FILE.json] [--time-scale 0.05] [--seed N]``
(``--help`` lists every flag).

Knowledge store (store.py): a JSON list of ``{"id", "content", "kv_ready"}``, or by default a
deterministic generated one (ids ``k0000``..``k0199``, a quarter short, the rest 1-3k tokens,
half kv_ready). Ids are lower-cased on load and on every lookup, like the original KDN.

Routes (wire-compatible with the original KDN; docs/protocol.md, "Knowledge"):
- ``POST /knowledge/search/text`` ``{"knowledge_ids", "need_fields"}`` ->
  ``{"items": [{"id", "knowledge_id", <need_fields>}], "miss": [ids]}``; latency
  ``rtt_ms`` + reply bytes over the link.
- ``POST /knowledge/inject_ready_kv`` ``{"request_id", "model", "knowledge_ids", "redis_host",
  "redis_port", "redis_db", "redis_password"}`` -> ``{"ok", "injected_kids", "text_only_kids",
  "miss_kids", "keys_injected", "payload_bytes", "payload_files", "network_sim_enabled",
  "detail"}`` after ``rtt_ms`` + the transfer of ``tokens x kv_bytes_per_token`` bytes of the
  kv_ready ids at ``bandwidth_mbps x link_efficiency``. Transfers to one Redis target
  (``host:port``) are serialized FIFO; different targets run in parallel. Nothing is written
  anywhere. Empty ``knowledge_ids`` -> 400 ``{"ok": false, "detail": "knowledge_ids is empty"}``.
- ``POST /v1/topology/hello`` -> ``{"ok", "kdn_id", ...}``; ``GET /v1/topology/ping`` ->
  ``{"ok": true}`` after ``rtt_ms``; ``GET /healthz``.

Control routes for tests: ``GET/POST /sim/config`` (partial knob update, validated),
``POST /sim/config/reset``, ``POST /sim/release`` (let hung requests go on), ``GET /sim/stats``
(counters, active/queued transfers, per-link totals, the last inject request, and
``last_search_trace_context``: the last search's traceparent and tracestate headers),
``POST /sim/stats/reset``.
Knobs (config.Knobs): rtt_ms, bandwidth_mbps, link_efficiency, kv_bytes_per_token,
fail_status, hang, fault_on ("all" | "search" | "inject"). Defaults reproduce the Proxy's IWS
transfer model (0.096 MB/token at 82.5 % of 1000 Mbps). ``--time-scale`` multiplies every
simulated duration.
"""
