"""Test and demo doubles of what the proxy talks to, never imported by the product.

- `instance`: a simulated OpenAI-compatible vLLM instance (data plane, KV-inject control plane,
  registration and heartbeats, timing from the same fitted curves as the predictor profile,
  faults and knobs at run time);
- `kdn`: a simulated knowledge server (text search, KV pushed to an instance's store);
- `scheduler`: a simulated Scheduler control plane (proxy registration and heartbeats), and
  `scheduler.requests`, the Scheduler-shaped request body;
- `common`: what the three share (CLI, knobs, control routes, serving);
- `demo`: `make run-workers`, the production launcher plus simulated instances and a KDN;
- `processes`: free ports and child processes on 127.0.0.1 for the demo, tests and benchmarks.

They are used from the checkout; the product's wheel does not contain them.
"""
