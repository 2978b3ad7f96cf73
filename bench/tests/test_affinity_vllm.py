"""bench/affinity_vllm's pure parts (the workload, the engines' counters and calls, the figures,
the targets, the contenders' command lines, the order of the runs) and its report section,
without engines or routers."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.affinity_vllm import __main__ as cli
from bench.affinity_vllm import contenders, engine_side, figures, load, runner, targets, workload
from bench.affinity_vllm.load import Outcome
from bench.harness.cli import name_values
from bench.harness.results import run_record
from bench.report import affinity_vllm as report
from tests.real_engine.build_tiny_model import write_tokenizer_files
from tests.real_engine.engines import VllmEngine


# --- the workload ----------------------------------------------------------------------------------
def _word_tokenizer() -> workload.Tokenizer:
    """A tokenizer of whole words, one id a word."""
    vocab = [f"w{i}" for i in range(50)] + ["System", "prompt", "Request"] + [f"{i}:" for i in range(700)]
    index = {word: i for i, word in enumerate(vocab)}
    return workload.Tokenizer(lambda text: [index[w] for w in text.split()],
                              lambda ids: " ".join(vocab[i] for i in ids), tuple(range(50)))


def test_a_text_is_cut_to_exactly_the_tokens_asked_or_refused():
    plain = _word_tokenizer()
    assert len(plain.encode(workload.exact_text(plain, "System prompt 3:", random.Random(1), 20))) == 20
    # A cut may re-tokenize differently (byte-level BPE at a cut inside a word): cuts around the
    # target are tried; when none holds, no prompt of the wrong size is made.
    never = workload.Tokenizer(plain.encode, lambda ids: "w1", plain.word_ids)
    with pytest.raises(workload.WorkloadError, match="exactly 20 tokens"):
        workload.exact_text(never, "System prompt 3:", random.Random(1), 20)


def test_system_prompts_are_whole_blocks_and_differ_from_their_first_token():
    tokenizer = _word_tokenizer()
    prompts = workload.system_prompts(tokenizer, seed=1)
    assert len(prompts) == workload.SYSTEM_PROMPTS == 16
    assert {len(tokenizer.encode(p)) for p in prompts} == {workload.SYSTEM_TOKENS} == {7 * workload.BLOCK_TOKENS}
    assert len({tuple(tokenizer.encode(p)[:3]) for p in prompts}) == len(prompts)
    assert prompts == workload.system_prompts(tokenizer, seed=1) != workload.system_prompts(tokenizer, seed=2)


def test_the_plan_is_seeded_zipf_popular_poisson_and_every_user_turn_distinct():
    tokenizer = _word_tokenizer()
    planned = workload.plan(tokenizer, 3, 600)
    assert planned == workload.plan(tokenizer, 3, 600) != workload.plan(tokenizer, 4, 600)
    assert workload.plan(tokenizer, 3, 100) == planned[:100]  # a shorter run is the same run's start
    assert len({p.user for p in planned}) == 600
    assert {len(tokenizer.encode(p.user)) for p in planned} == {workload.USER_TOKENS}
    gaps = [b.unit_at - a.unit_at for a, b in zip([workload.Planned(0.0, 0, "")] + planned, planned)]
    assert all(g > 0 for g in gaps) and 0.85 < sum(gaps) / len(gaps) < 1.15  # rate 1: seconds × rate
    popular = Counter(p.system for p in planned).most_common()
    assert len(popular) == 16 and popular[0][1] > 3 * popular[-1][1]  # Zipf(0.6): a head, a tail
    # The popularity rank is shuffled: the hottest prompt is not simply prompt 0.
    assert {Counter(p.system for p in workload.plan(tokenizer, s, 300)).most_common(1)[0][0] for s in range(5)} != {0}


def test_the_body_is_a_streaming_chat_that_decodes_exactly_max_tokens():
    request = workload.Planned(0.5, 1, "Request 0: w1")
    body = workload.body(request, ["sys zero", "sys one"], 32)
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 32 and body["model"] == "tiny"
    assert body["messages"] == [{"role": "system", "content": "sys one"}, {"role": "user", "content": "Request 0: w1"}]


def test_with_the_engines_tokenizer_requests_of_one_system_prompt_share_its_seven_blocks(tmp_path):
    from cacheroute_proxy import engine_prefix

    model = write_tokenizer_files(tmp_path / "tiny-llama")  # the tiny model's own tokenizer and template
    tokenizer = workload.load_tokenizer(model)
    prompts = workload.system_prompts(tokenizer, seed=1)
    assert {len(tokenizer.encode(p)) for p in prompts} == {896}
    planned = workload.plan(tokenizer, 1, 50)
    assert {len(tokenizer.encode(p.user)) for p in planned} == {64}
    first, second = [p for p in planned if p.system == planned[0].system][:2]
    prefix = engine_prefix.load(str(model), workload.BLOCK_TOKENS, 32)

    def keys(request: workload.Planned) -> list[int]:
        return prefix.chat_keys([SimpleNamespace(**m) for m in workload.body(request, prompts, 8)["messages"]])

    # The chat template renders the system prompt first: 7 full blocks in common, the 8th differs.
    assert keys(first)[:7] == keys(second)[:7] and len(keys(first)) == 7


# --- the engines: flags, counters, calls ------------------------------------------------------------
METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 6400.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 3840.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 99.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.16
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 8.0
"""


def test_an_engine_publishes_its_kv_events_on_tcp_for_subscribers_in_other_processes(tmp_path: Path):
    engine = VllmEngine(tmp_path / "vllm.log", kv_events=True, kv_events_over_tcp=True, max_model_len=2048)
    assert engine.kv_events_bind.startswith("tcp://*:")
    assert engine.kv_events_endpoint == "tcp://127.0.0.1:" + engine.kv_events_bind.rsplit(":", 1)[1]
    argv = engine.argv()
    assert engine.kv_events_bind in argv[argv.index("--kv-events-config") + 1]
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    unix = VllmEngine(tmp_path / "vllm.log", kv_events=True)
    assert unix.kv_events_bind == unix.kv_events_endpoint and unix.kv_events_bind.startswith("ipc://")
    assert VllmEngine(tmp_path / "vllm.log").kv_events_endpoint is None


def test_counters_are_the_totals_not_the_created_or_external_series():
    assert engine_side.counters_of(METRICS) == engine_side.Counters(3840.0, 6400.0, 8.0, 0.16, 8.0)
    with pytest.raises(RuntimeError, match="prefix_cache_hits_total"):
        engine_side.counters_of(METRICS.replace("vllm:prefix_cache_hits_total", "vllm:other"))


def test_the_engine_account_is_the_counters_difference_over_both_engines():
    before = [engine_side.Counters(100, 1000, 5, 1.0, 5), engine_side.Counters(0, 0, 0, 0.0, 0)]
    after = [engine_side.Counters(700, 2000, 15, 1.2, 15), engine_side.Counters(200, 1000, 30, 0.9, 30)]
    account = engine_side.engine_account(before, after)
    assert account["prefix_cache_hit_rate"] == 0.4 and account["share"] == [10, 30]
    assert account["engine_ttft_mean_ms"] == 27.5  # 1.1 s over 40 first tokens
    assert [e["hit_rate"] for e in account["per_engine"]] == [0.6, 0.2]


def test_the_calls_a_contender_made_come_from_the_access_log_without_the_harness_reads():
    log = ('(APIServer pid=1) INFO:     127.0.0.1:5 - "POST /v1/chat/completions/render HTTP/1.1" 200 OK\n'
           '(APIServer pid=1) INFO:     127.0.0.1:5 - "GET /metrics HTTP/1.1" 200 OK\n'
           '(APIServer pid=1) INFO:     127.0.0.1:6 - "GET /model_info?x=1 HTTP/1.1" 404 Not Found\n'
           '(APIServer pid=1) INFO:     127.0.0.1:5 - "POST /v1/chat/completions/render HTTP/1.1" 200 OK\n')
    calls = engine_side.calls_in(log)
    assert calls == Counter({"POST /v1/chat/completions/render 200": 2, "GET /metrics 200": 1,
                             "GET /model_info 404": 1})
    assert engine_side.contender_calls(calls, engines=1) == {"GET /model_info 404": 1,
                                                            "POST /v1/chat/completions/render 200": 2}


def test_every_contender_meets_engines_with_the_same_flags():
    args = engine_side.ENGINE_ARGS
    assert args[args.index("--num-gpu-blocks-override") + 1] == "64"
    assert "--enable-scale-out" in args and "--enable-prefix-caching" in args
    # The model runs in the engine-core process, on one OpenMP thread: no worker process spinning.
    assert args[args.index("--distributed-executor-backend") + 1] == "uni"
    assert engine_side.ENGINE_ENV == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                      "OMP_NUM_THREADS": "1"}


# --- the contenders ----------------------------------------------------------------------------------
def _engines() -> list[SimpleNamespace]:
    return [SimpleNamespace(url=f"http://127.0.0.1:800{i}", kv_events_endpoint=f"tcp://127.0.0.1:900{i}")
            for i in range(2)]


def test_the_peers_are_launched_from_their_venvs_on_loopback_with_their_policy():
    engines = _engines()
    argv = contenders.peer_argv(contenders.spec("vllm-router kv_aware"), engines, 30000, 30001)
    assert argv[:2] == ["-m", "vllm_router.launch_router"]
    assert argv[argv.index("--policy") + 1] == "kv_aware"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"] == [
        "http://127.0.0.1:8000=tcp://127.0.0.1:9000", "http://127.0.0.1:8001=tcp://127.0.0.1:9001"]
    assert argv[argv.index("--kv-event-block-size") + 1] == "128" and argv[argv.index("--kv-event-model") + 1] == "tiny"
    sglang = contenders.peer_argv(contenders.spec("sglang-router cache_aware"), engines, 30000, 30001)
    assert sglang[:2] == ["-m", "sglang_router.launch_router"] and "--kv-event-source" not in sglang
    # Both would listen on every interface (:29000 for Prometheus) by default.
    assert sglang[sglang.index("--host") + 1] == sglang[sglang.index("--prometheus-host") + 1] == "127.0.0.1"
    assert sglang[sglang.index("--worker-urls") + 1:sglang.index("--worker-urls") + 3] == [e.url for e in engines]
    assert sglang[sglang.index("--log-level") + 1] == "warn"
    cache_aware = contenders.peer_argv(contenders.spec("vllm-router cache_aware"), engines, 30000, 30001)
    assert cache_aware[cache_aware.index("--policy") + 1] == "cache_aware" and "--kv-event-source" not in cache_aware


def test_the_peers_are_pinned_in_one_place_each():
    assert contenders.pinned_version("vllm-router") == "0.1.17"
    assert contenders.pinned_version("sglang-router") == "0.3.2"
    assert contenders.PEERS == ("vllm-router cache_aware", "vllm-router kv_aware", "sglang-router cache_aware")
    with pytest.raises(ValueError, match="unknown contender"):
        contenders.spec("nginx")


def test_proxy_settings_from_the_command_line_reach_the_proxy_contenders(tmp_path: Path):
    engines = _engines()
    kv = contenders.build(contenders.spec("kv_aware"), engines, tmp_path, {"PROXY_A": "1"}, {"PROXY_B": "2"})
    ll = contenders.build(contenders.spec("least_load"), engines, tmp_path, {"PROXY_A": "1"}, {"PROXY_B": "2"})
    assert kv.env["PROXY_A"] == ll.env["PROXY_A"] == "1"
    assert kv.env["PROXY_B"] == "2" and "PROXY_B" not in ll.env
    assert kv.env["PROXY_AFFINITY_BLOCK_TOKENS"] == "128" and "PROXY_AFFINITY_TOKENIZER" not in ll.env
    assert kv.env["PROXY_INSTANCE_STRATEGY"] == "kv_aware" and kv.env["PROXY_WORKERS"] == "4"
    described = kv.describe()
    assert described["env"]["PROXY_B"] == "2" and "PROXY_SHM_NAME" not in described["env"]


def test_a_variant_is_kv_aware_with_its_own_settings_beside_the_default(tmp_path: Path):
    sticky = contenders.variant("sticky:PROXY_KV_AWARE_WORK_WEIGHT=2,PROXY_PACE_STEP=0")
    assert sticky.name == "kv_aware sticky" and contenders.spec("kv_aware sticky", [sticky]) is sticky
    built = contenders.build(sticky, _engines(), tmp_path, {}, {})
    assert built.env["PROXY_KV_AWARE_WORK_WEIGHT"] == "2" and built.env["PROXY_PACE_STEP"] == "0"
    assert built.env["PROXY_INSTANCE_STRATEGY"] == "kv_aware"
    assert built.env["PROXY_AFFINITY_BLOCK_TOKENS"] == "128"
    default = contenders.build(contenders.spec("kv_aware"), _engines(), tmp_path, {}, {})
    assert "PROXY_KV_AWARE_WORK_WEIGHT" not in default.env
    with pytest.raises(ValueError, match="unknown contender"):
        contenders.spec("kv_aware sticky")  # not without its definition
    for malformed in ("sticky", ":PROXY_A=1", "sticky:PROXY_A"):
        with pytest.raises(SystemExit):
            contenders.variant(malformed)


def test_a_variant_may_run_the_proxy_with_its_own_number_of_workers(tmp_path: Path):
    two = contenders.build(contenders.variant("w2:PROXY_WORKERS=2"), _engines(), tmp_path, {}, {})
    assert (two.workers, two.ports.workers, two.env["PROXY_WORKERS"]) == (2, 2, "2")
    default = contenders.build(contenders.spec("kv_aware"), _engines(), tmp_path, {}, {})
    assert (default.workers, default.env["PROXY_WORKERS"]) == (contenders.WORKERS, str(contenders.WORKERS))


def test_the_ceilings_placement_puts_the_most_requested_first_where_fewest_went_within_the_room():
    counts = {0: 50, 1: 40, 2: 30, 3: 20, 4: 10, 5: 5}
    homes = contenders.placement(counts, 2, room=3)
    assert homes == {0: 0, 1: 1, 2: 1, 3: 0, 4: 0, 5: 1}  # 80 / 75 requests, 3 prompts each
    # Room binds before the requests even out: the third engine-0 prompt fills it.
    assert contenders.placement({0: 100, 1: 10, 2: 9, 3: 8}, 2, room=2) == {0: 0, 1: 1, 2: 1, 3: 0}
    # No room anywhere: the engine with the fewest requests.
    assert contenders.placement({0: 9, 1: 8, 2: 7}, 2, room=1) == {0: 0, 1: 1, 2: 1}
    assert contenders.PROMPTS_AN_ENGINE_HOLDS == 8  # (64 blocks - 4 running) // 7 blocks a prompt


def test_the_ceiling_sends_each_request_straight_to_its_prompts_engine_and_is_no_peer():
    engines = _engines()
    ceiling = contenders.build(contenders.spec("planned placement"), engines, Path("/nonexistent"), {}, {})
    planned = [workload.Planned(float(n), system, f"u{n}") for n, system in enumerate([3, 3, 3, 5, 5, 7])]
    send_to = ceiling.sender(planned)
    assert [send_to(p) for p in planned] == [engines[0].url] * 3 + [engines[1].url] * 2 + [engines[1].url]
    described = ceiling.describe()
    assert ceiling.pids() == [] and described["placement"] == {"3": 0, "5": 1, "7": 1}
    assert described["kind"] == "ceiling" and described["prompts_an_engine_holds"] == 8
    assert "planned placement" not in contenders.PEERS
    results = _results(_run(0.6, "kv_aware", 0.88, 24), _run(0.6, "sglang-router cache_aware", 0.88, 25),
                       _run(0.6, "planned placement", 0.9, 20))
    p50 = next(v for v in targets.judge(results) if v.target == "TTFT p50 vs the best peer")
    assert (p50.reference_name, p50.verdict) == ("sglang-router cache_aware", "PASS")


# --- the runs, the figures, the targets --------------------------------------------------------------
def test_contenders_run_abc_then_cba():
    assert runner.schedule(["A", "B", "C"], 2) == ["A", "B", "C", "C", "B", "A"]
    assert runner.schedule(["A", "B"], 3) == ["A", "B", "B", "A", "A", "B"]
    # Each load from the next contender on: the edges of a load's runs go round.
    assert runner.schedule(["A", "B", "C"], 2, start=1) == ["B", "C", "A", "A", "C", "B"]
    assert runner.schedule(["A", "B", "C"], 2, start=3) == runner.schedule(["A", "B", "C"], 2)


def test_a_peers_own_counters_are_read_as_deltas_of_its_total_series():
    before = runner.counters_total('# HELP x\nvllm_router_requests_total{route="/v1"} 3\nup 1\n'
                                   'vllm_router_kv_placement_lookups_total{result="hit"} 2\n')
    after = runner.counters_total('vllm_router_requests_total{route="/v1"} 10\n'
                                  'vllm_router_kv_placement_lookups_total{result="hit"} 2\n'
                                  'vllm_router_kv_placement_lookups_total{result="miss"} 4\n')
    assert runner._deltas(before, after) == {'vllm_router_kv_placement_lookups_total{result="miss"}': 4.0,
                                             'vllm_router_requests_total{route="/v1"}': 7.0}


def _ended(*ends: float) -> list[Outcome]:
    return [Outcome(ttft_ms=10.0, ended_at=t) for t in ends]


def test_saturation_is_measured_between_the_start_and_the_drain_of_the_closed_loop():
    # 2 in flight: the first 2 ends (cold start) and the last 2 (drain) are outside the window.
    outcomes = _ended(0.1, 0.2, 1.0, 1.5, 2.0, 2.5, 3.0, 9.0, 9.5)
    assert figures.saturation_rps(outcomes, 2) == pytest.approx(5 / (3.0 - 0.2))
    outcomes.append(Outcome(error="status 500", ended_at=0.5))  # a failed request is not throughput
    assert figures.saturation_rps(outcomes, 2) == pytest.approx(5 / (3.0 - 0.2))
    with pytest.raises(ValueError, match="need more than 4"):
        figures.saturation_rps(_ended(1, 2, 3, 4), 2)


def test_a_runs_outcomes_are_written_a_line_a_request_in_plan_order(tmp_path: Path):
    import json
    planned = [workload.Planned(2.0, 3, "a"), workload.Planned(5.0, 1, "b")]
    outcomes = [Outcome(ttft_ms=12.5, instance="vllm-0", system=3, predicted_ttft_ms=11.0),
                Outcome(error="status 503: busy", system=1)]
    load.write_outcomes(tmp_path / "run.jsonl", planned, outcomes, rate=4.0)
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [(r["at_s"], r["system"], r["instance"], r["ttft_ms"]) for r in lines] == \
        [(0.5, 3, "vllm-0", 12.5), (1.25, 1, None, None)]
    assert lines[0]["predicted_ttft_ms"] == 11.0 and lines[1]["error"] == "status 503: busy"
    with pytest.raises(ValueError):  # an outcome for every planned request
        load.write_outcomes(tmp_path / "short.jsonl", planned, outcomes[:1], rate=4.0)


def test_a_run_summary_counts_errors_and_unfinished_streams_apart_from_the_ttfts():
    outcomes = [Outcome(ttft_ms=float(t), ended_at=1.0, guard=t > 40, saved_ms=8.0 if t < 30 else 0.0,
                        predicted_ttft_ms=float(t + 1)) for t in range(10, 60, 10)]
    outcomes += [Outcome(error="status 503: busy"), Outcome(ttft_ms=5.0, error="stream ended without [DONE]")]
    summary = figures.summarize(outcomes, wall_s=2.0)
    assert (summary["requests"], summary["ok"], summary["error_count"]) == (7, 5, 2)
    assert summary["errors"] == {"status 503: busy": 1, "stream ended without [DONE]": 1}
    assert summary["ttft_p50_ms"] == 30.0 and summary["ttft_p99_ms"] == 50.0
    assert summary["completed_per_s"] == 2.5
    assert (summary["guard_fired"], summary["guard_decisions"], summary["saved"]) == (1, 5, 2)
    assert summary["saved_ms_p50"] == 0.0 and summary["predicted_ttft_p50_ms"] == 31.0
    assert summary["prompt_concentration"] is None  # no instance named


def test_the_proxys_account_of_a_request_names_its_time_before_forwarding_and_choosing():
    from bench.harness.streamed import proxy_account
    account = proxy_account({"trace": {"proxy_recv_ms": 100, "route_select_start_ms": 101,
                                       "route_select_end_ms": 104, "forward_start_ms": 105,
                                       "actual_ttft_ms": 30}})
    assert (account.before_forward_ms, account.select_ms, account.proxy_ttft_ms) == (5, 3, 30)
    assert proxy_account(None).select_ms is None  # a peer says nothing of it
    outcomes = [Outcome(ttft_ms=40.0, before_forward_ms=5, select_ms=s, outside_ms=10.0) for s in (3, 4)]
    summary = figures.summarize(outcomes + [Outcome(ttft_ms=40.0)], wall_s=1.0)
    assert (summary["before_forward_mean_ms"], summary["select_mean_ms"]) == (5.0, 3.5)


def test_prompt_concentration_is_the_share_sent_to_each_prompts_usual_instance():
    sent = [(0, "a"), (0, "a"), (0, "a"), (0, "b"), (1, "b"), (1, "b"), (2, "a")]
    outcomes = [Outcome(ttft_ms=1.0, instance=i, system=p) for p, i in sent]
    assert figures.prompt_concentration(outcomes) == round(6 / 7, 4)
    assert figures.cpu_figures(0.5, {"workers": 0.4}, 5) == {
        "cpu_s": 0.5, "cpu_ms_per_request": 100.0, "cpu_ms_per_request_by_role": {"workers": 80.0}}


def _run(load: float, name: str, hit: float, p50: float, p99: float = 500.0, order: int = 0) -> dict:
    return {"load": load, "order": order, "contender": name, "rate_per_s": 10 * load, "requests": 600,
            "ok": 599, "error_count": 1, "prefix_cache_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "completed_per_s": 8.0, "cpu_ms_per_request": 5.0, "share": [300, 299],
            "guard_fired": 2 if name == "kv_aware" else 0, "guard_decisions": 599 if name == "kv_aware" else 0,
            "saved": 100, "saved_ms_p50": 7.5, "predicted_ttft_p50_ms": 40.0, "engine_calls": {"POST /v1/chat/completions 200": 600},
            "contender_setup": {"kind": "proxy", "workers": 4, "env": {"PROXY_INSTANCE_STRATEGY": name}}}


def test_runs_aggregate_per_load_and_contender_into_medians_and_their_spread():
    runs = [_run(0.4, "kv_aware", 0.7, 50), _run(0.4, "least_load", 0.4, 60), _run(0.4, "least_load", 0.5, 80),
            _run(0.4, "kv_aware", 0.8, 40), _run(0.4, "kv_aware", 0.9, 45), _run(0.6, "kv_aware", 0.6, 90)]
    rows = {(r["load"], r["contender"]): r for r in figures.aggregate(runs)}
    kv = rows[(0.4, "kv_aware")]
    assert kv["runs"] == 3 and kv["prefix_cache_hit_rate"] == {"median": 0.8, "min": 0.7, "max": 0.9,
                                                                 "runs": [0.7, 0.8, 0.9]}
    assert kv["ttft_p50_ms"]["median"] == 45 and kv["share"] == [900, 897] and kv["errors"] == 3
    assert rows[(0.4, "least_load")]["ttft_p50_ms"]["median"] == 70
    assert rows[(0.6, "kv_aware")]["runs"] == 1


def _results(*runs: dict) -> list[dict]:
    return figures.aggregate(list(runs))


def test_the_targets_are_judged_from_the_medians_at_each_load():
    results = _results(_run(0.4, "kv_aware", 0.75, 45, 500), _run(0.4, "least_load", 0.5, 50, 500),
                       _run(0.6, "kv_aware", 0.69, 51, 400), _run(0.6, "least_load", 0.5, 50, 500))
    verdicts = {(v.load, v.target): v for v in targets.judge(results)}
    assert verdicts[(0.4, "hit rate")].verdict == "PASS" and verdicts[(0.4, "hit rate")].ratio == 1.5
    assert verdicts[(0.4, "TTFT p50")].verdict == "PASS"  # 0.9× exactly
    assert verdicts[(0.4, "TTFT p99")].verdict == "PASS"
    assert verdicts[(0.6, "hit rate")].verdict == "FAIL"  # 1.38× < 1.4×
    assert verdicts[(0.6, "TTFT p50")].verdict == "FAIL"  # 1.02× > 1.0×
    assert verdicts[(0.6, "TTFT p99")].verdict == "PASS"
    assert verdicts[(0.4, "hit rate vs the best peer")].verdict == "not measured"  # no peer ran


def test_against_the_peers_each_figure_is_judged_against_the_best_peer_on_it():
    results = _results(_run(0.4, "kv_aware", 0.7, 40), _run(0.4, "vllm-router cache_aware", 0.72, 90),
                       _run(0.4, "sglang-router cache_aware", 0.6, 35), _run(0.4, "vllm-router kv_aware", 0.5, 60))
    verdicts = {v.target: v for v in targets.judge(results) if v.load == 0.4}
    hit, p50 = verdicts["hit rate vs the best peer"], verdicts["TTFT p50 vs the best peer"]
    assert (hit.reference_name, hit.verdict) == ("vllm-router cache_aware", "FAIL")
    assert (p50.reference_name, p50.verdict) == ("sglang-router cache_aware", "FAIL")
    assert "TTFT p99" not in verdicts or verdicts["TTFT p99"].verdict == "not measured"
    assert [v.target for v in targets.judge(_results(_run(0.5, "kv_aware", 0.7, 40)))] == [
        "hit rate vs the best peer", "TTFT p50 vs the best peer"]  # no least_load target at 50 %


# --- the command line and the report -----------------------------------------------------------------
def test_settings_are_name_value_pairs_and_an_unknown_contender_fails_before_the_engines_start():
    assert name_values(["PROXY_A=1", "PROXY_B=x=y"]) == {"PROXY_A": "1", "PROXY_B": "x=y"}
    with pytest.raises(SystemExit):
        name_values(["PROXY_A"])
    with pytest.raises(ValueError, match="unknown contender 'nginx'"):
        cli.main(["--contenders", "kv_aware,nginx", "--out", "/nonexistent/never-written.json"])


def test_the_recorded_command_can_be_pasted_into_a_shell():
    record = run_record("bench.affinity_vllm", ["--contenders", "kv_aware,vllm-router kv_aware"], "t0", {})
    assert record["command"] == "python -m bench.affinity_vllm --contenders 'kv_aware,vllm-router kv_aware'"


def _data(requests: int = 600, repeats: int = 2) -> dict:
    runs = [{**_run(0.4, "kv_aware", 0.75, 45, order=0),
             "index": {"engine_blocks_stored": 224, "engine_blocks_removed": 106,
                       "feeds": {"vllm-0": {"gaps": 0}, "vllm-1": {"gaps": 1}}}},
            _run(0.4, "least_load", 0.5, 50, order=1)]
    runs.append({**_run(0.4, "vllm-router kv_aware", 0.7, 48, order=2),
                 "engine_calls": {"POST /v1/chat/completions 200": 600, "POST /v1/chat/completions/render 200": 1200},
                 "contender_setup": {"kind": "vllm-router", "package": "vllm-router", "version": "0.1.17",
                                     "command": "python -m vllm_router.launch_router --policy kv_aware"}})
    results = figures.aggregate(runs)
    return {"command": "python -m bench.affinity_vllm", "requests_per_run": requests, "repeats": repeats,
            "seed": 1, "max_tokens": 32, "workers": 4, "loads": [0.4],
            "engine": {"engines": 2, "vllm_version": "0.32.0", "kv_blocks": 64, "block_size": 128},
            "workload": {"system_prompts": 16, "system_prompt_tokens": 896, "user_tokens": 64, "zipf_s": 0.6},
            "calibration": {"concurrency": 16, "requests": 300, "saturation_rps": 25.2},
            "results": results, "targets": targets.as_records(targets.judge(results)), "runs": runs,
            "failed_starts": [{"load": 0.4, "contender": "sglang-router cache_aware", "order": 3,
                               "error": "sglang-router is not installed: run `make peers`"}]}


def test_the_report_has_a_table_a_load_the_targets_and_every_run():
    text = report.section(_data())
    assert "Smoke run" not in text
    assert "| kv_aware | 1 | 75.0% | 45 |" in text  # a row a contender: hit rate, TTFT p50
    assert "25.2 req/s" in text and "At 40% of least_load's saturation (4 req/s offered)" in text
    assert "| 40% | hit rate | 75.0% | 50.0% (least_load) | 1.50× | ≥ 1.5× | **PASS** |" in text
    assert "POST /v1/chat/completions/render 200 ×1,200" in text and "| 224 / 106, 1 gaps |" in text
    assert "| 2 of 599; 100 (7.50); 40 |" in text  # kv_aware's guard, savings, predicted TTFT
    assert "vllm-router 0.1.17: `python -m vllm_router.launch_router --policy kv_aware`" in text
    assert "**sglang-router cache_aware did not start**" in text and "make peers" in text


def test_a_short_run_is_marked_as_a_smoke_run():
    for requests, repeats in ((120, 2), (600, 1)):
        assert "Smoke run" in report.section(_data(requests=requests, repeats=repeats))


def test_a_runs_row_shows_the_time_choosing_within_the_time_before_forwarding():
    from bench.report.affinity_vllm import _run_row
    run = {"load": 0.4, "order": 0, "contender": "kv_aware", "ttft_p50_ms": 21.1, "ttft_p99_ms": 146.0,
           "ttft_mean_ms": 30.0, "engine_ttft_mean_ms": 21.9, "before_forward_mean_ms": 1.01,
           "outside_worker_mean_ms": 1.95}
    assert "; 1.01 / 1.95" in _run_row(run)[4]  # a run of an older tree: no choice recorded
    assert "; 1.01 (0.45) / 1.95" in _run_row({**run, "select_mean_ms": 0.45})[4]
    assert _run_row({**run, "contender": "sglang-router", "before_forward_mean_ms": None,
                     "outside_worker_mean_ms": None})[4] == "21.1 / 146; 30 / 21.9"
