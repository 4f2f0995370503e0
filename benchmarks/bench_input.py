"""Input pipelines: JPEG decode + random crop + flip, jdp's Loader vs torch's DataLoader vs Grain.

Same JPEG source and same work per example (decode, random 112x112 crop, random flip, each
example's randomness its own), batches of 32. jdp's Loader also puts each batch on the device;
torch and Grain stop at host arrays. Workers start once and one epoch warms them up; then one
epoch per pipeline per round, rounds interleaved. `python -m benchmarks.bench_input` prints it.
"""
from __future__ import annotations

import io
import itertools
import os
import statistics
import time

import numpy as np

from benchmarks.harness import report

NUM_IMAGES, SIZE, CROP, BATCH = 1024, 128, 112, 32


def make_jpegs(n: int = NUM_IMAGES, seed: int = 0) -> dict[str, np.ndarray]:
    """n smooth noisy RGB images, JPEG-encoded (quality 90), as zero-padded byte rows."""
    from PIL import Image

    rng, (y, x) = np.random.default_rng(seed), np.mgrid[0:SIZE, 0:SIZE] / SIZE
    encoded = []
    for a, b, c in rng.uniform(0.5, 4, (n, 3)):
        base = np.stack([np.sin(a * x * 6), np.cos(b * y * 6), np.sin(c * (x + y) * 3)], -1)
        pixels = np.clip((base + 1) * 110 + rng.normal(0, 12, base.shape), 0, 255)
        out = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=90)
        encoded.append(np.frombuffer(out.getvalue(), np.uint8))
    rows = np.zeros((n, max(map(len, encoded))), np.uint8)
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
    return np.ascontiguousarray(image[:, ::-1] if rng.random() < 0.5 else image)


def augment(batch: dict, rng: list) -> dict:
    """jdp's transform: the batch's JPEG rows -> images, each with its example's generator."""
    images = [decode_crop_flip(*a) for a in zip(batch["jpeg"], batch["size"], rng, strict=True)]
    return {"image": np.stack(images), "label": batch["label"]}


def grain_decode(example: dict, rng: np.random.Generator) -> dict:
    """Grain's random map: the same work with Grain's per-example generator."""
    return {"image": decode_crop_flip(example["jpeg"], example["size"], rng),
            "label": example["label"]}


class TorchJpegs:
    """torch's map-style dataset over the same rows, the same work."""

    def __init__(self, data: dict):
        self.data = data

    def __len__(self) -> int:
        return len(self.data["label"])

    def __getitem__(self, i: int):
        d, rng = self.data, np.random.default_rng([0, 0, i])
        return decode_crop_flip(d["jpeg"][i], d["size"][i], rng), d["label"][i]


def jdp_pipeline(data: dict, workers: int):
    """(one epoch's image batches, close) for jdp's Loader."""
    import jax

    import jdp

    loader = jdp.data.Loader(jdp.data.ArraySource(data), BATCH, shuffle=True, transform=augment,
                             num_workers=workers, drop_last=True)
    return (lambda: (jax.block_until_ready(b["image"]) for b in loader)), loader.close


def torch_pipeline(data: dict, workers: int):
    """The same for torch's DataLoader, with its default start method (fork: its best case)."""
    import torch

    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(TorchJpegs(data), BATCH, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=workers > 0)
    return (lambda: (x for x, _ in loader)), lambda: None


def grain_pipeline(data: dict, workers: int):
    """The same for a Grain MapDataset: no reading threads or read-ahead (workers are the only
    parallelism, as for the others), one iterator for all epochs (workers start once)."""
    import grain
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags, which a script never parses
    examples = [{k: v[i] for k, v in data.items()} for i in range(len(data["label"]))]
    dataset = (grain.MapDataset.source(examples).shuffle(seed=0).repeat()
               .random_map(grain_decode, seed=0).batch(BATCH, drop_remainder=True))
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers:
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    batches = iter(iterable)
    return (lambda: (b["image"] for b in itertools.islice(batches, NUM_IMAGES // BATCH))), (
        lambda: None)


def images_per_s(epoch) -> float:
    """Images per second of one epoch (jdp's batches are [devices, per device, H, W, C])."""
    start = time.perf_counter()
    count = sum(int(np.prod(images.shape[:-3])) for images in epoch())
    return count / (time.perf_counter() - start)


def table(rounds: int = 5) -> str:
    """The markdown table: every pipeline's median images/s over interleaved epochs."""
    for name in ("jax", "jdp", "torch", "grain"):  # no first-batch time holds an import
        try:
            __import__(name)
        except ImportError:
            pass
    data, rows, live = make_jpegs(), [], []
    for make, workers in [(jdp_pipeline, w) for w in (0, 1, 2)] + [
            (torch_pipeline, 0), (torch_pipeline, 2), (grain_pipeline, 0), (grain_pipeline, 2)]:
        rows.append([make.__name__.split("_")[0], workers])
        try:
            start = time.perf_counter()
            epoch, close = make(data, workers)
            next(iter(epoch()), None)
            rows[-1].append(time.perf_counter() - start)  # the first batch, workers' start-up
            images_per_s(epoch)  # warm-up
            live.append((rows[-1], epoch, close, []))
        except ImportError as err:
            rows[-1].append(f"not installed ({err.name})")
    for _ in range(rounds):
        for _, epoch, _, rates in live:
            rates.append(images_per_s(epoch))
    for row, _, close, rates in live:
        row[2:] = [f"{statistics.median(rates):,.0f}", f"{min(rates):,.0f}-{max(rates):,.0f}",
                   f"{row[2]:.1f}"]
        close()
    return (f"Input pipeline: {NUM_IMAGES} JPEGs {SIZE}x{SIZE} -> decode, random crop {CROP}, "
            f"flip; batch {BATCH}; {os.cpu_count()} CPU cores; median of {rounds} interleaved "
            "epochs (min-max)\n\n" + report.table(
                ["pipeline", "workers", "images/s", "min-max", "first batch (s)"],
                [row + [""] * (5 - len(row)) for row in rows]))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(table())
