"""Simulated OpenAI-compatible vLLM Instance, for the demo and the test suite.

Run: ``python -m cacheroute_sim.instance --port 9001 [--no-register] [--time-scale 0.05] [knobs...]``
(``--help`` lists every flag).

Data plane: ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream or not),
``GET /v1/models`` (with ``max_model_len``), ``GET /version``, ``GET /healthz`` and ``GET /health``. Every response carries ``x-sim-instance: <id>``.
Timing follows the fitted curves of the original benchmark tables (timing.py): serialized
prefill, batched decode whose inter-token latency grows with the batch, ``--max-concurrency``
slots.

Control plane (the KV inject), a second listener on ``--cp-port`` (default: data port + 1,
skipped with a warning when that port is taken; ``--cp-port 0`` disables it):
``GET /healthz`` and ``POST /v1/kv/inject_ready`` ``{"request_id", "kdn_addr", "model",
"knowledge_ids"}``, which calls the KDN's ``/knowledge/inject_ready_kv`` with this Instance's
(fake, never contacted) Redis target ``--redis-host/--redis-port/--redis-db/--redis-password``
and relays the KDN's answer verbatim; a failed KDN call (unreachable, ``--kdn-timeout``
exceeded, 5xx, not a JSON object) answers 502 ``{"ok": false, ..., "detail": <reason>}``.
The register body carries ``meta.cp_port`` so the Proxy need not assume 9002, and lists
``kv_inject`` in ``capabilities.runtime.supported_cache_features`` only when the control plane
runs (without one, the Proxy sends knowledge as text).

KV prefix hit (simulation-only hint, a real vLLM ignores the header): a data-plane request
with ``x-cacheroute-kv-prefix-tokens: N`` (integer >= 0; the Proxy sends it on the kvcache path
after a successful inject) is prefilled as if its first N prompt tokens were in Redis: the
prefill computes ``max(1, prompt_tokens - N)`` tokens, after a Redis pull of
``2764.34 ms/GB x N x 0.0000381 GB + 12.46 ms`` (N capped at the prompt; scaled like every
other duration). A malformed value is a 400.

The KV kept (residency.py): injected knowledge KV per id, in an LRU of
``kv_capacity_tokens`` (default ``--kv-mem-gb``, registered as ``meta.kv_mem_gb``, over 3.81e-5
GB a token); an inject of ids all resident is answered at once, without the KDN. A request
with ``x-cacheroute-kv-knowledge-ids: k1,k2`` (sent by the Proxy beside the prefix tokens) has
its leading resident ids' tokens cached, and with ``prefix_caching`` its leading prompt blocks
(16 tokens) found in the prefix cache; the cached prefix costs ``cached_prefill_factor`` of its
prefill. ``--report-resident`` puts ``resident_keys`` in heartbeats.

Control routes for tests:
- ``GET /sim/config`` / ``POST /sim/config`` (partial JSON update of the knobs, validated)
  / ``POST /sim/config/reset`` (back to the start-time knobs);
- ``POST /sim/release``: let every currently hung, held or stalled request go on;
- ``GET /sim/stats`` / ``POST /sim/stats/reset`` (includes ``kv_injects``,
  ``kv_inject_failed``, ``kv_prefix_hits``, ``kv_prefix_tokens_total``, and
  ``last_request_headers``: the last generation request's headers as received, ``[name,
  value]`` pairs in order, names lower-case; ``last_inject_trace_context``: the last
  ``/v1/kv/inject_ready``'s traceparent and tracestate), the KV kept's counters, ``prefills``,
  ``prefill_ms_total`` and ``last_prefill`` (the simulated prefill, GPU ms), and
  ``residency`` (what is held now);
- ``POST /sim/kv/clear``: forget every KV kept.
Knobs (config.Knobs): slow_factor, hang, fail_status + fail_rate, drop_after_chunks,
stall_after_chunks, hold_streams, default_max_tokens, response_headers (added to every
generation answer), request_id_headers (answer with ``x-request-id``, the request's or a new
one, as vLLM's ``--enable-request-id-headers``), kv_capacity_tokens, prefix_caching,
prefix_cache_blocks, cached_prefill_factor.
"""
