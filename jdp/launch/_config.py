"""One launch's settings, checked once: `LaunchConfig`, what the launcher's functions read.

`python -m jdp.launch` parses its command line, checks every value (a bad one exits 2 before
anything starts, `_cli`), and freezes the result here; the rounds, the ranks' environments and
the supervisor's limits read it, and nothing changes it afterwards.
"""
from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The launcher's options after their checks (see `python -m jdp.launch --help`)."""

    script: str
    script_args: tuple = ()
    nproc_per_node: int = 1
    nnodes: int = 1                    # the most nodes (MAX of an elastic MIN:MAX)
    min_nodes: int | None = None       # MIN of an elastic --nnodes MIN:MAX; None: fixed
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None     # None: a free port per round (one node)
    rdzv_port: int | None = None
    rdzv_timeout: float | None = None
    max_restarts: int = 0
    logdir: str | None = None
    redirect_stdout_and_stderr: bool = False
    progress_timeout: float | None = None
    stop_grace: float | None = None
    devices_per_process: int | None = None
    module: bool = False
    no_python: bool = False
    compilation_cache: str | None = None
    profile_steps: str | None = None
    replica_group: int | None = None   # --replica_group G of --replica_groups R (None: no FT)
    replica_groups: int | None = None
    ft_lighthouse: str | None = None   # "start:PORT", "http://HOST:PORT", or None (inherited)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchConfig:
        """The config of checked command-line arguments (`_cli.parse_args`)."""
        values = {f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)}
        return cls(**{**values, "script_args": tuple(values["script_args"])})
