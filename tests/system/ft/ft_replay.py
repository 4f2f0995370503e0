"""The independent reference for the replica-group tests: single-device optax replaying a
run's recorded quorum history on the examples each group read at each step."""
import json
import pathlib

import fault_tolerant as example
import jax
import numpy as np
import optax

from jdp.data import DistributedSampler


def events(path: pathlib.Path) -> list:
    """The record's events; a last line still being written (no newline yet) is left for
    the next read."""
    lines = path.read_text().split("\n") if path.exists() else []
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _merged(event_lists: list, row) -> dict:
    """step -> `row(commit event)`, merged over every group's record; a step recorded two
    ways is a failure of the test."""
    merged: dict = {}
    for evs in event_lists:
        for e in evs:
            if e["event"] == "commit":
                seen = merged.setdefault(e["step"], row(e))
                assert seen == row(e), f"step {e['step']}: {seen} and {row(e)} ({e})"
    return merged


def history(event_lists: list) -> dict:
    """step -> the groups that committed it, merged over every group's record."""
    return _merged(event_lists, lambda e: e["groups"])


def group_batch(group: int, groups: int, step: int, batch_size: int,
                processes: int = 1) -> np.ndarray:
    """The example indices group `group` read at `step` (1-based): each of its processes'
    Loader batch `step - 1` over epochs (drop_last), in process order."""
    rows = []
    for p in range(processes):
        sampler = DistributedSampler(example.EXAMPLES, num_replicas=groups * processes,
                                     rank=group * processes + p, shuffle=True, seed=0)
        epoch, b = divmod(step - 1, len(sampler) // batch_size)
        sampler.set_epoch(epoch)
        rows.append(np.asarray(list(sampler))[b * batch_size:(b + 1) * batch_size])
    return np.concatenate(rows)


def replay(steps: dict, groups: int, batch_size: int, width: int, lr: float,
           processes: int = 1, optimizer: str = "adam") -> dict:
    """The final parameters of single-device optax (the example's `--optimizer`) on the
    concatenated batches of each step's groups."""
    data, params = example.dataset(), example.init_params(width)
    tx = getattr(optax, optimizer)(lr)
    opt_state = tx.init(params)
    grad = jax.jit(jax.grad(example.loss_fn))
    for step in range(1, max(steps) + 1):
        rows = np.concatenate([group_batch(g, groups, step, batch_size, processes)
                               for g in steps[step]])
        g = grad(params, {k: v[rows] for k, v in data.items()})
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def syncs(event_lists: list) -> dict:
    """Semi-synchronous runs: commit -> (its groups, the groups' own steps done at it), merged
    over every group's record (commit 1 is the start, at 0 steps)."""
    return _merged(event_lists, lambda e: (e["groups"], e["inner"]))


def replay_syncs(record: dict, groups: int, batch_size: int, width: int, lr: float,
                 outer=None, processes: int = 1) -> dict:
    """The final parameters of LocalSGD (`outer` None) or DiLoCo (`outer`, an optax
    optimizer) replayed on one device: at each recorded sync, every group in it takes plain
    SGD steps from the last sync's parameters on the batches it read, then their parameters
    are averaged (LocalSGD) or their mean `anchor - params` goes through `outer`."""
    data, anchor = example.dataset(), example.init_params(width)
    outer_state = outer.init(anchor) if outer is not None else None
    grad = jax.jit(jax.grad(example.loss_fn))
    done = 0
    for commit in sorted(record)[1:]:
        members, inner = record[commit]
        finals = []
        for g in members:
            params = anchor
            for step in range(done + 1, inner + 1):
                rows = group_batch(g, groups, step, batch_size, processes)
                g_ = grad(params, {k: v[rows] for k, v in data.items()})
                params = jax.tree.map(lambda p, d: p - lr * d, params, g_)
            finals.append(params)
        if outer is None:
            anchor = jax.tree.map(lambda *ps: np.mean(np.stack(ps), 0), *finals)
        else:
            pseudo = jax.tree.map(lambda a, *ps: np.mean(np.stack([a - p for p in ps]), 0),
                                  anchor, *finals)
            updates, outer_state = outer.update(pseudo, outer_state, anchor)
            anchor = optax.apply_updates(anchor, updates)
        done = inner
    return jax.tree.map(np.asarray, anchor)


def commits(event_lists: list) -> list:
    """Every commit of a semi-synchronous run once, in order: (groups, the step it was sent
    at, the step it merged at, its fragment); the groups' records must agree."""
    merged = _merged(event_lists, lambda e: (e["groups"], e["inner"], e.get("merged", e["inner"]),
                                             e.get("fragment", 0)))
    return [merged[c] for c in sorted(merged)]


def replay_streaming(record: list, groups: int, batch_size: int, width: int, lr: float,
                     parts: tuple, outer=None, processes: int = 1) -> dict:
    """Streaming LocalSGD or DiLoCo replayed on one device, every group in every sync (no
    kills): each group's own SGD trajectory; a fragment's sync takes the groups' fragments at
    the step it was sent, averages them (or their `anchor - params` through `outer`), and at
    the step it merged at sets each group's fragment to the result plus the group's own change
    since it sent."""
    data, init = example.dataset(), example.init_params(width)
    leaves, treedef = jax.tree.flatten(init)
    anchor = [np.asarray(x) for x in leaves]
    states = [outer.init([anchor[i] for i in part]) for part in parts] if outer else None
    params = {g: list(anchor) for g in range(groups)}
    grad = jax.jit(jax.grad(example.loss_fn))
    sent: dict = {}
    last = max(merged for _, _, merged, _ in record)
    for step in range(1, last + 1):
        for g in range(groups):
            rows = group_batch(g, groups, step, batch_size, processes)
            d = jax.tree.leaves(grad(jax.tree.unflatten(treedef, params[g]),
                                     {k: v[rows] for k, v in data.items()}))
            params[g] = [p - lr * x for p, x in zip(params[g], d, strict=True)]
        for c, (members, inner, merged, f) in enumerate(record):
            if inner == step and inner > 0:
                assert members == list(range(groups)), (c, members)
                sent[c] = {g: [params[g][i] for i in parts[f]] for g in range(groups)}
            if merged == step and inner > 0:
                result = _fragment_result(sent[c], [anchor[i] for i in parts[f]], outer,
                                          states, f)
                if outer is not None:
                    result, states[f] = result
                    for i, value in zip(parts[f], result, strict=True):
                        anchor[i] = value
                for g in range(groups):
                    for i, r, s in zip(parts[f], result, sent[c][g], strict=True):
                        params[g][i] = r + (params[g][i] - s)
    return dict(zip(sorted(init), (np.asarray(x) for x in params[0]), strict=True))


def _fragment_result(sent: dict, anchor: list, outer, states, f):
    """LocalSGD: the groups' mean fragment; DiLoCo: (the outer step's new anchor, its state)."""
    if outer is None:
        return [np.mean(np.stack([sent[g][j] for g in sent]), 0) for j in range(len(anchor))]
    pseudo = [np.mean(np.stack([anchor[j] - sent[g][j] for g in sent]), 0)
              for j in range(len(anchor))]
    updates, state = outer.update(pseudo, states[f], anchor)
    return [np.asarray(x) for x in optax.apply_updates(anchor, updates)], state
