"""Fixtures shared by the test files: a tiny training run trained once per session and reused.

The pytest process imports timm the way the entry points do (without wandb), so importing the app's
modules here costs what it costs in train.py.
"""

from __future__ import annotations

from pathlib import Path

import functools
import os
import tempfile

# Every process of the session (pytest, the forkserver of tests.helpers.run_ranks, subprocesses) sees one Hugging
# Face cache of its own, offline: set before timm imports huggingface_hub, which reads them once. Tests never reach
# the network nor the user's cache; those that need pretrained weights write them into it (tests/helpers.py).
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="test-hf-hub-")
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from core.startup import import_timm_without_wandb, openmp_waits_passively
from tests.helpers import TINY, run_script, s3_server

# As train.py does before torch loads OpenMP: runs made in this process (train_here, evaluate's main) and the ranks
# forked from it wait as the app's own processes do. Spinning idle threads made a tiny run 2-4x slower beside a busy
# process (a second test worker, a co-tenant).
openmp_waits_passively()
import_timm_without_wandb()


@functools.cache
def gpu_problem() -> str | None:
    """Why this machine's GPU cannot run the GPU tier, or None (core.dist.unusable_gpu; asked once)."""
    import torch

    from core.dist import nvidia_driver_version, unusable_gpu

    return unusable_gpu(nvidia_driver_version(), torch.version.cuda, torch.cuda.is_available(),
                        os.environ.get("CUDA_VISIBLE_DEVICES"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `gpu` test fails where a GPU is present but unusable (a too-old driver), and skips only where none is."""
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    problem = gpu_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `python -m pytest -m gpu -s -n 0` on one")
    if item.get_closest_marker("two_gpus") is not None and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's Hugging Face cache goes with it."""
    import shutil

    shutil.rmtree(os.environ["HF_HUB_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Each test leaves torch's thread count as it found it. A run made in this process (train_here, evaluate's main)
    sets it for its loader workers (core/startup.tune_cpu_process: 1 thread with 1 worker on 2 cores), and every
    later test in the process computed with that count: what a test computes must not depend on the tests before it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def s3_env():
    """moto's S3 server (a real HTTP server, tests/helpers.s3_server) for the session: the environment naming it."""
    with s3_server() as env:
        yield env


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The output folder of one finished TINY training (last.pth, best.pth, metrics.jsonl, config.yaml).

    Read it, never write into it: tests that change a run copy it or train their own.
    """
    out = tmp_path_factory.mktemp("tiny") / "run"
    # the one shared run that draws curves.png and samples.png
    run_script("train.py", *TINY, "logging.curves=true", "logging.samples=6", f"output_dir={out}")
    return out


@pytest.fixture(scope="session")
def tiny_sharded_run(tmp_path_factory) -> Path:
    """TINY with train.ckpt_format=sharded, trained in this process: its last.dcp/ folder. Read it, never write."""
    from tests.helpers import train_here

    out = tmp_path_factory.mktemp("tiny_sharded") / "run"
    train_here(*TINY, "train.ckpt_format=sharded", f"output_dir={out}")
    return out


SPLIT_COUNTS = {"a": 16, "b": 15, "c": 12}  # split_pipeline_run's class folders: 4 + 4 + 3 validation images


@pytest.fixture(scope="session")
def split_pipeline_run(tmp_path_factory) -> Path:
    """TINY trained in this process on a folder of class folders (20 px PNGs, named 000.png ... in every class) split
    by data.val_fraction=0.25, with an eval pipeline file, centre.yaml (a 16 x 16 centre crop, not the preset's
    resize first): the run folder holds val.txt and eval_transform.yaml. Read it, never write into it (nor into its
    data or centre.yaml without putting them back)."""
    import albumentations as A

    from tests.helpers import make_image_folder, train_here

    base = tmp_path_factory.mktemp("split_pipeline")
    root = make_image_folder(base / "data", {"photos": SPLIT_COUNTS}, size=20) / "photos"
    A.save(A.Compose([A.CenterCrop(16, 16)]), str(base / "centre.yaml"), data_format="yaml")
    train_here(*TINY, "data.name=imagefolder", f"data.root={root}", "data.val_fraction=0.25",
               f"data.eval_transform={base / 'centre.yaml'}", f"output_dir={base / 'run'}")
    return base / "run"
