"""DistributedSampler: torch's index lists, padding positions, per-epoch shuffling, errors.

The expected lists are worked out by hand from torch.utils.data.DistributedSampler: pad the
index list by repeating it from its start to a multiple of the world size (or cut it down with
drop_last), then rank r takes indices[r::world].
"""
import numpy as np
import pytest
from conftest import assert_one_line

from jdp.data import DistributedSampler

TORCH_LISTS = [
    # (n, world, drop_last, [rank 0, rank 1, ...])
    (10, 3, False, [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]),
    (10, 3, True, [[0, 3, 6], [1, 4, 7], [2, 5, 8]]),
    (12, 4, False, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    (12, 4, True, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    (11, 4, True, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (5, 2, False, [[0, 2, 4], [1, 3, 0]]),
    (5, 2, True, [[0, 2], [1, 3]]),
    (4, 3, False, [[0, 3], [1, 0], [2, 1]]),
    (7, 1, False, [[0, 1, 2, 3, 4, 5, 6]]),
    (1, 1, True, [[0]]),
]


@pytest.mark.parametrize("n, world, drop_last, expected", TORCH_LISTS)
def test_unshuffled_lists_equal_torchs(n, world, drop_last, expected):
    for rank in range(world):
        sampler = DistributedSampler(n, num_replicas=world, rank=rank, shuffle=False,
                                     drop_last=drop_last)
        assert list(sampler) == expected[rank]
        assert len(sampler) == len(expected[rank])
        sampler.set_epoch(5)  # no effect without shuffle
        assert list(sampler) == expected[rank]


@pytest.mark.parametrize("n, world, expected", [
    (10, 3, [[False] * 4, [False, False, False, True], [False, False, False, True]]),
    (4, 3, [[False, False], [False, True], [False, True]]),
    (12, 4, [[False] * 3] * 4),
])
def test_is_padding_marks_the_repeated_positions(n, world, expected):
    for rank in range(world):
        sampler = DistributedSampler(n, num_replicas=world, rank=rank, shuffle=False)
        assert sampler.is_padding().tolist() == expected[rank]


@pytest.mark.parametrize("n, world, drop_last", [(103, 4, False), (103, 4, True), (5, 5, False),
                                                 (64, 8, False)])
def test_shuffled_ranks_cover_every_example_once_besides_padding(n, world, drop_last):
    samplers = [DistributedSampler(n, world, r, shuffle=True, seed=7, drop_last=drop_last)
                for r in range(world)]
    for s in samplers:
        s.set_epoch(2)
    assert len({len(s) for s in samplers}) == 1
    real = np.concatenate([s.indices()[~s.is_padding()] for s in samplers])
    everything = np.concatenate([s.indices() for s in samplers])
    if drop_last:
        assert len(everything) == n // world * world
        assert len(np.unique(everything)) == len(everything)
    else:
        assert sorted(real.tolist()) == list(range(n))
        assert len(everything) == -(-n // world) * world


def test_shuffled_padding_repeats_the_start_of_the_permutation():
    n, world = 10, 4  # 12 slots: the permutation, then its first 2 entries again
    perm = np.random.default_rng(3 + 1).permutation(n)
    padded = np.concatenate([perm, perm[:2]])
    for rank in range(world):
        s = DistributedSampler(n, world, rank, shuffle=True, seed=3)
        s.set_epoch(1)
        assert list(s) == padded[rank::world].tolist()


def test_permutation_changes_with_epoch_and_repeats_for_same_seed_and_epoch():
    def order(seed, epoch):
        s = DistributedSampler(1000, 1, 0, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 0) != order(0, 1)
    assert order(0, 1) == order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(0, 3)) == list(range(1000))


def test_defaults_come_from_jax_process_count_and_index():
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (1, 0, True, 0, False)
    assert sorted(s) == list(range(10))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_examples=10, num_replicas=2, rank=2), ValueError, ["rank=2", "range(2)"]),
    (dict(num_examples=10, num_replicas=2, rank=-1), ValueError, ["rank=-1"]),
    (dict(num_examples=0), ValueError, ["num_examples=0", "non-empty"]),
    (dict(num_examples=2.5), TypeError, ["num_examples=2.5", "int"]),
    (dict(num_examples=3, num_replicas=4, rank=0, drop_last=True), ValueError,
     ["num_examples=3", "num_replicas=4", "fewer processes"]),
    (dict(num_examples=2, num_replicas=5, rank=0), ValueError,      # torch would pad ranks
     ["num_examples=2", "num_replicas=5", "fewer processes"]),     # with nothing but repeats
    (dict(num_examples=10, num_replicas=0, rank=0), ValueError, ["num_replicas=0"]),
    (dict(num_examples=10, seed=-1), ValueError, ["seed=-1"]),
])
def test_bad_arguments_raise_one_line_errors_naming_value_and_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        DistributedSampler(**kwargs)
    assert_one_line(info.value, words)


def test_set_epoch_rejects_negative_epochs():
    with pytest.raises(ValueError, match="epoch=-1"):
        DistributedSampler(10).set_epoch(-1)


@pytest.mark.parametrize("shuffle", [False, True])
def test_order_is_the_list_every_rank_strides_over(shuffle):
    samplers = [DistributedSampler(11, num_replicas=3, rank=r, shuffle=shuffle, seed=4)
                for r in range(3)]
    for s in samplers:
        s.set_epoch(2)
    order = samplers[0].order()
    expected = np.random.default_rng(6).permutation(11) if shuffle else np.arange(11)
    np.testing.assert_array_equal(order, expected)
    padded = np.concatenate([order, order[:1]])  # 12 = 4 per rank
    for r, s in enumerate(samplers):
        np.testing.assert_array_equal(s.indices(), padded[r::3])
