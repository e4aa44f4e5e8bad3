"""Datasets, samplers and DataLoaders for training and evaluation.

Training uses torch's DistributedSampler (shuffle with `seed`, `set_epoch` every epoch, drop_last), or for
WebDataset shards under data.shard_order=by_rank data/shard_order.ByRankSampler (each rank its own shards).
Evaluation uses `ShardSampler`: each rank gets a contiguous block of whole batches and no index
is padded or dropped, so every validation image is counted exactly once whatever the world size.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import albumentations as A
import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from core.config import DataConfig, global_batch, mixing, reads_by_rank
from core.dist import DistInfo, local_main_first
from core.errors import UserError
from core.signals import worker_signals
from data.collate import collate_channels_last, collate_readable
from data.datasets import AugmentedDataset, DummyDataset, ImageFolderDataset
from data.digits import export_digits
from data.hf import HFDataset
from data.listfile import ListFileDataset
from data.erasing import EraseCollate
from data.folds import fold_side, read_folds
from data.mirror import errors_by_url, local_root, named_by_url, prepare_mirror
from data.mixing import MixCollate
from data.shard_order import ByRankSampler, ShardPlan
from data.shards import ShardDataset, split_index
from data.split import FILES, Split, SplitDataset
from data.transforms import SizedTransforms, deferred_erasing, eval_transform, tensor_augment, train_transform

log = logging.getLogger(__name__)


class EpochSampler(DistributedSampler):
    """DistributedSampler that yields (epoch, index), so a sample's augmentation can be seeded by both.

    `set_epoch(epoch, start)` skips this rank's first `start` samples of that epoch: a run resumed
    from a mid-epoch checkpoint trains on exactly the samples the interrupted run had not reached.

    The epoch's global order is defined first and then dealt out to the ranks in units: unit u (u = 1, or 2
    for mixed pairs) goes to rank u % world_size. With per-rank batch B (a multiple of the unit), step j of
    every rank together covers global positions [j B W, (j + 1) B W): the same global batches for any world
    size. With units of 2 (mixing) the keys are (epoch, index, repeat, pair), pair = position // 2; with
    `repeats` k >= 2 (repeated augmentation, as timm's RepeatAugSampler: the epoch keeps the dataset's
    length) each index appears k times close together, as repeat 0..k-1, keyed (epoch, index, repeat, -1)
    without mixing: k units in a row, on k different ranks when world_size >= k. With mixing each of the k
    copies gets a different partner (`repeated_pairs`), as in the sources, where each copy lands in another
    batch. With neither, this is torch's DistributedSampler (shuffle, drop_last) exactly.

    `balanced` (data.sampler=class_balanced) replaces the epoch's permutation by len(dataset) draws with
    replacement, each a uniform class and then a uniform image of it (an image's chance is 1 / (classes x its
    class's count)), from the same (seed, epoch) generator; units, repeats and the dealing stay as above.

    `group` G > 0 (data.mix_mode=batch, one mixing draw per G images) with `step` images per optimizer step (all
    processes, accumulation included): the epoch is laid out as the sources deal it to step / G processes of
    G images each (`source_layout`: torch's DistributedSampler, or timm's RepeatAugSampler with repeats), group
    after group, and dealt in units of min(G, per-process batch): each process batch holds whole groups (one
    draw each), a repeated image's copies sit in different groups, and the layout depends on (seed, epoch, G,
    step) alone, not on how many processes share a step. The epoch is then whole optimizer steps.
    """

    start = 0

    def __init__(self, dataset, *args, unit: int = 1, repeats: int = 1, balanced: bool = False, group: int = 0,
                 step: int = 0, roll: bool = False, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.unit, self.repeats, self.group, self.step, self.roll = unit, max(repeats, 1), group, step, roll
        self.mixed = unit == 2 or group > 0
        self.by_class = images_by_class(dataset.labels, dataset.classes) if balanced else None
        if group:
            self.num_samples = len(self.dataset) // step * step // self.num_replicas
        else:
            self.num_samples = len(self.dataset) // unit // self.num_replicas * unit
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def global_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(index, repeat) at each position of this epoch, as two arrays, the same for every rank and world size.
        Array operations, not a Python tuple per sample: 1.28M images took 2.3 s per epoch on every rank before
        its first batch that way (docs/benchmarks.md, section 21)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's shuffle
        if self.by_class is None:
            perm = torch.randperm(len(self.dataset), generator=generator).numpy()
        else:
            perm = balanced_draws(*self.by_class, len(self.dataset), generator)
        if self.group:
            return source_layout(perm, self.repeats, self.step // self.group, self.group, len(perm) // self.step,
                                 self.roll)
        if self.unit == 2 and self.repeats > 1:
            indices, repeats = repeated_pairs(perm, self.repeats)
            return indices[:len(perm)], repeats[:len(perm)]
        return repeated_units(perm, self.unit, self.repeats)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        (indices, repeats), u = self.global_order(), self.unit
        firsts = np.arange(self.rank * u, self.total_size, self.num_replicas * u)
        positions = (firsts[:, None] + np.arange(u)[None, :]).reshape(-1)[self.start:]
        epoch = itertools.repeat(self.epoch)
        if not self.mixed and self.repeats == 1:
            return zip(epoch, indices[positions].tolist())
        pairs = (positions // 2).tolist() if self.mixed else itertools.repeat(-1)
        return zip(epoch, indices[positions].tolist(), repeats[positions].tolist(), pairs)

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


def repeated_units(perm: np.ndarray, unit: int, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """(index, repeat) of `perm` cut into units of `unit`, each unit written `repeats` times in a row (repeat 0, 1,
    ...), the whole cut to perm's length."""
    whole = len(perm) // unit * unit
    rest = perm[whole:]
    indices = np.concatenate([np.repeat(perm[:whole].reshape(-1, 1, unit), repeats, axis=1).reshape(-1),
                              np.tile(rest, repeats)])
    copies = np.concatenate([np.tile(np.repeat(np.arange(repeats), unit), whole // unit),
                             np.repeat(np.arange(repeats), len(rest))])
    return indices[:len(perm)], copies[:len(perm)]


def images_by_class(labels, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(image indices sorted by class, where each class starts in them); a class without images is refused:
    a class-balanced sampler would have to draw it."""
    labels = torch.as_tensor(labels, dtype=torch.int64)
    counts = torch.bincount(labels, minlength=len(classes))
    if not counts.all():
        empty = [name for name, n in zip(classes, counts.tolist()) if n == 0]
        raise UserError(f"data.sampler=class_balanced: the training set has no images of class(es) "
                        f"{', '.join(empty[:10])}; add images of them, remove their folders, or use "
                        "data.sampler=uniform")
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return torch.argsort(labels, stable=True), starts


def balanced_draws(order: torch.Tensor, starts: torch.Tensor, n: int, generator: torch.Generator) -> np.ndarray:
    """n image indices drawn with replacement: a uniform class, then a uniform image of that class."""
    classes = torch.randint(len(starts) - 1, (n,), generator=generator)
    counts = starts[1:] - starts[:-1]
    within = torch.randint(2**62, (n,), generator=generator) % counts[classes]  # bias < count / 2^62
    return order[starts[classes] + within].numpy()


def repeated_pairs(perm: np.ndarray, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """(index, repeat) for mixed pairs with repeated augmentation: an image meets a different partner in
    each of its `repeats` copies.

    perm is cut into blocks of an even size m > repeats; repeat r pairs a block's images as round r of a
    round-robin tournament (the circle method: m - 1 rounds, every two players meet exactly once), pair
    after pair. A last block too short for that (only a dataset barely larger than `repeats`) reuses rounds.
    """
    size = repeats + 2 - repeats % 2
    whole = len(perm) // size * size
    rest = perm[whole:len(perm) - (len(perm) - whole) % 2]  # the last block, of an even length
    where, copies = tournament(size, repeats)
    last_where, last_copies = tournament(len(rest), repeats)
    return (np.concatenate([perm[:whole].reshape(-1, size)[:, where].reshape(-1), rest[last_where]]),
            np.concatenate([np.tile(copies, whole // size), last_copies]))


def tournament(size: int, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions in a block of `size` (even) images that repeated_pairs writes, pair after pair, and the repeat
    of each: round r % (size - 1) of the circle method, position size - 1 in the middle."""
    last, where, copies = size - 1, [], []
    for repeat in range(repeats if size else 0):
        r = repeat % max(last, 1)
        pairs = [(last, r)] + [((r + i) % last, (r - i) % last) for i in range(1, size // 2)]
        where += [position for pair in pairs for position in pair]
        copies += [repeat] * size
    return np.array(where, dtype=np.int64), np.array(copies, dtype=np.int64)


def source_layout(perm: np.ndarray, repeats: int, ranks: int, group: int, steps: int,
                  roll: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(index, repeat) of `steps` steps as the sources deal an epoch to `ranks` processes of `group` images:
    process v's batch j is rows (j group + i) ranks + v of the permutation, each index repeated `repeats` times in
    a row (torch's DistributedSampler; DeiT's RASampler, timm's RepeatAugSampler: k copies on k processes).
    Written batch after batch, with timm's mixing pairs (row i with row group-1-i) side by side, or (`roll`,
    torchvision's partners: row i with row i-1) in the batch's own order."""
    rows = np.arange(group) if roll else np.array([row for k in range(group // 2) for row in (k, group - 1 - k)])
    batches = np.arange(steps)[:, None, None] * group + rows[None, None, :]  # [step, process, row]
    stream = (batches * ranks + np.arange(ranks)[None, :, None]).reshape(-1)
    return perm[stream // repeats], stream % repeats


class ShardSampler(Sampler[int]):
    """Rank r gets one contiguous block of whole batches: no padding, no duplicates, in order."""

    def __init__(self, size: int, rank: int, world_size: int, batch_size: int = 1) -> None:
        self.start, self.stop = shard_bounds(size, rank, world_size, batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def shard_bounds(size: int, rank: int, world_size: int, batch_size: int = 1) -> tuple[int, int]:
    """The [start, stop) block of `size` items that `rank` evaluates.

    Blocks are cut at multiples of batch_size, so every batch holds the same images whatever the
    world size: CPU kernels pick algorithms by batch shape, and only equal batches give bitwise
    equal per-image outputs (predictions.csv is then identical for any number of processes).
    """
    batches = math.ceil(size / batch_size)
    first, last = batches * rank // world_size, batches * (rank + 1) // world_size
    return min(first * batch_size, size), min(last * batch_size, size)


def build_datasets(cfg: DataConfig, seed: int, local_rank: int = 0,
                   split: Split | None = None) -> tuple[AugmentedDataset, AugmentedDataset]:
    """(train, val) datasets for data.name with their transforms; val is labelled with the training class map;
    `split`: data.val_fraction's lists (data/split.py)."""
    prepare_data(cfg, local_rank)
    train_tf, eval_tf, tensor_tf, erasing = (train_transform(cfg), eval_transform(cfg), tensor_augment(cfg),
                                             deferred_erasing(cfg))
    if cfg.skip_corrupt and cfg.name != "dummy":
        log.info("data.skip_corrupt: unreadable training images are dropped from their batch and counted")
    train = dataset_of(cfg, True, train_tf, seed, split=split)
    if not cfg.skip_corrupt:
        train.corrupt_advice = "; or set data.skip_corrupt=true to drop unreadable training images (counted each epoch)"
    val = dataset_of(cfg, False, eval_tf, seed, train.classes, split)
    for dataset, pipeline_file in ((train, cfg.train_transform), (val, cfg.eval_transform)):
        if pipeline_file:
            dataset[0]  # a pipeline file's first output checked (SizeCheck) in this process, before any write
    train.tensor_transform = tensor_tf  # data.auto_augment, data.random_erase: for any data format
    train.erasing = erasing  # data.random_erase_fill=normalized: boxes drawn, filled on the device
    if cfg.size_schedule:
        train.sized = SizedTransforms(cfg)  # each epoch's crop size, chosen in the loader's workers by epoch
    return train, val


def build_val_dataset(cfg: DataConfig, seed: int, local_rank: int = 0,
                      classes: list[str] | None = None, crops: int = 1, split: Split | None = None) -> AugmentedDataset:
    """The validation set alone (evaluate.py needs no training split); `classes`: the training class map;
    `crops`: 5 for the stacked five crops of test-time augmentation; `split`: data.val_fraction's lists."""
    transform = eval_transform(cfg, crops)
    prepare_data(cfg, local_rank)
    return dataset_of(cfg, False, transform, seed, classes, split)


def prepare_data(cfg: DataConfig, local_rank: int) -> None:
    """data.name=digits: the digits cache is written by local rank 0 first; data.root at a URL: its local mirror
    brought up to date by each node's local rank 0 first (data/mirror.py)."""
    prepare_mirror(cfg, local_rank)
    if cfg.name == "digits":
        with local_main_first(local_rank):
            if local_rank == 0:
                export_digits(Path(cfg.root))


def dataset_of(cfg: DataConfig, train: bool, transform: A.Compose, seed: int, classes: list[str] | None = None,
               split: Split | None = None) -> AugmentedDataset:
    """The training or validation split in data.name's format; `classes` is the class map its labels use (None: its
    own classes). Unreadable images are skipped (data.skip_corrupt) in training only: an evaluation counts each.
    With data.folds_file (audit.py's k folds) both sides are parts of the training split (data/folds.py). data.root at
    a URL is read from its local mirror (data/mirror.py, prepare_data), and errors name the URL."""
    local = dataclasses.replace(cfg, root=local_root(cfg))
    with errors_by_url(cfg):
        if cfg.folds_file:
            base = side_of(local, True, transform, seed, classes, split, skip_corrupt=train and cfg.skip_corrupt)
            dataset = fold_side(base, read_folds(cfg.folds_file), cfg.fold, train, cfg.folds_file)
        else:
            dataset = side_of(local, train, transform, seed, classes, split, skip_corrupt=train and cfg.skip_corrupt)
    return named_by_url(dataset, cfg)


def side_of(cfg: DataConfig, train: bool, transform: A.Compose, seed: int, classes: list[str] | None,
            split: Split | None, skip_corrupt: bool) -> AugmentedDataset:
    """data.name's training split (`train`) or validation split."""
    if cfg.name == "dummy":
        size, offset = (cfg.dummy_train_size, 0) if train else (cfg.dummy_val_size, cfg.dummy_train_size)
        return DummyDataset(size, cfg.dummy_num_classes, cfg.dummy_image_size, transform, seed, offset)
    if cfg.val_fraction:
        if split is None:
            raise UserError(f"data.val_fraction={cfg.val_fraction}: the run's val.txt was not given; evaluate the "
                            "run's checkpoint in its folder, or set data.val_fraction=0 and name a data.val_split")
        name = FILES["train" if train else "val"]
        return SplitDataset(cfg.root, split.train if train else split.val, transform, seed, classes,
                            skip_corrupt=skip_corrupt, max_pixels=cfg.max_image_pixels,
                            list_file=f"{split.folder}/{name}" if split.folder else f"the run folder's {name}")
    return build_split(cfg, cfg.train_split if train else cfg.val_split, transform, seed, classes, skip_corrupt)


def build_split(cfg: DataConfig, split: str, transform: A.Compose, seed: int, classes: list[str] | None = None,
                skip_corrupt: bool = False) -> AugmentedDataset:
    """One named split in data.name's format; `classes` is the class map its labels use (None: its own classes)."""
    max_pixels = cfg.max_image_pixels
    if cfg.name == "wds":
        return ShardDataset(split_index(cfg.root, split), transform, seed, classes, skip_corrupt=skip_corrupt,
                            max_pixels=max_pixels, cache_dir=cfg.shard_cache, multi_label=cfg.multi_label,
                            cache_gb=cfg.shard_cache_gb)
    if cfg.name == "hf":
        return HFDataset(cfg.root, split, transform, seed, classes, image_column=cfg.image_column,
                         label_column=cfg.label_column, path_column=cfg.path_column, skip_corrupt=skip_corrupt,
                         max_pixels=max_pixels, multi_label=cfg.multi_label, hf_config=cfg.hf_config,
                         hf_revision=cfg.hf_revision)
    if cfg.name == "listfile":
        return ListFileDataset(cfg.root, split, transform, seed, classes, skip_corrupt=skip_corrupt,
                               max_pixels=max_pixels, multi_label=cfg.multi_label)
    return ImageFolderDataset(Path(cfg.root) / split, transform, seed, classes, skip_corrupt=skip_corrupt,
                              max_pixels=max_pixels)


def _worker_init(worker_id: int) -> None:
    """OpenCV's own thread pool would fight the DataLoader workers for the same cores; a worker whose parent
    has gone stays quiet; stop signals are the parent's to handle (core.signals.worker_signals)."""
    cv2.setNumThreads(1)
    sys.excepthook = _quiet_if_parent_gone
    worker_signals()


def _quiet_if_parent_gone(exc_type: type[BaseException], value: BaseException, tb) -> None:
    """A worker hands batches to its parent through multiprocessing's resource-sharing thread; when the parent
    dies (SIGTERM, a failed rank) that thread meets a closed connection and reports it through sys.excepthook."""
    if not issubclass(exc_type, (ConnectionError, EOFError)):
        sys.__excepthook__(exc_type, value, tb)


def before_workers_fork() -> None:
    """Make this process safe and cheap to fork into DataLoader workers.

    OpenCV's thread pool does not survive fork: a worker forked while the pool's threads sleep (any
    OpenCV call in this process earlier, e.g. decoding with num_workers=0 before) hangs forever in its
    first OpenCV call. With workers this process decodes nothing, so it gives the pool up first.
    """
    cv2.setNumThreads(1)
    share_heap_with_workers()


def share_heap_with_workers() -> None:
    """Freeze the garbage collector's view of this process's objects before DataLoader workers fork.

    A GC pass in a forked worker writes to the header of every object it inherited, which copies the
    parent's heap into the worker page by page (benchmarks/index_memory.py measures it; docs/benchmarks.md).
    Garbage is collected first: frozen objects are only ever freed by reference counting.
    """
    gc.collect()
    gc.freeze()


def _loader_kwargs(cfg: DataConfig, device: torch.device, seed: int) -> dict:
    # The loader's own generator: starting an epoch then never draws from the global torch RNG
    # that dropout uses, so a run resumed mid-epoch continues that RNG exactly.
    kwargs: dict = dict(num_workers=cfg.num_workers, pin_memory=device.type == "cuda", worker_init_fn=_worker_init,
                        generator=torch.Generator().manual_seed(seed))
    if cfg.num_workers > 0:
        kwargs.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
    return kwargs


class OneLineErrorLoader(DataLoader):
    """DataLoader whose workers' UserErrors reach the user as the one line they hold.

    torch re-raises a worker's exception in this process as the same type with the worker's whole
    traceback as its message (torch._utils.ExceptionWrapper.reraise); the last line of that traceback
    is the original message.
    """

    def __iter__(self) -> Iterator:
        # The workers start here, in iter() (core.signals.workers_shielded relies on it), not at the first batch.
        return self.one_line_errors(super().__iter__())

    @staticmethod
    def one_line_errors(batches: Iterator) -> Iterator:
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as err:
                stop_workers(batches)
                if isinstance(err, UserError):
                    raise UserError(worker_message(str(err))) from err
                raise
            yield batch


def stop_workers(batches: Iterator) -> None:
    """End a failed iterator's workers now. Left to the cycle collector (the exception's traceback holds the
    iterator), torch's shutdown waits its 5 s timeout for each worker: 10 s with 2 workers, measured."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # torch's multi-process iterator only
    if shutdown is not None:
        shutdown()


def worker_message(text: str) -> str:
    """The original message in torch's "Caught UserError in DataLoader worker process N. Original Traceback ..."."""
    if not text.startswith("Caught UserError in DataLoader worker"):
        return text
    prefix = f"{UserError.__module__}.{UserError.__qualname__}: "
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return lines[-1][len(prefix):] if lines else text


class TooFewImages(UserError):
    """A rank's share of the training images is smaller than one batch (`images`: that share)."""

    def __init__(self, message: str, images: int) -> None:
        super().__init__(message)
        self.images = images


def build_train_loader(dataset: AugmentedDataset, cfg: DataConfig, batch_size: int, seed: int,
                       info: DistInfo, accum_steps: int = 1) -> DataLoader:
    """Shuffled, drop_last loader over this rank's share of the training set (with mixing, batches carry
    their mixes: data.mixing)."""
    step = global_batch(info.world_size, batch_size, accum_steps)
    group = mix_group(cfg, batch_size, step)
    sampler: EpochSampler | ByRankSampler
    if shard_order(cfg, dataset, info.world_size)[0] == "by_rank":
        plan = ShardPlan(np.diff(dataset.starts), seed, info.rank, info.world_size, unit=2 if mixing(cfg) else 1)
        sampler = ByRankSampler(plan, mixing(cfg), dataset.warm)
        dataset.follow(plan)
    else:
        sampler = EpochSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=seed,
                               drop_last=True, unit=min(group, batch_size) if group else 2 if mixing(cfg) else 1,
                               repeats=cfg.aug_repeats, balanced=cfg.sampler == "class_balanced", group=group,
                               step=step, roll=bool(group) and cfg.mix_partner == "roll")
    check_repeats(cfg.aug_repeats, len(dataset), batch_size * info.world_size, mixing(cfg) and not group)
    if len(sampler) < batch_size:
        raise TooFewImages(f"each rank gets {len(sampler)} training images but train.batch_size is {batch_size}; "
                           "lower train.batch_size or use fewer processes", len(sampler))
    if cfg.num_workers > 0:
        before_workers_fork()
    collate = MixCollate(cfg, seed, group) if mixing(cfg) else collate_readable
    if dataset.erasing is not None:  # data.random_erase_fill=normalized: the boxes ride beside the batch
        collate = EraseCollate(collate)
    return OneLineErrorLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                              collate_fn=collate, **_loader_kwargs(cfg, info.device, seed + info.rank))


def shard_order(cfg: DataConfig, dataset: AugmentedDataset, world_size: int) -> tuple[str, str]:
    """data.shard_order resolved, "global" or "by_rank", with the line that says why; by_rank asked for where it
    cannot be is refused in one line."""
    shards = len(dataset.urls) if isinstance(dataset, ShardDataset) else 0
    needs_global = ("data.aug_repeats > 1" if cfg.aug_repeats > 1 else
                    "data.sampler=class_balanced" if cfg.sampler == "class_balanced" else
                    "data.mix_mode=batch" if mixing(cfg) and cfg.mix_mode == "batch" else
                    "data.folds_file" if cfg.folds_file else
                    f"{shards} shard(s) for {world_size} processes" if shards < world_size else "")
    if cfg.shard_order == "by_rank":
        if cfg.name != "wds":
            raise UserError(f"data.shard_order=by_rank deals whole WebDataset shards to the processes, and data.name="
                            f"{cfg.name} has none; set data.shard_order=auto or global")
        if needs_global:
            raise UserError(f"data.shard_order=by_rank cannot be used with {needs_global} (each process reads whole "
                            "shards of its own); set data.shard_order=global"
                            + (", or write smaller shards (python -m data.make_shards --shard-size)"
                               if shards < world_size else ""))
        return "by_rank", "data.shard_order=by_rank: each process reads only its own shards of an epoch"
    if not reads_by_rank(cfg):
        return "global", f"data.shard_order={cfg.shard_order}: global, one permutation of all samples for all processes"
    if needs_global:
        return "global", f"data.shard_order=auto: global (a URL data.root, but {needs_global} needs it)"
    return "by_rank", ("data.shard_order=auto: by_rank (data.root is a URL): each process reads, and copies into "
                       "data.shard_cache, only its own shards of an epoch")


def mix_group(cfg: DataConfig, batch_size: int, step: int) -> int:
    """Images per mixing draw in data.mix_mode=batch (0: not that mode), checked to lay out whole draws in
    process batches and optimizer steps."""
    if not mixing(cfg) or cfg.mix_mode != "batch":
        return 0
    group = cfg.mix_group or batch_size
    fix = "set data.mix_group=0 (one draw per train.batch_size images) or a divisor of train.batch_size"
    if batch_size % group and group % batch_size:
        raise UserError(f"data.mix_group {group} and train.batch_size {batch_size}: one must divide the other, so "
                        f"each process batch holds whole mixing draws; {fix}")
    if cfg.mix_partner == "roll" and batch_size % group:
        raise UserError(f"data.mix_partner=roll mixes within a group of data.mix_group {group} images, which must "
                        f"then divide train.batch_size {batch_size} (a group on one process); set data.mix_group=0 "
                        "or a divisor of train.batch_size")
    if step % group:
        raise UserError(f"data.mix_group {group} does not divide the {step} images of an optimizer step "
                        f"(train.batch_size x processes x train.accum_steps); {fix}")
    return group


def check_repeats(repeats: int, images: int, global_batch: int, mixed: bool) -> None:
    """Refuse data.aug_repeats that would fill an epoch, or a batch, with copies of a few images."""
    if repeats > images:
        raise UserError(f"data.aug_repeats {repeats} is more than the {images} training images: an epoch would be "
                        f"a few images, each many times; use at most {min(images, global_batch)}")
    if repeats > global_batch:
        raise UserError(f"data.aug_repeats {repeats} is more than the global batch of {global_batch} images "
                        f"(train.batch_size x processes): a batch would hold copies of one image; use at most "
                        f"{global_batch}")
    block = repeats + 2 - repeats % 2  # repeated_pairs' block
    if mixed and repeats > 1 and block > images:
        raise UserError(f"data.aug_repeats {repeats} with mixup or cutmix needs at least {block} training images "
                        f"(a different partner for each copy); there are {images}")


def full_epoch_images(loader: DataLoader, world_size: int) -> int:
    """The images a whole epoch trains on over all ranks (those it did not, with data.skip_corrupt, were
    unreadable)."""
    batch_size = loader.batch_size
    return loader.sampler.num_samples // batch_size * batch_size * world_size


DROP_NOTE_SHARE = 0.01  # an epoch that leaves out more than this share of the training set says so at start-up
TINY_EPOCH = 10  # batches per process under which the note is a warning


def dropped_images_note(loader: DataLoader, world_size: int, accum_steps: int,
                        drop_last_accum: bool) -> tuple[int, str] | None:
    """(log level, line) when an epoch leaves out more than DROP_NOTE_SHARE of the training images: each process's
    last partial batch (drop_last, as torch's DistributedSampler and timm), the images past a whole batch on every
    process, and with train.drop_last_accum the micro-batches short of a step; a warning when an epoch is under
    TINY_EPOCH batches. None: nothing worth saying."""
    total, whole = len(loader.dataset), len(loader) + loader.sampler.start // loader.batch_size
    short = whole % accum_steps if drop_last_accum else 0  # batches per process short of a whole step
    batches = whole - short
    trained = batches * loader.batch_size * world_size
    if total - trained <= DROP_NOTE_SHARE * total:
        return None
    level = logging.WARNING if batches < TINY_EPOCH else logging.INFO
    by_rank = isinstance(loader.sampler, ByRankSampler)
    dealt = loader.sampler.num_samples * world_size if by_rank else total
    rest = ([f"{total - dealt} image(s) of the processes dealt more whole shards than the one with the fewest, "
             "data.shard_order=by_rank: smaller shards leave out fewer"] if dealt < total else [])
    rest += ["a last partial batch"] if whole * loader.batch_size * world_size < dealt else []
    if short:
        rest.append(f"{short} batch(es) per process short of a whole step of train.accum_steps={accum_steps}, "
                    "train.drop_last_accum=true")
    remedy = ", fewer processes, or train.drop_last_accum=false" if short else ", or fewer processes,"
    return level, (f"each epoch trains on {trained} of the {total} training images ({100 * trained / total:.0f}%): "
                   f"{world_size} process(es) x {batches} batch(es) of train.batch_size={loader.batch_size}, the "
                   f"rest ({'; '.join(rest)}) is left out, other images each epoch; a train.batch_size (or "
                   f"train.global_batch_size) that divides the set{remedy} leave out fewer")


def build_eval_loader(dataset: AugmentedDataset, cfg: DataConfig, batch_size: int, info: DistInfo,
                      collate_fn: Callable = collate_channels_last) -> DataLoader:
    """In-order loader over this rank's block of whole batches of the validation set (see shard_bounds)."""
    if len(dataset) < info.world_size:
        raise UserError(f"the validation set has {len(dataset)} images, fewer than the {info.world_size} processes; "
                        "use fewer processes")
    sampler = ShardSampler(len(dataset), info.rank, info.world_size, batch_size)
    if isinstance(dataset, ShardDataset):
        dataset.keep_to(sampler.start, sampler.stop)
    if cfg.num_workers > 0:
        before_workers_fork()
    return OneLineErrorLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
                              collate_fn=collate_fn, **_loader_kwargs(cfg, info.device, info.rank))


@dataclass
class DataBundle:
    train: DataLoader
    val: DataLoader
    num_classes: int
    class_names: list[str]
    class_counts: list[int]  # training images per class (class weights, logit adjustment); multi-label: positives
    steps_per_epoch: int = 0  # optimizer steps in a whole epoch (train.accum_steps, train.drop_last_accum)
    split: Split | None = None  # data.val_fraction's lists, written to the run folder at its first write

    def sizes(self) -> dict[str, int]:
        """Images in each split (the checkpoints record them for the model card)."""
        return {"train": len(self.train.dataset), "val": len(self.val.dataset)}


def build_data(cfg: DataConfig, batch_size: int, seed: int, info: DistInfo, accum_steps: int = 1,
               drop_last_accum: bool = False, split: Split | None = None) -> DataBundle:
    """Everything training needs from data/: both loaders, the class list, and the optimizer steps per epoch."""
    check_held_out(cfg)
    train_set, val_set = build_datasets(cfg, seed, info.local_rank, split)
    log.info("data %s: train %d images, val %d images, %d classes%s", cfg.name, len(train_set), len(val_set),
             len(train_set.classes), ", multi-label (data.multi_label=true)" if cfg.multi_label else "")
    if cfg.name == "wds":
        log.info(shard_order(cfg, train_set, info.world_size)[1])
    return dataclasses.replace(loaders(train_set, val_set, cfg, batch_size, seed, info, accum_steps, drop_last_accum),
                               split=split)


def check_held_out(cfg: DataConfig) -> None:
    """Training validates on a split it does not train on: data.val_split=train would score the training images each
    epoch and pick best.pth on them."""
    if cfg.train_split == cfg.val_split and cfg.name != "dummy" and not (cfg.val_fraction or cfg.folds_file):
        raise UserError(f"data.val_split={cfg.val_split} is data.train_split: each epoch's validation, and the choice "
                        "of best.pth, would score the images the model trains on; name a held-out split (e.g. "
                        "data.val_split=val), or hold out part of it with data.val_fraction (data.name=imagefolder)")


def probe_data(cfg: DataConfig, batch_size: int, seed: int, info: DistInfo, split: Split | None = None) -> DataBundle:
    """train.batch_size=auto's first loaders, of the smallest batch it tries (`batch_size`), mixing in pairs until the
    batch is known; a rank with fewer images than that is told so (the loader's own line named a train.batch_size
    the user never gave)."""
    try:
        return build_data(dataclasses.replace(cfg, mix_mode="pair"), batch_size, seed, info, split=split)
    except TooFewImages as err:
        raise UserError(f"train.batch_size=auto: each rank gets {err.images} training image(s), fewer than the "
                        f"smallest batch it tries ({batch_size}); add training images, use fewer processes, or set "
                        "train.batch_size to a number") from None


def with_batch_size(data: DataBundle, cfg: DataConfig, batch_size: int, seed: int, info: DistInfo,
                    accum_steps: int = 1, drop_last_accum: bool = False) -> DataBundle:
    """The same datasets in loaders of another batch (train.batch_size=auto, once the search found it)."""
    return dataclasses.replace(loaders(data.train.dataset, data.val.dataset, cfg, batch_size, seed, info, accum_steps,
                                       drop_last_accum), split=data.split)


def loaders(train_set: AugmentedDataset, val_set: AugmentedDataset, cfg: DataConfig, batch_size: int, seed: int,
            info: DistInfo, accum_steps: int = 1, drop_last_accum: bool = False) -> DataBundle:
    """Both loaders of the datasets and the class list, with every rank given a validation batch."""
    val = build_eval_loader(val_set, cfg, batch_size, info)
    val_batches = math.ceil(len(val_set) / batch_size)
    if val_batches < info.world_size:  # a rank without a batch would skip DDP's buffer sync and hang the others
        raise UserError(f"the validation set has {len(val_set)} images, {val_batches} batch(es) of train.batch_size "
                        f"{batch_size} for {info.world_size} processes, and each process needs one; use fewer "
                        "processes or a smaller train.batch_size")
    train = build_train_loader(train_set, cfg, batch_size, seed, info, accum_steps)
    return DataBundle(train=train, val=val, num_classes=len(train_set.classes), class_names=list(train_set.classes),
                      class_counts=class_counts(train_set.labels, len(train_set.classes)),
                      steps_per_epoch=steps_per_epoch(train, accum_steps, drop_last_accum))


def class_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """Images of each class: of class indices, or (multi-label) the positives of each multi-hot column."""
    if labels.ndim == 2:
        return labels.sum(axis=0, dtype=np.int64).tolist()
    return np.bincount(labels, minlength=num_classes).tolist()


def steps_per_epoch(loader: DataLoader, accum_steps: int, drop_last_accum: bool = False) -> int:
    """Optimizer steps in one epoch: a last, shorter accumulation group still steps, or (train.drop_last_accum, as
    ConvNeXt's engine.py skips the micro-batches past len(dataset) // total_batch_size steps) is left out."""
    if not drop_last_accum:
        return math.ceil(len(loader) / accum_steps)
    if len(loader) < accum_steps:
        raise UserError(f"train.drop_last_accum=true: each process gets {len(loader)} batches per epoch, fewer than "
                        f"train.accum_steps={accum_steps}, so an epoch would make no optimizer step; lower "
                        "train.accum_steps or train.batch_size, or set train.drop_last_accum=false")
    return len(loader) // accum_steps
