"""Guarantee 4 (evaluate.py) and guarantee 7 (resume) of docs/correctness.md.

They run against issue 3's `resume` / `train.ckpt_every_steps` config keys and evaluate.py (`eval.json`,
`predictions.csv`), so they pass only once those have landed. Same settings as tests/test_correctness.py.
"""

from __future__ import annotations

import csv
import json
import math

import torch

from tests.compare import differing_tensors, load_weights
from tests.helpers import run_ranks, run_script
from tests.test_correctness import COMMON, GLOBAL_BATCH, RUNS, STEPS, TRAIN_SIZE, VAL_SIZE

STEPS_PER_EPOCH = TRAIN_SIZE // GLOBAL_BATCH
STOP_AT = STEPS_PER_EPOCH + 2  # an interruption in the middle of the second epoch


def test_evaluate_py_is_exact_for_1_2_3_processes(tmp_path):
    """Guarantee 4: evaluate.py on 23 validation images gives the same metrics and one prediction per image
    for 1, 2 and 3 processes, and the top-1 the training run measured."""
    run_dir = tmp_path / "train"
    nproc, overrides = RUNS["single"]
    run_script("train.py", *COMMON, *overrides, "train.max_steps=3", f"output_dir={run_dir}", nproc=nproc)
    checkpoint = run_dir / "last.pth"
    trained_top1 = torch.load(checkpoint, weights_only=True)["val_top1"]
    results = {}
    for world in (1, 2, 3):
        out = tmp_path / f"eval{world}"
        run_script("evaluate.py", str(checkpoint), "--output-dir", str(out), nproc=world)
        with (out / "predictions.csv").open() as f:
            rows = list(csv.DictReader(f))
        results[world] = json.loads((out / "eval.json").read_text()), rows
    reference, reference_rows = results[1]
    assert reference["n"] == VAL_SIZE and math.isclose(reference["top1"], trained_top1, abs_tol=1e-9)
    assert [int(r["index"]) for r in reference_rows] == list(range(VAL_SIZE))  # each image once, in order
    exact = ("index", "path", "label", "pred", "top5")
    for world, (metrics, rows) in results.items():
        assert (metrics["n"], metrics["top1"], metrics["top5"]) == (reference["n"], reference["top1"],
                                                                   reference["top5"]), world
        assert math.isclose(metrics["loss"], reference["loss"], rel_tol=1e-5)
        assert [[r[k] for k in exact] for r in rows] == [[r[k] for k in exact] for r in reference_rows], world
        for row, ref in zip(rows, reference_rows):
            assert math.isclose(float(row["confidence"]), float(ref["confidence"]), abs_tol=1e-5)


def keys_read_with_resume(rank: int, world: int, out_dir: str, stop_at: int) -> list[list[tuple[int, int]]]:
    """The (epoch, index) keys fit's training loop reads: one uninterrupted run, then a run stopped after
    `stop_at` steps (checkpointing every step) and resumed from its last.pth; one key list per fit call."""
    from data.datasets import AugmentedDataset
    from engine.config import load_config
    from engine.dist import DistInfo
    from train import fit

    calls: list[list[tuple[int, int]]] = []
    read = AugmentedDataset.__getitem__

    def recording_getitem(self, key):
        if isinstance(key, tuple):  # training samplers yield (epoch, index); evaluation plain indices
            calls[-1].append(key)
        return read(self, key)

    AugmentedDataset.__getitem__ = recording_getitem  # a spy: the data returned is unchanged
    info = DistInfo(rank, world, rank, world, torch.device("cpu"))
    base = [*COMMON[2:], "model.name=test_efficientnet_gn", f"train.batch_size={GLOBAL_BATCH // world}",
            "logging.level=WARNING"]
    for run_dir, extra in ((f"{out_dir}/straight", []),
                           (f"{out_dir}/resumed", [f"train.max_steps={stop_at}", "train.ckpt_every_steps=1"]),
                           (f"{out_dir}/resumed", ["resume=auto", "train.max_steps=0"])):
        calls.append([])
        fit(load_config("dummy", [*base, f"output_dir={run_dir}", *extra]), info)
    return calls


def test_resumed_run_reads_the_same_samples_in_the_same_order(tmp_path):
    """Guarantee 7: stopped mid-epoch and resumed, 2 ranks read exactly the uninterrupted sequence."""
    for rank, (straight, first, second) in enumerate(run_ranks(keys_read_with_resume, 2, tmp_path,
                                                               str(tmp_path), STOP_AT)):
        per_step = GLOBAL_BATCH // 2
        assert len(straight) == STEPS * per_step and len(first) == STOP_AT * per_step, rank
        assert first + second == straight, rank  # nothing read twice, nothing skipped, same order


def test_resumed_run_gives_bitwise_identical_weights(tmp_path):
    """Guarantee 7 through train.py: 2 ranks with SyncBN, stopped mid-epoch and resumed == uninterrupted."""
    nproc, overrides = RUNS["sync2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_script("train.py", *COMMON, *overrides, f"output_dir={straight}", nproc=nproc)
    run_script("train.py", *COMMON, *overrides, f"output_dir={resumed}", f"train.max_steps={STOP_AT}",
               "train.ckpt_every_steps=1", nproc=nproc)
    assert torch.load(resumed / "last.pth", weights_only=True)["global_step"] == STOP_AT
    run_script("train.py", *COMMON, *overrides, f"output_dir={resumed}", "resume=auto", "train.max_steps=0",
               nproc=nproc)
    assert torch.load(resumed / "last.pth", weights_only=True)["global_step"] == STEPS
    assert differing_tensors(load_weights(straight), load_weights(resumed)) == []
