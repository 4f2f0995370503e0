"""The examples run as a user would run them: the DDP quickstart, MNIST, spawn, restarts."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import REPO, child_env, job_env, job_processes, run_python, start_launcher

EXAMPLES = os.path.join(REPO, "examples")
FINAL_W = re.compile(r"rank (\d+): final w = (\[\[.*\]\])")
MNIST_ARGS = ["--dataset", "digits", "--epochs", "5", "--batch-size", "64", "--quiet"]


def final_ws(output: str) -> dict:
    return {int(r): np.array(json.loads(w)) for r, w in FINAL_W.findall(output)}


def test_ddp_quickstart_under_the_launcher_learns_w_2_3_on_every_rank(tag):
    launcher = start_launcher(["--nproc_per_node", "2", os.path.join(EXAMPLES, "ddp_train.py")],
                              env=job_env(tag))
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    ws = final_ws(out)
    assert sorted(ws) == [0, 1]
    for w in ws.values():
        np.testing.assert_allclose(w, [[2.0], [3.0]], atol=1e-4)
    np.testing.assert_array_equal(ws[0], ws[1])
    assert "iteration 450 loss" in out


def test_ddp_quickstart_as_one_process_over_8_devices():
    result = run_python([os.path.join(EXAMPLES, "ddp_train.py")], env=child_env(devices=8))
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(final_ws(result.stdout)[0], [[2.0], [3.0]], atol=1e-4)


def last_record(output_dir) -> dict:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return json.loads(f.readlines()[-1])


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """The MNIST example on 2 processes x 1 device, run once for the tests that compare."""
    out = tmp_path_factory.mktemp("two_process")
    tag = "two-process-mnist"
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "1",
                               os.path.join(EXAMPLES, "mnist.py"), *MNIST_ARGS,
                               "--output-dir", str(out)], env=job_env(tag))
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    return last_record(out)


@pytest.mark.long
def test_mnist_two_processes_reach_the_accuracy_of_one(tmp_path, two_process_run):
    result = run_python([os.path.join(EXAMPLES, "mnist.py"), *MNIST_ARGS,
                         "--output-dir", str(tmp_path)], env=child_env(devices=2), timeout=300)
    assert result.returncode == 0, result.stderr
    one = last_record(tmp_path)
    assert one["test_accuracy"] > 0.85
    assert abs(two_process_run["test_accuracy"] - one["test_accuracy"]) <= 0.01
    assert os.path.getsize(tmp_path / "metrics.png") > 0


def rank_process(tag: str, rank: int):
    """The Python process of `rank` in a launched job (its env carries RANK)."""
    for proc in job_processes(tag):
        try:
            env = proc.environ()
            if env.get("RANK") == str(rank) and "mnist.py" in " ".join(proc.cmdline()):
                return proc
        except Exception:  # noqa: BLE001 - a process may end while we look
            continue
    return None


@pytest.mark.long
def test_kill_9_of_a_rank_restarts_and_resumes_from_the_last_checkpoint(
        tmp_path, tag, two_process_run):
    logdir, ckpt, out = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "out"
    launcher = start_launcher(
        ["--nproc_per_node", "2", "--devices_per_process", "1", "--max_restarts", "1",
         "--logdir", logdir, "--redirect_stdout_and_stderr", os.path.join(EXAMPLES, "mnist.py"),
         *MNIST_ARGS, "--checkpoint-dir", ckpt, "--output-dir", out], env=job_env(tag))
    try:
        deadline = time.monotonic() + 240
        rank0_out = logdir / "rank.0" / "stdout"
        while not (rank0_out.exists() and '"epoch": 2' in rank0_out.read_text()):
            assert time.monotonic() < deadline and launcher.poll() is None, "no epoch 2"
            time.sleep(0.1)
        victim = rank_process(tag, 1)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err
    assert "restart 1 of 1: starting all 2 processes again" in err
    epochs = [int(e) for e in re.findall(r'"epoch": (\d+)', rank0_out.read_text())]
    assert epochs.count(1) == 1 and epochs[-1] == 5, epochs  # resumed, not started over
    resumed = last_record(out)
    assert resumed["epoch"] == 5
    assert abs(resumed["test_accuracy"] - two_process_run["test_accuracy"]) <= 0.005


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
def test_mnist_example_runs_end_to_end_on_tfds_mnist(tmp_path):
    mnist = load_example("mnist")
    with tfds.testing.mock_data(num_examples=256, policy=tfds.testing.MockPolicy.USE_CODE):
        record = mnist.main(["--dataset", "mnist", "--epochs", "1", "--batch-size", "64",
                             "--quiet", "--output-dir", str(tmp_path)])
    assert record["epoch"] == 1 and np.isfinite(record["train_loss"])
    assert 0.0 <= record["test_accuracy"] <= 1.0


@pytest.mark.long
def test_mnist_resumes_a_run_preempted_at_the_last_step_of_an_epoch(tmp_path):
    """A preemption seen at an epoch's last batch saves the loader at the next epoch's start,
    so the rerun trains the remaining epoch and saves each step once (it used to re-enter the
    finished epoch and fail with "step 11 is not after the latest checkpoint 11")."""
    import jdp
    mnist = load_example("mnist")
    args = mnist.parse_args(["--dataset", "digits", "--epochs", "2", "--quiet",
                             "--checkpoint-dir", str(tmp_path)])
    loader, _ = mnist.make_loaders(args)
    state = jdp.broadcast(mnist.create_train_state(0, args.lr, 2 * len(loader)))
    step = jdp.train_step(mnist.loss_fn, has_aux=True)
    for batch in loader:  # the example's loop, leaving at the last batch as a preemption does
        state, _ = step(state, batch)
        if loader.step == len(loader):
            break
    jdp.checkpoint.Checkpointer(tmp_path).save(mnist.step_count(state), state, loader=loader)
    record = mnist.train_and_evaluate(args)
    assert record["epoch"] == 2 and record["test_accuracy"] > 0.3
    assert jdp.checkpoint.Checkpointer(tmp_path).all_steps() == [len(loader), 2 * len(loader)]


@pytest.mark.long
def test_spawn_mlp_example_trains_one_epoch_and_its_loss_falls(tag):
    result = subprocess.run(
        [os.sys.executable, os.path.join(EXAMPLES, "spawn_mlp.py"), "--epochs", "1",
         "--batch-size", "20"], env=job_env(tag), cwd=REPO, capture_output=True, text=True,
        timeout=180)
    assert result.returncode == 0, result.stderr
    match = re.search(r"epoch 0: mean loss ([\d.]+) \(first batch ([\d.]+), last batch ([\d.]+)\)",
                      result.stdout)
    assert match, result.stdout
    mean, first, last = map(float, match.groups())
    assert last < first * 0.8


@pytest.mark.long
def test_demo_reaches_96_percent_on_held_out_mnist5k_median_over_seeds_0_to_2(tmp_path):
    """What `make demo` runs (the defaults: mnist5k, 8 simulated devices, no network), for
    seeds 0-2 in one process; the held-out split's accuracy, median over the seeds."""
    code = f"""
import json, sys
sys.path.insert(0, {EXAMPLES!r})
import mnist
for seed in range(3):
    record = mnist.main(["--quiet", "--seed", str(seed), "--output-dir", {str(tmp_path)!r}])
    print("ACCURACY", json.dumps(record["test_accuracy"]), record["epoch"], flush=True)
"""
    result = run_python(["-c", code], env=child_env(devices=8), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training on 8 devices in 1 processes" in result.stdout
    found = re.findall(r"ACCURACY ([\d.]+) (\d+)", result.stdout)
    accuracies = sorted(float(a) for a, _ in found)
    print("held-out accuracy, seeds 0-2:", accuracies)
    assert len(accuracies) == 3 and {int(e) for _, e in found} == {10}
    assert np.median(accuracies) >= 0.96, accuracies
