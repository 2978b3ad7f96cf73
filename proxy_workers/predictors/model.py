"""The predictors the Proxy runs per request, built once from a profile.

All results are milliseconds as floats (the original's ``estimate_*`` helpers returned integer
ms; round at the edge if a wire format needs integers). Token counts are ints. Nothing here does
I/O or allocates more than a small result tuple, so every call costs on the order of a
microsecond (see tests/test_predictors.py::test_per_call_cost).

The semantics (docs/predictors.md) are the original Proxy's, with these deliberate differences:
- prefill above the last anchor (345 tokens) is the fitted model, never 0;
- at bs > 1 the prediction is never below the bs=1 prediction for the same length (the
  four-term model alone goes to 0 for short prompts at bs ≥ 2);
- TPOT for a batch size without its own line is interpolated (or nearest, per profile).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from typing import NamedTuple

from proxy_workers.predictors.profile import (
    PredictorProfile,
    _clear_cache,
    effective_profile_name,
    load_profile,
)

# Prompt lengths whose text prefill a Predictors keeps (text_service_ms): more than the lengths a
# workload repeats, few enough to stay small; past it the memo starts afresh.
TEXT_SERVICE_KEPT = 4096


class KvcacheService(NamedTuple):
    """Prefill service time of a kvcache-mode request, ms and tokens."""

    total_ms: float  # redis_ms + residual_prefill_ms
    redis_ms: float  # LMCache pull of the aligned knowledge KV
    residual_prefill_ms: float  # prefill of what is not covered by the pulled KV
    effective_knowledge_tokens: int  # floor(K / align) · align: the part served from KV
    residual_tokens: int  # max(1, P + (K − K_eff) + header)


class Predictors:
    """Pure predictor functions over one profile's coefficients (precomputed in ms)."""

    __slots__ = (
        "_a",
        "_align",
        "_anchor_max",
        "_anchor_ms",
        "_anchor_only_max",
        "_anchor_tokens",
        "_b",
        "_c",
        "_d",
        "_header",
        "_redis_gb_per_token",
        "_redis_intercept",
        "_redis_slope",
        "_text_service",
        "_tpot_max_bs",
        "_tpot_table",
        "_transfer_mb_per_token",
        "_utilisation",
        "profile",
    )

    def __init__(self, profile: PredictorProfile) -> None:
        self.profile = profile
        ttft = profile.ttft
        self._a = ttft.a_s * 1000.0
        self._b = ttft.b_s * 1000.0
        self._c = ttft.c_s * 1000.0
        self._d = ttft.d_s * 1000.0
        self._anchor_tokens = tuple(t for t, _ in ttft.anchors_ms)
        self._anchor_ms = tuple(float(ms) for _, ms in ttft.anchors_ms)
        self._anchor_max = self._anchor_tokens[-1] if self._anchor_tokens else -1
        self._anchor_only_max = ttft.anchor_only_max_tokens if self._anchor_tokens else -1

        # TPOT lines (ms) for every bs from 1 to the largest measured one; larger bs use the
        # last entry. Resolving missing sizes here keeps tpot_ms a tuple index.
        lines = {line.bs: (line.slope_s * 1000.0, line.intercept_s * 1000.0)
                 for line in profile.tpot.per_bs}
        sizes = sorted(lines)
        self._tpot_max_bs = sizes[-1]
        table: list[tuple[float, float]] = [(0.0, 0.0)]  # index 0 unused
        for bs in range(1, self._tpot_max_bs + 1):
            table.append(_tpot_line_for(bs, sizes, lines, profile.tpot.missing_bs))
        self._tpot_table = tuple(table)

        self._redis_slope = profile.redis_pull.ms_per_gb
        self._redis_intercept = profile.redis_pull.intercept_ms
        kv = profile.kv
        self._header = kv.header_overhead_tokens
        self._align = kv.align_tokens
        self._redis_gb_per_token = kv.redis_gb_per_token
        self._transfer_mb_per_token = kv.transfer_mb_per_token
        self._utilisation = kv.link_utilisation
        self._text_service: dict[int, float] = {}  # text_service_ms by total tokens

    def __repr__(self) -> str:
        return f"Predictors(profile={self.profile.name!r})"

    @property
    def header_overhead_tokens(self) -> int:
        return self._header

    # --- prefill ----------------------------------------------------------------------------

    def prefill_ms(self, tokens: int, bs: int = 1) -> float:
        """Prefill compute time (TTFT without queueing) of ``bs`` prompts of ``tokens`` each.

        bs=1: anchor value up to ``anchor_only_max_tokens`` (115), then max(model, anchor) up
        to the last anchor (345), then the model. bs>1: max(model(bs), prefill_ms(tokens, 1)).
        Raises ValueError for tokens ≤ 0 or bs ≤ 0.
        """
        if tokens <= 0:
            raise ValueError(f"prefill_ms: tokens must be > 0, got {tokens!r}")
        if bs <= 0:
            raise ValueError(f"prefill_ms: bs must be > 0, got {bs!r}")
        one = self._prefill_bs1(tokens)
        if bs == 1:
            return one
        base = (self._a * bs + self._b) * tokens + self._c * bs + self._d
        return max(one, base)

    def _prefill_bs1(self, tokens: int) -> float:
        base = (self._a + self._b) * tokens + self._c + self._d
        if tokens > self._anchor_max:
            return max(0.0, base)
        anchor = self._anchor(tokens)
        if tokens <= self._anchor_only_max:
            return anchor
        return max(anchor, base)

    def _anchor(self, tokens: int) -> float:
        xs = self._anchor_tokens
        i = bisect_right(xs, tokens)
        if i == 0:
            return self._anchor_ms[0]
        if i == len(xs):
            return self._anchor_ms[-1]
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self._anchor_ms[i - 1], self._anchor_ms[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    # --- decode -----------------------------------------------------------------------------

    def tpot_ms(self, context_tokens: int, bs: int = 1) -> float:
        """Time per output token (ms) with ``context_tokens`` in context and ``bs`` sequences
        decoding together; clipped at 0. Raises ValueError for context_tokens ≤ 0 or bs ≤ 0."""
        if context_tokens <= 0:
            raise ValueError(f"tpot_ms: context_tokens must be > 0, got {context_tokens!r}")
        if bs <= 0:
            raise ValueError(f"tpot_ms: bs must be > 0, got {bs!r}")
        slope, intercept = self._tpot_table[min(bs, self._tpot_max_bs)]
        value = slope * context_tokens + intercept
        return max(0.0, value)

    def decode_ms(self, context_tokens: int, new_tokens: int, bs: int = 1) -> float:
        """Time (ms) for ``new_tokens`` decode steps starting at ``context_tokens`` in context,
        each step adding one token: Σ tpot(context + i) for i < new_tokens (exact for the linear
        model, computed in O(1)). The first output token comes from prefill, not from here.
        0 for new_tokens = 0; ValueError for new_tokens < 0, context_tokens ≤ 0 or bs ≤ 0."""
        if new_tokens < 0:
            raise ValueError(f"decode_ms: new_tokens must be >= 0, got {new_tokens!r}")
        if context_tokens <= 0:
            raise ValueError(f"decode_ms: context_tokens must be > 0, got {context_tokens!r}")
        if bs <= 0:
            raise ValueError(f"decode_ms: bs must be > 0, got {bs!r}")
        if new_tokens == 0:
            return 0.0
        slope, intercept = self._tpot_table[min(bs, self._tpot_max_bs)]
        first = slope * context_tokens + intercept
        last = first + slope * (new_tokens - 1)
        if first >= 0.0 and last >= 0.0:
            return new_tokens * (first + last) / 2.0
        # A negative fitted slope crosses 0 somewhere: sum the clipped steps exactly.
        return sum(max(0.0, first + slope * i) for i in range(new_tokens))

    # --- KV cache path ----------------------------------------------------------------------

    def redis_pull_ms(self, kv_gb: float) -> float:
        """LMCache pull time (ms) of ``kv_gb`` GB of KV from Redis; max(0, a·kv_gb + b).
        Negative sizes count as 0 (as in the original)."""
        value = self._redis_slope * (max(0.0, kv_gb)) + self._redis_intercept
        return max(0.0, value)

    def effective_knowledge_tokens(self, knowledge_tokens: int) -> int:
        """Knowledge tokens served from KV: floor(K / align) · align (0 for K < align)."""
        if knowledge_tokens <= 0:
            return 0
        return knowledge_tokens - knowledge_tokens % self._align

    def text_service_ms(self, prompt_tokens: int, knowledge_tokens: int) -> float:
        """Prefill service (ms) of a text-mode request: prefill(max(1, P + K + header)), bs=1."""
        if prompt_tokens < 0 or knowledge_tokens < 0:
            raise ValueError("text_service_ms: token counts must be >= 0, got "
                             f"prompt={prompt_tokens!r}, knowledge={knowledge_tokens!r}")
        total = prompt_tokens + knowledge_tokens + self._header
        known = self._text_service.get(total)
        if known is None:  # a worker books the same few prompt lengths over and over
            if len(self._text_service) >= TEXT_SERVICE_KEPT:
                self._text_service.clear()
            known = self._text_service[total] = self._prefill_bs1(max(1, total))
        return known

    def kvcache_service(self, prompt_tokens: int, knowledge_tokens: int) -> KvcacheService:
        """Prefill service of a kvcache-mode request: the aligned
        knowledge is pulled from Redis, the rest (prompt, unaligned tail, header) is prefilled
        at bs=1. redis_ms includes the pull model's intercept even when nothing is aligned, as
        the original did."""
        if prompt_tokens < 0 or knowledge_tokens < 0:
            raise ValueError("kvcache_service: token counts must be >= 0, got "
                             f"prompt={prompt_tokens!r}, knowledge={knowledge_tokens!r}")
        k_eff = knowledge_tokens - knowledge_tokens % self._align
        residual = prompt_tokens + (knowledge_tokens - k_eff) + self._header
        residual = max(residual, 1)
        redis = self._redis_slope * (k_eff * self._redis_gb_per_token) + self._redis_intercept
        redis = max(redis, 0.0)
        prefill = self._prefill_bs1(residual)
        return KvcacheService(redis + prefill, redis, prefill, k_eff, residual)

    def kv_transfer_ms(self, knowledge_tokens: int, bandwidth_mbps: float) -> float:
        """KDN→Instance transfer time (ms) of the KV of ``knowledge_tokens`` (all of it: the
        instance pulls and holds the whole knowledge's KV, though only its aligned part spares
        prefill) over a link of ``bandwidth_mbps`` megabits/s used at ``link_utilisation``:
        K · transfer_mb_per_token / (bandwidth_mbps / 8 · utilisation) seconds.
        ValueError for K < 0 or bandwidth ≤ 0."""
        if knowledge_tokens < 0:
            raise ValueError(f"kv_transfer_ms: knowledge_tokens must be >= 0, got {knowledge_tokens!r}")
        if not bandwidth_mbps > 0:
            raise ValueError(f"kv_transfer_ms: bandwidth_mbps must be > 0, got {bandwidth_mbps!r}")
        megabytes = knowledge_tokens * self._transfer_mb_per_token
        return 1000.0 * megabytes / (bandwidth_mbps * 0.125 * self._utilisation)


def _tpot_line_for(bs: int, sizes: list[int], lines: dict[int, tuple[float, float]],
                   missing: str) -> tuple[float, float]:
    if bs in lines:
        return lines[bs]
    i = bisect_right(sizes, bs)
    if i == 0:
        return lines[sizes[0]]
    if i == len(sizes):
        return lines[sizes[-1]]
    lo, hi = sizes[i - 1], sizes[i]
    if missing == "nearest":
        return lines[lo] if bs - lo < hi - bs else lines[hi]
    w = (bs - lo) / (hi - lo)
    (s0, c0), (s1, c1) = lines[lo], lines[hi]
    return (s0 + (s1 - s0) * w, c0 + (c1 - c0) * w)


_predictors_by_name: dict[str, Predictors] = {}
_predictors_by_profile: dict[int, Predictors] = {}


def get_predictors(name_or_path: str | os.PathLike[str] = "default") -> Predictors:
    """The process-wide :class:`Predictors` for a profile: built once, its file read once; a
    repeated call is one dict lookup (no stat, no read). `load_profile` returns one object per
    file, so a name and a path to the same file share one Predictors. (Two threads racing on the
    first call may both build one; they are equal and immutable, so either is fine.)"""
    key = effective_profile_name(name_or_path)
    found = _predictors_by_name.get(key)
    if found is None:
        profile = load_profile(key)
        found = _predictors_by_profile.get(id(profile))
        if found is None or found.profile is not profile:
            found = _predictors_by_profile[id(profile)] = Predictors(profile)
        _predictors_by_name[key] = found
    return found


def clear_profile_cache() -> None:
    """Forget loaded profiles and built predictors (tests; a process otherwise keeps them)."""
    _predictors_by_name.clear()
    _predictors_by_profile.clear()
    _clear_cache()
