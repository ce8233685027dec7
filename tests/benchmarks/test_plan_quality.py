"""plan_quality's verdicts on the order of plans: pairs whose round times overlap are ties."""

from __future__ import annotations

from benchmarks.plan_quality import _order_beyond_noise, _separated, round_order


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
