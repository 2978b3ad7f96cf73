"""One request's record (`Trace`), what preparing its knowledge found (`Knowledge`), and the
`cacheroute_meta` object both are reported in (`Meta`).

The trace is written along the request's way through the worker -- app (arrival), exchange
(selection, forward, first token), pipeline (prepare and ready stages, predictions) and knowledge
(KDN fetch, KV inject) -- and read by clients and bench/bench_pressure.py as the `trace` member
of `cacheroute_meta`. Its fields are declared in the order a request meets them, which is the
order they have in the JSON. Each defaults to None, and a None field is left out of the JSON
(`omit_defaults`), so the object names exactly what this request went through; a 0 is a value
and is kept.

`encode_meta` is the one place `cacheroute_meta` is encoded: the JSON answer splices its bytes
in (relay.with_meta), the stream sends them as its last event (sse.meta_event).
"""

from __future__ import annotations

from typing import Any

import msgspec

# Times named *_ms without "predict" are wall-clock milliseconds (cacheroute_proxy.clock.now_ms).


class Trace(msgspec.Struct, omit_defaults=True, gc=False):
    """A request's timings and decisions, in lifecycle order. Scalars only, so the garbage
    collector need not track it (gc=False)."""

    # --- arrival (app) ---
    proxy_recv_ms: int | None = None  # the request reached the worker, before its body was read
    worker: str | None = None  # which worker served it: w<index>-pid<pid>
    request_id: int | None = None  # the client's Request_ID (0 for a plain OpenAI body)
    # --- instance selection (exchange, around Router.acquire) ---
    route_select_start_ms: int | None = None
    route_select_end_ms: int | None = None  # the lease is held from here
    snapshot_age_ms: float | None = None  # least_load: age of the predicted layer the choice read
    instance_id: str | None = None  # the instance chosen (the last one, after a retry)
    # kv_aware: the chosen instance's predicted time to first token for this request (queue wait
    # + prefill + KV transfer; absent while the predicted layer is unknown), what its holding of
    # the request's knowledge or prompt saved of that, and whether the balance guard fired.
    route_predicted_ttft_ms: float | None = None
    affinity_saved_ms: float | None = None
    affinity_guard: bool | None = None  # true: the balance guard had kv_aware choose as least_load
    # --- prepare stage (pipeline) ---
    prepare_seq: int | None = None  # place in this worker's prepare order for the instance
    proxy_enqueue_ms: int | None = None  # entered the instance's pipeline
    iws_reason: str | None = None  # why text or kvcache was chosen (IWS, or an instance without KV pull)
    # The KDN link IWS or the KV reservation estimated the transfer over: "measured" (reported
    # by instances), "static" (PROXY_KDN_LINKS_JSON) or "default" (KDN_DEFAULT_BANDWIDTH_MBPS).
    kdn_link_source: str | None = None
    injection_mode: str | None = None  # a request with knowledge: "text" or "kvcache"
    prepare_dequeue_ms: int | None = None  # began waiting for one of the instance's prepare slots
    prepare_start_ms: int | None = None  # a prepare slot was held (or nothing was to prepare)
    # --- knowledge (knowledge.KnowledgePreparer, inside the prepare stage) ---
    kdn_fetch_start_ms: int | None = None
    kdn_fetch_end_ms: int | None = None
    kdn_link_wait_ms: int | None = None  # kvcache: wait for the (instance, KDN) link to free
    kv_ack_start_ms: int | None = None  # kvcache: the instance was asked to pull the KV
    kvcache_actual_path: str | None = None  # "kv_injected", or "recompute" if the pull failed
    kv_ack_end_ms: int | None = None
    prepare_self_done_ms: int | None = None  # this request's preparation ended
    # --- ready stage (pipeline) ---
    # Release from the prepare stage to the ready stage (PROXY_READY_RELEASE_POLICY):
    ready_release_seq: int | None = None  # place in this worker's release order for the instance
    ready_release_policy: str | None = None  # "ordered" or "text_bypass", as configured
    ready_bypass: bool | None = None  # true: a text request released ahead of a blocked head
    ready_blocked_seq: int | None = None  # a bypass only: the prepare_seq of the head it passed
    ready_enqueue_ms: int | None = None  # released in prepare order, reserved with the sidecar
    actual_know_prepare_ms: int | None = None  # ready_enqueue_ms - proxy_enqueue_ms
    predict_service_ms: float | None = None  # predicted prefill (or KV pull + residual prefill)
    predict_decode_ms: float | None = None  # predicted decode of all its tokens
    predict_queue_wait_ms: float | None = None  # predicted ready wait (a fresh snapshot only)
    # Predicted proxy_enqueue_ms -> first token: actual_know_prepare_ms + predicted ready wait +
    # predicted service (a fresh snapshot only, like predict_queue_wait_ms).
    predict_total_ms: float | None = None
    pred_first_token_ts_ms: int | None = None  # when the first token is predicted, wall clock
    ready_dequeue_ms: int | None = None  # admitted under the host-wide READY_CONCURRENCY
    # Which of this worker's ready places for the instance it took: the lowest one free, from 0
    # (so 0 means no other request of this worker was being forwarded to the instance).
    ready_worker_idx: int | None = None
    # --- forward (exchange) ---
    forward_start_ms: int | None = None
    actual_ready_queue_ms: int | None = None  # forward_start_ms - ready_enqueue_ms
    first_token_ms: int | None = None  # a stream's first chunk from the instance
    decode_start_ms: int | None = None  # the sidecar was told: first token seen, decoding now
    actual_ttft_ms: int | None = None  # first_token_ms - proxy_recv_ms
    actual_vllm_ttft_ms: int | None = None  # first_token_ms - forward_start_ms
    actual_total_ms: int | None = None  # first_token_ms - proxy_enqueue_ms
    actual_vllm_internal_ms: int | None = None  # the same as actual_vllm_ttft_ms, named as the
    # other actual_* intervals are (know_prepare, ready_queue, vllm_internal sum to total)
    predict_error_ms: int | None = None  # first token actual - predicted (> 0: later than predicted)
    forward_end_ms: int | None = None  # the instance's answer was read whole (or failed)
    # --- retries (exchange) ---
    retries: int | None = None  # attempts after the first; the timings above are the last one's


class Knowledge(msgspec.Struct):
    """What preparation found and did: its lists, ack and error go into cacheroute_meta
    (encode_meta). One per request, so a Struct: built without a Python-level __init__."""

    kv_ready_kids: list[str] = msgspec.field(default_factory=list)
    text_only_kids: list[str] = msgspec.field(default_factory=list)
    miss_kids: list[str] = msgspec.field(default_factory=list)
    kv_ack: dict[str, Any] = msgspec.field(default_factory=dict)
    prefix_tokens: int = 0  # KV the instance now holds for this request's prefix
    error: str | None = None  # preparation failed; the request went on without its knowledge
    # kv-ready ids whose KV the affinity index says the chosen instance already held: no KDN
    # transfer and no inject for them
    resident_kids: list[str] = msgspec.field(default_factory=list)


class Meta(msgspec.Struct):
    """The `cacheroute_meta` object. Every member is always present (`error` as null)."""

    trace: Trace
    kv_ack: dict[str, Any]  # the instance's answer to the KV pull, or the proxy's own account
    kv_ready_kids: list[str]
    text_only_kids: list[str]
    miss_kids: list[str]
    error: str | None  # why knowledge or the answer is missing or cut; null if nothing is
    resident_kids: list[str] = []  # of kv_ready_kids: already resident on the instance (kv_aware's index)


_encoder = msgspec.json.Encoder()


def tenths(value: float) -> float:
    """A trace's predicted or measured milliseconds, to a tenth: `round(value, 1)` except where
    value * 10 falls on a half (then the even tenth), at half its cost (`round(value, 1)` finds
    the nearest decimal exactly; this runs for the predictions of every request)."""
    return round(value * 10) / 10


def _encoded_meta(trace: Trace, error: str | None, knowledge: Knowledge) -> bytes:
    return _encoder.encode(Meta(trace, knowledge.kv_ack, knowledge.kv_ready_kids,
                                knowledge.text_only_kids, knowledge.miss_kids, error,
                                knowledge.resident_kids))


# A request without knowledge (the lean path's; `Pipeline.book`'s default): read, never written.
EMPTY_KNOWLEDGE = Knowledge()
# The meta of such a request without error, around its trace: built once, not a Meta and its
# members for every request.
_PLAIN_HEAD = b'{"trace":'
_PLAIN_TAIL = _encoded_meta(Trace(), None, EMPTY_KNOWLEDGE)[len(_PLAIN_HEAD) + 2:]


def encode_meta(trace: Trace, error: str | None, knowledge: Knowledge) -> bytes:
    """`cacheroute_meta` as JSON bytes: the trace and what preparation found and did."""
    if knowledge is EMPTY_KNOWLEDGE and error is None:
        return _PLAIN_HEAD + _encoder.encode(trace) + _PLAIN_TAIL
    return _encoded_meta(trace, error, knowledge)
