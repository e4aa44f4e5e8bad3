"""The CUDA path's decisions and defects, reproduced on the CPU (tests/test_gpu.py runs the rest on a GPU).

Each test drives the app's own code with a CPU analogue of what happens on a GPU: a CPU GradScaler with an
inf first gradient, the GPU's compute capability or device count as an argument, constructed tied logits,
a recorder of host<->device traffic, optimizer state held in fake CUDA tensors.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import timm
import torch
import torch.distributed as dist
from timm.optim import create_optimizer_v2
from torch._subclasses.fake_tensor import FakeTensorMode

from assembly.evaluate import PredictionWriter, summarize
from core.cli import collective_failure_line, peer_lost_error
from core.config import DataConfig, ModelConfig, OptimConfig, SchedConfig, TrainConfig
from core.dist import DistInfo, cuda_device_index, nccl_watchdog_env, unusable_gpu
from core.errors import UserError
from core.files import merge_parts, part_file
from data.datasets import DummyDataset
from data.loader import build_eval_loader
from data.mixing import BatchMix, MixCollate
from data.transforms import DeviceNormalize, eval_transform
from engine.checkpoint.saver import Checkpointer
from engine.evaluation import evaluate as run_evaluation
from engine.hooks import EmaUpdate
from engine.losses import build_loss
from engine.optim import build_optimizer, build_scheduler
from engine.precision import Precision, gpu_auto_mode
from engine.prefetch import device_batches
from engine.state import TrainState
from engine.trainer import LoopConfig, TrainParts, train_one_epoch
from models.ema import create_ema
from models.factory import prepare_model
from models.parallel import wrap_for_training
from tests.helpers import HANG, REPO, TINY, Batches, op_counter, run_ranks, run_script, script_env

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


# 1. fp16 + GradScaler + fused SGD ---------------------------------------------------------------------------

def _fp16_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Three steps through Precision.step with a CPU GradScaler; the first gradient holds an inf (skipped)."""
    precision = Precision("cpu", torch.float16, torch.amp.GradScaler("cpu"))
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(8, 6, generator=generator)
        precision.backward(model(x).square().mean())
        if step == 0:
            next(model.parameters()).grad[0, 0] = float("inf")  # what an fp16 overflow at the initial scale does
        precision.step(optimizer, model, clip_grad=0.0)
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_skipped_first_fp16_step_leaves_weights_and_state_as_the_plain_optimizer_does(name):
    cfg = OptimConfig(name=name, lr=0.05, momentum=0.9, weight_decay=0.01)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, cfg, grad_scaler=True)
    plain = create_optimizer_v2(reference, opt=name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                momentum=cfg.momentum, foreach=False)  # torch's per-tensor loop: the reference
    _fp16_steps(model, ours)
    _fp16_steps(reference, plain)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        for key, value in plain.state[q].items():
            torch.testing.assert_close(torch.as_tensor(ours.state[p][key]).float(),
                                       torch.as_tensor(value).float(), rtol=1e-5, atol=1e-6)


def test_fused_step_is_kept_where_no_grad_scaler_is_used():
    model = torch.nn.Linear(3, 2)
    assert build_optimizer(model, OptimConfig(name="sgd")).defaults["fused"] is True
    assert build_optimizer(model, OptimConfig(name="adamw", lr=1e-3), grad_scaler=True).defaults["fused"] is True
    assert not build_optimizer(model, OptimConfig(name="sgd"), grad_scaler=True).defaults.get("fused")


# 2. amp=auto on pre-Ampere GPUs ------------------------------------------------------------------------------

@pytest.mark.parametrize("capability, mode", [((6, 0), "fp16"), ((7, 0), "fp16"), ((7, 5), "fp16"),
                                              ((8, 0), "bf16"), ((8, 6), "bf16"), ((9, 0), "bf16"),
                                              ((12, 0), "bf16")])
def test_amp_auto_on_a_gpu_follows_its_compute_capability(capability, mode):
    # sm_75 (T4, RTX 20xx) emulates bf16 (torch.cuda.is_bf16_supported() is True there) without bf16 Tensor
    # Cores: fp16 + GradScaler is the fast choice below 8.0.
    assert gpu_auto_mode(capability) == mode


# 3. tied logits in evaluate.py -------------------------------------------------------------------------------

class TiedLogits(torch.nn.Module):
    """Every class gets the same logit: topk must break the tie once, the same way for metrics and CSV."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().sum(dim=(1, 2, 3))[:, None] * 0.0 + torch.zeros(1, 1000)


def test_tied_logits_give_one_prediction_for_the_metrics_and_the_csv(tmp_path):
    cfg = DataConfig(name="dummy", img_size=8, crop_pct=1.0, num_workers=0)
    # Labels 997, 998, 999, 0: only class 0 of the tied classes' low indices is present.
    dataset = DummyDataset(4, 1000, 8, eval_transform(cfg), seed=0, offset=997)
    loader = build_eval_loader(dataset, cfg, 4, CPU)
    names = [f"c{i}" for i in range(1000)]
    writer = PredictionWriter(dataset, 0, names)
    normalize = DeviceNormalize(cfg.mean, cfg.std, CPU.device, channels_last=False)
    metrics = run_evaluation(TiedLogits(), loader, Precision("cpu", None), CPU, normalize, on_batch=writer)
    writer.write(part_file(tmp_path, "predictions", 0))
    rows = merge_parts(tmp_path, "predictions", 1, len(dataset))
    result, _ = summarize(rows, metrics, names, "tied.pth", ema=False)  # raised on disagreement
    csv_top1 = 100.0 * sum(row["pred"] == row["label"] for row in rows) / len(rows)
    assert result["top1"] == csv_top1
    assert all(row["top5"].split()[0] == row["pred"] for row in rows)


# 4. the CUDA device of a rank --------------------------------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}


@pytest.mark.parametrize("env, gpus, expected", [
    ({}, 1, 0),  # one process
    ({}, 4, 0),
    (TORCHRUN, 8, 1),  # torchrun, one GPU per local rank
    (SRUN, 8, 1),  # srun without GPU binding: SLURM_LOCALID
    (SRUN, 1, 0),  # srun --gpus-per-task=1: Slurm bound this task's GPU
    ({**TORCHRUN, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 1, 0),  # 1 per node
    ({**SRUN, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "0"}, 1, 0),
])
def test_cuda_device_is_the_local_rank_or_the_gpu_the_launcher_bound(env, gpus, expected):
    assert cuda_device_index(env, gpus) == expected


@pytest.mark.parametrize("env, gpus, message", [
    (TORCHRUN, 1, r"2 processes on this node see one GPU.*share it.*--nproc_per_node=1.*--gpus-per-task=1"),
    ({**TORCHRUN, "LOCAL_RANK": "0"}, 1, r"2 processes on this node see one GPU"),  # rank 0 stops too
    ({**SRUN, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 1, r"see one GPU"),  # torchrun under srun
    ({**TORCHRUN, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}, 2, r"local rank 2 .* 2 visible GPU"),
])
def test_ranks_that_would_share_or_lack_a_gpu_stop_with_one_line(env, gpus, message):
    with pytest.raises(UserError, match=message):
        cuda_device_index(env, gpus)


# 5. host<->device syncs in the hot loop ----------------------------------------------------------------------

COLLECTIVES = ("allreduce_", "broadcast_", "allgather_", "reduce_scatter_", "_allgather_base_", "alltoall_")


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=generator),
             torch.randint(0, 4, (4,), generator=generator)) for _ in range(count)]


STEPS = 6


def _step_traffic(rank: int, world: int, sync_bn: bool) -> dict[str, int]:
    """Host<->device traffic and collectives of STEPS training steps on this rank, EMA on, as train.py builds it."""
    torch.manual_seed(0)
    info = DistInfo(rank, world, rank, world, torch.device("cpu"))
    model_cfg = ModelConfig(name="test_resnet", sync_bn=sync_bn, channels_last=False)
    model = prepare_model(timm.create_model("test_resnet", num_classes=4), model_cfg, info.device, world)
    # DDP when world > 1 (its start-up broadcasts not counted)
    trained = wrap_for_training(model, info.device, info.world_size, model_cfg.compile)
    optimizer = build_optimizer(model, OptimConfig())
    parts = TrainParts(trained, optimizer, build_scheduler(optimizer, SchedConfig(), 1, STEPS),
                       torch.nn.CrossEntropyLoss(), Precision("cpu", None))
    loop = LoopConfig(log_interval=1000, normalize=DeviceNormalize([0.5] * 3, [0.5] * 3, info.device, False))
    hooks = [EmaUpdate(create_ema(model, 0.99, warmup=True), model)]
    batches = _batches(STEPS)  # made before recording: in a real run they come from the DataLoader's workers
    with op_counter() as traffic:
        train_one_epoch(parts, batches, TrainState(), loop, info, hooks)
    counts = {name: traffic.ops[name] for name in ("lift_fresh", "_local_scalar_dense")}
    counts["collectives"] = sum(n for name, n in traffic.ops.items() if name in COLLECTIVES)
    counts["bn_layers"] = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return counts


def _traffic_on_two_ranks(rank: int, world: int) -> dict[str, dict[str, int]]:
    return {"plain": _step_traffic(rank, world, False), "sync_bn": _step_traffic(rank, world, True)}


def test_training_and_evaluation_steps_make_no_hidden_host_device_traffic():
    train_traffic = _step_traffic(0, 1, sync_bn=False)
    normalize = DeviceNormalize([0.5] * 3, [0.5] * 3, CPU.device, channels_last=False)
    model, batches = timm.create_model("test_resnet", num_classes=4), _batches(STEPS)
    with op_counter() as eval_traffic:
        run_evaluation(model, Batches(batches, 4), Precision("cpu", None), CPU, normalize)
    assert train_traffic["lift_fresh"] == 0 and eval_traffic.ops["lift_fresh"] == 0
    # The one documented per-step read: the inf/NaN gradient check fused with the stop flag. None in evaluation.
    assert train_traffic["_local_scalar_dense"] == STEPS
    assert eval_traffic.ops["_local_scalar_dense"] == 0


@pytest.mark.slow
def test_two_ranks_read_the_device_once_per_step_and_sync_bn_adds_two_collectives_per_layer(tmp_path):
    """With DDP, EMA on: one host read per step (inf/NaN check and stop flag in one all-reduce); SyncBN adds
    exactly one all-reduce per BatchNorm layer forward and one backward, nothing else (no per-layer host read)."""
    for ranks in run_ranks(_traffic_on_two_ranks, 2, tmp_path):
        plain, synced = ranks["plain"], ranks["sync_bn"]
        for counts in (plain, synced):
            assert counts["lift_fresh"] == 0 and counts["_local_scalar_dense"] == STEPS, counts
        assert synced["collectives"] - plain["collectives"] == 2 * synced["bn_layers"] * STEPS, (plain, synced)


def _fp16_step_reads(rank: int, world: int) -> dict:
    """Four fp16 steps through Precision.step with a CPU GradScaler (an inf gradient on the first, as at fp16's
    initial scale; rank 1 gets SIGTERM before the third): the device reads of each step, what comes back, and the
    scale after each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = build_optimizer(model, OptimConfig(name="momentum", lr=0.05), grad_scaler=True)
    precision = Precision("cpu", torch.float16, torch.amp.GradScaler("cpu"))
    generator, found = torch.Generator().manual_seed(0), {"reads": [], "answers": [], "scales": []}
    for step in range(4):
        precision.backward(model(torch.randn(8, 6, generator=generator)).square().mean())
        if step == 0:
            next(model.parameters()).grad[0, 0] = float("inf")  # DDP would have summed it onto every rank
        with op_counter() as reads:
            found["answers"].append(precision.step(optimizer, model, 0.0, 15 if step == 2 and rank == 1 else 0))
        found["reads"].append(reads.ops["_local_scalar_dense"])
        found["scales"].append(precision.scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
    return found


@pytest.mark.slow  # two processes (the one-process case: test_fp16_reads_the_device_once_per_step_in_one_process)
def test_fp16_folds_the_stop_flag_into_the_grad_scalers_inf_read_on_two_ranks(tmp_path):
    """Issue 62 item 5: fp16 read the device twice per step on several ranks (the GradScaler's inf check inside
    scaler.step, then the stop flag's all-reduce); now once, as bf16: the inf flag and the stop signal travel in
    one all-reduce. The scaler still halves its scale after the inf step and every rank gets rank 1's SIGTERM."""
    for found in run_ranks(_fp16_step_reads, 2, tmp_path):
        assert found["reads"] == [1, 1, 1, 1], found
        assert [signum for _, signum in found["answers"]] == [0, 0, 15, 0], found
        assert found["scales"][0] == 32768.0 and found["scales"][1:] == [32768.0] * 3, found


def test_fp16_reads_the_device_once_per_step_in_one_process():
    found = _fp16_step_reads(0, 1)
    assert found["reads"] == [1, 1, 1, 1] and found["scales"] == [32768.0] * 4, found
    assert [answer for answer in found["answers"]] == [(True, 0)] * 4  # fp16's skips are the scaler's, not faults


@pytest.mark.parametrize("loss", ["ce", "bce"])
@pytest.mark.slow  # 5-14 s of processes: the fast tier's budget
def test_mixed_training_steps_make_no_hidden_host_device_traffic(loss):
    """Mixup/cutmix (data.mixing) and the soft-target losses add no copy from the host and no device read."""
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=4)
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_scheduler(optimizer, SchedConfig(), 1, 6)
    normalize = DeviceNormalize([0.5] * 3, [0.5] * 3, CPU.device, channels_last=False)
    loop = LoopConfig(log_interval=1000, normalize=normalize, mix=BatchMix(4, smoothing=0.1))
    data = DataConfig(mixup_alpha=0.2, cutmix_alpha=1.0)
    collate = MixCollate(data, seed=0)
    batches = [collate([(images[i], int(labels[i]), (0, step * 2 + i // 2)) for i in range(4)])
               for step, (images, labels) in enumerate(_batches(6))]  # made by the workers in a real run
    assert all(batch[2][:, 1].any() for batch in batches)  # every batch mixes something
    with op_counter() as traffic:
        parts = TrainParts(model, optimizer, scheduler, build_loss(TrainConfig(loss=loss), mixing=True),
                           Precision("cpu", None))
        train_one_epoch(parts, batches, TrainState(), loop, CPU)
    assert traffic.ops["lift_fresh"] == 0
    assert traffic.ops["_local_scalar_dense"] == 6  # the per-step inf/NaN check only


def test_device_batches_yield_every_batch_in_order_normalized():
    normalize = DeviceNormalize([0.5] * 3, [0.25] * 3, CPU.device, channels_last=True)
    for count in (0, 1, 3):
        batches = _batches(count)
        got = list(device_batches(batches, CPU.device, normalize))
        assert len(got) == count
        for (images, targets), (raw, labels) in zip(got, batches):
            assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(images, (raw.float() / 255 - 0.5) / 0.25)
            assert torch.equal(targets, labels)


# 9. optimizer state saved on the CPU -------------------------------------------------------------------------

def test_checkpoint_of_a_cuda_run_holds_only_cpu_tensors(tmp_path):
    with FakeTensorMode(allow_non_fake_inputs=True):  # CUDA tensors without a GPU: shapes and devices only
        model = torch.nn.Linear(3, 2, device="cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        for param in model.parameters():  # autograd would need a real GPU; the optimizer step does not
            param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        checkpointer = Checkpointer(tmp_path, CPU, 0, model=model, optimizer=optimizer, scheduler=scheduler,
                                    scaler=None, config={}, class_names=["a", "b"])
        contents = checkpointer.contents(TrainState().state_dict(), rng=[], metric_value=None)
    devices = {str(t.device) for t in _tensors(contents)}
    assert devices == {"cpu"}, devices


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


# 7. torch.compile with synchronized BatchNorm ----------------------------------------------------------------

def test_compile_with_sync_bn_on_several_processes_is_warned_about():
    from core.config import ModelConfig
    from models.factory import compile_warning

    assert "pytorch/pytorch#161302" in compile_warning(ModelConfig(compile=True, sync_bn=True), world_size=2)
    assert compile_warning(ModelConfig(compile=True, sync_bn=True), world_size=1) is None  # no SyncBN in 1 process
    assert compile_warning(ModelConfig(compile=True, sync_bn=False), world_size=8) is None


# The pinned wheel and the GPU generations it runs on ---------------------------------------------------------

CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130, the pinned wheel


@pytest.mark.parametrize("capability, supported", [((7, 0), False), ((6, 0), False), ((7, 5), True), ((8, 0), True),
                                                   ((8, 9), True), ((9, 0), True), ((10, 0), True), ((12, 0), True)])
def test_gpu_generations_the_pinned_wheel_runs_on(capability, supported):
    from core.dist import gpu_supported

    # V100 (7.0) needs another build: docs/gpu.md. The L4/RTX 40xx (8.9) run sm_86 code.
    assert gpu_supported(capability, CU130_ARCHS) is supported
    assert gpu_supported((7, 0), ["sm_75", "compute_70"])  # PTX is compiled for newer GPUs at load time


def test_the_installed_wheel_is_the_one_docs_gpu_md_describes():
    assert torch.version.cuda == "13.0" and torch.cuda.get_arch_list() == CU130_ARCHS


def collected(marks: str) -> int:
    """How many tests `python -m pytest -m <marks> --collect-only -q` collects (the GPU tier lives in test_gpu.py)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pytest", "-m", marks, "--collect-only", "-q", "-n", "0",
                          "tests/test_gpu.py"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return int(re.search(r"^(\d+)(?:/\d+)? tests? collected", out, re.M).group(1))


@pytest.mark.slow  # two pytest processes collecting the GPU tier
def test_docs_gpu_md_counts_the_gpu_tier_as_pytest_collects_it():
    """docs/gpu.md's "1 GPU: N tests; 2 or more GPUs: M" is what --collect-only finds (it said 18 and 28 at 29)."""
    one, two = collected("gpu and not two_gpus"), collected("gpu")
    assert f"1 GPU: {one} tests; 2 or more GPUs: {two}" in (REPO / "docs" / "gpu.md").read_text(), (one, two)


# 7. a GPU torch cannot use stops the run -------------------------------------------------------------------

@pytest.mark.parametrize("driver, wheel, available, visible, expected", [
    (None, "13.0", False, None, None),  # no GPU listed: the CPU is the only choice
    ("580.65.06", "13.0", True, None, None),  # usable
    ("535.104.05", "13.0", False, "", None),  # CUDA_VISIBLE_DEVICES= asks for the CPU
    ("535.104.05", "13.0", False, "-1", None),
    ("535.104.05", "13.0", False, None, r"driver 535\.104\.05.*CUDA 13\.0, which needs driver 580.*update"),
    ("535.104.05", "13.0", False, "0", r"driver 535\.104\.05.*CUDA 13\.0, which needs driver 580"),
    ("580.65.06", "13.0", False, None, r"driver 580\.65\.06.*CUDA 13\.0; torch's warning above"),
    ("550.54.15", None, False, None, r"driver 550\.54\.15.*CPU-only.*CUDA build"),
])
def test_a_gpu_torch_cannot_use_is_named_with_driver_wheel_and_fix(driver, wheel, available, visible, expected):
    problem = unusable_gpu(driver, wheel, available, visible)
    if expected is None:
        assert problem is None
    else:
        assert re.search(expected, problem) and "docs/gpu.md" in problem and "CUDA_VISIBLE_DEVICES=" in problem
        assert "\n" not in problem


@pytest.mark.slow
def test_train_and_the_gpu_tier_stop_when_nvidia_smi_lists_a_gpu_torch_cannot_use(tmp_path):
    """A fake nvidia-smi (driver 535) on PATH: train.py stops before writing, the GPU tier fails, not skips."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 535.104.05\n")
    fake.chmod(0o755)
    env = script_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run"
    proc = run_script("train.py", *TINY, f"output_dir={out}", env=env, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and re.search(r"^error: nvidia-smi lists a GPU \(driver 535\.104\.05\).*CUDA "
                                              + re.escape(str(torch.version.cuda)), lines[-1]), proc.stderr
    assert not out.exists()
    cpu = run_script("train.py", *TINY, f"output_dir={out}", "--dry-run", env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert not out.exists() and cpu.returncode == 0
    tier = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/test_gpu.py", "-k", "predict_and_onnx"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=HANG)
    assert tier.returncode == 1 and "1 error" in tier.stdout and "driver 535.104.05" in tier.stdout, tier.stdout


# 8. a failed collective names the rank at fault --------------------------------------------------------------

REMOTE = "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
CUDA_OOM = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'")


@pytest.mark.parametrize("err, lost", [
    (dist.DistBackendError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40213"), True),
    (dist.DistBackendError("[gloo/transport/tcp/pair.cc:598] Read error: Connection reset by peer"), True),
    (dist.DistBackendError("[unbound_buffer.cc:81] Timed out waiting 600000ms for recv operation to complete"), True),
    (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
                           "Timeout(ms)=600000) ran for 600012 milliseconds before timing out."), True),
    (dist.DistBackendError(f"NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited\n{REMOTE}"), True),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), True),  # the store's host is gone
    (dist.DistStoreError("Socket Timeout"), True),
    (RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:40213"), True),
    (dist.DistBackendError("CUDA error: an illegal memory access was encountered"), False),
    (dist.DistBackendError(CUDA_OOM), False),
    (dist.DistBackendError("ncclInvalidUsage: This usually reflects invalid usage of NCCL library."), False),
    (RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"), False),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value))
def test_only_lost_connections_and_timeouts_blame_another_rank(err, lost):
    assert peer_lost_error(err) is lost
    line = collective_failure_line(err, rank=3)
    assert line is not None if isinstance(err, dist.DistError) or lost else line is None
    if lost:
        assert line.startswith("[rank 3] stopped: a collective failed because another process failed")
    elif line is not None:
        assert line.startswith("[rank 3] error: a collective failed in this process") and "another" not in line
    assert line is None or "\n" not in line


@pytest.mark.parametrize("env, expected", [
    ({}, "3"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "1"),  # the user's choice stands
])
def test_nccl_watchdog_settings_are_explicit(env, expected):
    settings = nccl_watchdog_env(env)
    assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == expected and settings["TORCH_NCCL_ENABLE_MONITORING"] == "1"


# 9. evaluation repeats exactly on GPUs -----------------------------------------------------------------------

@pytest.mark.parametrize("device, deterministic", [("cuda", True), ("cpu", False)])
@pytest.mark.parametrize("tf32", [True, False])
def test_evaluation_asks_cudnn_for_deterministic_algorithms_on_cuda(device, deterministic, tf32):
    """Validation, evaluate.py and predict.py on a GPU: no algorithm picked by timing (cudnn.benchmark, which
    training sets), only deterministic ones, TF32 as their precision decided (not as training left it); training's
    flags come back after each batch. The CPU keeps TF32's flags as they are (they are CUDA's)."""
    from engine.evaluation import exact_kernels

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.deterministic, cudnn.benchmark, torch.get_num_threads(), matmul.allow_tf32, cudnn.allow_tf32
    cudnn.deterministic, cudnn.benchmark = False, True
    matmul.allow_tf32 = cudnn.allow_tf32 = not tf32  # training's, the other way
    torch.set_num_threads(2)
    try:
        with exact_kernels(torch.device(device), tf32):
            assert cudnn.deterministic is deterministic
            assert cudnn.benchmark is not deterministic
            assert torch.get_num_threads() == (2 if device == "cuda" else 1)  # CPU: fp32 sums follow the threads
            assert matmul.allow_tf32 is cudnn.allow_tf32 is (tf32 if device == "cuda" else not tf32)
        assert (cudnn.deterministic, cudnn.benchmark) == (False, True)
        assert torch.get_num_threads() == 2 and matmul.allow_tf32 is cudnn.allow_tf32 is (not tf32)
    finally:
        cudnn.deterministic, cudnn.benchmark, threads, matmul.allow_tf32, cudnn.allow_tf32 = saved
        torch.set_num_threads(threads)


# 10. TF32 for fp32 matmuls -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, capability, allowed, expected", [
    (None, (9, 0), True, True),  # amp=off on an H100: TF32 Tensor Cores (495 vs 67 TFLOPS)
    (None, (8, 0), True, True),  # A100
    (None, (7, 5), True, False),  # T4: no TF32
    (None, (9, 0), False, False),  # tf32=false: full fp32
    (torch.bfloat16, (9, 0), True, False),  # autocast: the matmuls are bf16; what it keeps in fp32 stays exact
    (torch.float16, (8, 0), True, False),
    (None, None, True, False),  # the CPU
])
def test_tf32_is_decided_per_precision(dtype, capability, allowed, expected):
    from engine.precision import tf32_for

    assert tf32_for(dtype, capability, allowed) is expected


@pytest.mark.parametrize("amp, eval_amp, tf32, training, measured", [
    ("off", "off", True, True, True),  # configs/convnext_tiny.yaml's amp: off, validated in fp32
    ("bf16", "off", True, False, True),  # the default: bf16 training, fp32 validation with TF32
    ("off", "off", False, False, False),  # tf32=false: every fp32 number is full fp32
    ("bf16", "bf16", True, False, False),
])
def test_training_validation_and_evaluate_take_the_same_tf32_decision(monkeypatch, amp, eval_amp, tf32, training,
                                                                     measured):
    """On an H100 (capability given, no GPU touched): training's precision, its validation's (eval_amp) and
    evaluate.py's (its amp defaults to the run's eval_amp) decide TF32 by one rule, so validation and evaluate.py
    still agree; the start-up lines say it, and training's kernels are set by it."""
    from core.startup import training_kernels
    from engine import precision as module

    monkeypatch.setattr(module, "capability_of", lambda device: (9, 0))
    gpu = torch.device("cuda", 0)
    train_precision, validation = module.run_precisions(amp, eval_amp, 0.0, "ddp", gpu, tf32)
    assert (train_precision.tf32, validation.tf32) == (training, measured)
    assert module.resolve_precision(eval_amp, gpu, tf32=tf32) == validation  # evaluate.py on the run's checkpoint
    assert ("TF32" in validation.described) is measured and validation.name in ("fp32", "bf16")
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32
    try:
        training_kernels("cuda", train_precision.tf32)
        assert matmul.allow_tf32 is cudnn.allow_tf32 is training
    finally:
        cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = saved


def test_a_checkpoint_saved_before_the_tf32_key_is_evaluated_as_it_validated():
    """Runs saved before `tf32` existed validated in full fp32: evaluate.py keeps that (its numbers are the run's),
    and follows a recorded value."""
    from engine.checkpoint.inference import for_inference

    assert for_inference({"eval_amp": "off"})["tf32"] is False
    assert for_inference({"eval_amp": "off", "tf32": True})["tf32"] is True


def test_the_documented_gpu_figures_are_read_by_the_smoke_test():
    """The GPU tier's figure checks read docs/gpu.md's table, a row per test and GPU: a measured row gives numbers,
    'to measure on first run' none; every test the table names exists in the tier."""
    from tests.helpers import documented_figures

    smoke = "test_resnet50_recipe_smoke_run_meets_the_documented_figures"
    assert documented_figures(smoke, "NVIDIA H100 80GB HBM3") == {"img_per_s": 4697.0, "peak_memory_gib": 11.15}
    assert documented_figures(smoke, "NVIDIA A100-SXM4-80GB") is None  # until a GPU run fills it in
    assert documented_figures(smoke, "no such GPU") is None
    table = ("| test | GPU | img/s | GiB |\n| `t` | NVIDIA X | 2,512.5 | 21.25 |\n"
             "| `t` | NVIDIA Y | to measure on first run | to measure on first run |")
    assert documented_figures("t", "NVIDIA X", table) == {"img_per_s": 2512.5, "peak_memory_gib": 21.25}
    assert documented_figures("t", "NVIDIA Y", table) is None and documented_figures("u", "NVIDIA X", table) is None
    named = set(re.findall(r"^\| `(test_\w+)` \|", (REPO / "docs" / "gpu.md").read_text(), re.M))
    tier = (REPO / "tests" / "test_gpu.py").read_text()
    assert named and all(f"def {name}(" in tier and f'check_figures("{name}"' in tier for name in named), named
