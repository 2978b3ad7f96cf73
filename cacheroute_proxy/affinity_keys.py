"""The affinity index's keys, spelled once for the workers, which
report and look them up, and the sidecar, which turns an instance's `resident_keys` into them.

A key is a 64-bit hash, never 0: of a knowledge id (case-insensitive, as the KDN looks ids
up), or of one block of a rendered prompt, chained on the block before it, so two prompts
that share a prefix share their leading keys and nothing after the first difference. A
prompt's blocks are the proxy's own (characters, below) unless PROXY_AFFINITY_TOKENIZER gives
the model's tokenizer: then they are the engine's own block hashes (engine_block_key).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

CHARS_PER_TOKEN = 4  # as the workers' token estimate: the proxy has no tokenizer
HOMES_KEPT = 4096  # (key, instances) whose rendezvous home a process keeps at hand


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def engine_block_key(published: int) -> int:
    """A block as a vLLM engine's KV events name it (cacheroute_proxy.engine_prefix), as a key."""
    return published or 1


def knowledge_key(kid: str) -> int:
    return _hash(b"k\0" + str(kid).lower().encode())


def prefix_keys(text: str, block_tokens: int, max_blocks: int) -> list[int]:
    """Chained hashes of the full blocks of `text` (block_tokens x CHARS_PER_TOKEN bytes
    each), at most `max_blocks`: key i depends on blocks 0..i."""
    size = block_tokens * CHARS_PER_TOKEN
    data = text.encode()
    keys: list[int] = []
    previous = b"p\0"
    for start in range(0, min(len(data) // size, max_blocks) * size, size):
        key = _hash(previous + data[start:start + size])
        keys.append(key)
        previous = key.to_bytes(8, "little")
    return keys


def rendezvous_home(key: int, instances: Sequence[str]) -> int:
    """The index, among `instances` (ids), of `key`'s home: the highest hash of (key, instance),
    so every worker names the same one and a key's home moves only when its home leaves."""
    return _rendezvous_home(key, tuple(instances))


@functools.lru_cache(maxsize=HOMES_KEPT)
def _rendezvous_home(key: int, instances: tuple[str, ...]) -> int:
    # Kept: a prompt's requests ask again among the same instances (a hash per instance each).
    scores = [_hash(key.to_bytes(8, "little") + name.encode()) for name in instances]
    return scores.index(max(scores))

