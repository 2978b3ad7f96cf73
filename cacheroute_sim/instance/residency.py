"""The KV this Instance keeps, as vLLM with LMCache and automatic prefix caching keeps it.

Two stores, each its own LRU:
- **knowledge KV**: what ``POST /v1/kv/inject_ready`` had the KDN copy in, per knowledge id,
  counted in tokens against ``kv_capacity_tokens`` (the knob, else the registered
  ``kv_mem_gb`` / timing.KV_GB_PER_TOKEN); the least recently used ids are evicted first;
- **prefix cache**: hashes of the prompt's full blocks of ``PREFIX_BLOCK_TOKENS`` tokens, each
  chained to the hash of the block before it (a block only matches after the same prefix, as
  in vLLM), at most ``prefix_cache_blocks`` of them (the knob, else the knowledge capacity
  over the block size).

A request's prefill finds its cached tokens here (``lookup``): the leading knowledge ids of
its ``x-cacheroute-kv-knowledge-ids`` hint that are resident, and the leading prompt blocks in
the prefix cache; the larger of the two prefixes is prefilled at ``cached_prefill_factor`` of
the cost (timing.cached_prefill_ms). Single event loop: plain dicts, no locks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from cacheroute_sim.instance.config import Knobs
from cacheroute_sim.instance.stats import Stats
from cacheroute_sim.instance.timing import CHARS_PER_TOKEN, KV_GB_PER_TOKEN

PREFIX_BLOCK_TOKENS = 16  # vLLM's default block size
PREFIX_BLOCK_CHARS = PREFIX_BLOCK_TOKENS * CHARS_PER_TOKEN  # the simulation's 4 chars a token


def block_hashes(text: str) -> list[bytes]:
    """The chained hashes of `text`'s full blocks (a partial last block is not cached)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
        block = text[start:start + PREFIX_BLOCK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        hashes.append(previous)
    return hashes


def tokens_per_id(ack: dict[str, Any], injected: Sequence[str], kv_bytes_per_token: int) -> int:
    """Tokens of each id a KDN answer injected. The answer has no per-id size, so its
    `payload_bytes` is shared evenly (exact for one id an inject, the sum right for several)."""
    payload = ack.get("payload_bytes")
    if not injected or not isinstance(payload, int) or isinstance(payload, bool) or payload <= 0:
        return 0
    return max(1, payload // max(1, kv_bytes_per_token) // len(injected))


class CacheHit(msgspec.Struct, frozen=True):
    """What one prefill found cached: the prefix it need not compute."""

    resident_tokens: int  # leading knowledge ids' KV
    prefix_hit_tokens: int  # leading prompt blocks in the prefix cache

    @property
    def cached_tokens(self) -> int:
        return max(self.resident_tokens, self.prefix_hit_tokens)


class Residency:
    def __init__(self, kv_mem_gb: float, stats: Stats) -> None:
        self._registered_tokens = int(kv_mem_gb / KV_GB_PER_TOKEN)
        self._stats = stats
        self._knowledge: OrderedDict[str, int] = OrderedDict()  # id -> tokens, LRU first
        self._knowledge_tokens = 0
        self._blocks: OrderedDict[bytes, None] = OrderedDict()  # LRU first

    # --- capacities (knobs, read live so /sim/config can shrink them) -------------------------
    def kv_capacity_tokens(self, knobs: Knobs) -> int:
        return self._registered_tokens if knobs.kv_capacity_tokens is None else knobs.kv_capacity_tokens

    def prefix_capacity_blocks(self, knobs: Knobs) -> int:
        if not knobs.prefix_caching:
            return 0
        if knobs.prefix_cache_blocks is not None:
            return knobs.prefix_cache_blocks
        return self.kv_capacity_tokens(knobs) // PREFIX_BLOCK_TOKENS

    # --- knowledge KV ----------------------------------------------------------------------------
    def resident(self, kids: Sequence[str], knobs: Knobs) -> list[str]:
        """Which of `kids` are resident now (used: they become the most recent)."""
        self._fit(knobs)
        found = [kid for kid in kids if kid in self._knowledge]
        for kid in found:
            self._knowledge.move_to_end(kid)
        return found

    def admit(self, kid: str, tokens: int, knobs: Knobs) -> None:
        """`kid`'s KV arrived (an acknowledged inject): the most recent, older ones evicted."""
        old = self._knowledge.pop(kid, None)
        if old is not None:
            self._knowledge_tokens -= old
        self._knowledge[kid] = tokens
        self._knowledge_tokens += tokens
        self._fit(knobs)

    def _fit(self, knobs: Knobs) -> None:
        capacity = self.kv_capacity_tokens(knobs)
        stats = self._stats
        while self._knowledge and self._knowledge_tokens > capacity:
            _, tokens = self._knowledge.popitem(last=False)
            self._knowledge_tokens -= tokens
            stats.kv_evictions += 1
            stats.kv_evicted_tokens_total += tokens
        blocks = self.prefix_capacity_blocks(knobs)
        while len(self._blocks) > blocks:
            self._blocks.popitem(last=False)
            stats.prefix_cache_evictions += 1

    # --- one prefill ----------------------------------------------------------------------------
    def lookup(self, kids: Sequence[str], hashes: Sequence[bytes], prompt_tokens: int,
               knobs: Knobs) -> CacheHit:
        """The cached prefix of a prompt of `prompt_tokens` whose context starts with `kids`'
        KV and whose full blocks hash to `hashes`; counts hits and misses."""
        self._fit(knobs)
        stats = self._stats
        resident = 0
        for i, kid in enumerate(kids):  # a prefix: the first id not resident ends it
            tokens = self._knowledge.get(kid)
            if tokens is None:
                stats.kv_resident_misses += len(kids) - i
                break
            self._knowledge.move_to_end(kid)
            stats.kv_resident_hits += 1
            resident += tokens
        hit_blocks = 0
        if self.prefix_capacity_blocks(knobs):
            for block in hashes:
                if block not in self._blocks:
                    break
                self._blocks.move_to_end(block)
                hit_blocks += 1
            stats.prefix_cache_queries += prompt_tokens
            stats.prefix_cache_hits += min(hit_blocks * PREFIX_BLOCK_TOKENS, prompt_tokens)
        # At least the last prompt token is always computed, as vLLM does.
        limit = max(0, prompt_tokens - 1)
        hit = CacheHit(min(resident, limit), min(hit_blocks * PREFIX_BLOCK_TOKENS, limit))
        stats.kv_resident_hit_tokens_total += hit.resident_tokens
        return hit

    def remember_prompt(self, hashes: Sequence[bytes], knobs: Knobs) -> None:
        """After a prefill its full blocks are cached (the most recent)."""
        if not self.prefix_capacity_blocks(knobs):
            return
        for block in hashes:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        self._fit(knobs)

    # --- reports ---------------------------------------------------------------------------------
    def resident_ids(self) -> list[str]:
        """Knowledge ids held now, least recently used first."""
        return list(self._knowledge)

    def clear(self) -> None:
        self._knowledge.clear()
        self._knowledge_tokens = 0
        self._blocks.clear()

    def snapshot(self, knobs: Knobs) -> dict[str, Any]:
        self._fit(knobs)
        return {"kv_capacity_tokens": self.kv_capacity_tokens(knobs),
                "kv_resident_tokens": self._knowledge_tokens,
                "knowledge_ids": self.resident_ids(),
                "prefix_cache_capacity_blocks": self.prefix_capacity_blocks(knobs),
                "prefix_cache_blocks": len(self._blocks),
                "prefix_block_tokens": PREFIX_BLOCK_TOKENS}
