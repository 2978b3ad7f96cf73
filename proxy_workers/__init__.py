"""The data plane: one of N worker processes on the shared service port (SO_REUSEPORT).

A request is recovered (`request_model`), an instance selected from the shared table
(`router`, around cacheroute_proxy/routing's policies; `affinity`, kv_aware's pricing),
prepared (`pipeline`, `knowledge`, `iws`, `predictors`) and forwarded over a pooled connection
(`exchange`, `upstream` on cacheroute_proxy/http1/client.py, `sse`); `event_channel` tells the
sidecar's timelines about it, `outliers` leaves failing instances out for a while, `drain` lets
a stopping worker finish what it has, `metrics` serves /metrics, `app` and `server` put it
together.
"""
