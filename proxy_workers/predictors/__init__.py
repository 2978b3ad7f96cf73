"""Timing predictors of the Proxy (docs/predictors.md), with real coefficients.

    from proxy_workers.predictors import get_predictors
    p = get_predictors("default")          # $PROXY_PREDICTOR_PROFILE or llama3-70b-8x5090
    p.prefill_ms(1000)                     # ≈ 1421.8 ms
    p.kvcache_service(200, 4000).total_ms

Coefficients live in one JSON file per model profile (``profiles/*.json``; schema in
:mod:`proxy_workers.predictors.profile`), validated and read once per process. Benchmark tables
behind the fitted profiles are in ``data/``; ``tools/predictors/calibrate.py`` measures an
instance into such tables and ``tools/predictors/refit.py`` fits them into a profile.
"""

from proxy_workers.predictors.model import (
    KvcacheService,
    Predictors,
    clear_profile_cache,
    get_predictors,
)
from proxy_workers.predictors.profile import (
    DEFAULT_PROFILE,
    PROFILE_ENV,
    PROFILES_DIR,
    KvConstants,
    PredictorProfile,
    ProfileError,
    RedisPullModel,
    TpotLine,
    TpotModel,
    TtftModel,
    available_profiles,
    effective_profile_name,
    load_profile,
    parse_profile,
    resolve_profile_path,
)

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES_DIR",
    "PROFILE_ENV",
    "KvConstants",
    "KvcacheService",
    "PredictorProfile",
    "Predictors",
    "ProfileError",
    "RedisPullModel",
    "TpotLine",
    "TpotModel",
    "TtftModel",
    "available_profiles",
    "clear_profile_cache",
    "effective_profile_name",
    "get_predictors",
    "load_profile",
    "parse_profile",
    "resolve_profile_path",
]
