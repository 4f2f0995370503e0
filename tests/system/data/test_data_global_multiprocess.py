"""The Loader's default (global) batches on 2 processes x 2 devices (launcher): one global
array per leaf, [batch_size * 2, ...], each process's rows (its sampler's examples) on its own
devices."""
import json

from conftest import job_env, start_launcher, write_script

SCRIPT = """
import json, sys
import jax, numpy as np
import jdp
from jdp.core import batch_sharded

jdp.initialize()
rank = jax.process_index()
loader = jdp.data.Loader({"id": np.arange(50)}, 4, shuffle=False)
out = []
for batch in loader:
    leaf = batch["id"]
    assert leaf.shape == (8,) and batch["mask"].shape == (8,), leaf.shape
    assert leaf.sharding == batch_sharded()
    mine = sorted((s.index[0].start, s.device.process_index, np.asarray(s.data).tolist())
                  for s in leaf.addressable_shards)
    out.append(mine)
json.dump({"rank": rank, "shards": out, "sampler": loader.sampler.indices().tolist()},
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
"""


def test_each_process_rows_sit_on_its_devices_in_the_global_batch(tmp_path, tag):
    script = write_script(tmp_path, "global.py", SCRIPT)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               tmp_path], env=job_env(tag))
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, err[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # independent: torch's unshuffled split, 50 examples over 2 ranks: rank r takes r::2
        order = list(range(rank, 50, 2))
        assert got["sampler"] == order
        assert len(got["shards"]) == 7  # 25 per rank in batches of 4
        for b, shards in enumerate(got["shards"]):
            # this process holds rows [4 * rank, 4 * rank + 4) of the global batch, 2 per device
            assert [s[0] for s in shards] == [4 * rank, 4 * rank + 2]
            assert all(s[1] == rank for s in shards)
            rows = [v for s in shards for v in s[2]]
            part = order[4 * b:4 * b + 4]  # the last one filled by repeating its own rows
            want = (part * 4)[:4]
            assert rows == want
