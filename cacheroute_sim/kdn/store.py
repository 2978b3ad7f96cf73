"""The knowledge store: what the original KDN keeps in its SQLite text index + KV directory.

Either loaded from a JSON file (a list of ``{"id", "content", "kv_ready"}``) or generated
deterministically from a seed: ids ``k0000``.., one in four short (50..300 tokens), the others
1000..3000 tokens, a ``kv_ready_ratio`` share with prebuilt KV. Ids are lower-cased, as the
original KDN lower-cases every kid it stores or is asked for.

Field meanings follow the original ``TextDatabase`` rows: ``length`` is the content length in
characters, ``rel_path`` is ``blocks/<kid>.txt``, ``kv_rel_dir`` the kid, ``kv_dumped_keys``
the number of KV chunk keys (one per 256 tokens, also one file each), ``kv_updated_at`` epoch
seconds; the three ``kv_*`` fields are null while ``kv_ready`` is false.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

CHARS_PER_TOKEN = 4
KV_CHUNK_TOKENS = 256
# A fixed build time for generated kv_ready entries, so two runs answer identical bytes.
GENERATED_KV_UPDATED_AT = 1_700_000_000

_WORDS = ("cache", "route", "kernel", "prefill", "decode", "token", "layer", "block", "redis",
          "vector", "query", "latency", "throughput", "context", "knowledge", "attention",
          "shard", "replica", "buffer", "stream")


class StoreError(ValueError):
    """The knowledge file is unusable; the message says why."""


class KnowledgeEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One row of a ``--knowledge`` file."""
    id: str
    content: str
    kv_ready: bool = False


class KnowledgeItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    content: str
    kv_ready: bool
    kv_updated_at: int | None

    @property
    def length(self) -> int:
        return len(self.content)

    @property
    def tokens(self) -> int:
        return max(1, math.ceil(len(self.content) / CHARS_PER_TOKEN))

    @property
    def kv_dumped_keys(self) -> int | None:
        return math.ceil(self.tokens / KV_CHUNK_TOKENS) if self.kv_ready else None

    def fields(self, need: frozenset[str] | None) -> dict[str, Any]:
        """The search reply item: id and knowledge_id always, then the ``need`` fields."""
        full = {
            "content": self.content,
            "length": self.length,
            "rel_path": f"blocks/{self.id}.txt",
            "kv_ready": self.kv_ready,
            "kv_rel_dir": self.id if self.kv_ready else None,
            "kv_dumped_keys": self.kv_dumped_keys,
            "kv_updated_at": self.kv_updated_at if self.kv_ready else None,
        }
        picked = full if need is None else {k: v for k, v in full.items() if k in need}
        return {"id": self.id, "knowledge_id": self.id, **picked}


def normalize_id(kid: str) -> str:
    return kid.strip().lower()


class KnowledgeStore:
    def __init__(self, items: Iterable[KnowledgeItem]) -> None:
        self._items: dict[str, KnowledgeItem] = {}
        for item in items:
            if item.id in self._items:
                raise StoreError(f"duplicate knowledge id {item.id!r} (ids are case-insensitive)")
            self._items[item.id] = item

    def __len__(self) -> int:
        return len(self._items)

    def get(self, kid: str) -> KnowledgeItem | None:
        return self._items.get(kid)

    def lookup(self, kids: Iterable[str]) -> tuple[list[KnowledgeItem], list[str]]:
        """Like the original ``get_many``: request order, no de-duplication, ids normalized."""
        items: list[KnowledgeItem] = []
        miss: list[str] = []
        for kid in kids:
            item = self._items.get(kid)
            if item is None:
                miss.append(kid)
            else:
                items.append(item)
        return items, miss

    def summary(self) -> dict[str, int]:
        ready = [i for i in self._items.values() if i.kv_ready]
        return {"items": len(self._items), "kv_ready": len(ready),
                "tokens": sum(i.tokens for i in self._items.values()),
                "kv_ready_tokens": sum(i.tokens for i in ready)}


def load_store(path: str | Path) -> KnowledgeStore:
    try:
        entries = msgspec.json.decode(Path(path).read_bytes(), type=list[KnowledgeEntry])
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc}") from None
    except msgspec.ValidationError as exc:
        raise StoreError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise StoreError(f"{path} is not JSON: {exc}") from None
    items = []
    for i, entry in enumerate(entries):
        kid = normalize_id(entry.id)
        if not kid:
            raise StoreError(f"{path}: entry {i} has an empty id")
        items.append(KnowledgeItem(id=kid, content=entry.content, kv_ready=entry.kv_ready,
                                   kv_updated_at=GENERATED_KV_UPDATED_AT))
    return KnowledgeStore(items)


def generate_store(count: int, kv_ready_ratio: float, seed: int) -> KnowledgeStore:
    rng = random.Random(seed)
    items = []
    for i in range(count):
        kid = f"k{i:04d}"
        tokens = rng.randint(50, 300) if i % 4 == 0 else rng.randint(1000, 3000)
        items.append(KnowledgeItem(id=kid, content=_text(kid, tokens * CHARS_PER_TOKEN, rng),
                                   kv_ready=rng.random() < kv_ready_ratio,
                                   kv_updated_at=GENERATED_KV_UPDATED_AT))
    return KnowledgeStore(items)


def _text(kid: str, chars: int, rng: random.Random) -> str:
    parts = [f"Knowledge {kid}."]
    size = len(parts[0])
    while size < chars:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:chars]
