"""Confidence intervals for accuracies measured on a few samples (needle cells hold 20 or so)."""

from __future__ import annotations

import math


def wilson_interval(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``correct / total`` (95 % by default).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or ``total``
    answers. ``total`` 0 gives (0, 1): nothing is known.
    """
    if total < 0 or not 0 <= correct <= total:
        raise ValueError(f"correct={correct}, total={total}: need 0 <= correct <= total")
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    z2 = z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    # at 0 or every answer the bound is exactly 0 or 1 (rounding would leave the observed rate outside)
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return low, high


__all__ = ["wilson_interval"]
