"""Paired differences by prompt: the mean, its standard error and a bootstrap interval that behaves."""

from __future__ import annotations

import random
import statistics

import pytest

from exitspec.paired import detectable_with, paired_cell, paired_difference


def test_only_shared_prompts_are_paired():
    a, b = {"p0": 3.0, "p1": 2.0, "p2": 5.0}, {"p1": 1.5, "p2": 4.0, "p3": 9.0}
    d = paired_difference(a, b)
    assert d["pairs"] == 2 and d["mean"] == pytest.approx(0.75)
    assert d["relative"] == pytest.approx(7.0 / 5.5 - 1)
    assert paired_difference(a, {"p9": 1.0}) is None and paired_cell(None) == "-"


def test_a_constant_gain_has_no_spread():
    d = paired_difference({i: 2.0 + i for i in range(10)}, {i: 1.5 + i for i in range(10)})
    assert d["stderr"] == pytest.approx(0.0) and d["ci95"] == pytest.approx([0.5, 0.5])


def test_the_bootstrap_interval_matches_the_normal_one_for_many_prompts():
    """For 400 prompts the mean is close to normal: the percentile interval is mean ± 1.96 s.e. within 10%."""
    rng = random.Random(0)
    a = {i: rng.gauss(2.2, 0.5) for i in range(400)}
    b = {i: a[i] - rng.gauss(0.1, 0.3) for i in range(400)}
    d = paired_difference(a, b)
    diffs = [a[i] - b[i] for i in range(400)]
    assert d["mean"] == pytest.approx(statistics.mean(diffs))
    assert d["stderr"] == pytest.approx(statistics.stdev(diffs) / 20)
    low, high = d["ci95"]
    assert low < d["mean"] < high and low > 0  # a real gain of 0.1 at s.e. 0.015 excludes 0
    assert (high - low) / (2 * 1.96 * d["stderr"]) == pytest.approx(1.0, abs=0.1)
    assert d["relative_ci95"][0] < d["relative"] < d["relative_ci95"][1]
    assert paired_cell(d).startswith(f"{d['mean']:+.3f} ± {d['stderr']:.3f} [")


def test_the_detectable_change_is_met_with_80_percent_power():
    """Simulated paired studies at the reported detectable change: about 80% of their intervals exclude 0, and
    a quarter as many prompts detect only twice the change."""
    rng = random.Random(1)
    b = {i: rng.gauss(2.0, 0.4) for i in range(100)}
    pilot = paired_difference({i: b[i] + rng.gauss(0.0, 0.2) for i in b}, b)
    assert pilot["detectable"] == pytest.approx(2.8 * pilot["stderr"] / statistics.mean(b.values()))
    assert detectable_with(pilot, 25) == pytest.approx(2 * pilot["detectable"])
    gain = pilot["detectable"] * statistics.mean(b.values())
    found = 0
    for _ in range(200):
        a = {i: b[i] + gain + rng.gauss(0.0, 0.2) for i in b}
        d = paired_difference(a, b)
        found += d["mean"] - 1.96 * d["stderr"] > 0
    assert 0.7 < found / 200 < 0.9
