"""Small statistics helpers: every reported figure is the median of its repetitions, shown
with the min and max (``Figure``); latency distributions use nearest-rank percentiles."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One measured quantity over ``n`` repetitions."""

    median: float
    min: float
    max: float
    n: int
    unit: str = ""

    @classmethod
    def of(cls, values: Iterable[float], unit: str = "") -> Figure:
        vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0, unit)
        return cls(statistics.median(vals), min(vals), max(vals), len(vals), unit)

    def to_json(self) -> dict:
        return {
            "median": _num(self.median),
            "min": _num(self.min),
            "max": _num(self.max),
            "n": self.n,
            "unit": self.unit,
        }


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] (NaN for no values)."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(s)))
    return s[min(rank, len(s)) - 1]


def ratio(a: float | None, b: float | None) -> float:
    """``a / b``, NaN when either is missing or ``b`` is 0."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return math.nan
    return a / b


def fmt(x: float | None, digits: int = 3) -> str:
    """Compact human formatting: 3 significant digits, no exponent for ordinary sizes."""
    if x is None or not math.isfinite(x):
        return "-"
    ax = abs(x)
    if float(x).is_integer() and ax < 1e9:
        return f"{int(x):,}"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.{digits}g}"


def fmt_fig(f: Figure) -> str:
    """``median [min–max]`` (just the median for one repetition)."""
    if f.n <= 1:
        return fmt(f.median)
    return f"{fmt(f.median)} [{fmt(f.min)}–{fmt(f.max)}]"
