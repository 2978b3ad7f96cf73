"""Benchmark tables: the input of ``tools/predictors/refit.py`` and the output of
``tools/predictors/calibrate.py``. One JSON file per kind::

    {"kind": "ttft", "columns": ["tokens", "bs", "ms"], "rows": [[89, 1, 88.4], ...]}
    {"kind": "tpot", "columns": ["context_tokens", "bs", "ms_per_token"],
     "rows": [[540.5, 4, 25.9], ...]}
    {"kind": "redis", "columns": ["kv_gb", "ms"], "rows": [[0.5, 1390.0], ...]}

plus optional ``source`` (free text: where the numbers come from, the command that produced
them). Rows are raw samples; repeated x values are allowed (the refit can aggregate them).
Tables and the profiles fitted from them are written in one layout (``dumps_pretty``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from proxy_workers.predictors.profile import PredictorProfile

TtftColumns = tuple[Literal["tokens"], Literal["bs"], Literal["ms"]]
TpotColumns = tuple[Literal["context_tokens"], Literal["bs"], Literal["ms_per_token"]]
RedisColumns = tuple[Literal["kv_gb"], Literal["ms"]]
TTFT_COLUMNS: TtftColumns = ("tokens", "bs", "ms")
TPOT_COLUMNS: TpotColumns = ("context_tokens", "bs", "ms_per_token")
REDIS_COLUMNS: RedisColumns = ("kv_gb", "ms")


class TableError(ValueError):
    """A benchmark table is malformed; the message names the file and the field or row."""


class TtftTable(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Literal["ttft"]
    columns: TtftColumns = TTFT_COLUMNS
    rows: list[tuple[int, int, float]]
    source: str = ""

    def __post_init__(self) -> None:
        for i, (tokens, bs, ms) in enumerate(self.rows):
            if tokens <= 0 or bs <= 0 or not ms >= 0:
                raise ValueError(f"rows[{i}] = {[tokens, bs, ms]}: "
                                 "need tokens > 0, bs > 0, ms >= 0")


class TpotTable(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Literal["tpot"]
    columns: TpotColumns = TPOT_COLUMNS
    rows: list[tuple[float, int, float]]
    source: str = ""

    def __post_init__(self) -> None:
        for i, (tokens, bs, ms) in enumerate(self.rows):
            if tokens <= 0 or bs <= 0 or not ms >= 0:
                raise ValueError(f"rows[{i}] = {[tokens, bs, ms]}: "
                                 "need context_tokens > 0, bs > 0, ms_per_token >= 0")


class RedisTable(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Literal["redis"]
    columns: RedisColumns = REDIS_COLUMNS
    # Negative pull times (measurement artefacts) are allowed here and clipped by the refit.
    rows: list[tuple[float, float]]
    source: str = ""

    def __post_init__(self) -> None:
        for i, (gb, _) in enumerate(self.rows):
            if gb < 0:
                raise ValueError(f"rows[{i}]: kv_gb must be >= 0")


Table = TtftTable | TpotTable | RedisTable


def load_table(path: str | Path, kind: type[Table]) -> Any:
    path = Path(path)
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except OSError as exc:
        raise TableError(f"benchmark table {path}: cannot read ({exc})") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TableError(f"benchmark table {path}: {exc}") from None


def dumps_pretty(obj: Any) -> str:
    """JSON with objects indented and arrays of scalars (rows, anchors) kept on one line."""
    return _pretty(msgspec.to_builtins(obj), 0) + "\n"


def _pretty(value: Any, level: int) -> str:
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        if all(not isinstance(v, (dict, list, tuple)) for v in value.values()):
            flat = json.dumps(value, ensure_ascii=False)
            if len(flat) + len(inner) <= 100:
                return flat
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_pretty(v, level + 1)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return json.dumps(value, ensure_ascii=False)
        items = [inner + _pretty(v, level + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False)


def profile_to_json(profile: PredictorProfile) -> str:
    """Pretty JSON for a profile file (what the refit writes; the workers only read them)."""
    return dumps_pretty(profile)


def write_table(path: str | Path, table: Table) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_pretty(table), encoding="utf-8")
