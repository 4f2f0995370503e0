"""Which engine started this process, and where it sits in the job: one function per engine.

Each function reads only what its engine puts in the environment (the table "Starting a job"
in docs/launch.md) and returns a `Found`, or None when the engine's signs are absent. A sign
without the rest (a Kubernetes Indexed Job pod without a process count, ...) is a one-line
ValueError naming what was found and what is missing, never a silent single-process job.
`detect` asks them in `ENGINES` order; the first that answers decides.
"""
from __future__ import annotations

import socket
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

from jdp.job import env as _env
from jdp.job import net as _net

K8S_PORT = 29500   # the coordinator's port in a Kubernetes pod unless MASTER_PORT says otherwise


class Found(NamedTuple):
    """A job's coordinates as one engine gives them; None: not given by it."""
    engine: str                   # named in "jdp: joined as process k of n via <engine>"
    coordinator: str | None       # "host:port" of process 0; None: agreed later, or by JAX
    num_processes: int | None
    process_id: int | None
    cluster: str | None = None    # JAX's cluster detection method, when JAX finds the rest
    late_dns: bool = False        # the coordinator's name may be published late: retry it


def torchrun(env: Mapping[str, str]) -> Found | None:
    """jdp.launch, torchrun, the Kubeflow PyTorchJob, or a user setting them by hand."""
    names = (_env.MASTER_ADDR, _env.MASTER_PORT, _env.WORLD_SIZE, _env.RANK)
    if not any(n in env for n in names):
        return None
    coordinator = None
    if _env.MASTER_ADDR in env and _env.MASTER_PORT in env:
        port = integer(env, _env.MASTER_PORT, "the coordinator's TCP port (e.g. MASTER_PORT=29500)")
        coordinator = _net.join_host_port(env[_env.MASTER_ADDR], port)
    return Found("torchrun's variables", coordinator,
                 _maybe(env, _env.WORLD_SIZE, "the number of processes"),
                 _maybe(env, _env.RANK, "this process's index, 0 <= RANK < WORLD_SIZE"),
                 late_dns=_in_a_pod(env))


def jax_variables(env: Mapping[str, str]) -> Found | None:
    """JAX_COORDINATOR_ADDRESS (read by JAX itself) with JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (JAX reads neither: jdp does)."""
    if "JAX_COORDINATOR_ADDRESS" not in env or _env.RANK in env:
        return None
    found = Found("JAX's variables", env["JAX_COORDINATOR_ADDRESS"],
                  _maybe(env, "JAX_NUM_PROCESSES", "the number of processes"),
                  _maybe(env, "JAX_PROCESS_ID", "this process's index below JAX_NUM_PROCESSES"),
                  late_dns=_in_a_pod(env))
    missing = [n for n, v in (("JAX_NUM_PROCESSES", found.num_processes),
                              ("JAX_PROCESS_ID", found.process_id)) if v is None]
    if missing:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS={found.coordinator} is set but "
                         f"{' and '.join(missing)} not; set both on every process (or start "
                         "it with `python -m jdp.launch`)")
    return found


def kubernetes(env: Mapping[str, str]) -> Found | None:
    """An Indexed Job (or a JobSet, whose Jobs are Indexed) with a headless Service: the rank
    is JOB_COMPLETION_INDEX, process 0 is the pod named like this one with index 0, in this
    pod's subdomain; the manifest sets WORLD_SIZE (Kubernetes tells a pod no process count)."""
    if ("KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env
            or _env.RANK in env or _env.MASTER_ADDR in env):
        return None
    index = integer(env, "JOB_COMPLETION_INDEX", "this pod's index in its Indexed Job")
    hostname = env.get("HOSTNAME") or socket.gethostname()
    what = f"a Kubernetes Indexed Job pod (JOB_COMPLETION_INDEX={index}, hostname {hostname})"
    if _env.WORLD_SIZE not in env:
        raise ValueError(f"{what} without a process count: set WORLD_SIZE in the manifest to "
                         "the Job's completions (see examples/kubernetes/)")
    if not hostname.endswith(f"-{index}"):
        raise ValueError(f"{what}: its hostname does not end in -{index}, so process 0's name "
                         "cannot be derived; use an Indexed Job (completionMode: Indexed)")
    subdomain = _subdomain(hostname)
    if subdomain is None:
        raise ValueError(f"{what} has no subdomain, so process 0 cannot be reached by name: "
                         "set spec.template.spec.subdomain to a headless Service's name "
                         "(see examples/kubernetes/)")
    host = f"{hostname[:-len(str(index))]}0.{subdomain}"
    port = integer(env, _env.MASTER_PORT, "the coordinator's TCP port") if (
        _env.MASTER_PORT in env) else K8S_PORT
    return Found("Kubernetes", _net.join_host_port(host, port),
                 integer(env, _env.WORLD_SIZE, "the number of pods (the Job's completions)"),
                 index, late_dns=True)


def _in_a_pod(env: Mapping[str, str]) -> bool:
    """In a Kubernetes pod, process 0's name (mapped by hand) may be published late too."""
    return "KUBERNETES_SERVICE_HOST" in env


def _subdomain(hostname: str) -> str | None:
    """The pod's subdomain: the label after its hostname in its FQDN (kubelet's /etc/hosts)."""
    fqdn = socket.getfqdn(hostname)
    if fqdn.startswith(hostname + ".") and len(fqdn) > len(hostname) + 1:
        return fqdn[len(hostname) + 1:].split(".", 1)[0]
    return None


def slurm(env: Mapping[str, str]) -> Found | None:
    """srun with more than one task: JAX's SLURM detection reads the rest."""
    if not _srun_step(env):
        return None
    if integer(env, "SLURM_NTASKS", "the number of SLURM tasks") <= 1:
        return None
    return Found("srun", None, None, None, cluster="slurm")


def _srun_step(env: Mapping[str, str]) -> bool:
    """A task of a job step that srun started: its step's variables, and a step id that is
    not one of SLURM's own (the batch script's, the extern and interactive steps': >= 2^32-256)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return (all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID"))
            and not (step.isdigit() and int(step) >= 2**32 - 256))


def slurm_allocation(env: Mapping[str, str]) -> str | None:
    """The warning for a process started without srun inside a SLURM allocation of several
    tasks (`python train.py` in salloc's shell or an sbatch script), which would train alone
    as process 0 of 1; None elsewhere."""
    if "SLURM_JOB_ID" not in env or _srun_step(env):
        return None
    tasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))
    nodes = env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1"))
    if not (tasks.isdigit() and int(tasks) > 1 or nodes.isdigit() and int(nodes) > 1):
        return None
    return (f"jdp: SLURM job {env['SLURM_JOB_ID']} was allocated {tasks} task(s) on {nodes} "
            "node(s), but this process was not started by srun (no job step): these variables "
            "come from the allocation, not from srun, so it trains alone as process 0 of 1; run "
            "`srun python ...` to start one process per task")


def open_mpi(env: Mapping[str, str]) -> Found | None:
    """mpirun (Open MPI) with more than one process: JAX's Open MPI detection reads the rest."""
    if "OMPI_MCA_orte_hnp_uri" not in env:
        return None
    if integer(env, "OMPI_COMM_WORLD_SIZE", "the Open MPI world size") <= 1:
        return None
    return Found("mpirun", None, None, None, cluster="ompi")


def cluster_coordinates(method: str, timeout_s: float) -> tuple[str, int, int, list[int]]:
    """(coordinator, process count, process id, local device ids) of an mpirun ("ompi") or
    srun ("slurm") job, exactly as JAX's own detection finds them: asked before joining, so
    that jdp's roll call (a missing process named, the count agreed, a lost or finished one
    named, a peer asked where it is) runs under mpirun and srun too."""
    # Private, for want of a public API: JAX's cluster classes are what
    # jax.distributed.initialize asks when given a cluster_detection_method.
    from jax._src.clusters import ClusterEnv
    found = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, method,
                                                            int(timeout_s))
    return found[0], found[1], found[2], list(found[3] or [])


def ray_train(env: Mapping[str, str]) -> Found | None:
    """A Ray Train worker (JaxTrainer, TorchTrainer, ...): rank and size from Ray's context;
    process 0's address is agreed through Ray when joining (`ray_coordinator`)."""
    context = ray_train_context()
    if context is None:
        return None
    world = context.get_world_size()
    return None if world is None else Found("Ray Train", None, world, context.get_world_rank())


def ray_train_context():
    """Ray Train's context when this process is one of its workers, else None. Ray is only
    asked when this process already imported it, so jdp never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    import ray.train
    try:
        context = ray.train.get_context()
        context.get_world_size()   # raises outside a Ray Train worker
    except (RuntimeError, AttributeError, DeprecationWarning):   # not a Ray Train worker
        return None
    return context


def ray_coordinator() -> str:
    """Process 0 picks its node's address and a free port; Ray hands it to every worker."""
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    address = None
    if ray.train.get_context().get_world_rank() == 0:
        host = ray.util.get_node_ip_address()
        address = _net.join_host_port(host, _net.free_port(host))
    return broadcast_from_rank_zero(address)


def wait_for_address(host: str, timeout_s: float) -> str:
    """`host`'s address, asking again each second until `timeout_s` (a pod's DNS record may
    appear after the pod starts); ValueError naming it when it never resolves."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            return _net.resolve(host, 0)[1][0]
        except (OSError, UnicodeError):
            if time.monotonic() >= deadline:
                raise ValueError(f"process 0's name {host!r} did not resolve within "
                                 f"{timeout_s:g} s; check that a headless Service named like "
                                 "the pods' subdomain exists (or raise JDP_INIT_TIMEOUT)") from None
        if not said:
            print(f"jdp: waiting for {host} (process 0) to resolve", file=sys.stderr, flush=True)
            said = True
        time.sleep(1.0)


def check_local_world(env: Mapping[str, str], num_processes: int | None,
                      process_id: int | None) -> None:
    """LOCAL_WORLD_SIZE (the processes on this node: shard_params="node", a GPU per process)
    comes with RANK and WORLD_SIZE from every launcher: alone it is left over from another
    job, and above the process count it cannot be right; either would size nodes wrongly."""
    if _env.LOCAL_WORLD_SIZE not in env:
        return
    local = integer(env, _env.LOCAL_WORLD_SIZE, "the processes on this node")
    if num_processes is None and _env.WORLD_SIZE in env:
        num_processes = integer(env, _env.WORLD_SIZE, "the number of processes")
    if num_processes is None and process_id is None and _env.RANK not in env:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} is set but RANK and WORLD_SIZE are not: "
                         "it is left over from another job (unset it), or start the job with "
                         f"`python -m jdp.launch --nproc_per_node {local} script.py`")
    if num_processes is not None and local > num_processes:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} is above WORLD_SIZE={num_processes}: a node "
                         "cannot hold more processes than the job; set LOCAL_WORLD_SIZE to the "
                         "processes on this node (or unset it)")


# The order in which engines are asked. JAX's variables and Kubernetes before torchrun's
# (their manifests may set WORLD_SIZE alone), but both step aside where RANK is set (torchrun
# inside a pod, or a manifest that maps RANK by hand).
ENGINES = (jax_variables, kubernetes, torchrun, slurm, open_mpi, ray_train)


def find(method: str | None, env: Mapping[str, str]) -> Found | None:
    """The engine that started this process (`detect`), or the cluster detection asked for
    through `cluster_detection_method` / JDP_CLUSTER_DETECTION ("k8s": jdp's own)."""
    method = method or env.get(_env.CLUSTER_DETECTION) or None
    if method in ("k8s", "kubernetes"):
        if (found := kubernetes(env)) is None:
            raise ValueError(f"{_env.CLUSTER_DETECTION}={method} but this process is not a pod "
                             "of an Indexed Job (no JOB_COMPLETION_INDEX, or RANK/MASTER_ADDR "
                             "set); see examples/kubernetes/")
        return found
    if method:
        return Found(f"JAX's cluster detection ({method})", None, None, None, method)
    return detect(env)


def detect(env: Mapping[str, str]) -> Found | None:
    """The first engine whose signs are in `env`, or None: a plain single process."""
    for engine in ENGINES:
        if (found := engine(env)) is not None:
            return found
    _plain_ray_actor()
    return None


def _plain_ray_actor() -> None:
    """A Ray actor outside Ray Train has no job description: refused with one line, since
    each actor would otherwise train alone as process 0 of 1. Ray is only asked when this
    process already imported it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    try:
        actor = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - an older or partial Ray: nothing to say
        return
    if actor is not None:
        raise ValueError(
            f"jdp.initialize(): this process is a Ray actor ({actor}) outside Ray Train, so "
            "nothing says how many processes the job has or which one this is; run the "
            "training function under ray.train's JaxTrainer (examples/ray_train.py), or give "
            "each actor MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (WORLD_SIZE=1 to train "
            "alone)")


def integer(env: Mapping[str, str], name: str, meaning: str) -> int:
    """Integer environment variable `name`; ValueError naming it and what it means."""
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; it must be {meaning}") from None
    if value < 0:
        raise ValueError(f"{name}={value} is negative; it must be {meaning}")
    return value


def _maybe(env: Mapping[str, str], name: str, meaning: str) -> int | None:
    return integer(env, name, meaning) if name in env else None
