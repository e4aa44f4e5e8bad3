"""The fast path changes speed, not results: fused SGD matches torch's per-tensor SGD, batches keep their values."""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys

import pytest
import timm
import torch
from torch.utils.data import DataLoader, default_collate

from core.config import DataConfig, OptimConfig
from core.dist import DistInfo
from core.errors import UserError
from data.datasets import DummyDataset
from data.loader import build_train_loader
from data.transforms import train_transform
from engine.optim import build_optimizer
from engine.precision import resolve_precision, run_precisions
from tests.helpers import REPO, script_env

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        images = torch.randn(4, 3, 16, 16, generator=generator)
        targets = torch.randint(0, 5, (4,), generator=generator)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_sgd_is_fused_and_matches_torch_per_tensor_sgd():
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=5)
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.05)
    ours = build_optimizer(model, cfg)
    assert ours.defaults["fused"] is True
    reference_model = copy.deepcopy(model)
    groups = [{"params": list(g["params"]), "weight_decay": g["weight_decay"]}
              for g in build_optimizer(reference_model, cfg).param_groups]
    reference = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, foreach=False)
    # The fused kernel rounds the same arithmetic differently, and 4 steps of forward and backward carry it on: per
    # tensor ||got - want|| / ||want|| measured up to 8e-6 on an AVX-512 CPU (elementwise up to 9e-7 apart); torch's
    # SGD without nesterov moves it to 3.
    for got, want in zip(_train(model, ours), _train(reference_model, reference)):
        assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_optimizers_without_a_fused_step_still_build():
    model = timm.create_model("resnet10t", num_classes=5)
    assert build_optimizer(model, OptimConfig(name="lamb", lr=1e-3)).defaults.get("fused") is None


def test_train_batches_are_channels_last_with_default_collate_values():
    cfg = DataConfig(name="dummy", img_size=16, num_workers=2, persistent_workers=False)
    dataset = DummyDataset(48, 4, 20, train_transform(cfg), seed=0)
    loader = build_train_loader(dataset, cfg, batch_size=8, seed=0, info=CPU)
    reference = DataLoader(dataset, batch_size=8, sampler=loader.sampler, collate_fn=default_collate)
    batches = list(loader)
    assert len(batches) == len(reference) == 6
    for (images, labels), (want_images, want_labels) in zip(batches, reference):
        assert images.shape == (8, 3, 16, 16) and images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


FAULTS_PER_PASS = """
import resource, sys, torch
from core.startup import tune_cpu_process
if sys.argv[1] == "init":
    tune_cpu_process(threads=1)
torch.set_num_threads(1)
conv = torch.nn.Conv2d(16, 16, 3, padding=1)
x = torch.randn(8, 16, 256, 256)  # 32 MB, and so is every activation of the pass
def faults_per_pass() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.no_grad():
        conv(conv(x).relu()).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print([faults_per_pass() for _ in range(3)])
"""


@pytest.mark.slow
def test_cpu_processes_reuse_freed_activation_memory_without_page_faults():
    """After the entry points' tune_cpu_process, a pass's 32 MB activations reuse freed heap memory instead of fresh pages."""
    def last_pass_faults(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", FAULTS_PER_PASS, mode], cwd=REPO, env=script_env(),
                              capture_output=True, text=True, timeout=120, check=True)
        return json.loads(proc.stdout.splitlines()[-1])[-1]

    block_pages = (32 << 20) // resource.getpagesize()
    assert last_pass_faults("bare") > block_pages  # glibc's default: each block above 32 MB is a fresh mmap
    assert last_pass_faults("init") < block_pages // 100


def _kernel_cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them: a source independent of torch's own probe."""
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("needs Linux's /proc/cpuinfo")
    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_amp_auto_uses_bf16_on_cpu_only_where_the_cpu_has_bf16_instructions():
    # On an AVX2-only CPU bf16 autocast is emulated and 4-15x slower than fp32 (docs/benchmarks.md 4b),
    # so `auto` must follow the hardware, not a fixed "bf16 on CPU".
    native = bool(_kernel_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == ("bf16" if native else "fp32")
    assert resolve_precision("bf16", cpu).name == "bf16"  # an explicit choice is kept
    assert resolve_precision("off", cpu).name == "fp32"


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")  # no CUDA here: the scaler disables itself
def test_fsdp_refuses_the_fp16_that_a_gpu_chose():
    """The GPU-only rule through its decision function, handed a CUDA device: fp16 needs a GradScaler, which FSDP
    would run on each process's shard of the gradients alone; DDP keeps it, and validation's eval_amp is its own."""
    gpu = torch.device("cuda")
    with pytest.raises(UserError, match="amp=fp16 chose fp16 on this GPU, which dist.strategy=fsdp cannot use"):
        run_precisions("fp16", "off", 0.0, "fsdp", gpu, False)
    precision, measured = run_precisions("fp16", "off", 0.0, "ddp", gpu, False)
    assert (precision.name, precision.scaler is not None, measured.name) == ("fp16", True, "fp32")
    assert run_precisions("bf16", "off", 0.0, "fsdp", gpu, False)[0].scaler is None


@pytest.mark.parametrize("native", [False, True])
def test_inference_computes_in_fp32_by_default_whatever_the_cpu_and_the_run(native, monkeypatch):
    """Issue 42 through the decision itself, for both CPU kinds: a run stored with amp=auto (bf16 where the CPU has
    bf16 instructions) or amp=bf16 is read for inference in fp32, unless amp= is given to the tool."""
    from engine.checkpoint.inference import Trained, inference_config

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == ("bf16" if native else "fp32")  # the probe is what decides
    for stored in ("auto", "bf16", "off"):
        trained = Trained({"amp": stored, "model": {"name": "test_resnet"}}, {}, ["a", "b"], "checkpoint x.pth")
        assert resolve_precision(inference_config(trained).amp, cpu).name == "fp32"
        assert resolve_precision(inference_config(trained, [("amp", "auto")]).amp, cpu).name == \
            ("bf16" if native else "fp32")
