"""Grain datasets and data sources feed the Loader directly (read one example at a time),
in this process and in worker processes."""
import numpy as np
import pytest

from jdp.data import DistributedSampler, Loader

grain = pytest.importorskip("grain", reason="grain is not installed (pip install grain)")

N = 37


def double(example):
    return {"x": example["x"] * 2, "id": example["id"]}


def rows(loader):
    out = {"x": [], "id": []}
    for batch in loader:
        real = np.asarray(batch["mask"]).reshape(-1)
        for key in out:
            out[key].append(np.asarray(batch[key]).reshape(-1)[real])
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_grain_map_dataset_is_a_source(workers):
    examples = [{"x": np.float32(i) / 4, "id": np.int32(i)} for i in range(N)]
    dataset = grain.MapDataset.source(examples).map(double)
    sampler = DistributedSampler(N, num_replicas=2, rank=1, shuffle=True, seed=2)
    order = sampler.indices()[~sampler.is_padding()]
    loader = Loader(dataset, 8, sampler=sampler, num_workers=workers)
    got = rows(loader)
    loader.close()
    np.testing.assert_array_equal(got["id"], order)
    np.testing.assert_array_equal(got["x"], order.astype(np.float32) / 4 * 2)


def test_a_grain_data_source_is_a_source():
    source = grain.sources.RangeDataSource(start=0, stop=N, step=1)

    class AsDicts:  # RangeDataSource yields ints: the Loader wants dicts of fields
        def __len__(self):
            return len(source)

        def __getitem__(self, i):
            return {"x": np.float32(source[i]), "id": np.int32(source[i])}

    got = rows(Loader(AsDicts(), 8, shuffle=False))
    np.testing.assert_array_equal(got["id"], np.arange(N))
