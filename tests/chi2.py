"""The chi-square critical value the statistical tests compare against."""
from __future__ import annotations

import math

FALSE_POSITIVE_RATE = 1e-6


def chi2_critical(df: int, alpha: float = FALSE_POSITIVE_RATE) -> float:
    """Upper alpha quantile of chi-square(df), Wilson–Hilferty; the normal quantile by bisection."""
    lo, hi = 0.0, 10.0
    for _ in range(100):
        z = (lo + hi) / 2
        lo, hi = (z, hi) if 0.5 * math.erfc(z / math.sqrt(2)) > alpha else (lo, z)
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3
