"""Child-side entry point: run a rank's code and leave promptly with its own exit code.

The launcher runs each Python child as ``python -u /path/to/jdp/_run.py script.py args...`` (or
``... _run.py -m module args...``, or ``... _run.py --exec program args...`` for --no_python);
`jdp.spawn` runs ``... _run.py --spawn payload.pkl``. It is run by path, not with
``-m jdp._run``, so that jax is not imported before the user's script (which may set
JAX_PLATFORMS or XLA_FLAGS itself); for the same reason it loads its two standard-library
siblings, jdp/_env.py and jdp/_exit.py, by path rather than through the `jdp` package.

Before the user's code runs it: arranges (Linux) to be killed if the supervisor
($JDP_SUPERVISOR_PID) dies, even by SIGKILL; makes SIGUSR1 dump every Python thread's stack
into $JDP_STACK_FILE (the progress watchdog's view of a stuck rank). A failing rank (an
exception, or `sys.exit(n)` with n != 0) prints its traceback and leaves at once with its own
code (jdp/_exit.py says why); a rank that succeeds exits normally, so JAX's shutdown barrier
still lines up the ranks that finish together.
"""
import sys

if __name__ == "__main__":
    # Run as a file, sys.path[0] is jdp/ itself, whose modules (data, state, ...) would shadow
    # top-level packages of the same name: drop it before importing anything else.
    del sys.path[0]

import faulthandler  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
from collections.abc import Callable  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """Load jdp/<name>.py by path under a private name, without importing the jdp package."""
    spec = importlib.util.spec_from_file_location(f"_jdp_runner{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_env = _sibling("_env")
_exit = _sibling("_exit")
_stack_file = None   # kept open: faulthandler writes to its descriptor


def guarded(target: Callable[[], object]) -> None:
    """Call `target`; on failure leave the process at once with the failure's exit code.

    `sys.exit(0)` and normal returns come back to the caller, so the interpreter exits the
    usual way (atexit handlers included).
    """
    try:
        target()
    except SystemExit as e:
        code = _exit.system_exit_code(e)
        if code == 0:
            return
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what Python prints for sys.exit("message")
        _exit.exit_now(code)
    except KeyboardInterrupt:
        _exit.report_failure(130)
    except BaseException:  # noqa: B036 - every failure must leave promptly
        _exit.report_failure(1)


def _run_script(argv: list) -> None:
    """Run `argv[0]` as __main__ with `argv` as sys.argv, as `python script.py` would."""
    path = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def _run_module(argv: list) -> None:
    """Run module `argv[0]` as __main__, as `python -m module` would."""
    sys.argv = [argv[0], *argv[1:]]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def _run_spawned(payload: str) -> None:
    """Run one `jdp.spawn` rank: the parent's sys.path and __main__, initialize, fn(rank, *args).

    The payload holds two pickles: multiprocessing's preparation data (sys.path, cwd, how to
    import the parent's __main__), then (fn, args). It is deleted as soon as it is read (it
    holds the parent's authkey), once every rank has read it: the last reader removes it.
    While it loads, JDP_SPAWN_BOOTSTRAP is set, so a `jdp.spawn` call at the top level of the
    parent's script fails clearly.
    """
    import multiprocessing.spawn
    os.environ[_env.SPAWN_BOOTSTRAP] = "1"
    with open(payload, "rb") as f:
        preparation = pickle.load(f)
        data = f.read()
    _mark_read(payload)
    multiprocessing.spawn.prepare(preparation)
    fn, args = pickle.loads(data)
    del os.environ[_env.SPAWN_BOOTSTRAP]
    from jdp.distributed import initialize
    initialize()
    fn(int(os.environ[_env.RANK]), *args)


def _mark_read(payload: str) -> None:
    """Leave a `read.RANK` mark beside the payload; the rank that completes the set deletes it."""
    directory = os.path.dirname(payload)
    open(os.path.join(directory, f"read.{os.environ[_env.RANK]}"), "w").close()
    world = int(os.environ[_env.WORLD_SIZE])
    if all(os.path.exists(os.path.join(directory, f"read.{r}")) for r in range(world)):
        try:
            os.unlink(payload)
        except FileNotFoundError:
            pass


def die_with_supervisor() -> None:
    """Linux: get SIGKILL when the supervisor ($JDP_SUPERVISOR_PID) dies; no rank outlives it.

    Done here rather than in a Popen preexec_fn: that would force a plain fork of a
    multithreaded parent (JAX warns about it) instead of CPython's faster vfork. The setting
    survives exec, so --no_python programs get it too.
    """
    parent = os.environ.pop(_env.SUPERVISOR_PID, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the supervisor died before prctl took effect
        os._exit(1)


def stacks_on_sigusr1() -> None:
    """Make SIGUSR1 write every Python thread's stack to $JDP_STACK_FILE (faulthandler).

    faulthandler writes from the signal handler in C, so it works while the main thread is
    blocked anywhere, in a sleep, a lock or a collective, without the rank's cooperation.
    """
    global _stack_file
    path = os.environ.get(_env.STACK_FILE)
    if not path:
        return
    try:
        _stack_file = open(path, "w")
    except OSError:
        return
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def main(argv: list) -> None:
    """Dispatch on the first argument: `--spawn PAYLOAD`, `--exec PROGRAM ...`, `-m MODULE ...`
    or `SCRIPT ...`."""
    die_with_supervisor()
    if not argv:
        sys.exit("usage: _run.py [--spawn PAYLOAD | --exec PROGRAM | -m MODULE | SCRIPT] [ARGS]")
    if argv[0] == "--exec":
        os.execvp(argv[1], argv[1:])
    stacks_on_sigusr1()
    if argv[0] == "--spawn":
        guarded(lambda: _run_spawned(argv[1]))
    elif argv[0] == "-m":
        guarded(lambda: _run_module(argv[1:]))
    else:
        guarded(lambda: _run_script(argv[1:] if argv[0] == "--" else argv))


if __name__ == "__main__":
    main(sys.argv[1:])
