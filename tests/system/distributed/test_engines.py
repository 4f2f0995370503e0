"""Jobs started by other engines join as one job, or stop with a one-line error.

Each case runs 2 real processes here with exactly the environment that engine gives them:
JAX's own coordinator variables, the pods of the Kubernetes manifests in examples/kubernetes/
(parsed; each pod's environment derived from them; the pods' DNS names pointed at 127.0.0.1
and the coordinator's port at a free one, see _k8s_pod/ beside this file). Their losses must
equal those of the same job started by torchrun's variables. Ray: test_ray.py.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import MPIRUN, REPO, child_env, finish, free_port, mpirun_command, run_ranks

SCRIPT = os.path.join(REPO, "tests", "system", "distributed", "_engine_train.py")
POD_SHIM = os.path.join(REPO, "tests", "system", "distributed", "_k8s_pod")
MANIFESTS = os.path.join(REPO, "examples", "kubernetes")


def start(envs, args=(SCRIPT,)):
    """One process per environment (stdout and stderr merged), 1 CPU device each."""
    return [subprocess.Popen([sys.executable, *args], cwd=REPO, env=child_env(1, **env),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for env in envs]


def losses(logs):
    """The losses each process printed ("LOSSES rank count [...]"), by rank."""
    found = {}
    for log in logs:
        line = next((ln for ln in log.splitlines() if ln.startswith("LOSSES ")), None)
        assert line is not None, log
        rank, count, values = line.split(" ", 3)[1:]
        assert count == "2", log
        found[int(rank)] = values
    return [found[0], found[1]]


@pytest.fixture(scope="module")
def torchrun_losses():
    """The reference: the same loop as a 2-process job started by torchrun's variables."""
    codes, logs = run_ranks([SCRIPT], timeout=120, devices=1)
    assert codes == [0, 0], logs
    assert all("joined as process" in log and "via torchrun's variables" in log for log in logs)
    found = losses(logs)
    assert found[0] == found[1]
    return found[0]


def test_jax_variables_join_with_the_losses_of_torchruns(torchrun_losses):
    address = f"127.0.0.1:{free_port()}"
    procs = start([{"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(r)} for r in (0, 1)])
    logs = finish(procs, 120)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert losses(logs) == [torchrun_losses, torchrun_losses]
    assert "jdp: joined as process 1 of 2 via JAX's variables" in logs[1]


def pod_environments(manifest: str, port: int, dns_misses: int = 0) -> list[dict]:
    """What Kubernetes gives each pod of `manifest` (an Indexed Job + headless Service, or a
    JobSet of one Indexed Job) plus the variables the manifest sets; the test-only shim plays
    the pod's FQDN and DNS, and MASTER_PORT moves the coordinator to a free port here."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(open(os.path.join(MANIFESTS, manifest)))}
    if "JobSet" in docs:
        jobset = docs["JobSet"]
        (replicated,) = jobset["spec"]["replicatedJobs"]
        assert replicated["replicas"] == 1
        job = replicated["template"]
        subdomain = jobset["spec"]["network"].get("subdomain", jobset["metadata"]["name"])
        prefix = f"{jobset['metadata']['name']}-{replicated['name']}-0"
    else:
        job, service = docs["Job"], docs["Service"]
        subdomain = job["spec"]["template"]["spec"]["subdomain"]
        assert service["metadata"]["name"] == subdomain and service["spec"]["clusterIP"] == "None"
        prefix = job["metadata"]["name"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    (container,) = spec["template"]["spec"]["containers"]
    manifest_env = {e["name"]: e["value"] for e in container.get("env", [])}
    return [{**manifest_env, "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{prefix}-{i}",
             "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
             "MASTER_PORT": str(port), "PYTHONPATH": POD_SHIM + os.pathsep + REPO,
             "JDP_TEST_POD_FQDN": f"{prefix}-{i}.{subdomain}.default.svc.cluster.local",
             "JDP_TEST_POD_DOMAIN": subdomain, "JDP_TEST_DNS_MISSES": str(dns_misses)}
            for i in range(spec["completions"])]


@pytest.mark.parametrize("manifest, dns_misses", [("indexed-job.yaml", 2), ("jobset.yaml", 0)])
def test_kubernetes_pods_from_the_example_manifests_join(torchrun_losses, manifest, dns_misses):
    """The Indexed Job's pod 0 is not published yet when each pod first looks: they wait."""
    envs = pod_environments(manifest, free_port(), dns_misses)
    assert envs[0]["WORLD_SIZE"] == "2" and len(envs) == 2
    logs = finish(start(envs), 120)
    assert losses(logs) == [torchrun_losses, torchrun_losses], logs
    assert "jdp: joined as process 1 of 2 via Kubernetes" in logs[1]
    if dns_misses:
        assert all("jdp: waiting for mnist-0.mnist (process 0) to resolve" in log for log in logs)


def test_an_indexed_job_pod_with_nothing_mapped_is_a_one_line_error_on_every_pod():
    envs = [{k: v for k, v in env.items() if k != "WORLD_SIZE"}
            for env in pod_environments("indexed-job.yaml", free_port())]
    procs = start(envs)
    logs = finish(procs, 60)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 1, log
        assert "process 0 of 1" not in log and "LOSSES" not in log
        error = log.strip().splitlines()[-1]
        assert error.startswith("ValueError: a Kubernetes Indexed Job pod"), log
        assert "without a process count: set WORLD_SIZE" in error


def test_a_rank_started_with_another_world_size_is_refused_on_both_sides():
    port = str(free_port())
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": w, "RANK": str(r)}
            for r, w in ((0, "2"), (1, "3"))]
    procs = start(envs)
    logs = finish(procs, 60)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 1, log
        assert ("ValueError: process 1 was started for a job of 3 processes but process 0 for "
                "2") in log, log
        assert "LOSSES" not in log


SPINNING = """
import os, jax, numpy as np, jdp
jdp.initialize()
f = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
f(np.ones(1, np.float32)).block_until_ready()
print(f"READY {jax.process_index()} {os.getpid()}", flush=True)
while True:
    f(np.ones(1, np.float32)).block_until_ready()
"""


def spinning_job(way: str, script: str) -> list:
    """The 2 ranks of SPINNING started `way`: one process each, or one mpirun for both."""
    if way == "mpirun":
        return [subprocess.Popen(
            mpirun_command(script, ("JAX_PLATFORMS", "PYTHONPATH", "XLA_FLAGS")), cwd=REPO,
            env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    port = str(free_port())
    return start([{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                   "RANK": str(r)} for r in (0, 1)], args=(script,))


@pytest.mark.parametrize("way, killed", [("torchrun", 0), ("torchrun", 1), ("mpirun", 1)])
def test_a_killed_peer_is_named_by_the_survivor_within_seconds(tmp_path, way, killed):
    """No jdp launcher: rank `killed` gets SIGKILL mid-collective; the other names it."""
    if way == "mpirun" and MPIRUN is None:
        pytest.skip("mpirun (Open MPI) is not installed")
    script = tmp_path / "spin.py"
    script.write_text(SPINNING)
    procs, pids = spinning_job(way, str(script)), {}
    try:
        for p in procs:
            for line in p.stdout:   # mpirun may run both ranks' lines together on one line
                found = re.findall(r"READY (\d) (\d+)", line)
                pids.update((int(rank), int(pid)) for rank, pid in found)
                if len(pids) == 2 or (found and way != "mpirun"):
                    break
        start_s = time.monotonic()
        os.kill(pids[killed], signal.SIGKILL)
        survivor = procs[0] if way == "mpirun" else procs[1 - killed]
        rest = survivor.communicate(timeout=10)[0]
        waited = time.monotonic() - start_s
    finally:
        finish(procs, 10)
    print(f"{way}: the survivor of a killed process {killed} exited {waited:.2f} s after the kill")
    assert survivor.returncode != 0
    assert f"jdp: process {1 - killed} lost process {killed} of the job" in rest, rest


POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "mnist-1"}


@pytest.mark.parametrize("env, engine, coordinates", [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"},
     "torchrun's variables", ("h:9", 2, 1)),
    ({"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     "JAX's variables", ("h:9", 4, 3)),
    ({**POD, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "mnist-0.mnist", "MASTER_PORT": "9"},
     "torchrun's variables", ("mnist-0.mnist:9", 2, 1)),    # mapped by hand: RANK wins
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     "srun", (None, None, None)),
    ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun", (None, None, None)),
    ({"HOME": "/root"}, None, None),
])
def test_each_engine_is_read_from_its_own_variables(env, engine, coordinates):
    # private: the internals this test checks have no public name
    from jdp.distributed import _engines
    found = _engines.detect(env)
    assert (found and found.engine) == engine
    assert (found and tuple(found[1:4])) == coordinates


@pytest.mark.parametrize("env, words", [
    ({"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_PROCESS_ID": "0"},
     ["JAX_COORDINATOR_ADDRESS=h:9", "JAX_NUM_PROCESSES not"]),
    ({**POD, "WORLD_SIZE": "2"}, ["JOB_COMPLETION_INDEX=1", "mnist-1", "no subdomain"]),
    ({**POD, "WORLD_SIZE": "2", "HOSTNAME": "other"}, ["does not end in -1", "Indexed"]),
    ({"JDP_CLUSTER_DETECTION": "k8s"}, ["JDP_CLUSTER_DETECTION=k8s", "not a pod"]),
])
def test_an_engine_seen_without_what_it_needs_is_a_one_line_error(env, words):
    from conftest import one_line_error

    # private: the internals this test checks have no public name
    from jdp.distributed import _init
    one_line_error(ValueError, words, _init._plan, None, None, None, None, None, env)


@pytest.mark.parametrize("env, count", [
    ({"LOCAL_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 4),   # jdp.launch, torchrun
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),                            # mpirun
    ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, 4),         # srun, sbatch's list
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2(x2)", "SLURM_TASKS_PER_NODE": "8", "SLURM_NODEID": "2"},
     2),                                                                 # the step's own list
    ({"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4"}, 1),   # one per machine
    ({"HOME": "/root"}, 1),
])
def test_each_engine_says_how_many_processes_share_a_node(env, count):
    """What shard_params="node" multiplies this process's devices by (Ray: test_ray.py)."""
    from jdp.distributed import processes_per_node
    assert processes_per_node(env) == count


SLOW_TO_REPORT = """
import sys, time
import numpy as np, optax, jdp
jdp.initialize()
report = sys.excepthook   # jdp's
def slowly(*exc):   # process 1 is slow to report its error, as on a loaded machine
    time.sleep(0.5 * jdp.process_index())
    report(*exc)
sys.excepthook = slowly
"""
BAD_OPTION = """
jdp.train_step(lambda params, batch: 0.0, accum_steps=0)
print("NOT REFUSED")
"""
UNEQUAL = """
state = jdp.TrainState.create(apply_fn=None, params={"w": np.zeros((4, 8, 8), np.float32)},
                              tx=optax.sgd(0.1))
jdp.broadcast(state, shard_params="node")
print("NOT REFUSED")
"""


def each_refuses(tmp_path, body: str, words: list, devices=(1, 1), local_sizes=None) -> None:
    """Two processes run `body` (process 1 slow to report an error) and each exits 1 with
    a one-line ValueError holding `words`: none ends the job before the other has said it."""
    from conftest import write_script
    script = write_script(tmp_path, "refused.py", SLOW_TO_REPORT + body)
    address = f"127.0.0.1:{free_port()}"
    sizes = {} if local_sizes is None else {"OMPI_COMM_WORLD_LOCAL_SIZE": local_sizes}
    procs = [subprocess.Popen([sys.executable, script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=child_env(devices[r], JAX_COORDINATOR_ADDRESS=address,
                                            JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(r),
                                            **{k: v[r] for k, v in sizes.items()}))
             for r in (0, 1)]
    logs = finish(procs, 120)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 1 and "NOT REFUSED" not in log, log
        error = log.strip().splitlines()[-1]
        assert error.startswith("ValueError: ") and all(w in error for w in words), log


def test_a_bad_step_option_every_process_gives_is_a_one_line_error_on_each(tmp_path):
    """Every process makes the same step, so each refuses the same bad option at once."""
    each_refuses(tmp_path, BAD_OPTION, ["accum_steps=0"])


@pytest.mark.parametrize("devices, local_sizes, words", [
    ((1, 2), ("1", "1"), ["jdp.broadcast: the processes hold different numbers of devices",
                          "process 0 has 1, process 1 has 2", "--devices_per_process"]),
    ((2, 2), ("1", "2"), ['shard_params="node": the processes disagree on devices per node',
                          "2 on process(es) 0 but 4 on process(es) 1", "shard_params=k"]),
])
def test_processes_of_unequal_devices_or_nodes_are_a_one_line_error_on_each(
        tmp_path, devices, local_sizes, words):
    """Processes with different device counts cannot share one data mesh, and nodes of
    different sizes cannot split a model alike: each process says so, none hangs, and
    process 0 does not end the job before process 1, slow to report, has said it too."""
    each_refuses(tmp_path, UNEQUAL, words, devices, local_sizes)
