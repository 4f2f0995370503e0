"""Input pipeline throughput: JPEG decode + random crop + flip, jdp's Loader vs torch vs Grain.

Every pipeline reads the same source (JPEG images made and encoded here with PIL), and does the
same work per example: decode, a random 112x112 crop, a random horizontal flip, each example's
randomness from its own generator; batches of 32 (uint8 [32, 112, 112, 3] and labels). jdp's
Loader also puts each batch on the device (and waits for it); torch's DataLoader and Grain stop
at host arrays. Workers are started once (torch `persistent_workers`, jdp's pool, Grain's
iterator) and one epoch warms them up; then every pipeline runs one epoch per round, rounds
interleaved (fair on shared cores). The table shows the median images/s and the seconds to the
first batch (worker start-up included).

    python -m benchmarks.bench_input               # prints a markdown table
"""
from __future__ import annotations

import io
import os
import statistics
import time

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

NUM_IMAGES, SIZE, CROP, BATCH = 1024, 128, 112, 32


def make_jpegs(n: int = NUM_IMAGES, seed: int = 0) -> dict[str, np.ndarray]:
    """n smooth RGB images with noise, JPEG-encoded (quality 90), as padded byte rows."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    encoded = []
    for _ in range(n):
        a, b, c = rng.uniform(0.5, 4, 3)
        base = np.stack([np.sin(a * x * 6), np.cos(b * y * 6), np.sin(c * (x + y) * 3)], -1)
        pixels = np.clip((base + 1) * 110 + rng.normal(0, 12, base.shape), 0, 255)
        out = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=90)
        encoded.append(np.frombuffer(out.getvalue(), np.uint8))
    width = max(len(e) for e in encoded)
    rows = np.zeros((n, width), np.uint8)
    for i, e in enumerate(encoded):
        rows[i, :len(e)] = e
    return {"jpeg": rows, "size": np.array([len(e) for e in encoded], np.int32),
            "label": np.arange(n, dtype=np.int32) % 10}


def decode_crop_flip(row: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One example's work: JPEG decode, random CROP x CROP crop, random horizontal flip."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(row[:size].tobytes())).convert("RGB"))
    top, left = rng.integers(0, SIZE - CROP + 1, 2)
    image = image[top:top + CROP, left:left + CROP]
    return image[:, ::-1] if rng.random() < 0.5 else image


class Augment:
    """jdp transform: the batch's JPEG rows -> images, each with its own generator."""

    def __call__(self, batch: dict, rng: list) -> dict:
        images = [decode_crop_flip(r, n, g)
                  for r, n, g in zip(batch["jpeg"], batch["size"], rng, strict=True)]
        return {"image": np.stack(images), "label": batch["label"]}


class TorchJpegs:
    """torch map-style dataset over the same rows, the same per-example work."""

    def __init__(self, data: dict):
        self.data = data

    def __len__(self) -> int:
        return len(self.data["label"])

    def __getitem__(self, i: int):
        rng = np.random.default_rng([0, 0, i])
        image = decode_crop_flip(self.data["jpeg"][i], self.data["size"][i], rng)
        return np.ascontiguousarray(image), self.data["label"][i]


class GrainDecode:
    """Grain random map: the same per-example work with Grain's per-example generator."""

    def __call__(self, example: dict, rng: np.random.Generator) -> dict:
        image = decode_crop_flip(example["jpeg"], example["size"], rng)
        return {"image": np.ascontiguousarray(image), "label": example["label"]}


class Pipeline:
    """One configuration: `epoch()` yields one epoch's image batches (workers kept between)."""

    def __init__(self, name: str, workers: int, epoch, close=lambda: None):
        self.name, self.workers, self.epoch, self.close = name, workers, epoch, close
        self.rates: list[float] = []
        self.first = float("nan")

    def run_epoch(self) -> None:
        start, count = time.perf_counter(), 0
        for images in self.epoch():
            count += len(images)
        self.rates.append(count / (time.perf_counter() - start))


def jdp_pipeline(data: dict, workers: int) -> Pipeline:
    import jax

    import jdp

    loader = jdp.data.Loader(jdp.data.ArraySource(data), BATCH, shuffle=True,
                             transform=Augment(), num_workers=workers, drop_last=True)

    def epoch():
        for batch in loader:
            yield jax.block_until_ready(batch["image"]).reshape(-1, CROP, CROP, 3)

    return Pipeline("jdp Loader", workers, epoch, loader.close)


def torch_pipeline(data: dict, workers: int) -> Pipeline:
    import torch

    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(
        TorchJpegs(data), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers,
        persistent_workers=workers > 0)  # torch's default start method (fork): its best case
    return Pipeline("torch DataLoader", workers, lambda: (x for x, _ in loader))


def grain_pipeline(data: dict, workers: int) -> Pipeline:
    import itertools

    import grain
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags, which a script never parses
    examples = [{k: v[i] for k, v in data.items()} for i in range(len(data["label"]))]
    dataset = (grain.MapDataset.source(examples).shuffle(seed=0).repeat()
               .random_map(GrainDecode(), seed=0).batch(BATCH, drop_remainder=True))
    # No reading threads: "workers" are the only parallelism, as for jdp and torch, and
    # nothing is read ahead while other pipelines are timed (the prefetch buffer is one batch).
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers:  # one iterator for all epochs: its workers start once
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    batches = iter(iterable)
    per_epoch = len(data["label"]) // BATCH
    return Pipeline("grain MapDataset", workers,
                    lambda: (b["image"] for b in itertools.islice(batches, per_epoch)))


def build(make, data: dict, workers: int) -> Pipeline | str:
    """The pipeline, warmed up by one epoch (its first-batch time recorded), or why not."""
    try:
        start = time.perf_counter()
        pipeline = make(data, workers)
        next(iter(pipeline.epoch()), None)
        pipeline.first = time.perf_counter() - start
        pipeline.run_epoch()
        pipeline.rates.clear()
        return pipeline
    except ImportError as err:
        return f"not installed ({err.name})"


def _preimport() -> None:
    """Import the libraries before timing, so no first-batch time holds an import."""
    import importlib

    for name in ("jax", "jdp", "torch", "grain"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def table(rounds: int = 5) -> str:
    """The input-pipeline table (markdown): every pipeline timed over interleaved epochs."""
    _preimport()
    data = make_jpegs()
    configs = [(jdp_pipeline, w) for w in (0, 1, 2)] + [(torch_pipeline, w) for w in (0, 2)]
    configs += [(grain_pipeline, w) for w in (0, 2)]
    pipelines = [build(make, data, w) for make, w in configs]
    live = [p for p in pipelines if isinstance(p, Pipeline)]
    for _ in range(rounds):  # interleaved: each round times one epoch of every pipeline
        for pipeline in live:
            pipeline.run_epoch()
    lines = [f"Input pipeline: {NUM_IMAGES} JPEGs {SIZE}x{SIZE} -> decode, random crop {CROP}, "
             f"flip; batch {BATCH}; {os.cpu_count()} CPU cores; median of {rounds} interleaved "
             "epochs (min-max)\n",
             "| pipeline | workers | images/s | min-max | first batch (s) |",
             "|---|---:|---:|---:|---:|"]
    for (make, workers), p in zip(configs, pipelines, strict=True):
        if isinstance(p, str):
            lines.append(f"| {make.__name__.split('_')[0]} | {workers} | {p} | | |")
            continue
        lines.append(f"| {p.name} | {workers} | {statistics.median(p.rates):,.0f} | "
                     f"{min(p.rates):,.0f}-{max(p.rates):,.0f} | {p.first:.1f} |")
        p.close()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table())
