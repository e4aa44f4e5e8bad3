"""Knowledge distillation (distill.*): a frozen teacher's logits on the same images, in the training loss.

distill.teacher_weights turns it on. The teacher is read like model.init_from (any form it takes), loaded
exactly (its classifier must have the data's classes), frozen (requires_grad False) and kept in eval mode;
it is never wrapped by DDP nor saved in checkpoints: the config records its path and its file's sha256
(distill.teacher_sha256), and a resumed run refuses a teacher whose file changed. The loop calls it inside
the student's autocast, on the images the student sees (mixed ones too, with mixup/cutmix); its loss is a
mean over the process's images, so DDP's gradient average gives the same step for any number of processes.

    loss = (1 - alpha) x train.loss(student, targets) + alpha x distillation loss
    soft: KL(softmax(teacher / tau) || softmax(student / tau)) x tau^2, summed over classes, mean over images
    hard: cross-entropy of the student against the teacher's argmax (DeiT's hard distillation)

A DeiT student with a distillation token (deit_*_distilled) returns (class-token, distillation-token) logits
while training: train.loss applies to the first, the distillation loss to the second; in eval mode timm
averages the two heads, so evaluation and every tool after training see one output. Any other student
distills its only logits.

Why not timm.task's LogitDistillationTask / TokenDistillationTask themselves: a task calls the student
itself, and the app's loop owns that call (DDP's no_sync within accumulation groups, torch.compile, the EMA
hook); a task renormalizes the teacher's input from the student's pretrained_cfg, while the app normalizes
with data.mean/std; and the logit task has soft KL only. So the loop calls the student and `Distillation`
computes the tasks' losses (the same formulas: tests/test_distill.py compares them with timm's tasks on the
same student, teacher and images), with the teacher held by timm's DistillationTeacher (eval mode, input
renormalization). DeiT's own soft loss divides its KL by images x classes; timm's, used here, by images.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from timm.task.distillation import DistillationTeacher
from torch import nn
from torch.nn import functional as F

from core.config import DistillConfig
from core.errors import UserError
from engine.checkpoint.weights import Pretrained, load_weights, usable, weights_value

log = logging.getLogger(__name__)


@dataclass
class Distillation:
    """The training loss with a teacher; the loop calls it in place of loss_fn, inside the same autocast."""

    teacher: DistillationTeacher
    kind: str  # soft | hard
    alpha: float
    tau: float
    token: bool  # the student has a distillation token: (class, distillation) logits while training
    student_mean: torch.Tensor  # data.mean and data.std, (1, 3, 1, 1): what the images are normalized with
    student_std: torch.Tensor
    renormalize: bool  # the teacher was trained with another mean/std (decided once: no host read per step)

    def __call__(self, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor,
                 images: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits train_top1 counts, the loss) for the student's outputs on `images`."""
        logits, distilled = outputs if self.token else (outputs, outputs)
        task_loss = loss_fn(logits, targets)
        with torch.no_grad():
            teacher_logits = self.teacher(self.teacher_input(images))
        if self.kind == "soft":
            student_log_p = F.log_softmax(distilled.float() / self.tau, dim=-1)
            teacher_log_p = F.log_softmax(teacher_logits.float() / self.tau, dim=-1)
            kd_loss = F.kl_div(student_log_p, teacher_log_p, reduction="batchmean", log_target=True) * self.tau ** 2
        else:
            kd_loss = F.cross_entropy(distilled.float(), teacher_logits.argmax(dim=-1))
        return logits, (1 - self.alpha) * task_loss + self.alpha * kd_loss

    def teacher_input(self, images: torch.Tensor) -> torch.Tensor:
        """The images as the teacher was trained to see them: DistillationTeacher.normalize_input's formula,
        whose torch.equal test of the two normalizations would read the device every step."""
        if not self.renormalize:
            return images
        teacher = self.teacher
        return (images * self.student_std + self.student_mean - teacher.mean_kd) / teacher.std_kd


def is_token_student(model: nn.Module) -> bool:
    """Whether the student has a distillation token and head (timm's deit_*_distilled)."""
    return hasattr(model, "set_distilled_training")


def check_teacher_needed(cfg: DistillConfig, student: nn.Module, student_name: str) -> None:
    """A distilled DeiT without a teacher would train its distillation head on the labels: refused, as is a
    teacher named without its weights."""
    if cfg.teacher_weights:
        return
    if is_token_student(student):
        named = f" (distill.teacher_name is {cfg.teacher_name})" if cfg.teacher_name else " and distill.teacher_name"
        raise UserError(f"model.name={student_name} has a distillation token, which trains against a teacher: set "
                        f"distill.teacher_weights{named}, or train {student_name.replace('_distilled', '')} "
                        "without one")
    if cfg.teacher_name:
        raise UserError(f"distill.teacher_name={cfg.teacher_name} is set but distill.teacher_weights is empty; give "
                        "the teacher's weights file (a checkpoint, .pth, .safetensors or model folder)")


def teacher_name(cfg: DistillConfig, pretrained: Pretrained) -> str:
    """The teacher's timm model name: distill.teacher_name, else the one its file (`pretrained`) names."""
    named = pretrained.architecture.split(".")[0] if pretrained.architecture else ""
    name = cfg.teacher_name or named
    if not name:
        raise UserError(f"{pretrained.source} does not name its model (a plain state dict); set "
                        "distill.teacher_name to the teacher's timm model name")
    if named and named != name.split(".")[0]:
        raise UserError(f"{pretrained.source} holds a {pretrained.architecture} but distill.teacher_name is {name}; "
                        f"set distill.teacher_name={named}")
    return name


def teacher_sha256(cfg: DistillConfig, pretrained: Pretrained, given: bool, resumed: dict[str, Any] | None) -> str:
    """distill.teacher_sha256 for this run: the file's (read with its weights), checked against the one given, else
    the resumed run's."""
    actual = pretrained.sha256
    if given:
        expected, where = cfg.teacher_sha256, "distill.teacher_sha256"
    else:
        expected = ((resumed or {}).get("distill") or {}).get("teacher_sha256", "")
        where = "the resumed run's teacher (its checkpoint's distill.teacher_sha256)"
    if expected and expected != actual:
        raise UserError(f"distill.teacher_weights={cfg.teacher_weights} has sha256 {actual[:12]}..., not "
                        f"{expected[:12]}... as {where}; restore that teacher, or set "
                        f"distill.teacher_sha256={actual} to continue with this one")
    return actual


def freeze_teacher(model: nn.Module, pretrained: Pretrained, name: str) -> nn.Module:
    """The teacher with exactly the file's weights, frozen and in eval mode (its BatchNorm statistics fixed)."""
    load_weights(model, pretrained.state_dict, f"{pretrained.source} (teacher {name})", check="distill.teacher_name")
    model.requires_grad_(False)
    return model.eval()


def teacher_normalization(pretrained: Pretrained, name: str, mean: Sequence[float], std: Sequence[float]
                          ) -> tuple[list[float], list[float], str]:
    """The mean/std the teacher was trained with (its file's config, else timm's pretrained_cfg of its name, as
    model.init_from resolves them), else the student's data.mean/std; and where they came from."""
    values, origins = [], []
    for key, student in (("mean", mean), ("std", std)):
        found, where = weights_value(pretrained, name, key)
        usable_here = found is not None and usable(key, found)
        values.append([float(v) for v in (found if usable_here else student)])
        origins.append(where if usable_here else "data's")
    return values[0], values[1], origins[0]


def build_distillation(cfg: DistillConfig, teacher: nn.Module, pretrained: Pretrained, name: str, student: nn.Module,
                       mean: Sequence[float], std: Sequence[float], device: torch.device,
                       channels_last: bool) -> Distillation:
    """The teacher on the device beside the student; a distilled DeiT student set to return both heads."""
    teacher_mean, teacher_std, origin = teacher_normalization(pretrained, name, mean, std)
    teacher = teacher.to(device)
    if channels_last:  # the images arrive channels-last: the same memory format as the student's
        teacher = teacher.to(memory_format=torch.channels_last)
    held = DistillationTeacher(teacher, device=device)
    held.mean_kd.copy_(torch.tensor(teacher_mean).view(1, -1, 1, 1))
    held.std_kd.copy_(torch.tensor(teacher_std).view(1, -1, 1, 1))
    token = is_token_student(student)
    if token:
        student.set_distilled_training(True)
    log.info("distill: teacher %s from %s (sha256 %s...), normalized with mean %s std %s (%s); %s%s, alpha %g%s",
             name, cfg.teacher_weights, cfg.teacher_sha256[:12], teacher_mean, teacher_std, origin, cfg.type,
             " through the distillation token" if token else "", cfg.alpha,
             f", tau {cfg.tau:g}" if cfg.type == "soft" else "")
    return Distillation(held, cfg.type, cfg.alpha, cfg.tau, token,
                        torch.tensor(list(mean), device=device).view(1, -1, 1, 1),
                        torch.tensor(list(std), device=device).view(1, -1, 1, 1),
                        renormalize=(teacher_mean, teacher_std) != ([float(v) for v in mean], [float(v) for v in std]))
