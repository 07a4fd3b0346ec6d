"""How the simulation report writes its figures: fixed decimals, percentages, ratios, a dash where there is none."""

from __future__ import annotations

import math


def num(x: float | None, digits: int = 2) -> str:
    """`x` with `digits` decimals; "–" for None, NaN or an infinity."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal; "–" for NaN or an infinity."""
    return "–" if not math.isfinite(x) else f"{100 * x:.1f}"


def ratio(a: float, b: float) -> str:
    """a ÷ b as "1.23×"; "> 100×" beyond that (a ratio to almost nothing); "–" where either is missing or b ≤ 0."""
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return "–"
    return "> 100×" if a / b > 100 else num(a / b) + "×"  # beyond that it is a ratio to almost nothing
