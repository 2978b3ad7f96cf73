"""The instance agent: one small process beside each OpenAI-compatible engine (a plain
`vllm serve`), so the engine joins the proxy without code of its own.

`cacheroute-proxy instance-agent --instance-url http://HOST:PORT` waits until the engine answers
`GET /health`, registers it with the proxy's control plane with what the engine says of itself
(`/v1/models`: model id, max_model_len; `/version`), heartbeats at the interval the proxy asks
for, resends capabilities when asked, registers again when the proxy forgot it, tells the proxy
within a second or two when the engine stops answering (and when it answers again), reports the
host's resources and the measured links to the KDN servers, and unregisters on SIGTERM/SIGINT.

Modules: `config` (options and their environment variables), `engine` (what the engine says),
`proxy_client` (the calls to the proxy's control plane), `resources` and `topology` (the
reports), `agent` (the lifecycle), `__main__` (the command line).
"""
