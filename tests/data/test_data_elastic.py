"""A Loader position saved on W processes restores onto W' processes (or another batch size):
the epoch continues with exactly the examples not yet consumed, each once.

Processes are simulated in one process: one Loader per rank with an explicit sampler.
"""
import json

import numpy as np
import pytest

from jdp.data import DistributedSampler, Loader

N, SEED = 203, 3


def loaders(world, batch, **sampler_kwargs):
    source = {"id": np.arange(N)}
    return [Loader(source, batch, sampler=DistributedSampler(
        N, num_replicas=world, rank=r, shuffle=True, seed=SEED, **sampler_kwargs))
        for r in range(world)]


def real_ids(batch):
    return np.asarray(batch["id"]).reshape(-1)[np.asarray(batch["mask"]).reshape(-1)].tolist()


def run(ranks, steps=None):
    """The ranks step together; the real example ids each consumed, up to `steps` batches."""
    seen = []
    iterators = [iter(r) for r in ranks]
    for step, batches in enumerate(zip(*iterators)):  # noqa: B905 -- ranks end together
        for b in batches:
            seen += real_ids(b)
        if steps is not None and step + 1 == steps:
            break
    else:  # zip stops at the first rank's end: let every rank see its end (and the next epoch)
        assert all(next(it, None) is None for it in iterators)
    del iterators
    return seen


@pytest.mark.parametrize("old, new", [((2, 16), (4, 8)), ((2, 16), (4, 16)), ((4, 8), (2, 8)),
                                      ((2, 8), (3, 8))])
@pytest.mark.parametrize("steps", [1, 3])
def test_resume_on_another_world_size_consumes_exactly_the_unseen_examples(old, new, steps):
    before = loaders(*old)
    for r in before:
        r.set_epoch(2)
    seen = run(before, steps)
    saved = json.loads(json.dumps(before[0].state_dict()))
    # independent: rank r's k-th index is position r + W*k of the epoch's order
    order = np.random.default_rng(SEED + 2).permutation(N)
    consumed = min(steps * old[0] * old[1], N)
    assert saved["offset"] == consumed
    assert sorted(seen) == sorted(order[:consumed].tolist())

    after = loaders(*new)
    for r in after:
        r.load_state_dict(saved)
        assert (r.epoch, r.step) == (2, 0)
    rest = run(after)
    assert sorted(seen + rest) == list(range(N))  # every example of the epoch exactly once
    assert sorted(rest) == sorted(order[consumed:].tolist())
    assert all((r.epoch, r.step) == (3, 0) for r in after)
    whole = run(after)  # the next epoch is whole, torch's split on the new world
    sampler = DistributedSampler(N, num_replicas=new[0], rank=0, shuffle=True, seed=SEED)
    sampler.set_epoch(3)
    assert sorted(whole) == list(range(N))
    assert whole[:new[1]] == sampler.indices()[:new[1]].tolist()


def test_the_rest_of_an_elastic_epoch_is_split_like_torch_over_the_new_ranks():
    before = loaders(2, 16)
    run(before, 2)
    saved = before[0].state_dict()
    after = loaders(3, 8)
    rest = np.random.default_rng(SEED).permutation(N)[64:]  # 139 left, padded to 141
    padded = np.resize(rest, 141)
    for rank, loader in enumerate(after):
        loader.load_state_dict(saved)
        batches = list(loader)
        assert len(batches) == 6  # 47 indices in batches of 8
        rows = np.concatenate([np.asarray(b["id"]).reshape(-1) for b in batches])
        mask = np.concatenate([np.asarray(b["mask"]).reshape(-1) for b in batches])
        np.testing.assert_array_equal(rows[:47], padded[rank::3])
        assert mask[:47].tolist() == (np.arange(rank, 141, 3) < 139).tolist()
        assert not mask[47:].any()


def test_a_mid_elastic_epoch_position_saves_and_restores_on_the_same_world_bitwise():
    before = loaders(2, 16)
    run(before, 2)
    after = loaders(4, 8)
    for r in after:
        r.load_state_dict(before[0].state_dict())
    run(after, 1)
    saved = json.loads(json.dumps(after[1].state_dict()))
    assert saved["offset"] == 64 + 32 and saved["start"] == 64 and saved["step"] == 1
    expected = [real_ids(b) for b in after[1]]
    again = loaders(4, 8)[1]
    again.load_state_dict(saved)
    assert [real_ids(b) for b in again] == expected


def test_sampler_drop_last_elastic_rest_is_cut_to_the_new_world():
    before = loaders(2, 16, drop_last=True)
    seen = run(before, 1)
    after = loaders(3, 8, drop_last=True)
    for r in after:
        r.load_state_dict(before[0].state_dict())
    rest = run(after)
    assert len(rest) == (N - 32) // 3 * 3 and not set(rest) & set(seen)
    assert len(set(rest)) == len(rest)


def test_the_saved_order_must_match():
    saved = loaders(2, 16)[0].state_dict()
    other = Loader({"id": np.arange(N)}, 8, sampler=DistributedSampler(
        N, num_replicas=4, rank=0, shuffle=True, seed=SEED + 1))
    with pytest.raises(ValueError, match="seed.*build the Loader and sampler as they were"):
        other.load_state_dict(saved)


def shift(batch, rng):
    """Augmentation: each row's x plus one uniform draw from its own generator."""
    return {"id": batch["id"], "x": batch["x"] + np.array([g.uniform() for g in rng])}


def test_an_example_gets_the_same_augmentation_on_any_world_size_and_after_an_elastic_resume():
    source = {"id": np.arange(N), "x": np.zeros(N)}

    def augmented(world, batch, saved=None, steps=None):
        ranks = [Loader(source, batch, transform=shift, sampler=DistributedSampler(
            N, num_replicas=world, rank=r, shuffle=True, seed=SEED)) for r in range(world)]
        values = {}
        for r in ranks:
            if saved is not None:
                r.load_state_dict(saved)
            for b in r:
                real = np.asarray(b["mask"]).reshape(-1)
                ids = np.asarray(b["id"]).reshape(-1)[real]
                values.update(zip(ids.tolist(), np.asarray(b["x"]).reshape(-1)[real].tolist(),
                                  strict=True))
                if steps is not None and r.step == steps:
                    break
        return values, ranks[0]

    # independent: the documented seed rule (sampler seed, epoch, example index), epoch 0
    want = {i: float(np.float32(np.random.default_rng([SEED, 0, i]).uniform())) for i in range(N)}
    assert augmented(2, 16)[0] == pytest.approx(want, abs=0)
    assert augmented(4, 8)[0] == pytest.approx(want, abs=0)
    first, rank0 = augmented(2, 16, steps=2)
    rest, _ = augmented(3, 8, saved=rank0.state_dict())
    assert set(first).isdisjoint(rest) and {**first, **rest} == pytest.approx(want, abs=0)
