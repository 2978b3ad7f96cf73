"""Ordinary least squares for the predictor models, in pure Python (no numpy).

The models have at most four parameters, so the normal equations are solved directly. Each
design column is first divided by its RMS: the TTFT columns span 1 (intercept) to ~3e4
(bs·L), and squaring that spread in XᵀX would cost digits for nothing. Gaussian elimination
with partial pivoting then solves the (well-scaled) 4×4 system; a pivot that vanishes means the
data cannot separate two parameters (e.g. a four-term TTFT fit from a single batch size), which
is reported instead of returning arbitrary numbers.

Used by ``tools/predictors/refit.py`` (and its tests); the Proxy itself never fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

# Relative pivot below which the scaled normal matrix is treated as singular.
_RANK_TOLERANCE = 1e-10


class FitError(ValueError):
    """The data cannot determine the requested model (too few rows, collinear columns)."""


class Residuals(NamedTuple):
    n: int
    rmse: float  # same unit as the targets
    max_abs: float
    r2: float  # 1 - SS_res / SS_tot (1.0 when the targets are constant and fitted exactly)


class LstsqResult(NamedTuple):
    coefficients: tuple[float, ...]
    residuals: Residuals


def least_squares(design: Sequence[Sequence[float]], targets: Sequence[float]) -> LstsqResult:
    """Least-squares x for design·x ≈ targets (``design``: one row of regressors per target)."""
    n = len(design)
    if n != len(targets):
        raise FitError(f"{n} design rows but {len(targets)} targets")
    if n == 0:
        raise FitError("no rows to fit")
    p = len(design[0])
    if any(len(row) != p for row in design):
        raise FitError("design rows have different lengths")
    if n < p:
        raise FitError(f"{n} rows cannot determine {p} parameters")

    scale = []
    for j in range(p):
        rms = math.sqrt(math.fsum(row[j] * row[j] for row in design) / n)
        if rms == 0.0:
            raise FitError(f"design column {j} is all zeros")
        scale.append(rms)
    scaled = [[row[j] / scale[j] for j in range(p)] for row in design]

    normal = [[math.fsum(r[i] * r[j] for r in scaled) for j in range(p)] for i in range(p)]
    rhs = [math.fsum(r[i] * y for r, y in zip(scaled, targets)) for i in range(p)]
    solution = _solve(normal, rhs)
    coefficients = tuple(solution[j] / scale[j] for j in range(p))
    return LstsqResult(coefficients, residual_stats(design, targets, coefficients))


def residual_stats(design: Sequence[Sequence[float]], targets: Sequence[float],
                   coefficients: Sequence[float]) -> Residuals:
    """Fit quality of ``coefficients`` on the rows (also used to score old coefficients)."""
    predictions = [math.fsum(c * x for c, x in zip(coefficients, row)) for row in design]
    return residual_stats_of(predictions, targets)


def residual_stats_of(predictions: Sequence[float], targets: Sequence[float]) -> Residuals:
    n = len(targets)
    if n == 0:
        return Residuals(0, 0.0, 0.0, 1.0)
    errors = [p - y for p, y in zip(predictions, targets)]
    ss_res = math.fsum(e * e for e in errors)
    mean = math.fsum(targets) / n
    ss_tot = math.fsum((y - mean) ** 2 for y in targets)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Residuals(n, math.sqrt(ss_res / n), max(abs(e) for e in errors), r2)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (in place; the inputs are scratch copies)."""
    p = len(rhs)
    largest = max(abs(matrix[i][i]) for i in range(p))
    for col in range(p):
        pivot_row = max(range(col, p), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot_row][col]) <= _RANK_TOLERANCE * largest:
            raise FitError("the data cannot separate the model's parameters "
                           f"(parameter {col} is collinear with the others)")
        if pivot_row != col:
            matrix[col], matrix[pivot_row] = matrix[pivot_row], matrix[col]
            rhs[col], rhs[pivot_row] = rhs[pivot_row], rhs[col]
        pivot = matrix[col][col]
        for r in range(col + 1, p):
            factor = matrix[r][col] / pivot
            if factor:
                for k in range(col, p):
                    matrix[r][k] -= factor * matrix[col][k]
                rhs[r] -= factor * rhs[col]
    solution = [0.0] * p
    for r in range(p - 1, -1, -1):
        acc = rhs[r] - math.fsum(matrix[r][k] * solution[k] for k in range(r + 1, p))
        solution[r] = acc / matrix[r][r]
    return solution


# --- the three model fits ------------------------------------------------------------------


class TtftFit(NamedTuple):
    """TTFT coefficients in seconds: t = a_s·bs·L + b_s·L + c_s·bs + d_s."""

    a_s: float
    b_s: float
    c_s: float
    d_s: float
    # "four_term" (≥ 2 batch sizes) or "single_bs_line" (one batch size: only a line in L is
    # identifiable; it is put on the bs-scaled terms, see fit_ttft).
    mode: str
    residuals_ms: Residuals


def ttft_design_row(tokens: float, bs: float) -> tuple[float, float, float, float]:
    return (bs * tokens, tokens, bs, 1.0)


def fit_ttft(rows: Sequence[tuple[float, int, float]]) -> TtftFit:
    """Fit (tokens, bs, ms) rows.

    With two or more batch sizes all four terms are fitted. With one batch size ``bs0`` only
    ``t = s·L + i`` is identifiable; it is stored as ``a = s/bs0, b = 0, c = 0, d = i`` so
    that the profile reproduces the line at ``bs0`` and scales the length term with the batch
    (prefills of a batch cost about bs times one prefill; an engine that serialises prefills,
    like the simulated instance, does exactly that for the last request of the batch).
    """
    if not rows:
        raise FitError("no TTFT rows")
    sizes = sorted({bs for _, bs, _ in rows})
    targets_s = [ms / 1000.0 for _, _, ms in rows]
    if len(sizes) >= 2:
        design = [ttft_design_row(tokens, bs) for tokens, bs, _ in rows]
        result = least_squares(design, targets_s)
        a, b, c, d = result.coefficients
        mode = "four_term"
    else:
        bs0 = sizes[0]
        result = least_squares([(tokens, 1.0) for tokens, _, _ in rows], targets_s)
        slope, intercept = result.coefficients
        a, b, c, d = slope / bs0, 0.0, 0.0, intercept
        mode = "single_bs_line"
    predictions = [1000.0 * (a * bs * t + b * t + c * bs + d) for t, bs, _ in rows]
    residuals = residual_stats_of(predictions, [ms for _, _, ms in rows])
    return TtftFit(a, b, c, d, mode, residuals)


class TpotLineFit(NamedTuple):
    """TPOT at one batch size, seconds per output token: slope_s·L + intercept_s."""

    bs: int
    slope_s: float
    intercept_s: float
    residuals_ms: Residuals


def fit_tpot(rows: Sequence[tuple[float, int, float]]) -> list[TpotLineFit]:
    """One line per batch size from (context_tokens, bs, ms_per_token) rows.

    A batch size measured at a single context length gets slope 0 and the mean as intercept.
    """
    if not rows:
        raise FitError("no TPOT rows")
    by_bs: dict[int, list[tuple[float, float]]] = {}
    for tokens, bs, ms in rows:
        by_bs.setdefault(bs, []).append((tokens, ms))
    lines = []
    for bs in sorted(by_bs):
        points = by_bs[bs]
        targets_ms = [ms for _, ms in points]
        if len({t for t, _ in points}) >= 2:
            slope_ms, intercept_ms = least_squares([(t, 1.0) for t, _ in points],
                                                   targets_ms).coefficients
        else:
            slope_ms, intercept_ms = 0.0, math.fsum(targets_ms) / len(targets_ms)
        predictions = [slope_ms * t + intercept_ms for t, _ in points]
        lines.append(TpotLineFit(bs, slope_ms / 1000.0, intercept_ms / 1000.0,
                                 residual_stats_of(predictions, targets_ms)))
    return lines


class RedisFit(NamedTuple):
    ms_per_gb: float
    intercept_ms: float
    residuals_ms: Residuals


def fit_redis(rows: Sequence[tuple[float, float]]) -> RedisFit:
    """Line through (kv_gb, ms) rows."""
    if not rows:
        raise FitError("no Redis pull rows")
    if len({gb for gb, _ in rows}) < 2:
        raise FitError("Redis pull rows need at least two distinct kv_gb values")
    result = least_squares([(gb, 1.0) for gb, _ in rows], [ms for _, ms in rows])
    slope, intercept = result.coefficients
    return RedisFit(slope, intercept, result.residuals)
