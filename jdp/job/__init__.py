"""The job's contract: what a launcher and its ranks agree on. Standard library only.

jdp's bottom floor. The launcher (`jdp.launch`, `jdp.spawn`) and the ranks' side
(`jdp.initialize`, the train step, the Loader, the Checkpointer) both import it, and it imports
neither, so the launcher sits on top of the library instead of under it:

- `env`: the names of the environment variables a rank is started with;
- `events`: a JSON-lines events file a rank appends to and its launcher reads (replica
  groups' commits, discards, heals);
- `progress`: each rank's progress slot and the preemption flag;
- `peers`: the connections between a job's processes (a lost one named, where a peer is);
- `rank`: the rank side's state, in one object (`current()`), and `preempted`;
- `watchdog`: the judgment of who is behind when a job stops moving, and stack dumps as
  tracebacks;
- `outcome`: how a round of ranks ended (one tagged type), its exit status and its one report;
- `net`: port checks and the wire format (JSON lines over TCP);
- `run`: the rank-side runner (run by path) and the prompt exits a failing rank leaves by;
- `malloc`: the allocator settings a launcher puts in a rank's environment and a rank applies;
- `values`: how every public function and launcher option checks the values it is given.
"""
from jdp.job import (
    env,
    events,
    malloc,
    net,
    outcome,
    peers,
    progress,
    rank,
    run,
    values,
    watchdog,
)
from jdp.job.outcome import EXIT_STALLED
from jdp.job.rank import preempted

__all__ = ["EXIT_STALLED", "env", "events", "malloc", "net", "outcome", "peers", "preempted",
           "progress", "rank", "run", "values", "watchdog"]
