"""dist.strategy=fsdp (FSDP2): the sharded training computes what DDP and one process compute, its checkpoints
are the usual single files, and what it cannot do is refused at load time in one line."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import timm
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import evaluate
from core.cli import report_errors
from core.config import OptimConfig
from core.config_load import load_config
from core.errors import UserError
from engine.checkpoint.formats import read_checkpoint
from engine.checkpoint.resume import load_optimizer_state
from engine.checkpoint.saver import optimizer_state_by_index
from engine.optim import build_optimizer
from engine.precision import Precision
from engine.trainer import fsdp_micro_step
from models.parallel import shard_model, shard_units
from tests.compare import differing_tensors, load_weights, relative_differences, worst_tensor
from tests.helpers import TINY, read_jsonl, run_on_ranks, run_ranks, run_script, train_here

# A ViT (LayerNorm, no BatchNorm) trained with AdamW, gradient clipping and an EMA: 2 epochs of 3 optimizer steps
# of a global batch of 12 (6 per rank on 2, 4 on 3, 12 in one process). 25 validation images, in batches of the
# same size: 2 and 3 batches on 2 ranks, 2, 2 and 3 on 3 (the sharded model's forwards are collectives: a rank with
# fewer batches must keep joining them).
VIT = ("--config", "dummy", "model.name=test_vit", "model.kwargs.img_size=16", "amp=off", "data.img_size=16",
       "data.dummy_image_size=16", "data.dummy_train_size=36", "data.dummy_val_size=25", "data.num_workers=0",
       "data.augment=false", "train.epochs=2", "train.global_batch_size=12", "logging.progress=false",
       "optim.name=adamw", "optim.lr=0.001", "optim.clip_grad=0.5", "model.ema_decay=0.9")
# Measured (parameters, relative; the EMA's are smaller): fsdp vs ddp 2.8e-12, fsdp vs one process 3.9e-7, ddp vs
# one process 3.9e-7; resumed on 3 ranks (2 micro-batches kept whole) vs uninterrupted 1.9e-8, on 1 process 3.9e-9,
# on 2 ranks bitwise. Sharded steps in 2 micro-batches kept whole vs one process 5.5e-7. A
# deliberate per-rank difference moves sharded steps far past TOL (3.1e-2 and 3.6e-1, while alike they are 1.7e-7):
# test_sharded_steps_match_one_process_and_catch_a_rank_apart.
TOL = 1e-5


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_the_ddp_and_single_process_model(tmp_path):
    """FSDP on 2 ranks == DDP on 2 ranks == 1 process; the fsdp last.pth is one file that evaluate.py reads and
    whose weights give the live model's val_loss. The same run stopped mid-epoch 1 with train.ckpt_format=sharded
    (last.dcp/, each rank's shards) resumes on 2 ranks bitwise where the uninterrupted run ends, and on 3 ranks (with
    2 micro-batches per step, dist.fsdp_accum_whole) and on 1 process (DCP reshards the folder) within fp32
    rounding of it, with every epoch in metrics.jsonl once."""
    single, ddp, fsdp, stopped = (tmp_path / name for name in ("single", "ddp", "fsdp", "stopped"))
    train_here(*VIT, f"output_dir={single}")  # one process: this one
    run_on_ranks("train.py", *VIT, f"output_dir={ddp}", nproc=2)
    run_on_ranks("train.py", *VIT, "dist.strategy=fsdp", f"output_dir={fsdp}", nproc=2)
    folder = (*VIT, "dist.strategy=fsdp", "train.ckpt_format=sharded")
    run_on_ranks("train.py", *folder, "train.max_steps=4", f"output_dir={stopped}", nproc=2)
    assert read_checkpoint(stopped / "last.dcp")["epoch_step"] == 1  # step 4 of 6: mid-epoch 1
    runs = {name: torch.load(out / "last.pth", weights_only=True) for name, out in
            (("single", single), ("ddp", ddp), ("fsdp", fsdp))}
    assert runs["fsdp"]["global_step"] == 6
    for a, b in (("ddp", "fsdp"), ("single", "fsdp"), ("single", "ddp")):
        for key in ("model", "ema"):
            report(a, b, key, runs[a][key], runs[b][key])
    # The same file layout as DDP's: every key, the optimizer state numbered as torch numbers it.
    assert runs["fsdp"].keys() == runs["ddp"].keys()
    fsdp_optim, ddp_optim = runs["fsdp"]["optimizer"], runs["ddp"]["optimizer"]
    assert fsdp_optim["param_groups"] == ddp_optim["param_groups"]
    assert fsdp_optim["state"].keys() == ddp_optim["state"].keys()
    # The fsdp run evaluated with its sharded weights; evaluate.py, reading last.pth whole in one process, agrees.
    row = read_jsonl(fsdp / "metrics.jsonl")[-1]
    assert report_errors(evaluate.main, [str(fsdp / "last.pth"), "--output-dir", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["n"] == 25 and result["top1"] == row["val_top1"]
    assert math.isclose(result["loss"], row["val_loss"], rel_tol=1e-5)
    # The stopped run's folder, resumed (resume=auto) on 2 ranks, 3 ranks and 1 process.
    for nproc in (3, 1, 2):
        out = tmp_path / f"on{nproc}"
        shutil.copytree(stopped, out)
        if nproc == 1:
            train_here(*folder, f"output_dir={out}")
        elif nproc == 3:  # the same global batch as 3 x 2 x 2 micro-batches, whole between micro-steps
            run_on_ranks("train.py", *folder, "train.accum_steps=2", "dist.fsdp_accum_whole=true", f"output_dir={out}",
                         nproc=3)
        else:
            run_on_ranks("train.py", *folder, f"output_dir={out}", nproc=nproc)
        resumed = read_checkpoint(out / "last.dcp")
        assert resumed["global_step"] == 6
        assert [r["epoch"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
        for key in ("model", "ema"):
            if nproc == 2:
                assert differing_tensors(runs["fsdp"][key], resumed[key]) == []
            else:
                report("fsdp", f"resumed on {nproc}", key, runs["fsdp"][key], resumed[key])


def report(a: str, b: str, key: str, first: dict, second: dict) -> None:
    """Print how far two runs' weights are apart and assert it is within TOL."""
    diffs = relative_differences(first, second)
    print(f"{a} vs {b} {key}: {diffs['parameters']:.1e}, worst tensor %.1e (%s)" % worst_tensor(first, second))
    assert diffs["parameters"] <= TOL


@pytest.mark.slow
def test_fsdp_in_one_process_trains_the_plain_model(tiny_run, tmp_path):
    """Without a process group there is nothing to shard: the run says so once and trains bitwise as ddp's."""
    proc = run_script("train.py", *TINY, "dist.strategy=fsdp", f"output_dir={tmp_path / 'run'}")
    assert proc.stderr.count("dist.strategy=fsdp in one process: nothing to shard") == 1
    assert differing_tensors(load_weights(tiny_run), load_weights(tmp_path / "run")) == []


def sharded_save_with_ema(rank: int, world: int, out: str) -> dict:
    """A step checkpoint (not best.pth) in train.ckpt_format=sharded of a sharded model and EMA; the EMA whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from core.config import Config, SchedConfig, to_dict
    from core.dist import DistInfo
    from engine.checkpoint.saver import Checkpointer
    from engine.optim import build_scheduler
    from engine.state import TrainState

    torch.manual_seed(0)
    model = timm.create_model("test_vit", num_classes=3, img_size=16)
    ema = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for param in ema.parameters():
            param.mul_(0.5)  # an EMA unlike the model
    shard_model(model, None), shard_model(ema, None)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=0.01), sharded=True)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(Path(out), DistInfo(rank, world, rank, world, torch.device("cpu")), 0, model=model,
                                optimizer=optimizer, scheduler=build_scheduler(optimizer, SchedConfig(), 1, 1),
                                scaler=None, config=to_dict(Config()), class_names=["a", "b", "c"], ema=ema,
                                sharded=True)
    checkpointer.save(TrainState(global_step=1, epoch_step=1))
    return get_model_state_dict(ema, options=StateDictOptions(full_state_dict=True))


@pytest.mark.slow
def test_sharded_folder_holds_the_sharded_ema_whole(tmp_path):
    """train.ckpt_format=sharded under fsdp: DCP writes the model and optimizer shards; the EMA, sharded like the
    model, is gathered into the folder's plain part whole (what resume and evaluate.py --ema read)."""
    (tmp_path / "run").mkdir()  # the run folder (train.py's lock makes it; no checkpoint write does)
    ema = run_ranks(sharded_save_with_ema, 2, tmp_path, str(tmp_path / "run"))[0]
    saved = read_checkpoint(tmp_path / "run" / "last.dcp")
    assert saved["global_step"] == 1 and differing_tensors(ema, saved["ema"]) == []


def test_fsdp_checkpoint_numbers_the_optimizer_state_as_torch_does():
    """optimizer_state_by_index turns torch.distributed.checkpoint's named optimizer state back into
    Optimizer.state_dict()'s (timm's two weight-decay groups, AdamW state after one step)."""
    torch.manual_seed(0)
    model = timm.create_model("test_vit", num_classes=3, img_size=16)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=0.01))
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    expected = optimizer.state_dict()
    got = optimizer_state_by_index(get_optimizer_state_dict(model, optimizer), optimizer)
    assert len(expected["param_groups"]) == 2 and got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys() and len(got["state"]) == len(list(model.parameters()))
    for index, state in expected["state"].items():
        assert all(torch.equal(got["state"][index][k], v) for k, v in state.items())


def sgd_step_on_shards(rank: int) -> dict:
    """One step of the app's SGD (fused where it can be) on a sharded ViT, and what it left."""
    torch.manual_seed(0)
    model = shard_model(timm.create_model("test_vit", num_classes=3, img_size=16), None)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.1), sharded=True)
    torch.manual_seed(rank)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    before = model.head.weight.full_tensor().clone()
    optimizer.step()
    return {"fused": optimizer.defaults.get("fused"), "moved": (model.head.weight.full_tensor() - before).abs().max()}


def adamw_steps(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, sharded: bool,
                micro: int = 1) -> tuple[dict, list[bool]]:
    """3 AdamW steps, one per row of `images` (in `micro` micro-batches, dist.fsdp_accum_whole's way when sharded),
    through the loop's step (gradients clipped at 0.5 over every rank's shards); the weights whole after, and
    whether a block's weight was whole (not a DTensor shard) after each micro-batch's backward."""
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=0.001), sharded=sharded)
    whole = []
    for step_images, step_labels in zip(images, labels):
        for i, (part_images, part_labels) in enumerate(zip(step_images.chunk(micro), step_labels.chunk(micro))):
            if micro > 1:
                fsdp_micro_step(model, last=i == micro - 1)
            (nn.functional.cross_entropy(model(part_images), part_labels) / micro).backward()
            whole.append(not isinstance(model.blocks[0].attn.qkv.weight, DTensor))
        assert Precision("cpu", None).step(optimizer, model, 0.5) == (True, 0)
        optimizer.zero_grad(set_to_none=True)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)), whole


def sharded_steps(rank: int, world: int) -> dict:
    """On 2 ranks: the SGD step above; 3 AdamW steps of a ViT sharded over the ranks, each rank on its half of a
    global batch of 8, and the same steps with a deliberate per-rank difference (rank 1 builds its shards from
    another seed; both ranks read the first half); then the same steps unsharded on the whole batch."""
    data = torch.Generator().manual_seed(0)
    images, labels = torch.randn(3, 8, 3, 16, 16, generator=data), torch.randint(0, 3, (3, 8), generator=data)
    half = slice(4 * rank, 4 * rank + 4)
    results = {"sgd": sgd_step_on_shards(rank)}
    for name, seed, part, micro in (("alike", 0, half, 1), ("2 micro-batches, whole between them", 0, half, 2),
                                    ("rank 1 from another seed", rank, half, 1),
                                    ("both ranks on the first half", 0, slice(0, 4), 1)):
        torch.manual_seed(seed)
        model = shard_model(timm.create_model("test_vit", num_classes=3, img_size=16), None)
        results[name], results[f"{name}: whole"] = adamw_steps(model, images[:, part], labels[:, part], True, micro)
    torch.manual_seed(0)  # on each rank: the loop's step all-reduces its inf/NaN flag
    results["one process"] = adamw_steps(timm.create_model("test_vit", num_classes=3, img_size=16), images, labels,
                                         sharded=False)[0]
    return results


@pytest.mark.slow
def test_sharded_steps_match_one_process_and_catch_a_rank_apart(tmp_path):
    """FSDP2 on 2 ranks gives one process's AdamW steps within TOL (also in 2 micro-batches per step kept whole
    between them, dist.fsdp_accum_whole's way), and the same comparison fails by far when the ranks differ on purpose (another seed for rank 1's shards, or both ranks reading the same images). Also:
    train.py's default optimizer is torch's fused SGD, which DTensors refuse (no sharding rule for
    aten._fused_sgd_): on sharded parameters it steps unfused."""
    results = run_ranks(sharded_steps, 2, tmp_path)
    for result in results:
        assert not result["sgd"]["fused"] and result["sgd"]["moved"] > 0
    one_process = results[0]["one process"]
    distances = {name: relative_differences(one_process, results[0][name])["parameters"]
                 for name in ("alike", "2 micro-batches, whole between them", "rank 1 from another seed",
                 "both ranks on the first half")}
    print("one process vs fsdp on 2 ranks:", ", ".join(f"{name} {value:.1e}" for name, value in distances.items()))
    assert distances.pop("alike") <= TOL and distances.pop("2 micro-batches, whole between them") <= TOL
    assert all(value > 100 * TOL for value in distances.values())
    # dist.fsdp_accum_whole: after the first micro-batch's backward the weights stay whole, after the last they are
    # shards again (as after every backward without it).
    assert results[0]["2 micro-batches, whole between them: whole"] == [True, False] * 3
    assert results[0]["alike: whole"] == [False] * 3


@pytest.mark.parametrize("name, kwargs, unit", [
    ("test_vit", {}, "Block"),  # ViT / DeiT: model.blocks
    ("eva02_tiny_patch14_224", {"depth": 2}, "EvaBlock"),
    ("test_convnext", {}, "ConvNeXtBlock"),  # model.stages[i].blocks
    ("swin_tiny_patch4_window7_224", {"embed_dim": 8, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1)},
     "SwinTransformerBlock"),  # model.layers[i].blocks
    ("resnet10t", {}, "BasicBlock"),  # model.layer1..layer4
    ("regnety_002", {}, "RegStage"),  # none of these: the model's children holding parameters
])
def test_shard_units_are_the_models_blocks(name, kwargs, unit):
    model = timm.create_model(name, **kwargs)
    units = shard_units(model)
    assert units and unit in {type(u).__name__ for u in units}
    params = [id(p) for u in units for p in u.parameters()]
    assert len(params) == len(set(params))  # disjoint: no parameter in two units


@pytest.mark.parametrize("overrides, message", [
    (["amp=fp16"], "dist.strategy=fsdp with amp=fp16: the GradScaler's inf check"),
    (["model.sync_bn=true"], "dist.strategy=fsdp with model.sync_bn=true: BatchNorm models"),
    (["model.compile=true"], "dist.strategy=fsdp with model.compile=true"),
    (["optim.clip_mode=agc", "optim.clip_grad=0.01"], "dist.strategy=fsdp with optim.clip_mode=agc"),
    (["dist.strategy=zero3"], "config key 'dist.strategy' is 'zero3'; choose one of ddp, fsdp"),
    (["dist.strategy=ddp", "dist.fsdp_accum_whole=true"], "config key 'dist.fsdp_accum_whole' applies to "
     "dist.strategy=fsdp"),
])
def test_what_fsdp_cannot_do_is_refused_in_one_line(overrides, message):
    with pytest.raises(UserError) as err:
        load_config("configs/dummy.yaml", ["dist.strategy=fsdp", *overrides])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_resumed_optimizer_state_takes_each_parameters_memory_format():
    """Torch's fused AdamW steps its state in the parameter's memory layout. State saved from contiguous weights
    (an fsdp run: FSDP2 keeps weights contiguous; or model.channels_last=false) and resumed into channels-last
    weights must step exactly as state saved from channels-last weights does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 3)).to(
        memory_format=torch.channels_last)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=0.1))
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    weights = [s["exp_avg"] for s in saved["state"].values() if s["exp_avg"].ndim == 4]
    assert len(weights) == 2 and all(not w.is_contiguous() for w in weights)  # channels-last, like the weights
    contiguous = {**saved, "state": {i: {k: v.contiguous() for k, v in s.items()} for i, s in saved["state"].items()}}
    results = []
    for state in (saved, contiguous):
        resumed = copy.deepcopy(model)
        resumed_optimizer = build_optimizer(resumed, OptimConfig(name="adamw", lr=0.1))
        load_optimizer_state(resumed, resumed_optimizer, copy.deepcopy(state))
        torch.manual_seed(1)
        resumed(torch.randn(2, 3, 8, 8)).sum().backward()
        resumed_optimizer.step()
        results.append([p.detach() for p in resumed.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
