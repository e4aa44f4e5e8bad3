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


def timm_032_trunc_normal_(tensor: torch.Tensor, mean=0., std=1., a=-2., b=2.) -> torch.Tensor:
    """timm 0.3.2's trunc_normal_ (timm/models/layers/weight_init.py, _no_grad_trunc_normal_), as written there."""
    import math

    def norm_cdf(x):
        return (1. + math.erf(x / math.sqrt(2.))) / 2.

    with torch.no_grad():
        l = norm_cdf((a - mean) / std)
        u = norm_cdf((b - mean) / std)
        tensor.uniform_(2 * l - 1, 2 * u - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
        return tensor


def test_cls_token_std_draws_deits_cls_token():
    """model.cls_token_std=0.02 draws the cls_token as DeiT's pinned timm 0.3.2 did (vision_transformer.py,
    VisionTransformer.__init__: trunc_normal_(self.cls_token, std=.02)), where timm 1.0 draws normal(std=1e-6); the
    other weights stay timm's. The draw is the last of create_model's, so the plain build's RNG state feeds it."""
    torch.manual_seed(0)
    plain = create_model(ModelConfig(name="test_vit"), 10)
    expected = timm_032_trunc_normal_(torch.empty_like(plain.cls_token), std=.02)
    torch.manual_seed(0)
    deit = create_model(ModelConfig(name="test_vit", cls_token_std=0.02), 10)
    assert torch.equal(deit.cls_token, expected)
    assert 0.01 < deit.cls_token.std() < 0.03 and plain.cls_token.abs().max() < 1e-5
    others = {k: v for k, v in deit.state_dict().items() if k != "cls_token"}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in others.items())


def test_cls_token_std_on_a_model_without_one_is_one_line():
    from core.errors import UserError

    with pytest.raises(UserError, match="model.cls_token_std is set but model 'test_resnet' has no cls_token"):
        create_model(ModelConfig(name="test_resnet", cls_token_std=0.02), 10)


def test_head_init_std_draws_maes_head():
    """model.head_init_std=2e-5 draws the classifier's weight as MAE's main_finetune.py does (trunc_normal_(
    model.head.weight, std=2e-5), timm 0.3.2's trunc_normal_: cut at +-2 in absolute units), bias left at timm's 0,
    where timm's VisionTransformer draws trunc_normal(std=0.02); the other weights stay timm's."""
    torch.manual_seed(0)
    plain = create_model(ModelConfig(name="test_vit"), 10)
    expected = timm_032_trunc_normal_(torch.empty_like(plain.head.weight), std=2e-5)
    torch.manual_seed(0)
    mae = create_model(ModelConfig(name="test_vit", head_init_std=2e-5), 10)
    assert torch.equal(mae.head.weight, expected)
    torch.manual_seed(1)
    big = timm_032_trunc_normal_(torch.empty(1000, 1024), std=2e-5)  # ViT-L's head: the draw's statistics
    assert abs(big.std().item() / 2e-5 - 1) < 0.01 and big.abs().max() < 6 * 2e-5  # +-2 never cuts at this std
    assert abs(mae.head.weight.std().item() / 2e-5 - 1) < 0.15 and plain.head.weight.std() > 0.01
    assert torch.equal(mae.head.bias, torch.zeros(10))
    others = {k: v for k, v in mae.state_dict().items() if k != "head.weight"}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in others.items())


def test_head_init_std_draws_a_remade_classifier_and_keeps_a_loaded_one():
    """Starting from weights (model.init_from, model.pretrained): a classifier timm re-made for another class count,
    or that the file lacks (MAE's encoder), is drawn by model.head_init_std after the load; one the file gave (the
    same class count) is left exactly as loaded, and so is every other tensor."""
    torch.manual_seed(5)
    weights = create_model(ModelConfig(name="test_vit"), 10).state_dict()
    encoder = {k: v for k, v in weights.items() if not k.startswith("head.")}
    for file, classes in ((weights, 4), (encoder, 10)):
        torch.manual_seed(0)
        plain = create_model(ModelConfig(name="test_vit"), classes, dict(file), "file")
        expected = timm_032_trunc_normal_(torch.empty_like(plain.head.weight), std=2e-5)
        torch.manual_seed(0)
        mae = create_model(ModelConfig(name="test_vit", head_init_std=2e-5), classes, dict(file), "file")
        assert torch.equal(mae.head.weight, expected) and torch.equal(mae.head.bias, torch.zeros(classes))
        assert all(torch.equal(mae.state_dict()[k], v) for k, v in encoder.items())
    kept = create_model(ModelConfig(name="test_vit", head_init_std=2e-5), 10, dict(weights), "file")
    assert all(torch.equal(kept.state_dict()[k], v) for k, v in weights.items())


def test_head_init_std_on_a_model_without_a_classifier_is_one_line():
    from core.errors import UserError

    with pytest.raises(UserError, match="model.head_init_std is set but model 'test_vit' has no classifier weight") \
            as err:
        create_model(ModelConfig(name="test_vit", head_init_std=2e-5), 0)
    assert "\n" not in str(err.value) and "remove model.head_init_std" in str(err.value)


def test_freeze_epochs_keeps_the_backbone_still_until_released_then_trains_it():
    """model.freeze_epochs, as build_parts and the Unfreeze hook do it: the optimizer holds every parameter, the
    backbone is frozen after it is built, and steps with momentum and weight decay leave every frozen tensor
    (BatchNorm statistics included) bitwise as it was; from the epoch the hook releases it, they all train."""
    from core.config import OptimConfig
    from engine.hooks import Unfreeze
    from engine.optim import build_optimizer
    from engine.state import TrainState
    from models.freeze import freeze_backbone

    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet"), 4)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.1, weight_decay=0.1), unfreezes=True)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
    hook = Unfreeze(1, freeze_backbone(model, 1).release, is_main=True)
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def steps(epoch: int) -> dict[str, torch.Tensor]:
        state = TrainState(epoch=epoch)
        hook.before_epoch(state)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.train()
        for _ in range(2):
            model(images).logsumexp(dim=1).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return before

    start = steps(0)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(start[k], v)}
    assert changed == {"fc.weight", "fc.bias"}
    start = steps(1)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(start[k], v)}
    assert {"conv1.0.weight", "bn1.weight", "bn1.running_mean", "fc.weight"} <= changed
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("overrides, message", [
    (["model.freeze_epochs=1"], "model.freeze_epochs=1 needs model.freeze=backbone"),
    (["model.freeze=backbone", "model.freeze_epochs=3", "train.epochs=3"],
     "model.freeze_epochs=3 is not below train.epochs=3"),
    (["model.freeze=backbone", "model.freeze_epochs=1", "train.epochs=3", "dist.strategy=fsdp"],
     "model.freeze_epochs=1 with dist.strategy=fsdp"),
])
def test_freeze_epochs_that_cannot_work_are_one_line(overrides, message):
    from core.config_load import load_config
    from core.errors import UserError

    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow  # three tiny runs in this process (~15 s)
def test_freeze_epochs_resumed_across_the_unfreeze_is_bitwise_the_uninterrupted_run(tmp_path):
    """fastai's fine_tune in one run: stopped in the frozen epoch (train.max_steps), resumed, unfrozen at epoch 1,
    it ends bitwise where the run never stopped ends; the frozen steps left the backbone as it started."""
    from engine.checkpoint.formats import load_checkpoint
    from tests.compare import assert_same
    from tests.helpers import train_here

    common = [*TINY, "train.epochs=2", "model.freeze=backbone", "model.freeze_epochs=1", "model.ema_decay=0.9"]
    train_here(*common, f"output_dir={tmp_path / 'straight'}", "train.keep_last_k=2")
    train_here(*common, f"output_dir={tmp_path / 'resumed'}", "train.max_steps=2")
    stopped = load_checkpoint(tmp_path / "resumed" / "last.pth")
    train_here(*common, f"output_dir={tmp_path / 'resumed'}")
    assert_same(load_checkpoint(tmp_path / "straight" / "last.pth"), load_checkpoint(tmp_path / "resumed" / "last.pth"))
    frozen = load_checkpoint(tmp_path / "straight" / "epoch_0000.pth")["model"]  # step 4, the frozen epoch's end
    final = load_checkpoint(tmp_path / "straight" / "last.pth")["model"]
    backbone = [k for k in frozen if not k.startswith("fc.")]
    assert stopped["global_step"] == 2 and all(torch.equal(stopped["model"][k], frozen[k]) for k in backbone)
    assert not torch.equal(stopped["model"]["fc.weight"], frozen["fc.weight"])
    assert not any(torch.equal(frozen[k], final[k]) for k in ("conv1.0.weight", "bn1.running_mean"))
