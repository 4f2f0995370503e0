"""flax's linen MNIST example and the NNX MNIST tutorial, ported to jdp the short way
(examples/flax_mnist/): each differs from its pinned upstream copy by at most 15 lines, and
trains on 1 process x 8 devices and on 2 processes x 4 devices (jdp.launch) to within 1 point
of the test accuracy of the upstream program on one device.

Excepted from the count, and shared by the ports and their single-device baselines: data
loading (linen: `get_datasets`; NNX: the tutorial's section-2 cell, the port's lines before
`from flax import nnx`), because both upstream programs download MNIST, and the tests read the
offline digits of examples/flax_mnist/mnist_data.py. The NNX tutorial's program is its code
cells from section 2 to 7 (section 1 installs packages, section 8 exports to TensorFlow
Serving). Training is kept short (a subset, few steps): the ports see the same batches as the
baseline, so they must agree closely even before the accuracy levels off.
"""
import difflib
import glob
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, job_env

pytest.importorskip("ml_collections")   # the linen example's configuration type
pytest.importorskip("tensorboardX")     # the NNX tutorial's writer
pytest.importorskip("matplotlib")       # the NNX tutorial's plots

HERE = os.path.join(REPO, "examples", "flax_mnist")
UPSTREAM = os.path.join(HERE, "upstream")
MAX_CHANGED = 15
LINEN_DATA = re.compile(r"^def get_datasets\(\):\n(?:(?:  .*)?\n)*?(?=\n\ndef )", re.M)
NNX_DATA_END = "from flax import nnx  # The Flax NNX API.\n"
LINEN_ENV = {"MNIST_TRAIN_EXAMPLES": "1536"}
LINEN_ARGS = ["--num_epochs", "2"]
NNX_ENV = {"MNIST_TRAIN_STEPS": "30", "MNIST_EVAL_EVERY": "29"}


def read(*parts):
    with open(os.path.join(*parts)) as f:
        return f.read()


def changed_lines(original: str, port: str) -> list:
    diff = difflib.unified_diff(original.splitlines(), port.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def tutorial_cells() -> list:
    """The NNX tutorial's program: its code cells of sections 2 to 7."""
    md = read(UPSTREAM, "mnist_tutorial.md")
    program = md[md.index("## 2. Load the MNIST dataset"):md.index("# 8. Export the model")]
    return re.findall(r"```\{code-cell\} ipython3\n(.*?)```", program, re.S)


def without_linen_data(text: str) -> str:
    assert len(LINEN_DATA.findall(text)) == 1
    return LINEN_DATA.sub("def get_datasets():\n", text)


def test_each_port_changes_at_most_15_lines_besides_data_loading():
    linen = changed_lines(without_linen_data(read(UPSTREAM, "train.py")),
                          without_linen_data(read(HERE, "train.py")))
    port = read(HERE, "mnist_tutorial.py")
    nnx_port = port[port.index(NNX_DATA_END):]
    nnx = changed_lines("\n".join(tutorial_cells()[1:]), nnx_port)
    print(f"changed lines: linen {len(linen)}, nnx {len(nnx)}")
    assert 0 < len(linen) <= MAX_CHANGED, "\n".join(linen)
    assert 0 < len(nnx) <= MAX_CHANGED, "\n".join(nnx)
    assert "jdp.broadcast" in "".join(linen) and "jdp.broadcast" in "".join(nnx)


def run(args, cwd, tag, devices=1, processes=1, extra=None, timeout=400):
    """Run the script (under jdp.launch for 2 processes) in `cwd`; its stdout."""
    env = job_env(tag, devices=devices, **(extra or {}))
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    launch = ["-m", "jdp.launch", "--nproc_per_node", str(processes),
              "--devices_per_process", str(devices)] if processes > 1 else []
    os.makedirs(cwd, exist_ok=True)
    result = subprocess.run([sys.executable, *launch, *args], env=env, cwd=cwd,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def linen_accuracy(stdout: str) -> float:
    return float(re.findall(r"test_accuracy \d+ ([\d.]+)", stdout)[-1])


@pytest.mark.long
def test_linen_port_trains_on_8_devices_and_2_processes_as_the_original_on_one(tmp_path, tag):
    original = read(UPSTREAM, "train.py").replace(
        "from flax.metrics import tensorboard\n",
        "from mnist_data import numpy_splits, tensorboard"
        "  # offline data; flax's writer needs TF\n")
    original = LINEN_DATA.sub("def get_datasets():\n  return numpy_splits()\n", original)
    (tmp_path / "train.py").write_text(original)
    main = os.path.join(HERE, "main.py")
    base = linen_accuracy(run([main, "--train", str(tmp_path / "train.py"), *LINEN_ARGS],
                              tmp_path / "one", tag, extra=LINEN_ENV))
    eight = linen_accuracy(run([main, *LINEN_ARGS], tmp_path / "eight", tag, devices=8,
                               extra=LINEN_ENV))
    two = linen_accuracy(run([main, *LINEN_ARGS], tmp_path / "two", tag, devices=4, processes=2,
                             extra=LINEN_ENV))
    print(f"linen test accuracy: 1 device {base:.4f}, 1x8 {eight:.4f}, 2x4 {two:.4f}")
    assert base > 0.5
    assert abs(eight - base) <= 0.01 and abs(two - base) <= 0.01


def nnx_accuracy(cwd) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = [f for f in glob.glob(os.path.join(cwd, "runs", "*", "events.out.tfevents.*"))
             if ".rank1" not in f]   # the port's 2 ranks write a directory each
    assert len(files) == 1, os.listdir(cwd)
    events = EventAccumulator(files[0], size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars("test_accuracy")[-1].value


@pytest.mark.long
def test_nnx_port_trains_on_8_devices_and_2_processes_as_the_original_on_one(tmp_path, tag):
    cells = tutorial_cells()
    data = ("import numpy as np\nimport matplotlib.pyplot as plt\n"
            "from mnist_data import numpy_batches as make_batches, numpy_splits\n"
            "train_steps, eval_every, batch_size = 1200, 200, 32\n"
            "train_steps = int(os.environ.get('MNIST_TRAIN_STEPS', train_steps))\n"
            "eval_every = int(os.environ.get('MNIST_EVAL_EVERY', eval_every))\n"
            "train_ds, test_ds = numpy_splits()\n")
    (tmp_path / "original.py").write_text("import os\n" + data + "\n".join(cells[1:]))
    run([str(tmp_path / "original.py")], tmp_path / "one", tag, extra=NNX_ENV)
    port = os.path.join(HERE, "mnist_tutorial.py")
    run([port], tmp_path / "eight", tag, devices=8, extra=NNX_ENV)
    run([port], tmp_path / "two", tag, devices=4, processes=2, extra=NNX_ENV)
    accuracy = {name: nnx_accuracy(tmp_path / name) for name in ("one", "eight", "two")}
    print(f"nnx test accuracy: {accuracy}")
    assert accuracy["one"] > 0.5
    assert abs(accuracy["eight"] - accuracy["one"]) <= 0.01
    assert abs(accuracy["two"] - accuracy["one"]) <= 0.01
