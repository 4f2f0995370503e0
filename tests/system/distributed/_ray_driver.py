"""The driver of test_ray.py (beside it): a local Ray cluster (2 CPUs), then Ray Train's
JaxTrainer with 2 workers whose loop calls only `jdp.initialize()` (no mapping of Ray's context).

    python tests/system/distributed/_ray_driver.py STORAGE_DIR train kill

train: the engine tests' loop (_engine_train.py, beside it; every worker prints its losses),
then each worker prints the processes on its node ("NODE rank count").
kill: collectives until worker 1 kills itself with SIGKILL at step 20; fit() must raise.
actor: a plain Ray actor calls jdp.initialize(), which must refuse ("ACTOR <outcome>").
Runs the modes in order on one cluster; prints "FIT <mode> OK" or "FIT <mode> FAILED <type>:
<message on one line>" for each.
"""
import os
import signal
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer


def train(config):
    import _engine_train

    import jdp.distributed
    _engine_train.main()
    # both workers run on this one node: what shard_params="node" multiplies its devices by
    print(f"NODE {jdp.process_index()} {jdp.distributed.processes_per_node()}", flush=True)


def kill(config):
    import jax
    import numpy as np

    import jdp
    jdp.initialize()
    f = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
    for step in range(10**6):
        if step == 20 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        f(np.ones(1, np.float32)).block_until_ready()


@ray.remote
class PlainActor:
    """A Ray actor outside Ray Train: jdp.initialize() must refuse, not train alone."""

    def start(self) -> str:
        import jdp
        try:
            jdp.initialize()
            return "OK"
        except ValueError as e:
            return f"ValueError: {e}"


def main(storage: str, *modes: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for mode in modes:
            if mode == "actor":
                print(f"ACTOR {ray.get(PlainActor.remote().start.remote())}", flush=True)
            else:
                fit(mode, storage)
    finally:
        ray.shutdown()


def fit(mode: str, storage: str) -> None:
    try:
        JaxTrainer({"train": train, "kill": kill}[mode],
                   scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name=mode, storage_path=storage)).fit()
        print(f"FIT {mode} OK", flush=True)
    except Exception as e:   # noqa: BLE001 -- the test reads the error
        print(f"FIT {mode} FAILED {type(e).__name__}: {' '.join(str(e).split())}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
