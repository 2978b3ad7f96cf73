"""Pure timing model of one vLLM Instance (fits of the original benchmark tables, as in
docs/predictors.md).

All functions return real-GPU milliseconds; the engine scales them by time_scale and the
slow_factor knob. Nothing here sleeps or reads state, so it is unit-tested directly.
"""

from __future__ import annotations

import math
from bisect import bisect_right

# Short-prompt calibration anchors (tokens -> ms) of the original TTFT predictor, bs=1.
PREFILL_ANCHORS: tuple[tuple[int, float], ...] = (
    (0, 60.0), (10, 60.0), (35, 47.0), (45, 53.26), (55, 65.97), (65, 70.71), (75, 76.63),
    (89, 88.38), (95, 90.35), (105, 93.01), (115, 95.67), (303, 396.0), (345, 472.0),
)
_ANCHOR_TOKENS = tuple(t for t, _ in PREFILL_ANCHORS)
LAST_ANCHOR_TOKENS = PREFILL_ANCHORS[-1][0]

# Least-squares fit of the benchmark table for bs=1: t(L) = 1.48604 ms * L - 64.205 ms.
# It sits ~24 ms below the last anchor at L=345; the step is kept because both pieces are
# what the fits give, and real prefill times jitter more than that anyway.
LONG_PROMPT_SLOPE_MS = 1.48604
LONG_PROMPT_INTERCEPT_MS = -64.205

# Fitted TPOT: ~24 ms/token alone, ~28 ms/token with 8 requests decoding together.
ITL_BASE_MS = 24.0
ITL_FULL_BATCH_MS = 28.0
ITL_MAX_BATCH = 8

CHARS_PER_TOKEN = 4

# LMCache pull of a KV prefix from Redis: 2764.34 ms/GB + 12.46 ms, with
# 0.0000381 GB of KV per token.
REDIS_PULL_MS_PER_GB = 2764.3407821694204
REDIS_PULL_BASE_MS = 12.460820712239126
KV_GB_PER_TOKEN = 0.0000381


def prompt_tokens(chars: int) -> int:
    """Token count of a prompt of ``chars`` characters: ceil(chars / 4), at least 1."""
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def prefill_ms(tokens: int) -> float:
    """Prefill (TTFT compute) time for one prompt of ``tokens`` tokens, run alone."""
    if tokens <= LAST_ANCHOR_TOKENS:
        return _interpolate_anchors(max(0, tokens))
    return LONG_PROMPT_SLOPE_MS * tokens + LONG_PROMPT_INTERCEPT_MS


def _interpolate_anchors(tokens: int) -> float:
    i = bisect_right(_ANCHOR_TOKENS, tokens)
    if i >= len(PREFILL_ANCHORS):
        return PREFILL_ANCHORS[-1][1]
    (t0, ms0), (t1, ms1) = PREFILL_ANCHORS[i - 1], PREFILL_ANCHORS[i]
    return ms0 + (ms1 - ms0) * (tokens - t0) / (t1 - t0)


def itl_ms(decoding: int) -> float:
    """Inter-token latency when ``decoding`` requests share the decode batch (clamped 1..8)."""
    batch = min(max(decoding, 1), ITL_MAX_BATCH)
    return ITL_BASE_MS + (ITL_FULL_BATCH_MS - ITL_BASE_MS) * (batch - 1) / (ITL_MAX_BATCH - 1)


def redis_pull_ms(tokens: int) -> float:
    """Time to pull the KV of ``tokens`` prefix tokens from Redis."""
    return max(0.0, REDIS_PULL_MS_PER_GB * tokens * KV_GB_PER_TOKEN + REDIS_PULL_BASE_MS)


def kv_hit_prefill_ms(tokens: int, prefix_tokens: int) -> float:
    """Prefill of a ``tokens`` prompt whose first ``prefix_tokens`` are in Redis already.

    The hit cannot exceed the prompt; the rest is computed (at least one token, as vLLM
    always recomputes the last one) after the pull.
    """
    hit = min(max(prefix_tokens, 0), tokens)
    return redis_pull_ms(hit) + prefill_ms(max(1, tokens - hit))


def cached_prefill_ms(tokens: int, cached_tokens: int, factor: float) -> float:
    """Prefill of a ``tokens`` prompt whose first ``cached_tokens`` have their KV on this
    Instance already (resident knowledge, prefix cache): those at ``factor`` of their cost
    (loading them is not free), the rest computed, at least one token."""
    cached = min(max(cached_tokens, 0), max(0, tokens - 1))
    if cached == 0:
        return prefill_ms(tokens)
    return factor * prefill_ms(cached) + prefill_ms(max(1, tokens - cached))
