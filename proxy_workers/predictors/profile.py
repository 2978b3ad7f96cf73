"""Model profiles: the coefficients of one (model, hardware) pair, one JSON file each.

A profile lives in ``proxy_workers/predictors/profiles/<name>.json`` (or anywhere, given by path)
and is validated on load against the Structs below; unknown or missing fields, wrong types and
out-of-range values fail with a :class:`ProfileError` naming the file and the field. Units are
in the field names: ``_s`` seconds, ``_ms`` milliseconds.

Profiles are read once per process: :func:`load_profile` caches by resolved file path, so the
request path never touches the disk (the original re-read its JSON on every prediction).
Edit a profile → restart the process.

Name resolution: ``"default"`` means the profile named by the environment variable
``PROXY_PREDICTOR_PROFILE`` if it is set (and not itself "default"), else
``llama3-70b-8x5090``. A plain name (letters, digits, ``._-``) is a shipped profile; anything
containing a path separator or ending in ``.json`` is a file path.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

PROFILE_ENV = "PROXY_PREDICTOR_PROFILE"
DEFAULT_PROFILE = "llama3-70b-8x5090"
SCHEMA_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ProfileError(ValueError):
    """A predictor profile is missing or invalid; the message names the file and the field."""


def _require(ok: bool, message: str) -> None:
    # Raised inside msgspec.convert/decode, a ValueError becomes a ValidationError that
    # also carries the JSON path ("- at `$.ttft`").
    if not ok:
        raise ValueError(message)


class TtftModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prefill (TTFT compute) time, seconds: ``a_s·bs·L + b_s·L + c_s·bs + d_s``, clipped at 0.

    ``anchors_ms`` are measured bs=1 short-prompt times (tokens, ms), linearly interpolated;
    they apply up to the last anchor's token count. At bs=1 and L ≤ ``anchor_only_max_tokens``
    the anchor value is used alone, above that the larger of anchor and model.
    """

    a_s: float
    b_s: float
    c_s: float
    d_s: float
    anchors_ms: tuple[tuple[int, float], ...] = ()
    anchor_only_max_tokens: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("a_s", "b_s", "c_s", "d_s"):
            value = getattr(self, name)
            _require(math.isfinite(value), f"ttft.{name} must be finite")
        # All-zero (the original's placeholder) or shrinking-with-length coefficients are the
        # defect this package exists to remove: refuse them at load.
        _require(self.a_s + self.b_s > 0,
                 "ttft.a_s + ttft.b_s must be > 0 (prefill time must grow with prompt length; "
                 "all-zero coefficients are a placeholder, not a model)")
        tokens = [t for t, _ in self.anchors_ms]
        _require(all(t >= 0 for t in tokens), "ttft.anchors_ms token counts must be >= 0")
        _require(all(b > a for a, b in itertools.pairwise(tokens)),
                 "ttft.anchors_ms must be sorted by strictly increasing token count")
        _require(all(ms >= 0 for _, ms in self.anchors_ms), "ttft.anchors_ms values must be >= 0")
        _require(self.anchor_only_max_tokens >= 0, "ttft.anchor_only_max_tokens must be >= 0")
        _require(not tokens or self.anchor_only_max_tokens <= tokens[-1],
                 "ttft.anchor_only_max_tokens must not exceed the last anchor's token count")


class TpotLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seconds per output token at batch size ``bs``, context length L: slope_s·L + intercept_s."""

    bs: int
    slope_s: float
    intercept_s: float

    def __post_init__(self) -> None:
        _require(self.bs >= 1, "tpot.per_bs[].bs must be >= 1")
        _require(self.slope_s + self.intercept_s > 0,
                 f"tpot.per_bs (bs={self.bs}): slope_s + intercept_s must be > 0 "
                 "(a decode step cannot take no time)")


class TpotModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-batch-size TPOT lines.

    ``missing_bs`` says what a batch size without its own line gets: ``"interpolate"`` —
    slope and intercept linearly interpolated between the neighbouring measured sizes;
    ``"nearest"`` — the nearest measured size's line (ties go to the larger, slower size).
    Outside the measured range both use the closest measured line (no extrapolation).
    """

    per_bs: tuple[TpotLine, ...]
    missing_bs: Literal["interpolate", "nearest"] = "interpolate"
    source: str = ""

    def __post_init__(self) -> None:
        _require(len(self.per_bs) > 0, "tpot.per_bs must not be empty")
        sizes = [line.bs for line in self.per_bs]
        _require(len(set(sizes)) == len(sizes), f"tpot.per_bs has duplicate bs values: {sizes}")


class RedisPullModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """LMCache pull from Redis, ms: ``max(0, ms_per_gb·kv_gb + intercept_ms)``."""

    ms_per_gb: float
    intercept_ms: float
    source: str = ""

    def __post_init__(self) -> None:
        _require(self.ms_per_gb >= 0, "redis_pull.ms_per_gb must be >= 0")


class KvConstants(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token/size constants of the KV-cache path.

    Two per-token KV sizes, deliberately separate (the original used both, and they disagree):
    ``redis_gb_per_token`` converts aligned knowledge tokens into the GB the Redis pull model
    was fitted on; ``transfer_mb_per_token`` sizes the KDN→Instance network transfer.
    """

    header_overhead_tokens: int = 36
    align_tokens: int = 256
    redis_gb_per_token: float
    transfer_mb_per_token: float
    link_utilisation: float = 0.825
    note: str = ""

    def __post_init__(self) -> None:
        _require(self.header_overhead_tokens >= 0, "kv.header_overhead_tokens must be >= 0")
        _require(self.align_tokens >= 1, "kv.align_tokens must be >= 1")
        _require(self.redis_gb_per_token > 0, "kv.redis_gb_per_token must be > 0")
        _require(self.transfer_mb_per_token > 0, "kv.transfer_mb_per_token must be > 0")
        _require(0 < self.link_utilisation <= 1, "kv.link_utilisation must be within (0, 1]")


class PredictorProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: int
    name: str
    description: str = ""
    # How the numbers were obtained (benchmark tables, refit command).
    provenance: str = ""
    ttft: TtftModel
    tpot: TpotModel
    redis_pull: RedisPullModel
    kv: KvConstants

    def __post_init__(self) -> None:
        _require(self.schema_version == SCHEMA_VERSION,
                 f"schema_version must be {SCHEMA_VERSION}, got {self.schema_version}")
        _require(bool(self.name), "name must not be empty")


# --- loading -------------------------------------------------------------------------------


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def effective_profile_name(name_or_path: str | os.PathLike[str] = "default",
                           environ: Mapping[str, str] | None = None) -> str:
    """``"default"`` → ``$PROXY_PREDICTOR_PROFILE`` or the built-in default; others unchanged.
    No I/O."""
    text = os.fspath(name_or_path)
    if text == "default":
        env = os.environ if environ is None else environ
        text = env.get(PROFILE_ENV, "").strip() or DEFAULT_PROFILE
        if text == "default":
            text = DEFAULT_PROFILE
    return text


def resolve_profile_path(name_or_path: str | os.PathLike[str] = "default",
                         environ: Mapping[str, str] | None = None) -> Path:
    """The file a name or path designates (see :func:`effective_profile_name`). Does not read
    it; raises :class:`ProfileError` for a bad or unknown name."""
    text = effective_profile_name(name_or_path, environ)
    if os.sep in text or "/" in text or text.endswith(".json"):
        return Path(text).expanduser().resolve()
    if not _NAME_RE.match(text):
        raise ProfileError(f"predictor profile name {text!r} is not a valid name "
                           "(letters, digits, '.', '_', '-'; or give a path to a .json file)")
    path = PROFILES_DIR / f"{text}.json"
    if not path.is_file():
        raise ProfileError(f"predictor profile {text!r} not found; shipped profiles: "
                           f"{', '.join(available_profiles())} (or give a path to a .json file)")
    return path


def parse_profile(data: bytes, origin: str = "<bytes>") -> PredictorProfile:
    """Decode and validate profile JSON (no caching)."""
    try:
        return msgspec.json.decode(data, type=PredictorProfile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"predictor profile {origin}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"predictor profile {origin}: not valid JSON ({exc})") from None


def _read_file(path: Path) -> bytes:
    # The one place a profile is read from disk (tests count calls to it).
    return path.read_bytes()


# Two levels: the name/path string as given (after "default" resolution) → profile, so a hit
# costs one dict lookup and no stat(); and resolved path → profile, so a name and a path to
# the same file share one object.
_by_name: dict[str, PredictorProfile] = {}
_by_path: dict[Path, PredictorProfile] = {}
_cache_lock = threading.Lock()


def load_profile(name_or_path: str | os.PathLike[str] = "default") -> PredictorProfile:
    """The validated profile for a name or path; the file is read once per process.

    Raises :class:`ProfileError` (a ValueError) if it is missing or invalid.
    """
    key = effective_profile_name(name_or_path)
    cached = _by_name.get(key)
    if cached is not None:
        return cached
    with _cache_lock:
        cached = _by_name.get(key)
        if cached is not None:
            return cached
        path = resolve_profile_path(key)
        cached = _by_path.get(path)
        if cached is None:
            try:
                data = _read_file(path)
            except OSError as exc:
                raise ProfileError(f"predictor profile {path}: cannot read ({exc})") from None
            cached = _by_path[path] = parse_profile(data, str(path))
        _by_name[key] = cached
        return cached


def _clear_cache() -> None:
    with _cache_lock:
        _by_name.clear()
        _by_path.clear()
