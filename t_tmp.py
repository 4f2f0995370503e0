import sys; sys.path[:0] = ["tests/system/ft", "examples"]
import ft_replay, numpy as np, optax
D = sys.argv[1]; outer = None if len(sys.argv) < 3 else optax.sgd(float(sys.argv[2]), momentum=0.9, nesterov=True)
rec = ft_replay.syncs([ft_replay.events(__import__("pathlib").Path(f"{D}/ev{g}.jsonl")) for g in range(3)])
want = ft_replay.replay_syncs(rec, 3, 8, 32, 0.01, outer)
fin = [np.load(f"{D}/p{g}.npz") for g in range(3)]
for k, v in want.items():
    print(k, max(np.abs(f[k] - v).max() for f in fin), all(f[k].tobytes() == fin[0][k].tobytes() for f in fin))
