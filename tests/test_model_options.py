"""Model options: gradient checkpointing, and freezing the backbone (linear probing) over real DDP processes."""

from __future__ import annotations

import pytest
import torch

import train
from core.cli import report_errors
from core.config import ModelConfig
from models.factory import create_model, prepare_model
from tests.helpers import TINY, run_on_ranks


def test_gradient_checkpointing_gives_the_same_gradients(capsys, tmp_path):
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = create_model(ModelConfig(name="test_vit", grad_checkpointing=checkpointing,
                                         kwargs={"img_size": 32}), 10)
        assert model.grad_checkpointing is checkpointing
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        model(x).logsumexp(dim=1).sum().backward()
        grads[checkpointing] = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.allclose(grads[True][k], grads[False][k], atol=1e-6) for k in grads[True])
    # A model timm cannot checkpoint: one line.
    code = report_errors(train.main, [*TINY, "model.name=dla34", "model.grad_checkpointing=true",
                                      f"output_dir={tmp_path / 'run'}", "--dry-run"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: model 'dla34' does not support gradient checkpointing"), line


def test_freeze_backbone_leaves_only_the_classifier_trainable_and_batchnorm_in_eval():
    model = prepare_model(create_model(ModelConfig(name="test_resnet", freeze="backbone"), 4),
                          ModelConfig(name="test_resnet", freeze="backbone", channels_last=False),
                          torch.device("cpu"), 1)
    assert [k for k, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running statistics untouched in train mode
    assert all(p.grad is None for k, p in model.named_parameters() if not k.startswith("fc."))


@pytest.mark.slow  # a real 2-process torchrun training
def test_two_ranks_with_a_frozen_backbone_train_only_the_head(tiny_run, tmp_path):
    start = tiny_run / "best.pth"
    out = tmp_path / "probe"
    run_on_ranks("train.py", *TINY, "model.name=test_resnet", f"model.init_from={start}", "model.freeze=backbone",
                 "train.batch_size=4", "train.epochs=2", f"output_dir={out}", nproc=2)
    before = torch.load(start, weights_only=True)["model"]
    ckpt = torch.load(out / "last.pth", weights_only=True)
    after = ckpt["model"]
    assert ckpt["epoch"] == 2 and ckpt["world_size"] == 2
    backbone = [k for k in before if not k.startswith("fc.")]
    assert all(torch.equal(before[k], after[k]) for k in backbone)  # bitwise, BatchNorm statistics included
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    # The optimizer holds the classifier only.
    assert sum(len(group["params"]) for group in ckpt["optimizer"]["param_groups"]) == 2
