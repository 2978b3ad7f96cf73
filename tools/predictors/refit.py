"""Fit predictor coefficients from benchmark tables and write (or check) a model profile.

    D=proxy_workers/predictors/data/sim
    python -m tools.predictors.refit --base llama3-70b-8x5090 --name sim --aggregate median \\
        --ttft $D/ttft.json --tpot $D/tpot.json --out proxy_workers/predictors/profiles/sim.json
    python -m tools.predictors.refit --base sim --check --aggregate median \\
        --ttft $D/ttft.json --tpot $D/tpot.json

Inputs are the table files of :mod:`tools.predictors.tables` (what
``tools/predictors/calibrate.py`` writes). Each given kind is fitted by ordinary least squares
(pure Python, :mod:`tools.predictors.fitting`; numpy is not used):

- TTFT rows (tokens, bs, ms) → ``a·bs·L + b·L + c·bs + d`` (seconds). With a single batch
  size only a line in L is identifiable: stored as a = slope/bs, b = c = 0, d = intercept.
- TPOT rows (context_tokens, bs, ms/token) → one line per batch size (seconds).
- Redis rows (kv_gb, ms) → ``ms_per_gb·kv_gb + intercept_ms``.

Everything not fitted (anchors, KV constants, kinds without a table, TPOT ``missing_bs``) is
copied from ``--base``. Negative times are clipped to 0 before fitting; ``--aggregate median``
first reduces repeated measurements of the same point to their median (how the original's Redis
pull fit was made).

``--check`` writes nothing: it prints old (``--base``) vs new coefficients and the residuals of
both on the given tables; with ``--tolerance R`` it exits 1 if any prediction on the table
rows moved by more than the fraction R.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import msgspec

from proxy_workers.predictors.profile import (
    PredictorProfile,
    ProfileError,
    RedisPullModel,
    TpotLine,
    load_profile,
    resolve_profile_path,
)
from tools.predictors.fitting import (
    FitError,
    RedisFit,
    Residuals,
    TpotLineFit,
    TtftFit,
    fit_redis,
    fit_tpot,
    fit_ttft,
    residual_stats_of,
)
from tools.predictors.tables import (
    RedisTable,
    TableError,
    TpotTable,
    TtftTable,
    load_table,
    profile_to_json,
)

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/predictors/refit.py

Row = TypeVar("Row", bound=tuple)  # type: ignore[type-arg]


class Tables(NamedTuple):
    ttft: list[tuple[int, int, float]]
    tpot: list[tuple[float, int, float]]
    redis: list[tuple[float, float]]
    ttft_sources: list[str]
    tpot_sources: list[str]
    redis_sources: list[str]


class Refit(NamedTuple):
    profile: PredictorProfile
    ttft: TtftFit | None
    tpot: list[TpotLineFit] | None
    redis: RedisFit | None


def read_tables(ttft: Sequence[str | Path] = (), tpot: Sequence[str | Path] = (),
                redis: Sequence[str | Path] = (), aggregate: str = "none") -> Tables:
    ttft_rows: list[tuple[int, int, float]] = []
    tpot_rows: list[tuple[float, int, float]] = []
    redis_rows: list[tuple[float, float]] = []
    sources: tuple[list[str], list[str], list[str]] = ([], [], [])
    for path in ttft:
        t = load_table(path, TtftTable)
        ttft_rows += [(tokens, bs, max(0.0, ms)) for tokens, bs, ms in t.rows]
        sources[0].append(_describe(path, t.source))
    for path in tpot:
        p = load_table(path, TpotTable)
        tpot_rows += [(tokens, bs, max(0.0, ms)) for tokens, bs, ms in p.rows]
        sources[1].append(_describe(path, p.source))
    for path in redis:
        r = load_table(path, RedisTable)
        redis_rows += [(gb, max(0.0, ms)) for gb, ms in r.rows]
        sources[2].append(_describe(path, r.source))
    return Tables(_aggregate(ttft_rows, aggregate), _aggregate(tpot_rows, aggregate),
                  _aggregate(redis_rows, aggregate), *sources)


def _aggregate(rows: list[Row], how: str) -> list[Row]:
    """Repeated x (all columns but the last) → one row with the median/mean target."""
    if how == "none" or not rows:
        return rows
    reduce: Callable[[list[float]], float] = (statistics.median if how == "median"
                                              else statistics.fmean)
    groups: dict[tuple[object, ...], list[float]] = {}
    for row in rows:
        groups.setdefault(tuple(row[:-1]), []).append(row[-1])
    return [(*x, reduce(ys)) for x, ys in sorted(groups.items())]  # type: ignore[misc]


def _describe(path: str | Path, source: str) -> str:
    shown = _display_path(Path(path))
    return f"{shown} ({source})" if source else shown


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def refit(base: PredictorProfile, tables: Tables, *, name: str | None = None,
          description: str | None = None, provenance: str | None = None,
          no_anchors: bool = False) -> Refit:
    """A new profile: ``base`` with every kind that has rows replaced by its least-squares fit.

    no_anchors: drop the base's short-prompt anchors, so the fitted TTFT model applies from the
    first token. The anchors are another engine's measured short-prompt times; kept, they would
    override the fit up to their last token count."""
    ttft_fit = fit_ttft(tables.ttft) if tables.ttft else None
    tpot_fit = fit_tpot(tables.tpot) if tables.tpot else None
    redis_fit = fit_redis(tables.redis) if tables.redis else None

    ttft = base.ttft
    if no_anchors:
        ttft = msgspec.structs.replace(ttft, anchors_ms=(), anchor_only_max_tokens=0)
    if ttft_fit is not None:
        ttft = msgspec.structs.replace(
            ttft, a_s=ttft_fit.a_s, b_s=ttft_fit.b_s, c_s=ttft_fit.c_s, d_s=ttft_fit.d_s,
            source=(f"OLS ({ttft_fit.mode}) of {len(tables.ttft)} rows from "
                    f"{'; '.join(tables.ttft_sources)}; residual RMSE "
                    f"{ttft_fit.residuals_ms.rmse:.2f} ms, "
                    f"max {ttft_fit.residuals_ms.max_abs:.2f} ms. "
                    + ("No anchors: the fitted model applies from the first token."
                       if no_anchors else
                       f"Anchors and anchor_only_max_tokens from base profile {base.name!r}.")))
    tpot = base.tpot
    if tpot_fit is not None:
        tpot = msgspec.structs.replace(
            tpot, per_bs=tuple(TpotLine(bs=f.bs, slope_s=f.slope_s, intercept_s=f.intercept_s)
                               for f in tpot_fit),
            source=(f"Per-bs OLS of {len(tables.tpot)} rows from "
                    f"{'; '.join(tables.tpot_sources)}; missing bs: {tpot.missing_bs}."))
    redis = base.redis_pull
    if redis_fit is not None:
        redis = RedisPullModel(
            ms_per_gb=redis_fit.ms_per_gb, intercept_ms=redis_fit.intercept_ms,
            source=(f"OLS of {len(tables.redis)} rows from {'; '.join(tables.redis_sources)}; "
                    f"residual RMSE {redis_fit.residuals_ms.rmse:.2f} ms."))
    fits = (("ttft", ttft_fit), ("tpot", tpot_fit), ("redis_pull", redis_fit))
    fitted = [kind for kind, fit in fits if fit is not None]
    kept = [kind for kind in ("ttft", "tpot", "redis_pull") if kind not in fitted] + ["kv"]
    default_provenance = (f"Fitted by tools/predictors/refit.py "
                          f"({', '.join(fitted) or 'nothing'}); "
                          f"{', '.join(kept)} copied from base profile {base.name!r}.")
    profile = msgspec.structs.replace(
        base, name=name or base.name,
        description=base.description if description is None else description,
        provenance=(default_provenance + (" " + provenance if provenance else "")),
        ttft=ttft, tpot=tpot, redis_pull=redis)
    # Re-validate the assembled profile exactly as load_profile would.
    profile = msgspec.json.decode(msgspec.json.encode(profile), type=PredictorProfile)
    return Refit(profile, ttft_fit, tpot_fit, redis_fit)


# --- check report -----------------------------------------------------------------------------


def _ttft_ms(profile: PredictorProfile, tokens: float, bs: float) -> float:
    t = profile.ttft
    return max(0.0, 1000.0 * (t.a_s * bs * tokens + t.b_s * tokens + t.c_s * bs + t.d_s))


def _tpot_line(profile: PredictorProfile, bs: int) -> tuple[float, float] | None:
    for line in profile.tpot.per_bs:
        if line.bs == bs:
            return line.slope_s, line.intercept_s
    return None


def _fmt_res(r: Residuals) -> str:
    return f"rmse {r.rmse:8.3f} ms  max |err| {r.max_abs:8.3f} ms  R² {r.r2:.6f}  (n={r.n})"


def _change(old: float, new: float) -> str:
    if old == new:
        return "="
    if old == 0:
        return "new"
    return f"{(new - old) / abs(old) * 100:+.2f}%"


def check_report(old: PredictorProfile, result: Refit, tables: Tables) -> tuple[list[str], float]:
    """Lines to print, and the largest relative change of a prediction on the table rows."""
    new = result.profile
    lines: list[str] = []
    worst_shift = 0.0

    def shift(p_old: float, p_new: float) -> float:
        return abs(p_new - p_old) / max(abs(p_old), 1.0)

    if result.ttft is not None:
        fit = result.ttft
        lines.append(f"TTFT: {len(tables.ttft)} rows, fit {fit.mode}; "
                     "seconds = a·bs·L + b·L + c·bs + d")
        lines.append(f"  {'':6} {'old':>14} {'new':>14}  change")
        for coef in ("a_s", "b_s", "c_s", "d_s"):
            o, n = getattr(old.ttft, coef), getattr(new.ttft, coef)
            lines.append(f"  {coef:6} {o:14.6e} {n:14.6e}  {_change(o, n)}")
        for label, prof in (("old", old), ("new", new)):
            model = prof.ttft
            lines.append(f"  bs=1 line ({label}): {(model.a_s + model.b_s) * 1e3:.5f} ms·L "
                         f"{(model.c_s + model.d_s) * 1e3:+.3f} ms")
        targets = [ms for _, _, ms in tables.ttft]
        old_pred = [_ttft_ms(old, t, bs) for t, bs, _ in tables.ttft]
        new_pred = [_ttft_ms(new, t, bs) for t, bs, _ in tables.ttft]
        lines.append("  residuals old: " + _fmt_res(residual_stats_of(old_pred, targets)))
        lines.append("  residuals new: " + _fmt_res(residual_stats_of(new_pred, targets)))
        worst = sorted(zip(tables.ttft, new_pred), key=lambda x: -abs(x[1] - x[0][2]))[:3]
        for (t, bs, ms), pred in worst:
            lines.append(f"    worst: L={t} bs={bs} measured {ms:.2f} ms, new model {pred:.2f} ms "
                         f"({pred - ms:+.2f})")
        worst_shift = max([worst_shift] + [shift(o, n) for o, n in zip(old_pred, new_pred)])
    if result.tpot is not None:
        lines.append(f"TPOT: {len(tables.tpot)} rows; ms/token = slope·L + intercept")
        lines.append(f"  {'bs':>3} {'old slope ms':>14} {'new slope ms':>14} {'old icpt ms':>12} "
                     f"{'new icpt ms':>12}  residuals new")
        for f in result.tpot:
            o = _tpot_line(old, f.bs)
            os_, oi = (o[0] * 1e3, o[1] * 1e3) if o else (float("nan"), float("nan"))
            lines.append(f"  {f.bs:>3} {os_:14.4e} {f.slope_s * 1e3:14.4e} {oi:12.4f} "
                         f"{f.intercept_s * 1e3:12.4f}  {_fmt_res(f.residuals_ms)}")
            if o:
                for tokens, bs, _ in tables.tpot:
                    if bs == f.bs:
                        p_old = (o[0] * tokens + o[1]) * 1e3
                        p_new = (f.slope_s * tokens + f.intercept_s) * 1e3
                        worst_shift = max(worst_shift, shift(p_old, p_new))
    if result.redis is not None:
        r = result.redis
        o_r = old.redis_pull
        lines.append(f"Redis pull: {len(tables.redis)} rows; ms = ms_per_gb·kv_gb + intercept_ms")
        lines.append(f"  ms_per_gb    {o_r.ms_per_gb:14.6f} {r.ms_per_gb:14.6f}  "
                     f"{_change(o_r.ms_per_gb, r.ms_per_gb)}")
        lines.append(f"  intercept_ms {o_r.intercept_ms:14.6f} {r.intercept_ms:14.6f}  "
                     f"{_change(o_r.intercept_ms, r.intercept_ms)}")
        targets = [ms for _, ms in tables.redis]
        old_pred = [max(0.0, o_r.ms_per_gb * gb + o_r.intercept_ms) for gb, _ in tables.redis]
        new_pred = [max(0.0, r.ms_per_gb * gb + r.intercept_ms) for gb, _ in tables.redis]
        lines.append("  residuals old: " + _fmt_res(residual_stats_of(old_pred, targets)))
        lines.append("  residuals new: " + _fmt_res(residual_stats_of(new_pred, targets)))
        worst_shift = max([worst_shift] + [shift(o, n) for o, n in zip(old_pred, new_pred)])
    lines.append(f"largest change of a prediction on the table rows: {worst_shift * 100:.2f}%")
    return lines, worst_shift


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.predictors.refit",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--base", default="llama3-70b-8x5090",
                   help="profile (name or path) giving everything not fitted, and the 'old' "
                        "coefficients for --check (default: %(default)s)")
    p.add_argument("--ttft", action="append", default=[], metavar="FILE",
                   help="TTFT table (repeatable)")
    p.add_argument("--tpot", action="append", default=[], metavar="FILE",
                   help="TPOT table (repeatable)")
    p.add_argument("--redis", action="append", default=[], metavar="FILE",
                   help="Redis pull table (repeatable)")
    p.add_argument("--aggregate", choices=("none", "median", "mean"), default="none",
                   help="reduce repeated measurements of one point before fitting")
    p.add_argument("--name", help="profile name to write (default: the base's)")
    p.add_argument("--description", help="profile description (default: the base's)")
    p.add_argument("--provenance", help="text appended to the generated provenance")
    p.add_argument("--no-anchors", action="store_true",
                   help="drop the base's short-prompt TTFT anchors: the fitted model applies "
                        "from the first token (for an engine unlike the base's)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="write the new profile here")
    mode.add_argument("--check", action="store_true",
                      help="print old vs new coefficients and residuals; write nothing")
    p.add_argument("--tolerance", type=float, default=None,
                   help="with --check: exit 1 if a prediction on the table rows moves by more "
                        "than this fraction (e.g. 0.02)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.ttft or args.tpot or args.redis):
        print("refit_predictors: give at least one of --ttft, --tpot, --redis", file=sys.stderr)
        return 2
    try:
        base = load_profile(args.base)
        tables = read_tables(args.ttft, args.tpot, args.redis, args.aggregate)
        command = "python -m tools.predictors.refit " + shlex.join(
            _relative_args(list(sys.argv[1:] if argv is None else argv)))
        provenance = f"Command: {command}." + (f" {args.provenance}" if args.provenance else "")
        result = refit(base, tables, name=args.name, description=args.description,
                       provenance=provenance, no_anchors=args.no_anchors)
    except (ProfileError, TableError, FitError) as exc:
        print(f"refit_predictors: {exc}", file=sys.stderr)
        return 2

    if args.check:
        base_path = _display_path(resolve_profile_path(args.base))
        print(f"old: {base.name} ({base_path})   new: fitted from the tables "
              f"(aggregate={args.aggregate})")
        lines, worst = check_report(base, result, tables)
        print("\n".join(lines))
        if args.tolerance is not None and worst > args.tolerance:
            print(f"FAIL: predictions moved by {worst * 100:.2f}% > tolerance "
                  f"{args.tolerance * 100:.2f}%", file=sys.stderr)
            return 1
        return 0

    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_to_json(result.profile), encoding="utf-8")
    lines, _ = check_report(base, result, tables)
    print("\n".join(lines))
    print(f"wrote {_display_path(out)}")
    return 0


def _relative_args(argv: list[str]) -> list[str]:
    # Paths inside the repository are recorded relative to it, so provenance does not depend
    # on where the checkout lives. The free-text options are left out: they are in the file.
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            out.append("...")
            continue
        if arg in ("--description", "--provenance"):
            skip_next = True
        if arg.startswith(("--description=", "--provenance=")):
            out.append(arg.split("=", 1)[0] + "=...")
            continue
        path = Path(arg)
        if path.is_absolute() and os.path.exists(path):
            out.append(_display_path(path))
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
