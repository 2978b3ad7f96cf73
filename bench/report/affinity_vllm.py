"""kv_aware on real engines (bench/results/affinity_vllm.json,
bench/affinity_vllm/): per load one table, a row a contender (medians over its runs, with the
spread), the targets judged from those medians, and every run in the order run."""

from __future__ import annotations

from typing import Any

from bench.report import blocks
from bench.report.fmt import DASH, num, table

FULL_REQUESTS, FULL_REPEATS = 600, 2


TITLE = "kv_aware on two real vLLM engines, against vllm-router and the SGLang router"


def section(data: dict[str, Any], file_name: str = "affinity_vllm.json", title: str = TITLE) -> str:
    parts = [f"## {title}",
             _smoke(data), *blocks.header_blocks(data, file_name), _scenario(data), _contenders(data)]
    results = data.get("results") or []
    for load in dict.fromkeys(r["load"] for r in results):
        parts.append(_load_table(data, load, [r for r in results if r["load"] == load]))
    if data.get("targets"):
        parts.append("Targets, from the medians over the runs:\n\n" + _targets_table(data["targets"]))
    for failed in data.get("failed_starts") or []:
        parts.append(f"**{failed['contender']} did not start** (load {_share(failed['load'])}): "
                     f"`{num(failed['error'][-300:])}`")
    if data.get("runs"):
        parts.append("Each run, in the order run:\n\n" + table(
            ["load", "#", "contender", "hit rate (per engine)",
             "TTFT p50 / p99; mean: client / engines; this proxy's mean before forwarding (of it, choosing) / outside the worker (ms)",
             "req/s", "errors", "share",
             "CPU (ms/request)", "kv_aware: guard fired; choices that saved (median ms); predicted TTFT p50",
             "KV events followed: blocks stored / removed",
             "engine calls beyond the chats"],
            [_run_row(r) for r in data["runs"]]))
    return "\n\n".join(p for p in parts if p)


def pooled(sources: dict[str, dict[str, Any]], title: str) -> str:
    """The runs of several files of the same scenario and contenders taken together: per load
    the medians over all their runs, and the targets judged from those."""
    # Here, not at the top: the benchmark's figures import its load generator (aiohttp), which
    # the report does not otherwise need.
    from bench.affinity_vllm import figures, targets

    runs = [run for data in sources.values() for run in data.get("runs") or []]
    results = figures.aggregate(runs)
    merged = {"runs": runs}
    names = [f"`{name}`" for name in sources]
    parts = [f"### {title}", "The runs of " + ", ".join(names[:-1]) + " and " + names[-1]
             + ", each file's offered rates from its own calibration; a figure only some "
             "files have (the engines' own TTFT) is the median of theirs."]
    for load in dict.fromkeys(r["load"] for r in results):
        parts.append(_load_table(merged, load, [r for r in results if r["load"] == load]))
    parts.append("Targets, from the medians over all these runs:\n\n"
                 + _targets_table(targets.as_records(targets.judge(results))))
    return "\n\n".join(parts)


def _targets_table(verdicts: list[dict[str, Any]]) -> str:
    return table(
        ["load", "target", "kv_aware", "reference", "ratio", "bound", "verdict"],
        [[_share(t["load"]), t["target"], _figure(t["target"], t["ours"]),
          f"{_figure(t['target'], t['reference'])} ({t['reference_name']})",
          DASH if t["ratio"] is None else f"{t['ratio']:.2f}×", t["bound"],
          t["verdict"] if t["verdict"] == "not measured" else f"**{t['verdict']}**"]
         for t in verdicts])


def _smoke(data: dict[str, Any]) -> str:
    if (data.get("requests_per_run") or 0) >= FULL_REQUESTS and (data.get("repeats") or 0) >= FULL_REPEATS:
        return ""
    return (f"> **Smoke run** ({num(data.get('requests_per_run'))} requests a run, "
            f"{num(data.get('repeats'))} run(s) a contender): it shows the harness and every contender "
            f"work; its figures are too short and too few to support a conclusion.")


def _share(load: float) -> str:
    return f"{load:.0%}"


def _rate(value: float | None) -> str:
    return DASH if value is None else f"{value:.1%}"


def _figure(target: str, value: float | None) -> str:
    return _rate(value) if target.startswith("hit rate") else num(value)


def _scenario(data: dict[str, Any]) -> str:
    engine, work, cal = data.get("engine") or {}, data.get("workload") or {}, data.get("calibration") or {}
    if cal.get("given"):
        calibration = f"least_load's saturation given on the command line: {num(cal.get('saturation_rps'))} req/s."
    else:
        calibration = (f"Calibration: least_load (this proxy, {num(data.get('workers'))} workers) in a closed "
                       f"loop of {num(cal.get('concurrency'))} in flight over {num(cal.get('requests'))} "
                       f"requests completed {num(cal.get('saturation_rps'))} req/s in its steady part "
                       f"(TTFT p50 {num(cal.get('ttft_p50_ms'))} ms, hit rate {_rate(cal.get('prefix_cache_hit_rate'))}, "
                       f"errors {num(cal.get('error_count'))}); each load below is a share of that.")
    return (f"Scenario: {num(engine.get('engines'))} vLLM {num(engine.get('vllm_version'))} CPU engines "
            f"serving the tiny model, one core each, {num(engine.get('kv_blocks'))} KV blocks of "
            f"{num(engine.get('block_size'))} tokens, max_num_seqs {num(engine.get('max_num_seqs'))}, prefix "
            f"caching on, KV events on `{num(engine.get('kv_events'))}`, the same flags for every contender "
            f"(engine 0's: `{' '.join(str(a) for a in (engine.get('argv') or [])[2:])}`, with "
            f"{', '.join(f'`{k}={v}`' for k, v in (engine.get('env') or {}).items())}). Workload (seed {num(data.get('seed'))}): "
            f"{num(work.get('system_prompts'))} system prompts of {num(work.get('system_prompt_tokens'))} tokens, "
            f"each request one of them drawn Zipf({num(work.get('zipf_s'))}) plus a unique "
            f"{num(work.get('user_tokens'))}-token user turn, {num(data.get('max_tokens'))} tokens out; "
            f"{num(data.get('requests_per_run'))} streaming chats a run, {work.get('arrivals', 'Poisson')}. "
            f"Every run starts a fresh contender and resets both prefix caches; contenders run ABC…CBA, "
            f"{num(data.get('repeats'))} run(s) each per load. The hit rate is the engines' own: "
            f"Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` over both engines. "
            f"{calibration}")


def _contenders(data: dict[str, Any]) -> str:
    seen: dict[str, dict[str, Any]] = {}
    for run in data.get("runs") or []:
        seen.setdefault(run["contender"], run.get("contender_setup") or {})
    if not seen:
        return ""
    lines = ["Contenders:", ""]
    for name, setup in seen.items():
        if setup.get("kind") == "proxy":
            env = ", ".join(f"`{k}={v}`" for k, v in (setup.get("env") or {}).items())
            lines.append(f"- **{name}**: this proxy, {num(setup.get('workers'))} workers, an instance agent "
                         f"per engine; {env}")
        elif setup.get("kind") == "ceiling":
            homes = ", ".join(f"{system} → {engine}" for system, engine in (setup.get("placement") or {}).items())
            held = setup.get("prompts_an_engine_holds")
            room = "as many prompts as a cache holds" if held is None else f"{held} prompts an engine"
            lines.append(f"- **{name}** (the ceiling, not a router): no process between; the client sends each "
                         f"request to the engine its system prompt has in a placement made from the run's "
                         f"whole request list (most requested first, to the engine with fewer requests, "
                         f"{room} at most): {homes}")
        else:
            lines.append(f"- **{name}**: {setup.get('package')} {setup.get('version')}: `{setup.get('command')}`")
    return "\n".join(lines)


def _spread(row: dict[str, Any], key: str, render: Any = num) -> str:
    figure = row.get(key) or {}
    if figure.get("median") is None:
        return DASH
    if row.get("runs", 0) < 2:
        return render(figure["median"])
    return f"{render(figure['median'])} ({render(figure['min'])}–{render(figure['max'])})"


def _load_table(data: dict[str, Any], load: float, rows: list[dict[str, Any]]) -> str:
    first = next((r for r in data.get("runs") or [] if r["load"] == load), {})
    head = (f"At {_share(load)} of least_load's saturation ({num(first.get('rate_per_s'))} req/s offered); "
            f"medians over the runs (min–max):")
    return head + "\n\n" + table(
        ["contender", "runs", "hit rate", "TTFT p50 (ms)", "TTFT p99 (ms)", "TTFT mean: client / engines (ms)",
         "completed req/s", "errors", "share per engine", "CPU (ms/request)", "guard fired"],
        [[r["contender"], num(r["runs"]), _spread(r, "prefix_cache_hit_rate", _rate), _spread(r, "ttft_p50_ms"),
          _spread(r, "ttft_p99_ms"), _means(r), _spread(r, "completed_per_s"), num(r["errors"]),
          " / ".join(num(v) for v in r.get("share") or []), _spread(r, "cpu_ms_per_request"),
          f"{num(r['guard_fired'])} of {num(r['guard_decisions'])}" if r.get("guard_decisions") else DASH]
         for r in rows])


def _means(row: dict[str, Any]) -> str:
    """The client's mean TTFT beside the engines' own (medians over the runs): the difference is
    what the route in front of the engines added."""
    client, engines = ((row.get(key) or {}).get("median") for key in ("ttft_mean_ms", "engine_ttft_mean_ms"))
    return _pair(client, engines) or DASH


def _pair(first: float | None, second: float | None) -> str:
    """"first / second"; empty where the run did not record both (the engines' own TTFT, this
    proxy's account: older runs, and peers)."""
    return "" if first is None or second is None else f"{num(first)} / {num(second)}"


def _with_choice(run: dict[str, Any]) -> str | None:
    """The mean before forwarding, with the choice's part of it where the run recorded it."""
    before, choosing = run.get("before_forward_mean_ms"), run.get("select_mean_ms")
    return None if before is None else num(before) + ("" if choosing is None else f" ({num(choosing)})")


def _run_row(run: dict[str, Any]) -> list[str]:
    roles = run.get("cpu_ms_per_request_by_role") or {}
    cpu = num(run.get("cpu_ms_per_request")) + (
        " (" + ", ".join(f"{role} {num(ms)}" for role, ms in roles.items()) + ")" if roles else "")
    guard = (f"{num(run.get('guard_fired'))} of {num(run.get('guard_decisions'))}; {num(run.get('saved'))} "
             f"({num(run.get('saved_ms_p50'))}); {num(run.get('predicted_ttft_p50_ms'))}"
             if run.get("guard_decisions") else DASH)
    extra = {call: n for call, n in (run.get("engine_calls") or {}).items()
             if not call.startswith("POST /v1/chat/completions 200")}
    per_engine = " / ".join(_rate(e.get("hit_rate")) for e in run.get("per_engine") or [])
    hits = _rate(run.get("prefix_cache_hit_rate")) + (f" ({per_engine})" if per_engine else "")
    return [_share(run["load"]), num(run["order"] + 1), run["contender"], hits,
            "; ".join(filter(None, (f"{num(run.get('ttft_p50_ms'))} / {num(run.get('ttft_p99_ms'))}",
                                    _pair(run.get("ttft_mean_ms"), run.get("engine_ttft_mean_ms")),
                                    _pair(_with_choice(run), run.get("outside_worker_mean_ms"))))),
            num(run.get("completed_per_s")),
            num(run.get("error_count")), " / ".join(num(v) for v in run.get("share") or []), cpu, guard,
            _events(run), ", ".join(f"{call} ×{num(n)}" for call, n in extra.items()) or DASH]


def _events(run: dict[str, Any]) -> str:
    """This proxy's sidecar's account of the engines' KV events in the run: the blocks they
    reported stored and removed, and each feed's lost batches (gaps), if any."""
    index = run.get("index")
    if not index or not index.get("feeds"):
        return DASH
    gaps = sum(feed.get("gaps") or 0 for feed in index["feeds"].values())
    return (f"{num(index.get('engine_blocks_stored'))} / {num(index.get('engine_blocks_removed'))}"
            + (f", {num(gaps)} gaps" if gaps else ""))
