"""The Wilson score interval: textbook values, inside [0, 1], covering the true rate about 95 % of the time."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_csa2.metrics.intervals import wilson_interval


def test_textbook_values():
    # Wilson (1927) / Newcombe (1998): 5 of 10 -> [0.2366, 0.7634]; 0 of 10 -> [0, 0.2775]
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="0 <= correct <= total"):
        wilson_interval(3, 2)


@given(st.integers(1, 500), st.data())
def test_the_interval_holds_the_observed_rate_inside_zero_one(total, data):
    correct = data.draw(st.integers(0, total))
    low, high = wilson_interval(correct, total)
    assert 0.0 <= low <= correct / total <= high <= 1.0 and high - low > 0


def test_coverage_is_near_95_percent():
    rng = random.Random(0)
    hits = 0
    trials = 2000
    for _ in range(trials):
        p = rng.uniform(0.1, 0.9)
        n = 40
        k = sum(rng.random() < p for _ in range(n))
        low, high = wilson_interval(k, n)
        hits += low <= p <= high
    assert 0.92 <= hits / trials <= 0.98, hits / trials
