"""Knowledge distillation (distill.*, engine/distill.py): timm's losses, a frozen teacher, any number of processes.

The losses are compared with timm's own distillation tasks on the same student, teacher and images; the
teacher goes through real training steps of the app's loop and must come out bitwise as its file holds it;
1 process and 2 gloo ranks (train.py, torchrun) train the same student with distillation and mixup on.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shutil

import pytest
import timm
import torch
from timm.task import LogitDistillationTask, TokenDistillationTask

import train
from assembly.start import StartingWeights, load_teacher
from core.cli import report_errors
from core.config import DistillConfig, OptimConfig, SchedConfig
from core.config_load import load_config
from core.dist import DistInfo
from core.errors import UserError
from data.transforms import DeviceNormalize
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.weights import Pretrained, read_pretrained
from engine.distill import build_distillation, teacher_name, teacher_sha256
from engine.optim import build_optimizer, build_scheduler
from engine.precision import Precision
from engine.state import TrainState
from engine.trainer import LoopConfig, TrainParts, train_one_epoch
from tests.compare import load_weights, relative_differences
from tests.helpers import TINY, read_jsonl, run_on_ranks, train_here

CPU = torch.device("cpu")
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])  # the students' data.mean/std here
TOKEN_STUDENT = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)  # a deit_*_distilled, tiny


def tiny_teacher(num_classes: int, seed: int = 1) -> torch.nn.Module:
    """test_resnet (BatchNorm: its running statistics would move if it trained) with timm's pretrained_cfg,
    whose mean/std (0.5) differ from the students' data.mean/std: the teacher's input is renormalized."""
    torch.manual_seed(seed)
    return timm.create_model("test_resnet", num_classes=num_classes)


def make_student(token: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if token:
        return timm.create_model("deit_tiny_distilled_patch16_224", num_classes=5, **TOKEN_STUDENT)
    return timm.create_model("test_efficientnet_gn", num_classes=5)


@pytest.mark.parametrize("token, kind", [(False, "soft"), (True, "soft"), (True, "hard")])
def test_losses_equal_timms_distillation_tasks(token, kind):
    """The app's loss on the student's outputs == timm's LogitDistillationTask / TokenDistillationTask forward
    (which calls the same student itself) on the same images: same loss bits, same logits for train_top1."""
    teacher, student = tiny_teacher(5), make_student(token)
    cfg = DistillConfig(teacher_weights="teacher.pth", teacher_name="test_resnet", type=kind, alpha=0.3, tau=2.0)
    data_mean_std = student.pretrained_cfg["mean"], student.pretrained_cfg["std"]  # what timm's task assumes
    ours = build_distillation(cfg, copy.deepcopy(teacher).eval(), Pretrained(teacher.state_dict(), "teacher.pth"),
                              "test_resnet", student, *data_mean_std, CPU, channels_last=False)
    assert ours.token is token
    task_args = dict(criterion=torch.nn.CrossEntropyLoss(), distill_loss_weight=0.3, task_loss_weight=0.7,
                     temperature=2.0, verbose=False)
    if token:
        theirs = TokenDistillationTask(student, copy.deepcopy(teacher), distill_type=kind, **task_args)
    else:
        theirs = LogitDistillationTask(student, copy.deepcopy(teacher), **task_args)
    theirs.train()  # the student trains, the teacher stays in eval (timm's task.train)
    images, targets = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    expected = theirs(images, targets)
    logits, loss = ours(student(images), targets, images, torch.nn.CrossEntropyLoss())
    assert torch.equal(loss, expected["loss"]), (loss, expected["loss"])
    assert torch.equal(logits, expected["output"])
    # DeiT's data mean/std (ImageNet's) are not the teacher's (0.5): there the teacher's input was renormalized.
    assert ours.renormalize is token and torch.equal(ours.teacher.mean_kd, ours.student_mean) is not token


def test_teacher_is_frozen_and_bitwise_unchanged_by_training(tmp_path):
    """The run's teacher read (read_pretrained, teacher_name) + load_teacher + build_distillation, then 2 optimizer
    steps of the app's loop with mixup-free batches: the teacher's file tensors, BatchNorm statistics included, come
    out bit for bit; no gradient ever reached it; the student did train."""
    torch.save(tiny_teacher(10).state_dict(), tmp_path / "teacher.pth")
    cfg = load_config("dummy", [f"distill.teacher_weights={tmp_path / 'teacher.pth'}",
                                "distill.teacher_name=test_resnet"])
    student = timm.create_model("test_resnet", num_classes=10)
    file = read_pretrained(cfg.distill.teacher_weights)
    weights = StartingWeights(teacher=file, teacher_name=teacher_name(cfg.distill, file))
    teacher = load_teacher(cfg, weights, student, 10)
    distill = build_distillation(cfg.distill, teacher.model, teacher.weights, teacher.name, student, *IMAGENET, CPU,
                                 channels_last=False)
    before = copy.deepcopy(student.state_dict())
    optimizer = build_optimizer(student, OptimConfig(lr=0.1), grad_scaler=False)
    parts = TrainParts(student, optimizer, build_scheduler(optimizer, SchedConfig(), 1, 2), torch.nn.CrossEntropyLoss(),
                       Precision("cpu", None), distill)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=generator),
                torch.randint(0, 10, (8,), generator=generator)) for _ in range(2)]
    loop = LoopConfig(log_interval=1000, normalize=DeviceNormalize(*IMAGENET, CPU, False))
    train_one_epoch(parts, batches, TrainState(), loop, DistInfo(0, 1, 0, 1, CPU))
    held = distill.teacher.model
    assert not held.training and all(not m.training for m in held.modules())
    assert all(not p.requires_grad and p.grad is None for p in held.parameters())
    saved = torch.load(tmp_path / "teacher.pth", weights_only=True)
    assert held.state_dict().keys() == saved.keys()
    assert all(torch.equal(held.state_dict()[k], saved[k]) for k in saved)  # num_batches_tracked too
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_the_keys_the_user_gave_survive_the_start_up_derivations(tmp_path, capsys):
    """With optim.lr_base and train.global_batch_size set (optim.lr and train.batch_size derived at start-up), a
    wrong distill.teacher_sha256 is refused, and after the teacher file changed, the value the resume error
    suggests is accepted: the derivations once dropped the record of the keys given, and with it this check."""
    teacher = tmp_path / "teacher.pth"
    torch.save(tiny_teacher(10).state_dict(), teacher)
    run = tmp_path / "run"
    args = [*TINY, f"distill.teacher_weights={teacher}", "distill.teacher_name=test_resnet", "optim.lr_base=0.1",
            "train.global_batch_size=8", "train.max_steps=1", f"output_dir={run}"]
    assert report_errors(train.main, [*args, f"distill.teacher_sha256={'a' * 64}", "--dry-run"]) == 2
    assert f"has sha256 {hashlib.sha256(teacher.read_bytes()).hexdigest()[:12]}..., not aaaaaaaaaaaa" \
        in capsys.readouterr().err
    train_here(*args)
    torch.save(tiny_teacher(10, seed=2).state_dict(), teacher)
    assert report_errors(train.main, [*args, "--dry-run"]) == 2
    suggested = re.search(r"set (distill.teacher_sha256=[0-9a-f]{64}) to continue", capsys.readouterr().err)[1]
    assert report_errors(train.main, [*args, suggested, "--dry-run"]) == 0


def test_a_changed_teacher_file_is_refused_on_resume(tmp_path):
    """distill.teacher_sha256 recorded by the run (checkpoint config) must match the file a resumed run finds."""
    path = tmp_path / "teacher.pth"
    torch.save(tiny_teacher(10).state_dict(), path)
    cfg = DistillConfig(str(path), "test_resnet")
    recorded = hashlib.sha256(path.read_bytes()).hexdigest()
    assert teacher_sha256(cfg, read_pretrained(path), False, {"distill": {"teacher_sha256": recorded}}) == recorded
    torch.save(tiny_teacher(10, seed=2).state_dict(), path)
    with pytest.raises(UserError, match=rf"distill.teacher_weights={path} has sha256 .* resumed run's teacher .*"
                                        r"set distill.teacher_sha256=[0-9a-f]{64} to continue"):
        teacher_sha256(cfg, read_pretrained(path), False, {"distill": {"teacher_sha256": recorded}})


def test_a_sharded_checkpoint_folder_is_a_teacher(tiny_sharded_run, tmp_path, capsys):
    """distill.teacher_weights=<run>/last.dcp, a form model.init_from takes, was StopIteration: its digest covers
    the folder's files (a changed shard changes it), and the run trains with it."""
    folder = tmp_path / "last.dcp"
    shutil.copytree(tiny_sharded_run / "last.dcp", folder)
    args = [*TINY, f"distill.teacher_weights={folder}", "train.max_steps=1", f"output_dir={tmp_path / 'run'}"]
    train_here(*args)
    recorded = load_checkpoint(tmp_path / "run" / "last.pth")["config"]["distill"]["teacher_sha256"]
    digest = hashlib.sha256()  # of the folder's files' names and contents, in name order
    for file in sorted(p for p in (tiny_sharded_run / "last.dcp").iterdir() if p.is_file()):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    assert recorded == digest.hexdigest()
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    assert report_errors(train.main, [*args, "train.max_steps=2", "--dry-run"]) == 2
    assert f"distill.teacher_weights={folder} has sha256 " in capsys.readouterr().err


@pytest.mark.parametrize("overrides, expected", [
    (["distill.teacher_weights={tmp}/missing.pth"],
     "error: distill.teacher_weights={tmp}/missing.pth: {tmp}/missing.pth does not exist; give a checkpoint"),
    (["distill.teacher_weights={tmp}/teacher.pth"],
     "error: distill.teacher_weights={tmp}/teacher.pth does not name its model (a plain state dict); set "
     "distill.teacher_name"),
    (["distill.teacher_weights={tmp}/teacher.pth", "distill.teacher_name=test_resnet", "data.dummy_num_classes=4"],
     "error: distill.teacher_weights={tmp}/teacher.pth (teacher test_resnet) does not fit this model (shape "
     "differs: fc.weight: file [10, 96] vs model [4, 96], fc.bias: file [10] vs model [4]); check "
     "distill.teacher_name and the number of classes"),
    (["distill.teacher_weights={tmp}/teacher.pth", "distill.teacher_name=tst_resnet"],
     "error: unknown distill.teacher_name 'tst_resnet'; did you mean"),
    # The teacher's file and name are refused before any data is read (no data.root here: that error would come first).
    (["distill.teacher_weights={tmp}/missing.pth", "data.name=imagefolder", "data.root={tmp}/no_images"],
     "error: distill.teacher_weights={tmp}/missing.pth: {tmp}/missing.pth does not exist; give a checkpoint"),
    (["distill.teacher_weights={tmp}/teacher.pth", "distill.teacher_name=tst_resnet", "data.name=imagefolder",
      "data.root={tmp}/no_images"], "error: unknown distill.teacher_name 'tst_resnet'; did you mean"),
    (["distill.teacher_name=test_resnet"], "error: distill.teacher_name=test_resnet is set but "
     "distill.teacher_weights is empty"),
    (["model.name=deit_tiny_distilled_patch16_224", "model.kwargs.img_size=16"],
     "error: model.name=deit_tiny_distilled_patch16_224 has a distillation token, which trains against a teacher: "
     "set distill.teacher_weights and distill.teacher_name, or train deit_tiny_patch16_224 without one"),
    (["distill.alpha=1.5"], "error: config key 'distill.alpha' must be in [0, 1], got 1.5"),
    (["distill.tau=0"], "error: config key 'distill.tau' must be > 0, got 0"),
    (["distill.type=kl"], "error: config key 'distill.type' is 'kl'; choose one of soft, hard"),
])
def test_bad_distillation_settings_are_one_line(overrides, expected, tmp_path, capsys):
    """--dry-run makes every distillation check a run makes: each mistake is one line naming the key."""
    torch.save(tiny_teacher(10).state_dict(), tmp_path / "teacher.pth")
    argv = ["--dry-run", *TINY, f"output_dir={tmp_path / 'run'}", *[o.format(tmp=tmp_path) for o in overrides]]
    code = report_errors(train.main, argv)
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(expected.format(tmp=tmp_path)), err


def test_dry_run_loads_the_teacher(tmp_path, capsys):
    torch.save(tiny_teacher(10).state_dict(), tmp_path / "teacher.pth")
    argv = ["--dry-run", *TINY, f"output_dir={tmp_path / 'run'}", f"distill.teacher_weights={tmp_path}/teacher.pth",
            "distill.teacher_name=test_resnet", "distill.type=hard"]
    assert report_errors(train.main, argv) == 0
    assert capsys.readouterr().out.startswith("dry run passed: test_resnet, distilled from test_resnet (hard) on 32")
    assert not (tmp_path / "run").exists()


def test_recipe_without_its_teacher_is_one_line(capsys):
    """configs/deit_small_distilled.yaml names its teacher (regnety_160) but cannot ship its weights."""
    from tests.helpers import SMALL

    argv = ["--dry-run", "--config", "deit_small_distilled", *SMALL, "model.name=deit_tiny_distilled_patch16_224",
            "model.kwargs.img_size=32", "output_dir=/nonexistent/run"]
    assert report_errors(train.main, argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.name=deit_tiny_distilled_patch16_224 has a distillation token, which trains against a teacher: "
        "set distill.teacher_weights (distill.teacher_name is regnety_160), or train deit_tiny_patch16_224 without one")


# ---- 1 process == 2 ranks with distillation and mixup on (train.py, torchrun, gloo) --------------------------

@pytest.mark.slow
def test_one_process_equals_two_ranks_with_distillation_and_mixup(tmp_path):
    """Guarantee 1 of docs/correctness.md with a teacher: the same global batches (mixed the same way, the teacher
    seeing the mixed images) give the same weights within float32 rounding (tests/compare.py's TOL)."""
    from tests.compare import TOL
    from tests.helpers import COMMON

    torch.save(tiny_teacher(10).state_dict(), tmp_path / "teacher.pth")
    common = [*COMMON, "model.name=test_efficientnet_gn", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
              f"distill.teacher_weights={tmp_path / 'teacher.pth'}", "distill.teacher_name=test_resnet",
              "distill.tau=2.0", "train.label_smoothing=0.1"]
    train_here(*common, "train.batch_size=12", f"output_dir={tmp_path / 'one'}")
    run_on_ranks("train.py", *common, "train.batch_size=6", f"output_dir={tmp_path / 'two'}", nproc=2)
    diffs = relative_differences(load_weights(tmp_path / "one"), load_weights(tmp_path / "two"))
    print("distillation, 1 process vs 2 ranks:", diffs)
    assert max(diffs.values()) <= TOL, diffs
    one, two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [row["train_top1"] for row in one] == [row["train_top1"] for row in two]
    saved = torch.load(tmp_path / "two" / "last.pth", weights_only=True)
    assert not any(key.startswith("teacher") for key in saved) and saved["model"].keys() == load_weights(
        tmp_path / "one").keys()  # the student only: the teacher is not in the checkpoint
    assert saved["config"]["distill"]["teacher_sha256"] == hashlib.sha256(
        (tmp_path / "teacher.pth").read_bytes()).hexdigest()
