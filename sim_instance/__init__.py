"""Simulated OpenAI-compatible vLLM Instance, for the demo and the test suite.

Run: ``python -m sim_instance --port 9001 [--no-register] [--time-scale 0.05] [knobs...]``
(``--help`` lists every flag).

Data plane: ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream or not),
``GET /v1/models``, ``GET /healthz``. Every response carries ``x-sim-instance: <id>``.
Timing follows the fitted curves of the protocol reference (timing.py): serialized prefill,
batched decode whose inter-token latency grows with the batch, ``--max-concurrency`` slots.

Control routes for tests:
- ``GET /sim/config`` / ``POST /sim/config`` (partial JSON update of the knobs, validated)
  / ``POST /sim/config/reset`` (back to the start-time knobs);
- ``POST /sim/release``: let every currently hung, held or stalled request go on;
- ``GET /sim/stats`` / ``POST /sim/stats/reset``.
Knobs (config.Knobs): slow_factor, hang, fail_status + fail_rate, drop_after_chunks,
stall_after_chunks, hold_streams, default_max_tokens.
"""
