"""The two Markdown tables of the stack choice, from the medians."""

from __future__ import annotations



from .measure import median, rnd


def ratio(x, base):
    return None if (x is None or not base) else round(x / base, 3)


def md_servers(res: dict, base="uvicorn-httptools") -> str:
    """Medians over repeats; ratio = server / base.  req per CPU-s = 1000 / CPU s per 1k."""
    b = res[base]
    rows = ["| server | JSON req/s @c32 | ratio | JSON CPU s/1k req @c32 | ratio | JSON p50 @c1 (ms) "
            "| ratio | stream req/s @c32 | ratio | stream CPU s/1k req @c32 | ratio "
            "| stream p50 @c1 (ms) | ratio | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        g, c = _cells(r, b)
        errs = sum(r[s]["median"]["errors_total"] for s in r)
        rows.append(f"| {n} | {g('json_c32', 'rps'):.0f} | {ratio(g('json_c32', 'rps'), b['json_c32']['median'].get('rps'))} "
                    f"| {c('json_c32', 'cpu_s_per_1k')} | {c('json_c1', 'p50_ms')} "
                    f"| {g('stream_c32', 'rps'):.0f} | {ratio(g('stream_c32', 'rps'), b['stream_c32']['median'].get('rps'))} "
                    f"| {c('stream_c32', 'cpu_s_per_1k')} | {c('stream_c1', 'p50_ms')} | {errs} |")
    return "\n".join(rows)


def _cells(r: dict, base: dict | None):
    """g(scenario, key): a median of this target; c(scenario, key): "value | ratio to base"."""
    def g(s, k):
        return r[s]["median"].get(k)

    def c(s, k):
        return f"{g(s, k)} | {ratio(g(s, k), base[s]['median'].get(k)) if base else None}"
    return g, c


def added_latency(res, name, scen):
    """Median over repeats of the paired difference p50(proxy) - p50(direct), same repeat."""
    d = {r["repeat"]: r["p50_ms"] for r in res["direct"][scen]["runs"]}
    diffs = [r["p50_ms"] - d[r["repeat"]] for r in res[name][scen]["runs"]
             if r["repeat"] in d and r["p50_ms"] is not None and d[r["repeat"]] is not None]
    return rnd(median(diffs), 4)


def md_clients(res: dict, base="proxy-aiohttp") -> str:
    rows = ["| target | JSON p50 @c1 (ms) | added p50 (ms) | JSON req/s @c32 | ratio | "
            "proxy CPU s/1k req (JSON @c32) | ratio | stream p50 @c1 (ms) | added p50 (ms) | "
            "stream req/s @c32 | ratio | proxy CPU s/1k req (stream @c32) | ratio | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    b = res.get(base)
    for n, r in res.items():
        g, c = _cells(r, b)
        errs = sum(r[s]["median"]["errors_total"] for s in r)
        if n == "direct":
            rows.append(f"| direct (backend, no proxy) | {g('json_c1', 'p50_ms')} | 0 | {g('json_c32', 'rps'):.0f} "
                        f"| - | ({g('json_c32', 'cpu_s_per_1k')} backend) | - | {g('stream_c1', 'p50_ms')} "
                        f"| 0 | {g('stream_c32', 'rps'):.0f} | - | ({g('stream_c32', 'cpu_s_per_1k')} backend) | - | {errs} |")
            continue
        rows.append(f"| {n} | {c('json_c1', 'p50_ms').split(' |')[0]} | {added_latency(res, n, 'json_c1')} "
                    f"| {g('json_c32', 'rps'):.0f} | {ratio(g('json_c32', 'rps'), b['json_c32']['median'].get('rps'))} "
                    f"| {c('json_c32', 'cpu_s_per_1k')} | {g('stream_c1', 'p50_ms')} | {added_latency(res, n, 'stream_c1')} "
                    f"| {g('stream_c32', 'rps'):.0f} | {ratio(g('stream_c32', 'rps'), b['stream_c32']['median'].get('rps'))} "
                    f"| {c('stream_c32', 'cpu_s_per_1k')} | {errs} |")
    return "\n".join(rows)
