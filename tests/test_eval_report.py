"""`train eval`'s comparisons: the candidate paired with each other drafter by prompt, pooled over datasets, and
the anchor-weighted exit mass by depth."""

from __future__ import annotations

import pytest

from exitspec.train.eval_report import ALL, exit_rows, paired_rows, plot_exits


def row(drafter, dataset, taus, exits, budget=32, temperature=0.0):
    mean = sum(taus.values()) / len(taus)
    return {"drafter": drafter, "dataset": dataset, "budget": budget, "temperature": temperature,
            "trees": 2 * len(taus), "tau": mean, "tau_stderr": 0.0, "reach_by_depth": [1.0],
            "exit_by_depth": exits, "tau_by_sequence": taus}


@pytest.fixture
def rows():
    return [
        row("dflash", "gsm8k", {"gsm8k/0": 2.0, "gsm8k/1": 3.0}, [0.5, 0.5]),
        row("dflash", "mtbench", {"mtbench/0": 1.5}, [0.8, 0.2]),
        row("runs/x/exit/final", "gsm8k", {"gsm8k/0": 2.5, "gsm8k/1": 3.0}, [0.3, 0.5, 0.2]),
        row("runs/x/exit/final", "mtbench", {"mtbench/0": 1.5, "mtbench/9": 4.0}, [0.6, 0.4]),
    ]


def test_the_last_drafter_is_paired_with_each_other_one_per_dataset_and_pooled(rows):
    paired = {p["dataset"]: p for p in paired_rows(rows)}
    assert set(paired) == {"gsm8k", "mtbench", ALL}
    assert all(p["candidate"] == "runs/x/exit/final" and p["other"] == "dflash" for p in paired.values())
    assert (paired["gsm8k"]["pairs"], paired["gsm8k"]["mean"]) == (2, pytest.approx(0.25))
    assert (paired["mtbench"]["pairs"], paired["mtbench"]["mean"]) == (1, 0.0)  # mtbench/9: dflash lacks it
    assert (paired[ALL]["pairs"], paired[ALL]["mean"]) == (3, pytest.approx(0.5 / 3))
    assert paired_rows(rows[:2]) == []  # one drafter: nothing to pair


def test_exit_mass_by_depth_is_weighted_by_anchors(rows, tmp_path):
    exits = {e["drafter"]: e for e in exit_rows(rows)}
    assert exits["dflash"]["anchors"] == 6
    assert exits["dflash"]["exit_by_depth"] == pytest.approx([(4 * 0.5 + 2 * 0.8) / 6, (4 * 0.5 + 2 * 0.2) / 6])
    assert exits["runs/x/exit/final"]["exit_by_depth"] == pytest.approx([0.45, 0.45, 0.1])  # deeper trees padded
    assert exits["dflash"]["tau"] == pytest.approx((4 * 2.5 + 2 * 1.5) / 6)
    plot_exits(list(exits.values()), tmp_path / "exits.png")
    assert (tmp_path / "exits.png").stat().st_size > 0
