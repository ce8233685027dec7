"""plan_quality's verdicts on the order of plans (pairs whose medians' intervals overlap are ties) and
its noise band (the control copy, the intervals, the load's drift since calibrate())."""

from __future__ import annotations

import pytest
from benchmarks.plan_quality import _order_beyond_noise, _separated, round_order, summarize

from benchmarks import plan_quality as pq


def test_pairs_are_separated_only_when_their_rounds_do_not_overlap():
    assert _separated([1.0, 1.1, 1.2], [1.3, 1.5])
    assert _separated([1.3, 1.5], [1.0, 1.1, 1.2])
    assert not _separated([1.0, 1.4], [1.3, 1.5])  # one round of the first is slower than one of the second
    assert not _separated([1.0], [1.0])


def test_order_beyond_noise_scores_separated_pairs_only():
    rounds = [[1.0, 1.1, 1.05], [1.08, 1.2, 1.15], [3.0, 3.1, 3.2]]  # plans 0 and 1 tie
    # estimates that swap the tie: not scored; plan 2 slowest in both
    assert _order_beyond_noise([2.0, 1.0, 5.0], rounds) == "0/2"
    # estimates that put plan 2 first: wrong on both of its pairs
    assert _order_beyond_noise([2.0, 2.5, 1.0], rounds) == "2/2"
    # equal estimates of separated plans do not order them: misordered
    assert _order_beyond_noise([1.0, 1.0, 1.0], rounds) == "2/2"


def test_every_plan_runs_once_in_every_position_over_as_many_rounds():
    orders = [round_order(4, r) for r in range(4)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)  # each round times every plan once
    for position in range(4):
        assert sorted(order[position] for order in orders) == [0, 1, 2, 3]


def test_from_nine_rounds_one_spike_does_not_make_a_pair_a_tie():
    fast = [1.0, 1.02, 1.01, 0.99, 1.03, 1.0, 1.02, 1.01, 5.0]  # one round in a load spike
    slow = [1.5, 1.52, 1.49, 1.51, 1.5, 1.53, 1.48, 1.5, 1.51]
    assert not max(fast) < min(slow)  # the ranges overlap ...
    assert _separated(fast, slow)  # ... the intervals of the medians do not


def test_the_control_copy_and_the_anchors_give_the_noise_band_and_the_drift():
    rounds = [1.0] * 7
    result = {
        "rows": [
            {
                "labels": ["planner", "planner+cal"],
                "types": "TW2",
                "key": "a",
                "est": {"default": 1.0, "calibrated": 1.2},
                "measured_s": 1.0,
                "rounds_s": rounds,
            },
            {
                "labels": ["all row_wise"],
                "types": "RW2",
                "key": "b",
                "est": {"default": 1.0, "calibrated": 3.0},
                "measured_s": 2.0,
                "rounds_s": [2.0] * 7,
            },
        ],
        "control": {"of": 0, "rounds_s": [1.1] * 7},
        "anchors": [{"rounds_s": [3.0] * 7}, {"rounds_s": [4.0] * 7}, {"rounds_s": [1.0] * 7}],
        "anchor_cal_s": [2.0, 2.0, 2.0],  # the machine 1.5x, 2x, 0.5x slower: median 1.5
        "calibrate_s": 1.0,
    }
    rows, verdict = summarize("demo", 2, result)
    assert verdict["control_ratio"] == pytest.approx(1.1)
    assert verdict["drift"] == pytest.approx(1.5)
    assert rows[0]["drift_adj_err"] == pytest.approx(1.2 * 1.5 / 1.0 - 1.0)
    assert rows[1]["cal_err"] == pytest.approx(0.5)
    assert verdict["estimates_within_25pct"] is False  # the strict verdict is unchanged
    assert verdict["planner_within_10pct"] is True and verdict["planner_ties_fastest"] is True
    assert (rows[0]["ci_lo_ms"], rows[0]["ci_hi_ms"]) == (1e3, 1e3)


def test_every_timed_step_gets_the_batch_as_a_new_object():
    # a reused KJT skips the construction's checks and per-key totals after the first step, and a
    # sharded lookup reuses its splits of that object, which training's new batch every step never
    # does: the benchmark times steps on a new object of the same tensors
    import torch
    from benchmarks.plan_quality import _batch, fresh

    features = _batch([(100, 8, 2.0), (50, 16, 1.0)], 4, seed=0)
    copy = fresh(features)
    assert copy is not features and fresh(features) is not copy
    assert copy.keys() == features.keys() and copy.length_per_key() == features.length_per_key()
    assert torch.equal(copy.values(), features.values()) and torch.equal(copy.lengths(), features.lengths())


def test_steal_is_the_hypervisors_share_of_the_ticks_between_two_readings():
    assert pq.steal_share((10, 1000), (30, 1400)) == 20 / 400
    assert pq.steal_share(None, (30, 1400)) is None  # no /proc/stat
    assert pq.steal_share((10, 1000), (10, 1000)) is None  # no time passed
    ticks = pq.cpu_times()
    if ticks is not None:  # Linux: steal is a part of the total
        assert 0 <= ticks[0] <= ticks[1]
