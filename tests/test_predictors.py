"""Tests of proxy_workers/predictors/ and the offline tools that produce its profiles
(tools/predictors/).

In-process and fast, but for one short calibration run against a simulated instance
(tools/predictors/calibrate.py; a real run of it produced the shipped sim tables).
"""

from __future__ import annotations

import json
import math
import timeit
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proxy_workers import predictors as pred
from proxy_workers.predictors import (
    DEFAULT_PROFILE,
    PROFILE_ENV,
    KvcacheService,
    Predictors,
    ProfileError,
    get_predictors,
    load_profile,
)
from proxy_workers.predictors import profile as profile_module
from tools.predictors import calibrate as calibrate_instance, refit as refit_predictors
from tools.predictors.fitting import (
    FitError,
    fit_redis,
    fit_tpot,
    fit_ttft,
    least_squares,
)
from tools.predictors.tables import TableError, TpotTable, TtftTable, load_table, profile_to_json
from cacheroute_sim.instance import timing as sim_timing
from tests.sim_harness import running_sim

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "proxy_workers" / "predictors"
PROFILE_70B = PKG / "profiles" / "llama3-70b-8x5090.json"
TTFT_70B_BS1 = PKG / "data" / "llama3-70b-8x5090" / "ttft_bs1.json"
SIM_TTFT = PKG / "data" / "sim" / "ttft.json"
SIM_TPOT = PKG / "data" / "sim" / "tpot.json"
VLLM_TTFT = PKG / "data" / "vllm-cpu-tiny" / "ttft.json"
VLLM_TPOT = PKG / "data" / "vllm-cpu-tiny" / "tpot.json"


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    pred.clear_profile_cache()
    yield
    pred.clear_profile_cache()


@pytest.fixture
def p70() -> Predictors:
    return get_predictors("llama3-70b-8x5090")


def _raw_70b() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PROFILE_70B.read_text())
    return data


def _write(tmp_path: Path, data: dict[str, Any], name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# --- profiles: loading, resolution, caching ------------------------------------------------


def test_shipped_profiles_load_and_carry_the_reference_values() -> None:
    assert set(pred.available_profiles()) >= {"llama3-70b-8x5090", "sim"}
    p = load_profile("llama3-70b-8x5090")
    assert (p.ttft.a_s, p.ttft.b_s, p.ttft.c_s, p.ttft.d_s) == (
        1.46449e-3, 2.15490e-5, -3.16579e-2, -3.25473e-2)
    assert p.ttft.anchors_ms[0] == (0, 60.0) and p.ttft.anchors_ms[-1] == (345, 472.0)
    assert p.ttft.anchor_only_max_tokens == 115
    assert {line.bs: (line.slope_s, line.intercept_s) for line in p.tpot.per_bs} == {
        1: (2.018e-7, 0.023942), 2: (5.55e-7, 0.025353), 4: (6.34e-7, 0.026653),
        8: (8.37e-7, 0.027656)}
    assert p.redis_pull.ms_per_gb == 2764.3407821694204
    assert p.redis_pull.intercept_ms == 12.460820712239126
    assert (p.kv.header_overhead_tokens, p.kv.align_tokens) == (36, 256)
    assert (p.kv.redis_gb_per_token, p.kv.transfer_mb_per_token, p.kv.link_utilisation) == (
        3.81e-5, 0.096, 0.825)
    assert "redis_gb_per_token" in p.kv.note and "transfer_mb_per_token" in p.kv.note
    sim = load_profile("sim")
    assert sim.name == "sim" and "calibrate_instance" in sim.provenance


def test_default_resolves_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_profile("default").name == DEFAULT_PROFILE == "llama3-70b-8x5090"
    assert load_profile().name == DEFAULT_PROFILE
    monkeypatch.setenv(PROFILE_ENV, "sim")
    assert load_profile("default").name == "sim"
    assert get_predictors().profile.name == "sim"
    monkeypatch.setenv(PROFILE_ENV, "default")
    assert load_profile("default").name == DEFAULT_PROFILE
    by_path = str(PROFILE_70B)
    assert pred.effective_profile_name("default", {PROFILE_ENV: by_path}) == by_path
    assert pred.effective_profile_name("default", {PROFILE_ENV: " "}) == DEFAULT_PROFILE


def test_name_and_path_give_the_same_cached_object() -> None:
    by_name = load_profile("llama3-70b-8x5090")
    assert load_profile(str(PROFILE_70B)) is by_name
    assert load_profile(PROFILE_70B) is by_name
    assert get_predictors(PROFILE_70B) is get_predictors("llama3-70b-8x5090")
    assert get_predictors("default").profile is by_name


def test_the_file_is_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Path] = []
    real = profile_module._read_file

    def counting(path: Path) -> bytes:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(profile_module, "_read_file", counting)
    first = get_predictors("llama3-70b-8x5090")
    for _ in range(50):
        assert get_predictors("llama3-70b-8x5090") is first
        assert load_profile("llama3-70b-8x5090") is first.profile
        assert load_profile(str(PROFILE_70B)) is first.profile
        first.prefill_ms(1000)
        first.kvcache_service(100, 3000)
    assert reads == [PROFILE_70B]
    pred.clear_profile_cache()
    assert get_predictors("llama3-70b-8x5090") is not first
    assert len(reads) == 2


def test_unknown_or_bad_names_are_refused() -> None:
    with pytest.raises(ProfileError,
                       match=r"'nope' not found; shipped profiles: .*llama3-70b-8x5090"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="not a valid name"):
        load_profile("bad name!")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile("/nonexistent/dir/profile.json")


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda d: d["ttft"].pop("a_s"), r"missing required field `a_s`.*\$\.ttft"),
    (lambda d: d["ttft"].update(a_s="fast"), r"Expected `float`, got `str` - at `\$\.ttft\.a_s`"),
    (lambda d: d["tpot"]["per_bs"][0].update(slop=1.0),
     r"unknown field `slop`.*\$\.tpot\.per_bs\[0\]"),
    (lambda d: d["ttft"].update(a_s=0.0, b_s=0.0, c_s=0.0, d_s=0.0),
     r"ttft\.a_s \+ ttft\.b_s must be > 0.*placeholder"),
    (lambda d: d["ttft"].update(anchors_ms=[[10, 60.0], [5, 50.0]]),
     r"ttft\.anchors_ms must be sorted"),
    (lambda d: d["kv"].update(link_utilisation=1.5), r"kv\.link_utilisation must be within"),
    (lambda d: d["kv"].pop("transfer_mb_per_token"),
     r"missing required field `transfer_mb_per_token`"),
    (lambda d: d["kv"].update(align_tokens=0), r"kv\.align_tokens must be >= 1"),
    (lambda d: d["tpot"]["per_bs"].append(d["tpot"]["per_bs"][0]), r"duplicate bs values"),
    (lambda d: d["tpot"].update(missing_bs="extrapolate"), r"\$\.tpot\.missing_bs"),
    (lambda d: d["tpot"].update(per_bs=[]), r"tpot\.per_bs must not be empty"),
    (lambda d: d["redis_pull"].update(ms_per_gb=-1), r"redis_pull\.ms_per_gb must be >= 0"),
    (lambda d: d.update(schema_version=2), r"schema_version must be 1"),
])
def test_invalid_profiles_fail_naming_the_field(tmp_path: Path, mutate: Any, expected: str) -> None:
    data = _raw_70b()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError, match=expected) as info:
        load_profile(str(path))
    assert str(path) in str(info.value)


def test_invalid_json_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=r"broken\.json: not valid JSON"):
        load_profile(str(path))


def test_profile_round_trips_through_the_writer() -> None:
    p = load_profile("llama3-70b-8x5090")
    assert pred.parse_profile(profile_to_json(p).encode()) == p


# --- prefill ------------------------------------------------------------------------------


def test_prefill_reference_values(p70: Predictors) -> None:
    # bs=1 line of the four-term fit: 1.48604 ms·L − 64.205 ms.
    assert p70.prefill_ms(1000) == pytest.approx(1421.834, abs=0.01)
    assert p70.prefill_ms(1000, 1) == p70.prefill_ms(1000)
    assert p70.prefill_ms(3801) == pytest.approx(1.486039 * 3801 - 64.2052, abs=0.01)


def test_prefill_short_prompts_use_the_anchors(p70: Predictors) -> None:
    assert p70.prefill_ms(1) == 60.0
    assert p70.prefill_ms(10) == 60.0
    assert p70.prefill_ms(35) == 47.0
    assert p70.prefill_ms(50) == pytest.approx((53.26 + 65.97) / 2)
    assert p70.prefill_ms(115) == 95.67
    # 116..345: the larger of anchor and model.
    assert p70.prefill_ms(303) == 396.0  # anchor above the model (386.1)
    assert p70.prefill_ms(345) == 472.0
    for tokens in range(116, 346):
        model = 1.486039 * tokens - 64.2052
        assert p70.prefill_ms(tokens) >= model - 1e-6


def test_prefill_is_never_zero_beyond_the_anchors(p70: Predictors) -> None:
    assert p70.prefill_ms(346) == pytest.approx(1.486039 * 346 - 64.2052, abs=0.01)
    previous = 0.0
    for tokens in range(346, 130_000, 997):
        value = p70.prefill_ms(tokens)
        assert value > previous > 0.0 or previous == 0.0
        assert value > 0.0
        previous = value


def test_prefill_batches(p70: Predictors) -> None:
    a, b, c, d = 1.46449, 2.15490e-2, -31.6579, -32.5473  # ms
    assert p70.prefill_ms(1000, 4) == pytest.approx(a * 4000 + b * 1000 + c * 4 + d)
    assert p70.prefill_ms(2000, 2) > 2 * p70.prefill_ms(2000, 1) * 0.95
    # The four-term model alone is ≤ 0 here; a batch is never faster than one prompt.
    assert p70.prefill_ms(10, 2) == p70.prefill_ms(10, 1) == 60.0
    for tokens in (1, 50, 200, 345, 346, 1000, 5000):
        for bs in (2, 3, 8):
            assert p70.prefill_ms(tokens, bs) >= p70.prefill_ms(tokens, bs - 1)


@pytest.mark.parametrize(("tokens", "bs"), [(0, 1), (-5, 1), (10, 0), (10, -1)])
def test_prefill_rejects_non_positive(p70: Predictors, tokens: int, bs: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        p70.prefill_ms(tokens, bs)


# --- decode --------------------------------------------------------------------------------


def test_tpot_by_batch_size(p70: Predictors) -> None:
    assert p70.tpot_ms(1000, 1) == pytest.approx(2.018e-4 * 1000 + 23.942)
    assert p70.tpot_ms(1000) == p70.tpot_ms(1000, 1)
    assert p70.tpot_ms(500, 2) == pytest.approx(5.55e-4 * 500 + 25.353)
    assert p70.tpot_ms(500, 4) == pytest.approx(6.34e-4 * 500 + 26.653)
    assert p70.tpot_ms(1000, 8) == pytest.approx(8.37e-4 * 1000 + 27.656)
    # Missing sizes interpolate between neighbours; beyond the largest, the largest.
    assert p70.tpot_ms(500, 3) == pytest.approx((p70.tpot_ms(500, 2) + p70.tpot_ms(500, 4)) / 2)
    assert p70.tpot_ms(500, 6) == pytest.approx((p70.tpot_ms(500, 4) + p70.tpot_ms(500, 8)) / 2)
    assert p70.tpot_ms(500, 64) == p70.tpot_ms(500, 8)
    for bs in range(1, 12):
        assert p70.tpot_ms(500, bs + 1) >= p70.tpot_ms(500, bs)
    with pytest.raises(ValueError):
        p70.tpot_ms(0, 1)
    with pytest.raises(ValueError):
        p70.tpot_ms(10, 0)


def test_tpot_nearest_mode(tmp_path: Path) -> None:
    data = _raw_70b()
    data["tpot"]["missing_bs"] = "nearest"
    p = get_predictors(str(_write(tmp_path, data)))
    ref = get_predictors("llama3-70b-8x5090")
    assert p.tpot_ms(500, 3) == ref.tpot_ms(500, 4)  # tie → the larger (slower) size
    assert p.tpot_ms(500, 5) == ref.tpot_ms(500, 4)
    assert p.tpot_ms(500, 7) == ref.tpot_ms(500, 8)


def test_decode_sums_the_steps(p70: Predictors) -> None:
    assert p70.decode_ms(1000, 0) == 0.0
    assert p70.decode_ms(1000, 1, 4) == p70.tpot_ms(1000, 4)
    expected = sum(p70.tpot_ms(1000 + i, 2) for i in range(128))
    assert p70.decode_ms(1000, 128, 2) == pytest.approx(expected)
    with pytest.raises(ValueError):
        p70.decode_ms(1000, -1)
    with pytest.raises(ValueError):
        p70.decode_ms(0, 5)


# --- Redis pull, service, transfer -----------------------------------------------------------


def test_redis_pull(p70: Predictors) -> None:
    assert p70.redis_pull_ms(1.0) == pytest.approx(2764.3407821694204 + 12.460820712239126)
    assert p70.redis_pull_ms(0.0) == pytest.approx(12.460820712239126)
    assert p70.redis_pull_ms(-3.0) == p70.redis_pull_ms(0.0)
    assert p70.redis_pull_ms(3840 * 3.81e-5) == pytest.approx(416.8949, abs=1e-3)


def test_text_service(p70: Predictors) -> None:
    assert p70.text_service_ms(200, 4000) == p70.prefill_ms(200 + 4000 + 36)
    assert p70.text_service_ms(0, 0) == p70.prefill_ms(36) == 47.0 + (53.26 - 47.0) * 0.1
    with pytest.raises(ValueError):
        p70.text_service_ms(-1, 0)


def test_text_service_is_kept_by_length_and_the_memo_stays_bounded(p70: Predictors,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What text_service_ms keeps is what it computes (asked again, any split of the same
    total), and the memo starts afresh past TEXT_SERVICE_KEPT lengths."""
    from proxy_workers.predictors import model

    monkeypatch.setattr(model, "TEXT_SERVICE_KEPT", 8)
    fresh = Predictors(p70.profile)
    for tokens in range(0, 400, 7):
        first = fresh.text_service_ms(tokens, 0)
        assert first == p70.prefill_ms(tokens + 36) == fresh.text_service_ms(0, tokens)
        assert len(fresh._text_service) <= 8


def test_kvcache_service_composition(p70: Predictors) -> None:
    s = p70.kvcache_service(200, 4000)
    assert isinstance(s, KvcacheService)
    assert s.effective_knowledge_tokens == 3840  # floor(4000/256)·256
    assert s.residual_tokens == 200 + 160 + 36
    assert s.redis_ms == pytest.approx(p70.redis_pull_ms(3840 * 3.81e-5))
    assert s.residual_prefill_ms == p70.prefill_ms(396)
    assert s.total_ms == pytest.approx(s.redis_ms + s.residual_prefill_ms)
    # Long knowledge: pulling KV beats recomputing it (with zero coefficients it never did).
    assert s.total_ms < p70.text_service_ms(200, 4000) / 3
    # Knowledge below one chunk: nothing served from KV, the pull intercept remains.
    small = p70.kvcache_service(10, 100)
    assert (small.effective_knowledge_tokens, small.residual_tokens) == (0, 146)
    assert small.redis_ms == pytest.approx(12.460820712239126)
    assert small.residual_prefill_ms == p70.prefill_ms(146)
    assert p70.effective_knowledge_tokens(4000) == 3840
    assert p70.effective_knowledge_tokens(-5) == 0
    with pytest.raises(ValueError):
        p70.kvcache_service(0, -1)


def test_kv_transfer(p70: Predictors) -> None:
    # K_eff · 0.096 MB / (bw/8 · 0.825) s
    assert p70.kv_transfer_ms(3840, 1000) == pytest.approx(3840 * 0.096 / (125 * 0.825) * 1000)
    assert p70.kv_transfer_ms(3840, 10_000) == pytest.approx(p70.kv_transfer_ms(3840, 1000) / 10)
    assert p70.kv_transfer_ms(0, 1000) == 0.0
    with pytest.raises(ValueError):
        p70.kv_transfer_ms(256, 0)
    with pytest.raises(ValueError):
        p70.kv_transfer_ms(-1, 1000)


def test_per_call_cost(p70: Predictors) -> None:
    calls = {
        "prefill_ms(1000)": lambda: p70.prefill_ms(1000),
        "prefill_ms(200)": lambda: p70.prefill_ms(200),
        "prefill_ms(1000, 4)": lambda: p70.prefill_ms(1000, 4),
        "tpot_ms(1000, 3)": lambda: p70.tpot_ms(1000, 3),
        "decode_ms(1000, 128, 2)": lambda: p70.decode_ms(1000, 128, 2),
        "redis_pull_ms(0.1)": lambda: p70.redis_pull_ms(0.1),
        "text_service_ms(200, 4000)": lambda: p70.text_service_ms(200, 4000),
        "kvcache_service(200, 4000)": lambda: p70.kvcache_service(200, 4000),
        "kv_transfer_ms(3840, 1000)": lambda: p70.kv_transfer_ms(3840, 1000),
        "get_predictors('default')": lambda: get_predictors("default"),
    }
    n = 20_000
    costs = {name: min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
             for name, fn in calls.items()}
    print("\nper-call cost (µs, incl. ~0.05 µs lambda overhead):")
    for name, us in costs.items():
        print(f"  {name:30} {us:6.3f}")
    # Low microseconds each, with ample headroom for a loaded CI machine.
    assert max(costs.values()) < 10.0, costs


# --- fitting and the refit script ----------------------------------------------------------


def test_least_squares_recovers_a_known_four_term_model() -> None:
    a, b, c, d = 1.5e-3, 2e-5, -0.03, -0.03
    rows = [(tokens, bs, 1000 * (a * bs * tokens + b * tokens + c * bs + d))
            for bs in (1, 2, 3, 4) for tokens in range(89, 3802, 128)]
    fit = fit_ttft(rows)
    assert fit.mode == "four_term"
    for got, want in zip((fit.a_s, fit.b_s, fit.c_s, fit.d_s), (a, b, c, d)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert fit.residuals_ms.max_abs < 1e-6


def test_least_squares_rank_and_shape_errors() -> None:
    with pytest.raises(FitError, match="cannot separate"):
        least_squares([(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)], [1.0, 2.0, 3.0])
    with pytest.raises(FitError, match="cannot determine"):
        least_squares([(1.0, 1.0)], [1.0])
    with pytest.raises(FitError, match="no rows"):
        least_squares([], [])


def test_tpot_and_redis_fits() -> None:
    lines = fit_tpot([(100.0, 1, 24.0 + 0.001 * 100), (900.0, 1, 24.0 + 0.001 * 900),
                      (500.0, 8, 28.0), (500.0, 8, 28.2)])
    assert [line.bs for line in lines] == [1, 8]
    assert lines[0].slope_s == pytest.approx(1e-6) and lines[0].intercept_s == pytest.approx(0.024)
    assert lines[1].slope_s == 0.0 and lines[1].intercept_s == pytest.approx(0.0281)
    redis = fit_redis([(gb, 2764.34 * gb + 12.46) for gb in (0.01, 0.1, 0.5, 1.0)])
    assert redis.ms_per_gb == pytest.approx(2764.34)
    assert redis.intercept_ms == pytest.approx(12.46)


def test_refit_of_the_reference_bs1_table_gives_the_reference_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    tables = refit_predictors.read_tables(ttft=[TTFT_70B_BS1])
    assert len(tables.ttft) == 13
    result = refit_predictors.refit(load_profile("llama3-70b-8x5090"), tables)
    fit = result.ttft
    assert fit is not None and fit.mode == "single_bs_line"
    # Reference bs=1 line: 1.48604e-3·L − 0.064205 s.
    assert fit.a_s + fit.b_s == pytest.approx(1.48604e-3, rel=0.01)
    assert fit.c_s + fit.d_s == pytest.approx(-0.064205, abs=0.002)
    assert get_predictors("llama3-70b-8x5090").prefill_ms(1000) == pytest.approx(
        Predictors(result.profile).prefill_ms(1000), rel=0.015)
    # The CLI check mode prints both and passes a 2 % prediction tolerance.
    assert refit_predictors.main(
        ["--check", "--ttft", str(TTFT_70B_BS1), "--tolerance", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "bs=1 line (old): 1.48604 ms·L -64.205 ms" in out
    assert "residuals new:" in out


def test_refit_reproduces_the_shipped_sim_profile(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert refit_predictors.main([
        "--base", "llama3-70b-8x5090", "--name", "sim", "--aggregate", "median",
        "--ttft", str(SIM_TTFT), "--tpot", str(SIM_TPOT), "--out", str(out)]) == 0
    refitted = load_profile(str(out))
    shipped = load_profile("sim")
    for coef in ("a_s", "b_s", "c_s", "d_s"):
        assert getattr(refitted.ttft, coef) == pytest.approx(getattr(shipped.ttft, coef),
                                                             rel=1e-9, abs=1e-15)
    assert len(refitted.tpot.per_bs) == len(shipped.tpot.per_bs)
    for new, old in zip(refitted.tpot.per_bs, shipped.tpot.per_bs):
        assert new.bs == old.bs
        assert new.slope_s == pytest.approx(old.slope_s, rel=1e-9, abs=1e-15)
        assert new.intercept_s == pytest.approx(old.intercept_s, rel=1e-9)
    assert refitted.redis_pull == shipped.redis_pull and refitted.kv == shipped.kv
    assert refitted.ttft.anchors_ms == shipped.ttft.anchors_ms
    assert refit_predictors.main([
        "--base", "sim", "--check", "--aggregate", "median", "--tolerance", "1e-9",
        "--ttft", str(SIM_TTFT), "--tpot", str(SIM_TPOT)]) == 0


def test_the_vllm_cpu_tiny_profile_is_its_tables_fitted_without_anchors(tmp_path: Path) -> None:
    """The shipped profile is what refit makes of the committed tables (measured against the
    real-engine suite's vLLM), and the fitted line, not another engine's anchors, applies to
    short prompts."""
    out = tmp_path / "p.json"
    shipped = load_profile("vllm-cpu-tiny")
    assert shipped.ttft.anchors_ms == () and shipped.ttft.anchor_only_max_tokens == 0
    assert "--no-anchors" in shipped.provenance and "calibrate.py" in shipped.ttft.source
    assert refit_predictors.main([
        "--base", "sim", "--name", "vllm-cpu-tiny", "--no-anchors", "--aggregate", "median",
        "--ttft", str(VLLM_TTFT), "--tpot", str(VLLM_TPOT), "--out", str(out)]) == 0
    refitted = load_profile(str(out))
    assert refitted.ttft == msgspec.structs.replace(shipped.ttft, source=refitted.ttft.source)
    assert refitted.tpot.per_bs == shipped.tpot.per_bs
    p = Predictors(shipped)
    line = lambda tokens: 1000 * ((shipped.ttft.a_s + shipped.ttft.b_s) * tokens + shipped.ttft.d_s)
    for tokens in (1, 50, 115, 345, 1000):
        assert p.prefill_ms(tokens) == pytest.approx(line(tokens))
    assert {line.bs for line in shipped.tpot.per_bs} == {1, 2, 4}  # max_num_seqs 4
    assert all(0 < p.tpot_ms(tokens, bs) < 50 for tokens in (1, 1024) for bs in (1, 2, 4, 8))


def test_refit_keeps_the_base_anchors_unless_told_not_to() -> None:
    tables = refit_predictors.read_tables(ttft=[SIM_TTFT])
    kept = refit_predictors.refit(load_profile("sim"), tables).profile
    assert kept.ttft.anchors_ms == load_profile("sim").ttft.anchors_ms
    assert "Anchors and anchor_only_max_tokens from base profile 'sim'" in kept.ttft.source
    dropped = refit_predictors.refit(load_profile("sim"), tables, no_anchors=True).profile
    assert dropped.ttft.anchors_ms == () and dropped.ttft.anchor_only_max_tokens == 0
    assert "No anchors" in dropped.ttft.source
    assert (dropped.ttft.a_s, dropped.ttft.d_s) == (kept.ttft.a_s, kept.ttft.d_s)


def test_sim_profile_matches_the_simulated_instance_model() -> None:
    sim = get_predictors("sim")
    # Prefill: the sim runs 1.48604 ms·L − 64.205 ms beyond its anchors.
    for tokens in (400, 1000, 2000, 3000):
        assert sim.prefill_ms(tokens) == pytest.approx(sim_timing.prefill_ms(tokens), rel=0.02)
    for tokens in (1, 50, 115, 300, 345):
        assert sim.prefill_ms(tokens) == pytest.approx(sim_timing.prefill_ms(tokens), abs=1.0)
    # TPOT: the sim's ITL is flat in L, 24 ms alone to 28 ms at 8 decoding.
    for bs in (1, 2, 4, 8):
        assert sim.tpot_ms(300, bs) == pytest.approx(sim_timing.itl_ms(bs), abs=1.0)


def test_refit_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refit_predictors.main(["--check"]) == 2
    bad = _write(tmp_path, {"kind": "ttft", "rows": [[100, 1, 50.0], [0, 1, 10.0]]})
    assert refit_predictors.main(["--check", "--ttft", str(bad)]) == 2
    assert "rows[1]" in capsys.readouterr().err
    with pytest.raises(TableError, match="unknown field `ms`"):
        load_table(_write(tmp_path, {"kind": "ttft", "rows": [], "ms": 1}, "t.json"), TtftTable)
    # A single bs and a single length: the line is not identifiable.
    one = _write(tmp_path, {"kind": "ttft", "rows": [[100, 1, 50.0], [100, 1, 51.0]]}, "one.json")
    assert refit_predictors.main(["--check", "--ttft", str(one)]) == 2


def test_refit_aggregates_repeats() -> None:
    rows = [(100, 1, 10.0), (100, 1, 11.0), (100, 1, 50.0), (200, 1, 20.0)]
    assert refit_predictors._aggregate(rows, "median") == [(100, 1, 11.0), (200, 1, 20.0)]
    assert refit_predictors._aggregate(rows, "mean")[0][2] == pytest.approx(71 / 3)
    assert refit_predictors._aggregate(rows, "none") == rows


def test_shipped_tables_are_valid() -> None:
    for path in (TTFT_70B_BS1, SIM_TTFT):
        table = load_table(path, TtftTable)
        assert table.rows and table.source
    tpot = load_table(SIM_TPOT, TpotTable)
    assert {bs for _, bs, _ in tpot.rows} == {1, 2, 4, 8}
    assert "calibrate_instance" in tpot.source


# --- calibrate_instance ---------------------------------------------------------------------


def test_calibrate_then_refit_against_a_fast_simulated_instance(tmp_path: Path) -> None:
    """The whole pipeline on a sim at 1/20 of real time (a few seconds): start, measure, stop, fit."""
    scale = 0.05
    with running_sim(tmp_path / "sim.log", "--no-register", "--time-scale", str(scale)) as sim:
        assert calibrate_instance.main([
            "--url", sim.url, "--out-dir", str(tmp_path),
            "--ttft-lengths", "500,1500,3000", "--ttft-repeats", "3", "--tpot-bs", "1,2",
            "--tpot-lengths", "64,512", "--tpot-repeats", "1", "--tpot-window-tokens", "10",
            "--max-seconds", "20"]) == 0
    ttft = load_table(tmp_path / "ttft.json", TtftTable)
    # usage.prompt_tokens = ceil(chars/4); three samples a length, so one slowed by a busy
    # machine does not move the fitted slope (the fit takes their median).
    assert sorted({row[0] for row in ttft.rows}) == [500, 1500, 3000] and len(ttft.rows) == 9
    assert f"--url {sim.url}" in ttft.source
    tpot = load_table(tmp_path / "tpot.json", TpotTable)
    assert {bs for _, bs, _ in tpot.rows} == {1, 2} and all(ms > 0 for *_, ms in tpot.rows)
    out = tmp_path / "fast.json"
    assert refit_predictors.main([
        "--base", "sim", "--name", "fast", "--ttft", str(tmp_path / "ttft.json"),
        "--tpot", str(tmp_path / "tpot.json"), "--aggregate", "median", "--out", str(out)]) == 0
    fitted = load_profile(str(out))
    # The sim's prefill slope, 1.48604 ms/token, scaled by the time scale.
    assert fitted.ttft.a_s == pytest.approx(1.48604e-3 * scale, rel=0.05)


# --- calibrate_instance helpers ------------------------------------------------------------


def test_calibrate_prompt_is_sized_for_the_sim_tokenizer() -> None:
    for tokens in (1, 16, 400, 3000):
        text = calibrate_instance.make_prompt(tokens, "abc123")
        assert len(text) == 4 * tokens
        assert sim_timing.prompt_tokens(len(text)) == tokens
    assert calibrate_instance.make_prompt(400, "x1") != calibrate_instance.make_prompt(400, "x2")


def test_calibrate_refuses_non_loopback_targets() -> None:
    calibrate_instance.require_loopback("http://127.0.0.1:9001")
    calibrate_instance.require_loopback("http://[::1]:9001")
    with pytest.raises(calibrate_instance.CalibrationError, match="only loopback"):
        calibrate_instance.require_loopback("http://10.1.2.3:8000")


def test_calibrate_counts_a_chunk_per_token_even_with_empty_text() -> None:
    """vLLM's chunks as they come: the role-only opening, a token whose text is still empty (it
    ends inside a UTF-8 character), a token with text, the usage chunk; the sim's too."""
    token = calibrate_instance.carries_a_token
    assert not token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert token({"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]})
    assert token({"choices": [{"delta": {"content": "ab"}}]})
    assert token({"choices": [{"text": ""}]})  # completions
    assert not token({"choices": [], "usage": {"prompt_tokens": 9}})
    assert not token({"choices": [{"delta": {"role": "assistant"}}]})  # the sim's opening
    assert not token({"choices": [{"delta": {}, "finish_reason": "stop"}]})


def test_calibrate_window_takes_only_gaps_while_all_streams_decode() -> None:
    trace = calibrate_instance.StreamTrace
    # Stream A starts at t=0 (gaps 0.1 s); B gets its first chunk at 0.35 (gaps 0.2 s).
    a = trace(sent_at=0.0, prompt_tokens_estimate=100, chunk_times=[0.1 * i for i in range(10)])
    b = trace(sent_at=0.0, prompt_tokens_estimate=100, chunk_times=[0.35, 0.55, 0.75, 0.95])
    gaps, context = calibrate_instance.window_gaps([a, b], window_end=0.9)
    # Window [0.35, 0.9]: A's gaps 0.4→0.5 … 0.8→0.9 (5), B's 0.35→0.55, 0.55→0.75 (2).
    assert len(gaps) == 7
    assert sorted(round(g) for g in gaps) == [100] * 5 + [200] * 2
    assert context == pytest.approx((sum(100 + k for k in range(5, 10)) + 101 + 102) / 7)
    assert calibrate_instance.window_gaps([a, trace(0.0, 10)], 1.0) == ([], 0.0)


def test_profile_struct_is_immutable() -> None:
    p = load_profile("llama3-70b-8x5090")
    with pytest.raises(AttributeError):
        p.ttft.a_s = 0.0  # type: ignore[misc]
    assert isinstance(p.ttft.anchors_ms, tuple)
    assert msgspec.structs.asdict(p)["name"] == "llama3-70b-8x5090"
    assert not math.isnan(p.ttft.d_s)
