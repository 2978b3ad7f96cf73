"""The host-wide affinity index's single writer.

Per instance, an LRU model of the keys whose KV it holds: knowledge ids whose inject it
acknowledged (RESIDENT events) and prompt-prefix blocks it was sent (PREFIX events), from every
worker, each with the tokens it stands for. The model is bounded by the instance's KV capacity
in tokens (its registration's meta.kv_capacity_tokens; else its meta.kv_mem_gb or
PROXY_KV_MEM_PER_INSTANCE_GB over PROXY_AFFINITY_KV_MB_PER_TOKEN) and by the row's
AFFINITY_ENTRIES: past either, the least recently used entries go, as the instance's own LRU
would evict them. A heartbeat's `resident_keys` (the instance's own account of its knowledge)
replaces the model's knowledge entries outright; a vLLM engine's KV cache events
(sidecar/kv_events.py) take over its prefix entries: from its first batch on, the blocks it
stores are added and those it evicts taken out, and the workers' PREFIX guesses for it are
ignored.

Each change readers see (a key added, evicted or resized; not a mere reordering, which would
have every worker decode the row again for nothing) is published
(shm_schema.affinity.AffinityWriter) at the next tick, one row per changed instance, saying
whether its prefix entries are the engine's. A registration (new, or again: the engine
restarted and its KV with it) and a removal clear the row. A restarted sidecar keeps the
index: `adopt` reads back every row whose generation is still its slot's, so routing loses
nothing across the restart.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable

from cacheroute_proxy.config import Settings
from shm_schema import Segment, read_all
from shm_schema.affinity import AFFINITY_ENTRIES, AFFINITY_KNOWLEDGE, AFFINITY_PREFIX, AffinityWriter, Resident
from shm_schema.events import Event, EventKind, residency

Where = tuple[int, int]  # (slot, generation)
CapacityOf = Callable[[int, int], int]  # (slot, generation) -> tokens, 0 = unknown


class InstanceModel:
    """One instance's resident keys, least recently used first."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (kind, tokens)
        self.tokens = 0
        self.evicted = 0
        self.engine_fed = False  # prefix entries come from the engine's own KV events

    def drop(self, key: int) -> bool:
        old = self.entries.pop(key, None)
        if old is not None:
            self.tokens -= old[1]
        return old is not None

    def drop_kind(self, kind: int) -> dict[int, tuple[int, int]]:
        """Take out every entry of `kind` (knowledge or prefix); returns them."""
        dropped = {key: entry for key, entry in self.entries.items() if entry[0] == kind}
        for key in dropped:
            self.drop(key)
        return dropped

    def touch(self, key: int, kind: int, tokens: int) -> bool:
        """The key is used now (most recent); True if the row readers see changed with it: a
        key new to the model, or another kind or size, or an entry evicted for it. Only the
        order changes otherwise, and readers see sets: the row waits for a change."""
        old = self.entries.get(key)
        evicted = self.evicted
        self.drop(key)
        self.entries[key] = (kind, tokens)
        self.tokens += tokens
        self._evict()
        return old != (kind, tokens) or self.evicted != evicted

    def replace_knowledge(self, keys: Iterable[int]) -> None:
        """The instance's own account of its knowledge: exactly these ids are resident
        (tokens as last known, 0 if never seen); prefix entries are kept."""
        known = self.drop_kind(AFFINITY_KNOWLEDGE)
        for key in keys:
            if key not in self.entries:
                tokens = known.get(key, (AFFINITY_KNOWLEDGE, 0))[1]
                self.entries[key] = (AFFINITY_KNOWLEDGE, tokens)
                self.tokens += tokens
        self._evict()

    def _evict(self) -> None:
        entries = self.entries
        while entries and (len(entries) > AFFINITY_ENTRIES
                           or (self.capacity_tokens and self.tokens > self.capacity_tokens)):
            _, (_, tokens) = entries.popitem(last=False)
            self.tokens -= tokens
            self.evicted += 1

    def published(self) -> list[Resident]:
        return [Resident(key, kind, tokens) for key, (kind, tokens) in self.entries.items()]


class AffinityModels:
    def __init__(self, seg: Segment, capacity_of: CapacityOf) -> None:
        self._seg = seg
        self._writer = AffinityWriter(seg)
        self._capacity_of = capacity_of
        self._models: dict[Where, InstanceModel] = {}
        self._dirty: set[Where] = set()
        self._cleared: set[int] = set()  # slots whose row must be emptied
        # Called when a row is to be written: a sidecar asleep between ticks wakes to publish it.
        self.on_change: Callable[[], None] = lambda: None
        self.stats = {"acknowledged": 0, "prefix_blocks": 0, "reports": 0, "adopted_entries": 0,
                      "stale_instance": 0, "prefix_guesses_ignored": 0, "engine_blocks_stored": 0,
                      "engine_blocks_removed": 0, "engine_clears": 0}

    # --- what changes the models ------------------------------------------------------------------
    def adopt(self) -> int:
        """A restarted sidecar: take over every row that still describes its slot's instance."""
        adopted = 0
        for instance in read_all(self._seg):
            generation, entries, capacity, engine_fed = self._writer.read(instance.slot)
            if generation != instance.generation or not entries:
                continue
            model = self._model(instance.slot, instance.generation, capacity)
            model.engine_fed = engine_fed
            for entry in entries:
                model.touch(entry.key, entry.kind, entry.tokens)
            adopted += len(entries)
        self.stats["adopted_entries"] += adopted
        return adopted

    def apply(self, event: Event) -> None:
        """A RESIDENT or PREFIX event from a worker."""
        model = self._model(event.slot, event.generation)
        if model is None:
            self.stats["stale_instance"] += 1
            return
        payload = residency(event)
        kind = AFFINITY_KNOWLEDGE if event.kind == EventKind.RESIDENT else AFFINITY_PREFIX
        if kind == AFFINITY_PREFIX and model.engine_fed:  # the engine says what it holds
            self.stats["prefix_guesses_ignored"] += 1
            return
        changed = False
        for key in (payload.key_0, payload.key_1, payload.key_2):
            if key:
                changed |= model.touch(key, kind, payload.tokens_each)
                self.stats["acknowledged" if kind == AFFINITY_KNOWLEDGE else "prefix_blocks"] += 1
        if changed:
            self._changed((event.slot, event.generation))

    def report(self, slot: int, generation: int, keys: Iterable[int]) -> None:
        """A heartbeat's `resident_keys`, as key hashes."""
        model = self._model(slot, generation)
        if model is not None:
            model.replace_knowledge(keys)
            self.stats["reports"] += 1
            self._changed((slot, generation))

    def engine_stored(self, slot: int, generation: int, keys: Iterable[int], tokens_each: int) -> None:
        """Blocks the instance's engine reports it now holds (a BlockStored)."""
        model = self._engine_model(slot, generation)
        if model is not None:
            for key in keys:
                model.touch(key, AFFINITY_PREFIX, tokens_each)
                self.stats["engine_blocks_stored"] += 1

    def engine_removed(self, slot: int, generation: int, keys: Iterable[int]) -> None:
        """Blocks the engine evicted (a BlockRemoved)."""
        model = self._engine_model(slot, generation)
        if model is not None:
            self.stats["engine_blocks_removed"] += sum(model.drop(key) for key in keys)

    def engine_cleared(self, slot: int, generation: int) -> None:
        """The engine emptied its prefix cache, or the sidecar missed some of its events: no
        prefix entry can be trusted."""
        model = self._engine_model(slot, generation)
        if model is not None:
            model.drop_kind(AFFINITY_PREFIX)
            self.stats["engine_clears"] += 1

    def _engine_model(self, slot: int, generation: int) -> InstanceModel | None:
        model = self._model(slot, generation)
        if model is None:
            self.stats["stale_instance"] += 1
            return None
        # From now on the engine's account, not the workers' guesses. What the row holds stays
        # (a restarted sidecar's adopted entries are the engine's own from before; a guess that
        # was right is a block the engine will report removed): the LRU bound ages out the rest.
        model.engine_fed = True
        self._changed((slot, generation))
        return model

    def capacity_tokens(self, slot: int, generation: int) -> int:
        """The instance's KV capacity in tokens: 0 unbounded, -1 no such instance."""
        model = self._models.get((slot, generation))
        return model.capacity_tokens if model is not None else self._capacity_of(slot, generation)

    def forget(self, slot: int) -> None:
        """The slot's instance left or registered again: nothing is resident there any more."""
        for where in [w for w in self._models if w[0] == slot]:
            del self._models[where]
            self._dirty.discard(where)
        self._cleared.add(slot)
        self.on_change()

    def _changed(self, where: Where) -> None:
        self._dirty.add(where)
        self.on_change()

    def _model(self, slot: int, generation: int, capacity: int | None = None) -> InstanceModel | None:
        where = (slot, generation)
        model = self._models.get(where)
        if model is None:
            if capacity is None:
                capacity = self._capacity_of(slot, generation)
                if capacity < 0:  # no such instance (any more)
                    return None
            for stale in [w for w in self._models if w[0] == slot]:
                del self._models[stale]
            model = self._models[where] = InstanceModel(capacity)
        return model

    # --- publication --------------------------------------------------------------------------------
    def publish(self) -> int:
        """Write every changed row; returns how many."""
        for slot in self._cleared:
            self._writer.clear(slot)
        written = len(self._cleared)
        self._cleared.clear()
        for where in self._dirty:
            model = self._models.get(where)
            if model is not None:
                self._writer.publish(where[0], where[1], model.published(), model.capacity_tokens,
                                     model.engine_fed)
                written += 1
        self._dirty.clear()
        return written

    def describe(self, names: dict[Where, str]) -> dict[str, Any]:
        return {**self.stats, "instances": {
            names.get(where, f"slot {where[0]}"): {
                "knowledge": sum(1 for kind, _ in m.entries.values() if kind == AFFINITY_KNOWLEDGE),
                "prefix_blocks": sum(1 for kind, _ in m.entries.values() if kind == AFFINITY_PREFIX),
                "tokens": m.tokens, "capacity_tokens": m.capacity_tokens or None,
                "evicted": m.evicted, "prefix_from": "engine" if m.engine_fed else "model"}
            for where, m in self._models.items()}}


def kv_capacity_tokens(registry: Any, settings: Settings, slot: int, generation: int) -> int:
    """The KV capacity, in tokens, of the instance in (slot, generation); -1 if none is there.
    Its registration's meta.kv_capacity_tokens; else its meta.kv_mem_gb (or
    PROXY_KV_MEM_PER_INSTANCE_GB) over PROXY_AFFINITY_KV_MB_PER_TOKEN; 0 = unbounded but
    for the row's entries."""
    record = registry.at(slot, generation)
    if record is None:
        return -1
    tokens = _positive(record.meta.get("kv_capacity_tokens"))
    if tokens:
        return int(tokens)
    gigabytes = _positive(record.meta.get("kv_mem_gb")) or settings.kv_mem_per_instance_gb
    return int(gigabytes * 1024 / settings.affinity_kv_mb_per_token)


def _positive(value: Any) -> float:
    """A positive number from an instance's meta, else 0 (meta is free-form: a bad value is
    ignored, as the registry ignores one for max_num_seqs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        return 0.0
    return float(value)
