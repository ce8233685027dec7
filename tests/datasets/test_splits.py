"""Train / validation splits (torchrec's ``idx_split_train_val``, ``rand_split_train_val``, filters);
expected values from torchrec 1.8 on the same inputs."""

import pytest
import torch.utils.data.datapipes as dp

from shardkit.datasets.utils import idx_split_train_val, rand_split_train_val, train_filter, val_filter


def test_filters_compare_the_last_decimal_digits_with_the_train_share():
    identity = lambda i: i  # noqa: E731
    assert [train_filter(identity, 0.25, 2, i) for i in (0, 24, 25, 99, 124, 125)] == [1, 1, 0, 0, 1, 0]
    assert [train_filter(identity, 0.755, 2, i) for i in (75, 76)] == [True, False]  # round(75.5) == 76
    assert [train_filter(identity, 0.755, 3, i) for i in (754, 755)] == [True, False]
    for i in range(30):
        assert val_filter(identity, 0.5, 1, i) is not train_filter(identity, 0.5, 1, i)


def test_idx_split_takes_the_first_share_of_every_block():
    train, val = idx_split_train_val(range(23), 0.25, 1)
    assert list(train) == [0, 1, 10, 11, 20, 21]
    assert list(val) == [2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19, 22]
    train, val = idx_split_train_val(range(40), 0.3, 1, key_fn=lambda i: i * 7 + 3)
    assert list(train) == [i for i in range(40) if (i * 7 + 3) % 10 < 3]
    assert sorted(list(train) + list(val)) == list(range(40))


def test_rand_split_is_torchrecs_and_the_same_on_every_pass():
    train, val = rand_split_train_val(range(20), 0.6, 3)
    assert list(train) == [0, 1, 2, 5, 6, 8, 9, 11, 13, 15, 18]  # torchrec 1.8, seed 3
    assert list(val) == [3, 4, 7, 10, 12, 14, 16, 17, 19]
    assert list(train) == [0, 1, 2, 5, 6, 8, 9, 11, 13, 15, 18]  # second epoch: same split
    other, _ = rand_split_train_val(range(20), 0.6, 4)
    assert list(other) != list(train)
    assert list(dp.iter.Batcher(train, 4))[0] == [0, 1, 2, 5]  # composes with torch's pipes


@pytest.mark.parametrize("split", [idx_split_train_val, rand_split_train_val])
@pytest.mark.parametrize("train_perc", [0.0, 1.0, -0.5, 2])
def test_train_share_outside_zero_one_is_rejected(split, train_perc):
    with pytest.raises(ValueError, match=r"train_perc must be in range \(0.0, 1.0\), got"):
        split(range(3), train_perc)
