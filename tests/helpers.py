"""Shared test plumbing: run train.py / evaluate.py for real, as a user would (subprocesses, torchrun).

benchmarks/harness.py launches its subprocesses with the same `script_env`. Timeouts here only catch
hangs: they are far above what a run needs on a 2-core machine under 3x load.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Iterator

import numpy as np
import cv2

REPO = Path(__file__).resolve().parent.parent
HANG = 900.0  # seconds after which a test's subprocess counts as hung
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "OMP_NUM_THREADS")
# The tiny training run most tests start from: synthetic data, a 0.4M-parameter model at 16 px, fp32, one epoch.
TINY = ["--config", "dummy", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
        "data.img_size=16", "data.dummy_image_size=20", "data.dummy_train_size=32", "data.dummy_val_size=10",
        "data.num_workers=0", "train.batch_size=8", "train.epochs=1", "logging.progress=false", "logging.curves=false",
        "logging.samples=0"]
# A config's recipe cut to two optimizer steps on dummy data, on the CPU (tests/test_recipes.py).
SMALL = ["data.name=dummy", "data.img_size=32", "data.dummy_image_size=36", "data.dummy_train_size=32",
         "data.dummy_val_size=8", "data.dummy_num_classes=4", "data.num_workers=0", "train.batch_size=4",
         "train.max_steps=2", "amp=off", "model.init_from=", "model.pretrained=false", "model.sync_bn=false",
         "data.mix_group=0",  # one mixing draw per batch of 4 (the recipes draw per GPU batch of 128-256)
         "model.channels_last=false",
         "logging.progress=false", "logging.curves=false", "logging.samples=0",
         "dist.backend=auto"]  # resnet50.yaml asks for nccl; here: the CPU
# The run that resume must reproduce bit for bit (tests/test_resume.py).
RUN = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.drop_rate=0.3", "model.drop_path_rate=0.1",
       "model.ema_decay=0.9", "model.channels_last=false",
       "amp='off'", "data.augment=true", "data.img_size=16", "data.dummy_image_size=20",
       "data.dummy_train_size=64", "data.dummy_val_size=37", "data.num_workers=0", "train.batch_size=8",
       "train.epochs=2", "logging.progress=false", "logging.interval=100"]

# The correctness runs (tests/test_correctness.py, docs/correctness.md):
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks
TRAIN_SIZE = 50  # 4 global batches per epoch for every world size here; drop_last leaves 2 images out
VAL_SIZE = 23  # divisible by neither 2 nor 3
EPOCHS = 2  # 8 optimizer steps, across an epoch boundary (a reshuffle)
STEPS = EPOCHS * (TRAIN_SIZE // GLOBAL_BATCH)

# fp32, no augmentation, SGD with momentum and weight decay (timm skips norms and biases). lr=0.01 keeps
# 8 steps out of the chaotic regime: at lr=0.05 a single rounding-triggered ReLU flip grows to 1e-3 of
# the weights within a few steps, which no tolerance can tell from a bug (docs/correctness.md).
COMMON = ("--config", "configs/dummy.yaml", "amp=off", "data.augment=false", "data.img_size=16",
          "data.dummy_image_size=16", f"data.dummy_train_size={TRAIN_SIZE}", f"data.dummy_val_size={VAL_SIZE}",
          "data.num_workers=0", "optim.name=sgd", "optim.lr=0.01", "optim.momentum=0.9",
          "optim.weight_decay=0.01", f"train.epochs={EPOCHS}", "logging.progress=false", "logging.curves=false",
          "logging.samples=0")
# No BatchNorm anywhere (GroupNorm): micro-batches are then normalized exactly like the full batch, which
# is what makes accumulation equal to one big step. A timm test model, 0.1M parameters.
NO_BN_MODEL = "model.name=test_efficientnet_gn"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3-compatible server as a real HTTP server in a subprocess on a free port; yields the standard
    environment that points the app at it (AWS_ENDPOINT_URL and test credentials)."""
    port = free_port()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=script_env())
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert server.poll() is None and time.monotonic() < deadline, "moto's server did not start"
            time.sleep(0.05)
        yield env
    finally:
        server.terminate()
        server.wait(30)


class CuttableLink:
    """A TCP relay on a free port of 127.0.0.1 to `target_port`, in threads: a real network path to a server that
    `cut()` takes away (open connections closed, new ones refused), while the server itself keeps its data; a new
    CuttableLink on the cut one's `port` brings the path back."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target, self.listener = target_port, socket.create_server(("127.0.0.1", port))
        self.port, self.open = self.listener.getsockname()[1], []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed by cut()
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                self.open += [client, server]
                for a, b in ((client, server), (server, client)):
                    threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        with contextlib.suppress(OSError):  # (close alone leaves a thread blocked in accept() to take one more)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def s3_auth(env: dict[str, str], on: bool) -> None:
    """Make the moto server check credentials (then it knows none: every key is a wrong one), or stop checking."""
    import urllib.request

    request = urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset-auth", method="POST",
                                     data=b"0" if on else b"inf", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).close()


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess: no inherited launch variables, W&B offline, quiet."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update({"WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", **extra})
    return env


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = HANG) -> None:
    """Until `path` exists (e.g. the first step checkpoint: training is under way), while `proc` still runs."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        assert proc.poll() is None, f"{path} did not appear: the process exited {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout:.0f} s"
        time.sleep(0.01)


def train_here(*args: str) -> None:
    """train.py's main in this process: a subprocess's run without its ~5 s of imports (for runs that need no
    environment, signal or process of their own); a non-zero exit fails the test."""
    import train
    from core.cli import report_errors

    assert report_errors(train.main, list(args)) == 0, args


def run_script(script: str, *args: str, nproc: int = 1, timeout: float = HANG, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """`python script args` for nproc == 1, else `torchrun --standalone --nproc_per_node=nproc script args`.

    A run that has not ended after `timeout` is hung: every process of it (DataLoader workers too) prints its
    Python stacks (faulthandler, on SIGABRT) into the failure, so that a hang seen once, in CI, says where.
    """
    if nproc == 1:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / script), *args]
    env = {**(env or script_env()), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=no_core_files) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = dump_stacks_and_kill(popen)
            raise AssertionError(f"{' '.join(cmd)} hung: still running after {timeout:.0f} s. The stacks of its "
                                 f"processes (faulthandler on SIGABRT):\n{stacks[-30000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def no_core_files() -> None:
    """In the child before exec: a SIGABRT (a hang's stack dump) must not leave core files in the repository."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc), children before their own children."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(0), [])
        found += children
        todo += children
    return found


def exited(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def dump_stacks_and_kill(popen: subprocess.Popen) -> str:
    """SIGABRT to a hung run and all its descendants (each dumps its stacks), then SIGKILL; their stderr."""
    pids = [popen.pid, *descendants(popen.pid)]  # DataLoader workers leave the process group: found by parent
    for pid in reversed(pids):  # one at a time, so that their dumps do not interleave in the shared stderr
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        deadline = time.monotonic() + 10
        while not exited(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        _, stderr = popen.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in [popen.pid, *descendants(popen.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, stderr = popen.communicate()
    for pid in pids:  # anything left (a worker whose parent died first); an exited pid may be another's by now
        if not exited(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return stderr


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Batches(list):
    """A list of (uint8 images, labels) batches that evaluation takes for a DataLoader: with its dataset's class
    names (str(index)), which the per-class metrics are keyed by."""

    def __init__(self, batches: list, classes: int) -> None:
        super().__init__(batches)
        self.dataset = types.SimpleNamespace(classes=[str(c) for c in range(classes)])


def as_written_before_the_rename(ckpt: dict) -> dict:
    """A checkpoint dict laid out as train.py wrote it before issue 46: the best value of train.best_metric as
    "best_top1", that metric's value at the save as "val_top1", and no "best_epoch"."""
    old = dict(ckpt)
    old["best_top1"], old["val_top1"] = old.pop("best_value"), old.pop("metric_value")
    del old["best_epoch"]
    return old


def make_image_folder(root: Path, counts: dict[str, dict[str, int]], size: int = 24, seed: int = 0) -> Path:
    """root/<split>/<class>/<i>.png with class-coloured noisy images; counts[split][class] = n."""
    rng = np.random.default_rng(seed)
    for split, per_class in counts.items():
        for c, (name, n) in enumerate(sorted(per_class.items())):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                colour = np.array([(c * 80) % 256, (c * 150) % 256, (c * 40 + 60) % 256], np.float64)
                image = np.clip(colour + rng.normal(0, 30, (size, size, 3)), 0, 255).astype(np.uint8)
                cv2.imwrite(str(folder / f"{i:03d}.png"), image)
    return root


# What run_ranks' forkserver imports once. The entry points load torch, timm and albumentations only once their
# arguments are read (assembly/launch.py), so the heavy modules are named here: export.py first, which imports timm
# without wandb (core/startup.import_timm_without_wandb), then what a training rank imports (assembly.fit).
RANK_PRELOAD = ["tests.helpers", "train", "evaluate", "predict", "export", "assembly.fit"]


def as_torchruns_rank() -> None:
    """A rank forked from the forkserver starts its own processes (DataLoader workers) as a torchrun rank does, by
    fork: it inherited the forkserver start method, with which each rank started a forkserver of its own that
    imported RANK_PRELOAD again (7-14 s per loader with workers)."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)


def _rank_entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    as_torchruns_rank()
    torch.set_num_threads(1)
    if backend == "nccl":  # the GPU tier: one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        # A DDP reducer still alive (in a reference cycle) at exit aborts the rank with
        # "terminate called without an active exception" in ~10% of runs: free it first.
        gc.collect()
        dist.destroy_process_group()


def run_ranks(fn, world: int, tmp_path: Path, *args, backend: str = "gloo") -> list:
    """Run fn(rank, world, *args) in `world` real processes joined by a gloo (or NCCL) group; return their results.

    fn must be importable (module level); results travel through torch.save files in tmp_path.
    """
    import torch
    import torch.multiprocessing as mp

    out_dir = Path(tmp_path) / f"ranks-{fn.__name__}-{world}"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Forked from a server process that imported torch, timm and the app once (multiprocessing's forkserver, started
    # at the first call): a spawned rank spent ~7 s importing them. The server is single-threaded, so safe to fork.
    mp.set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(_rank_entry, args=(world, free_port(), fn, args, str(out_dir), backend), nprocs=world,
                       start_method="forkserver", join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _main_entry(rank: int, world: int, port: int, script: str, args: tuple, env: dict, out_dir: str,
                cwd: str | None) -> None:
    """A rank of run_on_ranks: torchrun's launch variables, stdout and stderr into files, the script's main (in
    `cwd`, else the forkserver's folder); its exit code."""
    import importlib

    from core.cli import report_errors

    as_torchruns_rank()
    if cwd is not None:
        os.chdir(cwd)
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WANDB_MODE": "offline", **{name: value.replace("{rank}", str(rank))
                                                  for name, value in env.items()}})
    with open(Path(out_dir) / f"rank{rank}.out", "w") as out, open(Path(out_dir) / f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        module = script.removesuffix(".py").replace("/", ".")  # train.py: train; tests/x.py: tests.x
        code = report_errors(importlib.import_module(module).main, list(args))
        sys.stdout.flush()
    (Path(out_dir) / f"rank{rank}.code").write_text(str(code))


def run_on_ranks(script: str, *args: str, nproc: int, env: dict | None = None,
                 timeout: float = HANG, exit_code: int = 0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc script args` for a test that reads only the run's files: each rank runs the
    script's main with the variables torchrun sets, in a real process joined by a real gloo group, forked from
    run_ranks' forkserver (no ~7 s of imports per rank, nor torchrun's own 3 s). Tests of the launcher itself
    (signals, exit codes, torchrun's output) use run_script. `cwd`: the ranks' working folder (where a run at a URL
    stages its files); "{rank}" in a value of `env` is each rank's number (a folder of its own, as on a node of its own). A rank that exits other than `exit_code` (2: a refusal in one line) fails the test with its
    stderr; one still running after `timeout` fails it as hung. Returns the ranks' stdout and stderr, each the ranks'
    texts in rank order."""
    import tempfile

    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="ranks-main-")
    mp.set_forkserver_preload(RANK_PRELOAD)
    ranks = mp.start_processes(_main_entry, args=(nproc, free_port(), script, args, env or {}, out_dir,
                                                   None if cwd is None else str(cwd)),
                               nprocs=nproc, start_method="forkserver", join=False)
    try:
        deadline = time.monotonic() + timeout
        while not ranks.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                raise AssertionError(f"{script} {' '.join(args)} on {nproc} ranks hung: still running after "
                                     f"{timeout:.0f} s")
        for rank in range(nproc):
            code = Path(out_dir, f"rank{rank}.code").read_text()
            assert code == str(exit_code), (f"{script} {' '.join(args)}: rank {rank} exited {code}\n"
                                 + Path(out_dir, f"rank{rank}.err").read_text()[-5000:])
        stdout, stderr = ("".join(Path(out_dir, f"rank{rank}.{kind}").read_text() for rank in range(nproc))
                          for kind in ("out", "err"))
        return subprocess.CompletedProcess([script, *args], exit_code, stdout, stderr)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def png_header(width: int, height: int) -> bytes:
    """A 1-bit grayscale PNG that declares width x height but holds only a few rows (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * (1 + (width + 7) // 8) * 8)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def write_jpeg(path: Path, size: int = 64, seed: int = 0) -> bytes:
    """A textured size x size JPEG (so most of its bytes are scan data); returns the file's bytes."""
    rng = np.random.default_rng(seed)
    image = cv2.GaussianBlur(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), (5, 5), 2)
    cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return Path(path).read_bytes()


def start_from(path, name: str, num_classes: int, **kwargs):
    """What train.py's start_up does for model.init_from: read the file, create the model through timm with it,
    check it (imported here: benchmarks/harness.py imports this module and needs none of it)."""
    from core.config import ModelConfig
    from engine.checkpoint.weights import check_architecture, check_pretrained, read_pretrained
    from models.factory import create_model

    pretrained = read_pretrained(path)
    check_architecture(pretrained, name)
    model = create_model(ModelConfig(name=name, kwargs=kwargs), num_classes, pretrained.state_dict, pretrained.source)
    check_pretrained(model, pretrained)
    return model


def cache_hub_weights(name: str, seed: int = 0) -> tuple[dict, Path]:
    """Made-up (seeded) pretrained weights for timm's tag `name`, written into the session's Hugging Face cache
    (tests/conftest.py) in the Hub's own layout, as a download leaves them: refs/main naming a snapshot that holds
    timm's config.json and model.safetensors (timm's save_for_hf). Returns their state dict and the cache folder of
    the repository (remove it to empty the cache again)."""
    import timm
    import torch
    from huggingface_hub import constants
    from timm.models import get_pretrained_cfg
    from timm.models._hub import save_for_hf

    repo_id = get_pretrained_cfg(name).hf_hub_id
    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    revision = f"{seed:040x}"
    torch.manual_seed(seed)
    model = timm.create_model(name)
    save_for_hf(model, repo / "snapshots" / revision, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return {k: v.clone() for k, v in model.state_dict().items()}, repo


def last_error(capsys, code: int) -> str:
    """The one line the user sees; asserts the exit code and that no traceback was printed."""
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def check_one_line(args: list[str], expected: str, root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Run train.py's main on TINY + args from an empty working folder; the last line must hold `expected`. A
    `--config` in args takes the place of TINY's."""
    import train
    from core.cli import report_errors

    args = [a.format(root=root) for a in args]
    base = TINY[2:] if "--config" in args else TINY
    out = [] if any(a.startswith("output_dir=") for a in args) else [f"output_dir={tmp_path / 'run'}"]
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    line = last_error(capsys, report_errors(train.main, [*base, *out, *args]))
    assert line.startswith("error: ") and expected.format(root=root) in line, line
    assert not any((tmp_path / "cwd").iterdir())  # nothing lands in the working folder


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; no psutil needed)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def corrupt_in_batch(root: Path, rank: int, batch: int, batch_size: int, seed: int = 0) -> Path:
    """Overwrite the image that `rank` reads in its `batch`-th batch (0-based) of epoch 0 with junk bytes."""
    from data.loader import EpochSampler

    files = sorted(p for p in (root / "train").rglob("*.png"))  # the dataset's order: class, then file name
    sampler = EpochSampler(files, num_replicas=2, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(0)
    _, index = list(sampler)[batch * batch_size]
    files[index].write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return files[index]


def documented_figures(test: str, gpu: str, text: str | None = None) -> dict[str, float] | None:
    """`test`'s row for this GPU in docs/gpu.md's "Measured on GPUs" table, or None where it is missing or still
    "to measure on first run"."""
    text = (REPO / "docs" / "gpu.md").read_text() if text is None else text
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] == f"`{test}`" and cells[1] == gpu:
            if "to measure" in line:
                return None
            return {"img_per_s": float(cells[2].replace(",", "")), "peak_memory_gib": float(cells[3])}
    return None


def recipe_test_model(name: str) -> list[str]:
    """timm's test-sized variant of the config's architecture (same family, a fraction of a million weights)."""
    if name.startswith("deit") and "distilled" in name:  # timm has no test variant: one block, 32 wide
        return ["model.name=deit_tiny_distilled_patch16_224",
                "model.kwargs={img_size: 32, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}"]
    if name.startswith(("vit", "deit")):
        return ["model.name=test_vit", "model.kwargs.img_size=32"]
    if name.startswith("convnext"):
        return ["model.name=test_convnext"]
    return ["model.name=test_resnet"]


def op_counter():
    """A dispatch-mode recorder of every aten op run inside it, by name (`.ops`, a Counter): among them the ones that
    move data between host and device on a GPU, a tensor made from host data (lift_fresh: a copy to the device)
    and a read of a device value (_local_scalar_dense: a sync)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()
