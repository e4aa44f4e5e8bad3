"""The recipe fidelity table: per recipe config, per item, the source's value, the app's, and the test that proves
them equal. docs/correctness.md holds `fidelity_markdown()` (tests/test_recipes.py keeps the two in step);
regenerate it with `python -m tests.fidelity`.

The app's column is read from the config files themselves, so the table cannot drift from them. A row without a
test is a known difference, cited in that config's header ("Not expressible here").
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from core.config import to_dict
from core.config_load import load_config


@dataclass(frozen=True)
class Row:
    config: str  # file in configs/
    item: str
    source: str  # the source's value, and where the source sets it
    keys: tuple[str, ...]  # config keys that carry the app's value
    test: str = ""  # tests/<file>.py::<test> proving app == source; "" = a known difference
    note: str = ""  # the app's side, where the keys alone do not say it


SCHEDULE_TEST = "tests/test_recipes.py::test_recipe_schedule_is_its_sources"
BATCH_MIX_TEST = "tests/test_augment.py::test_batch_mode_mixes_a_group_as_timms_batch_mode"
LAYOUT_TEST = "tests/test_augment.py::test_batch_mode_groups_are_the_sources_gpu_batches_for_any_split_of_a_step"
GPU_BATCH_KEYS = ("data.mix_group", "train.batch_size")
ROLL_TEST = "tests/test_augment.py::test_roll_partners_mix_a_group_as_torchvisions_mixup_and_cutmix"
ROUNDING_TEST = "tests/test_augment.py::test_symmetric_cutmix_box_is_torchvisions_and_older_timms_for_the_same_draws"
LAST_BN_TEST = "tests/test_recipes.py::test_last_bn_init_is_the_sources"
LR_BASE_TEST = "tests/test_schedule.py::test_lr_base_scales_with_the_global_batch"
BCE_TEST = "tests/test_knobs.py::test_bce_threshold_and_pos_weight_equal_timms"
LR_KEYS = ("optim.lr_base", "optim.lr_base_size", "optim.lr_base_scale")
MAE = "vit_large_mae_finetune.yaml"

# Schedules, stepping, mixing, repeated augmentation, init (issue 31 items 2, 3, 5).
SCHEDULE_ROWS = [
    Row("resnet50.yaml", "lr schedule", "lr x (e+1)/8 in warmup epoch e, then cosine to 0 over the other 82 epochs "
        "(image_classification/training.py, lr_cosine_policy)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_shape", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("resnet50.yaml", "lr stepping", "once per epoch (lr_fn(iteration, epoch) reads the epoch only)",
        ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row("resnet50.yaml", "last BN of each block", "starts at 1 (image_classification/models/resnet.py: "
        "last_bn_0_init False)", ("model.kwargs",), LAST_BN_TEST),
    Row("resnet50.yaml", "lr for the global batch", "0.256 per 256 images, linear (README: --lr 2.048 at 2048)",
        LR_KEYS, LR_BASE_TEST),
    Row("resnet50.yaml", "decoding", "DALI on the GPU (--data-backend dali-gpu)", (), "",
        "not expressible: decoded on the CPU workers"),
    Row("convnext_tiny.yaml", "lr schedule", "cosine to 1e-6 over the 280 epochs after 20 warmup epochs from 0 "
        "(utils.py cosine_scheduler)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("convnext_tiny.yaml", "lr stepping", "every optimizer update (engine.py: lr_schedule_values[it])",
        ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row("convnext_tiny.yaml", "warmup ramp", "np.linspace(0, lr, warmup_iters): lr on the last warmup step", (),
        SCHEDULE_TEST, "timm's ramp lr x t / warmup_iters, relatively 1/warmup_iters lower (bounded in the test)"),
    Row("convnext_tiny.yaml", "mixup/cutmix draw", "timm Mixup, --mixup_mode batch: one draw per GPU batch of 128",
        ("data.mix_mode", "data.mix_group"), BATCH_MIX_TEST),
    Row("convnext_tiny.yaml", "GPU batches", "DistributedSampler deals the epoch to 8 GPUs, 4 micro-batches of 128 "
        "per step: each one mixing draw", GPU_BATCH_KEYS, LAYOUT_TEST,
        "a step's 4096 images are the source's; its 32 groups of 128 are dealt as 32 GPUs without accumulation "
        "would, another split of the same images (the layout must not depend on the split between processes "
        "and accumulation)"),
    Row("convnext_tiny.yaml", "lr for the global batch", "4e-3 at 4096 (TRAINING.md)", LR_KEYS, LR_BASE_TEST),
    Row("deit_small.yaml", "lr schedule", "timm cosine, 5 warmup epochs from 1e-6, to 1e-5 over all 300 epochs "
        "(main.py: timm create_scheduler, no warmup prefix)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("deit_small.yaml", "lr stepping", "once per epoch (main.py: lr_scheduler.step(epoch))",
        ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row("deit_small.yaml", "epoch the lr is for", "step(epoch) after epoch `epoch`: epoch e >= 1 trains at the "
        "value for e - 1 (main.py)", ("sched.epoch_lag",),
        "tests/test_schedule.py::test_epoch_lag_is_deits_step_after_each_epoch",
        "epoch e at the value for max(e - lag, 0), a function of the step (resumes exactly)"),
    Row("deit_small.yaml", "mixup/cutmix draw", "timm Mixup, --mixup-mode batch: one draw per GPU batch of 256",
        ("data.mix_mode", "data.mix_group"), BATCH_MIX_TEST),
    Row("deit_small.yaml", "repeated copies with mixing", "RASampler deals 3 copies of an image to 3 of the 4 GPUs, "
        "each GPU batch of 256 one mixing draw", ("data.aug_repeats", *GPU_BATCH_KEYS), LAYOUT_TEST),
    Row("deit_small.yaml", "lr for the global batch", "5e-4 x batch / 512 (main.py: linear_scaled_lr)", LR_KEYS,
        LR_BASE_TEST),
    Row("deit_small_distilled.yaml", "lr schedule", "as deit_small.yaml (main.py's defaults)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("deit_small_distilled.yaml", "epoch the lr is for", "as deit_small.yaml: step(epoch) after epoch `epoch`, "
        "epoch e >= 1 at the value for e - 1", ("sched.step_on_epochs", "sched.epoch_lag"), SCHEDULE_TEST),
    Row("deit_small_distilled.yaml", "repeated copies with mixing", "as deit_small.yaml: RASampler deals 3 copies "
        "of an image to 3 of the 4 GPUs, each GPU batch of 256 one mixing draw", ("data.aug_repeats", *GPU_BATCH_KEYS),
        LAYOUT_TEST),
    Row("deit_small_distilled.yaml", "distillation", "--distillation-type hard, alpha 0.5: 0.5 x CE(class head, "
        "labels) + 0.5 x CE(distillation head, teacher argmax); teacher regnety_160 in eval mode on the mixed images "
        "(main.py, losses.py DistillationLoss)", ("distill.type", "distill.alpha", "distill.teacher_name"),
        "tests/test_distill.py::test_losses_equal_timms_distillation_tasks", "timm's TokenDistillationTask, the same "
        "formula"),
    Row("resnet50_rsb_a3.yaml", "lr schedule", "timm cosine, 5 warmup epochs from 1e-4, to 1e-6 over all 100 "
        "epochs (no warmup prefix)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("resnet50_rsb_a3.yaml", "lr stepping", "once per epoch (timm train.py: lr_scheduler.step(epoch + 1), no "
        "--sched-on-updates)", ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row("resnet50_rsb_a3.yaml", "mixup/cutmix draw", "timm Mixup, --mixup-mode batch: one draw per GPU batch of 256",
        ("data.mix_mode", "data.mix_group"), BATCH_MIX_TEST),
    Row("resnet50_rsb_a3.yaml", "GPU batches", "DistributedSampler deals the epoch to the 8 GPUs: each GPU batch of "
        "256 one mixing draw and one BatchNorm batch", GPU_BATCH_KEYS, LAYOUT_TEST),
    Row("resnet50_rsb_a3.yaml", "lr for the global batch", "8e-3 at 2048, square-root rule for LAMB (timm "
        "train.py)", LR_KEYS, LR_BASE_TEST),
    Row("resnet50_rsb_a3.yaml", "BCE targets", "bce_target_thresh 0.2 binarizes the mixed targets (timm "
        "BinaryCrossEntropy)", ("train.loss", "train.bce_target_threshold"), BCE_TEST),
    Row("resnet50_torchvision.yaml", "lr schedule", "LinearLR from 0.01 x lr over 5 epochs, then "
        "CosineAnnealingLR(T_max=epochs - 5) to 0 (references/classification/train.py)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row("resnet50_torchvision.yaml", "lr stepping", "once per epoch (train.py: lr_scheduler.step() after each "
        "epoch)", ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row("resnet50_torchvision.yaml", "last BN of each block", "starts at 1 (zero_init_residual False)",
        ("model.kwargs",), LAST_BN_TEST),
    Row("resnet50_torchvision.yaml", "mixup/cutmix draw", "RandomChoice([MixUp, CutMix]) over each batch of 128 in "
        "the collate", ("data.mix_mode", "data.mix_group"), BATCH_MIX_TEST),
    Row("resnet50_torchvision.yaml", "mixing partners", "image i takes from image i-1 of the batch, the first from "
        "the last (MixUp/CutMix: batch.roll(1, 0))", ("data.mix_partner",), ROLL_TEST),
    Row("resnet50_torchvision.yaml", "cutmix box", "centre +- int(0.5 sqrt(1 - lam) x size), clipped; lambda "
        "corrected to the box (CutMix.make_params)", ("data.cutmix_rounding",), ROUNDING_TEST),
    Row("resnet50_torchvision.yaml", "repeated copies with mixing", "RASampler deals 4 copies of an image to 4 of "
        "the 8 GPUs, each GPU batch of 128 one mixing draw and one BatchNorm batch", ("data.aug_repeats",
                                                                                      *GPU_BATCH_KEYS), LAYOUT_TEST),
    Row("resnet50_torchvision.yaml", "lr for the global batch", "0.5 at 1024 (--lr 0.5, 8 x 128)", LR_KEYS,
        LR_BASE_TEST),
    Row(MAE, "lr schedule", "linear warmup from 0 over 5 epochs, then half-cycle cosine to 1e-6 over the 45 after it "
        "(util/lr_sched.py adjust_learning_rate)",
        ("sched.name", "sched.warmup_epochs", "sched.warmup_lr", "sched.warmup_prefix", "sched.min_lr"),
        SCHEDULE_TEST),
    Row(MAE, "lr stepping", "every iteration, at epoch + step / len(data_loader) (engine_finetune.py)",
        ("sched.step_on_epochs",), SCHEDULE_TEST),
    Row(MAE, "lr for the global batch", "--blr 1e-3 x effective batch / 256 (main_finetune.py): 4e-3 at 1024", LR_KEYS,
        LR_BASE_TEST),
    Row(MAE, "layer-wise lr decay, weight decay", "lr x 0.75^(25 - i): i = 0 embeddings, k + 1 block k, 25 fc_norm "
        "and head; no decay on 1-D tensors, pos_embed, cls_token (util/lr_decay.py param_groups_lrd)",
        ("optim.layer_decay", "optim.weight_decay", "optim.no_decay_norm_bias"),
        "tests/test_recipes.py::test_layer_decay_and_weight_decay_are_maes_for_its_vit",
        "timm's param_groups_layer_decay"),
    Row(MAE, "pooling", "mean of the patch tokens, then a new LayerNorm fc_norm, no final norm (models_vit.py, "
        "--global_pool)", ("model.kwargs",), "tests/test_recipes.py::test_global_pool_is_maes_models_vit"),
    Row(MAE, "pre-trained weights", "{'model': encoder}; norm.* unused, fc_norm fresh (main_finetune.py: "
        "load_state_dict(strict=False))", ("model.init_from",),
        "tests/test_recipes.py::test_mae_weights_converted_as_the_header_says_start_the_recipes_model",
        "the file converted once by the header's command"),
    Row(MAE, "head init", "trunc_normal_(model.head.weight, std=2e-5), bias 0 (main_finetune.py, after loading the "
        "encoder)", ("model.head_init_std",), "tests/test_model_options.py::test_head_init_std_draws_maes_head",
        "drawn after timm re-makes the classifier for the class count; a kept one is left as loaded"),
    Row(MAE, "mixup/cutmix draw", "timm Mixup, --mixup_mode batch: one draw per GPU batch of 32",
        ("data.mix_mode", "data.mix_group"), BATCH_MIX_TEST),
]

# Preprocessing, RandAugment ops and random erasing (issue 31 items 1 and 4): rows from that work go here.
PIXELS = "tests/test_pixels.py::"
EVAL_TIMM = PIXELS + "test_eval_preset_equals_timms"
CROP_TEST = PIXELS + "test_training_crop_equals_torchvisions_and_timms_for_a_given_box"
INC1_TEST = PIXELS + "test_rand_augment_inc1_ops_equal_timms"
PREPROCESSING_ROWS: list[Row] = [
    *(Row(name, "eval resize", "timm: PIL, short side floor(img_size / crop_pct), bicubic, centre crop",
          ("data.img_size", "data.crop_pct", "data.interpolation"), EVAL_TIMM, "torch's antialiased resize")
      for name in ("deit_small.yaml", "convnext_tiny.yaml")),
    Row("resnet50_rsb_a3.yaml", "eval resize", "timm: PIL, short side floor(224 / 0.95), bicubic, centre crop 224",
        ("data.val_img_size", "data.val_crop_pct", "data.interpolation"), EVAL_TIMM, "torch's antialiased resize"),
    *(Row(name, "RandAugment", f"timm {policy} (posterize to 1 bit at m9, mean-colour fill, bicubic)",
          ("data.auto_augment",), INC1_TEST, "timm's own ops, seeded per sample")
      for name, policy in (("deit_small.yaml", "rand-m9-mstd0.5-inc1"), ("convnext_tiny.yaml", "rand-m9-mstd0.5-inc1"),
                           ("resnet50_rsb_a3.yaml", "rand-m6-mstd0.5-inc1"), (MAE, "rand-m9-mstd0.5-inc1"))),
    *(Row(name, "training crop resize", "PIL antialiased resized_crop (timm RandomResizedCropAndInterpolation)",
          ("data.scale", "data.ratio"), CROP_TEST, "torch's antialiased resize of the same box")
      for name in ("deit_small.yaml", "convnext_tiny.yaml", "resnet50_rsb_a3.yaml", "resnet50_torchvision.yaml",
                   "resnet50.yaml", MAE)),
    Row("resnet50_rsb_a3.yaml", "train interpolation", "--train-interpolation random (timm train.py)",
        ("data.train_interpolation",), PIXELS + "test_random_training_interpolation_picks_bilinear_or_bicubic_per_image"),
    Row("deit_small.yaml", "random erasing mode", "--remode pixel", ("data.random_erase", "data.random_erase_mode"),
        "tests/test_augment.py::test_erasing_fills_a_box_with_varied_pixels"),
    Row("resnet50_torchvision.yaml", "eval preset", "resize 232, centre crop 224, bilinear antialiased "
        "(ImageClassification)", ("data.val_img_size", "data.val_crop_pct", "data.interpolation"),
        PIXELS + "test_eval_preset_equals_torchvisions_for_its_recipe"),
    Row("resnet50_torchvision.yaml", "TrivialAugment interpolation", "bilinear (--interpolation)",
        ("data.auto_augment", "data.interpolation"), PIXELS + "test_trivial_augment_samples_as_torchvisions_preset"),
    Row("resnet50_torchvision.yaml", "random erasing value", "0 after Normalize (RandomErasing, value 0)",
        ("data.random_erase", "data.random_erase_mode"),
        PIXELS + "test_const_erasing_is_zero_after_normalize_as_torchvisions"),
    Row(MAE, "eval resize", "torchvision Resize(int(224 / (224 / 256)) = 256, bicubic), CenterCrop(224) on PIL "
        "(util/datasets.py)", ("data.img_size", "data.crop_pct", "data.interpolation"),
        PIXELS + "test_eval_preset_equals_maes_for_its_recipe", "torch's antialiased resize"),
    Row(MAE, "random erasing mode", "--reprob 0.25 --remode pixel --recount 1",
        ("data.random_erase", "data.random_erase_mode", "data.random_erase_count"),
        "tests/test_augment.py::test_erasing_fills_a_box_with_varied_pixels"),
]

# Decoding (issue 40 item 9): every source reads images with PIL (torchvision's pil_loader: convert("RGB")).
DECODE_TEST = PIXELS + "test_images_opencv_reads_otherwise_decode_as_pils_loader"
DECODING_ROWS = [
    Row(name, "decoding", "PIL: EXIF orientation ignored, CMYK and 16-bit greyscale through convert('RGB') "
        "(torchvision pil_loader)", (), DECODE_TEST,
        "OpenCV with EXIF ignored; CMYK/YCCK JPEGs, 16-bit greyscale PNGs and TIFFs through PIL")
    for name in ("deit_small.yaml", "deit_small_distilled.yaml", "convnext_tiny.yaml", "resnet50_rsb_a3.yaml",
                 "resnet50_torchvision.yaml", MAE)
]

# Precision, init, weight decay, steps per epoch, erasing, EMA (issue 40 items 1, 4-8).
ERASE_BOX_TEST = "tests/test_augment.py::test_erasing_box_is_timms_or_torchvisions_formula_on_the_same_draws"
ERASE_FILL_TEST = "tests/test_augment.py::test_normalized_erasing_fill_is_timms_unbounded_normal"
TIMM_ERASING = ("deit_small.yaml", "deit_small_distilled.yaml", "convnext_tiny.yaml", MAE)
SOURCE_ROWS_40: list[Row] = [
    Row("resnet50_torchvision.yaml", "EMA in the warmup epochs", "copies the model at each update of the 5 warmup "
        "epochs and at the first after them (train.py: model_ema.n_averaged.fill_(0) while epoch < "
        "lr_warmup_epochs)", ("model.ema_reset_epochs",),
        "tests/test_ema.py::test_ema_reset_epochs_is_torchvisions_warmup_reset", "torch's AveragedModel beside it"),
    Row("convnext_tiny.yaml", "optimizer steps per epoch", "len(dataset_train) // total_batch_size (main.py): 312 at "
        "4096; engine.py skips the micro-batches after them", ("train.accum_steps", "train.drop_last_accum"),
        "tests/test_schedule.py::test_steps_per_epoch_with_accumulation_follow_convnexts_rule_when_dropping"),
    *(Row(name, "cls_token init", "trunc_normal_(std=.02) (timm 0.3.2 VisionTransformer, which DeiT's models.py "
          "builds)", ("model.cls_token_std",), "tests/test_model_options.py::test_cls_token_std_draws_deits_cls_token",
          "timm 1.0 would draw normal(std=1e-6)") for name in ("deit_small.yaml", "deit_small_distilled.yaml")),
    Row("resnet50.yaml", "convolution init", "kaiming_normal_(mode=\"fan_in\", nonlinearity=\"relu\") "
        "(models/common.py LayerBuilder.conv, ResNet.Params conv_init)", ("model.conv_init",),
        "tests/test_recipes.py::test_nvidia_conv_init_is_its_layer_builders", "timm's resnet alone: fan_out"),
    Row("resnet50.yaml", "no weight decay", "parameters whose names contain \"bn\" (optimizers.py "
        "get_sgd_optimizer): downsample BatchNorms and fc.bias are decayed", ("optim.no_decay_norm_bias",
        "optim.no_decay_match"), "tests/test_recipes.py::test_nvidia_weight_decay_skips_only_names_with_bn",
        "timm's 1-D rule would differ on 9 tensors"),
    Row("resnet50_torchvision.yaml", "no weight decay", "normalization layers' parameters only (utils.py "
        "set_weight_decay, --norm-weight-decay 0): fc.bias is decayed", ("optim.no_decay_norm_bias",
        "optim.no_decay_norm_layers"), "tests/test_recipes.py::test_torchvision_weight_decay_skips_only_norm_layers",
        "torchvision's split_normalization_params"),
    *(Row(name, "random erasing box", "timm RandomErasing: area 0.02-1/3, aspect 0.3-1/0.3 (log-uniform)",
          ("data.random_erase_box",), ERASE_BOX_TEST) for name in TIMM_ERASING),
    *(Row(name, "random erasing fill", "--remode pixel: N(0, 1) per pixel after normalization, unbounded",
          ("data.random_erase_fill",), ERASE_FILL_TEST, "the workers' boxes, filled on the device after normalization")
      for name in TIMM_ERASING),
    Row("resnet50_torchvision.yaml", "random erasing box", "RandomErasing: scale (0.02, 0.33), ratio (0.3, 3.3)",
        ("data.random_erase_box",), ERASE_BOX_TEST),
]

# Precision (issue 40 item 1): the source's, from its own command line and training loop.
PRECISION_TEST = "tests/test_recipes.py::test_recipe_precision_is_its_sources"
PRECISION_ROWS = [
    Row("resnet50.yaml", "precision", "fp16 with GradScaler(init_scale=128, growth_interval=1e9): --amp "
        "--static-loss-scale 128", ("amp", "loss_scale"), PRECISION_TEST, "the same GradScaler, stepped beside it"),
    *(Row(name, "precision", f"fp16 with a dynamic GradScaler ({source})", ("amp", "loss_scale"), PRECISION_TEST,
          "torch's GradScaler, as theirs") for name, source in (
        ("deit_small.yaml", "main.py --amp, NativeScaler"), ("deit_small_distilled.yaml", "main.py --amp, NativeScaler"),
        ("resnet50_rsb_a3.yaml", "timm train.py --amp"))),
    *(Row(name, "precision", f"fp32 ({source})", ("amp",), PRECISION_TEST) for name, source in (
        ("convnext_tiny.yaml", "main.py: --use_amp false by default"),
        ("resnet50_torchvision.yaml", "the recipe's command has no --amp"))),
]

# Smaller differences (issue 40 item 10): each moves a pixel or a fraction of a level.
TIMM_MIXING = ("deit_small.yaml", "deit_small_distilled.yaml", "convnext_tiny.yaml", "resnet50_rsb_a3.yaml", MAE)
DECLARED_ROWS = [
    *(Row(name, "cutmix box rounding", "the sources' older timm rounds the box as cy +- cut_h // 2 (timm 1.0.31's "
          "rand_bbox: one pixel larger for odd cuts, 44% of boxes)", ("data.cutmix_rounding",), ROUNDING_TEST)
      for name in TIMM_MIXING),
    Row("resnet50_torchvision.yaml", "TrivialAugment ops", "torchvision v1 on PIL images (presets.py)", (), "",
        "not expressible: v2 on uint8 tensors; Shear and Rotate 0.4-0.6/255 apart in the mean"),
    *(Row(name, "training crop of a portrait box", "PIL resizes a box taller than wide vertical-first", (), "",
          "not expressible: torch's antialiased resize, up to 0.28/255 apart in the mean (0.01/255 for landscape)")
      for name in ("deit_small.yaml", "convnext_tiny.yaml", "resnet50_rsb_a3.yaml", "resnet50_torchvision.yaml", MAE)),
]

ROWS = (SCHEDULE_ROWS + PREPROCESSING_ROWS + SOURCE_ROWS_40 + DECODING_ROWS + PRECISION_ROWS + DECLARED_ROWS)


def app_value(config: dict, key: str) -> str:
    """`key: value` as the config file would write it."""
    node = config
    for part in key.split("."):
        node = node[part]
    shown = yaml.safe_dump(node, default_flow_style=True).strip().removesuffix("...").strip()
    return f"`{key}: {shown}`"


def fidelity_markdown() -> str:
    """One table per recipe config, in file order; the app's values read from the configs."""
    sections = []
    for name in dict.fromkeys(row.config for row in ROWS):
        config = to_dict(load_config(name))
        lines = [f"#### configs/{name}", "", "| item | source | app | proved by |", "| --- | --- | --- | --- |"]
        for row in (row for row in ROWS if row.config == name):
            app = ", ".join([app_value(config, key) for key in row.keys] + [row.note] * bool(row.note))
            test = f"`{row.test}`" if row.test else "known difference (config header)"
            cells = [row.item, row.source, app, test]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(fidelity_markdown())
