"""Distributed setup and the few collectives the app uses.

Every helper works (as a no-op) when no process group exists, so callers never write
`if distributed:`. The launch environment is read from torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) or, when those are absent, from SLURM's srun (SLURM_PROCID, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from core.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_launch_env(env: dict[str, str] | None = None) -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun, SLURM, or one process."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0]
        return int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), int(per_node)
    return 0, 1, 0, 1


def cuda_device_index(env: dict[str, str], device_count: int) -> int:
    """This rank's GPU from the launch env: the one at its local rank, or the only visible one if the launcher bound it.

    One visible GPU is this rank's own only under srun (per-task binding) or with one process per node; under
    torchrun with several processes per node it would be shared, which NCCL rejects or runs slowly.
    """
    _, _, local_rank, local_world = read_launch_env(env)
    srun = "RANK" not in env and "SLURM_PROCID" in env
    if device_count == 1 and (srun or local_world == 1):
        return 0
    if device_count == 1:
        raise UserError(f"{local_world} processes on this node see one GPU and would share it; start one process "
                        "per GPU (torchrun --nproc_per_node=1) or let Slurm bind one GPU per task (srun "
                        "--gpus-per-task=1), or check CUDA_VISIBLE_DEVICES")
    if local_rank < device_count:
        return local_rank
    raise UserError(f"this process is local rank {local_rank} but sees {device_count} visible GPU(s); start at most "
                    f"{device_count} processes per node (torchrun --nproc_per_node={device_count}) or check "
                    "CUDA_VISIBLE_DEVICES")


def gpu_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build compiled for `arch_list` (torch.cuda.get_arch_list()) runs on this GPU.

    A cubin for sm_XY runs on sm_XZ with Z >= Y; PTX for compute_XY is compiled at load time for any newer GPU.
    """
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if not number.isdigit():  # sm_90a-style builds run on exactly that GPU
            continue
        built = (int(number[:-1]), int(number[-1]))
        if (kind == "sm" and built[0] == major and built[1] <= minor) or (kind == "compute" and built <= (major, minor)):
            return True
    return False


# CUDA major version of the torch wheel -> oldest driver branch that runs it (NVIDIA's CUDA compatibility table,
# with minor-version compatibility).
OLDEST_DRIVER = {"11": 450, "12": 525, "13": 580}


def nvidia_driver_version() -> str | None:
    """The driver version of the first GPU `nvidia-smi` on PATH lists; None where it lists none or is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    versions = out.stdout.split()
    return versions[0] if out.returncode == 0 and versions else None


def unusable_gpu(driver: str | None, wheel_cuda: str | None, cuda_available: bool, visible: str | None) -> str | None:
    """Why a GPU that nvidia-smi lists cannot be used by this torch, or None (usable, none listed, CPU asked for).

    Without this check torch warns and the run trains on the CPU for days. `CUDA_VISIBLE_DEVICES=` asks for the CPU.
    """
    if cuda_available or driver is None or (visible is not None and visible.strip() in ("", "-1")):
        return None
    if wheel_cuda is None:
        cause, fix = "this torch build is CPU-only", "install torch's CUDA build"
    else:
        oldest = OLDEST_DRIVER.get(wheel_cuda.split(".")[0])
        major = driver.split(".")[0]
        if oldest is not None and major.isdigit() and int(major) < oldest:
            cause = f"this torch build is for CUDA {wheel_cuda}, which needs driver {oldest} or newer"
            fix = f"update the NVIDIA driver to {oldest}+ or install a torch build for an older CUDA"
        else:
            cause = f"this torch build is for CUDA {wheel_cuda}; torch's warning above says why"
            fix = "check that the GPU is free and CUDA_VISIBLE_DEVICES names it"
    return (f"nvidia-smi lists a GPU (driver {driver}) but torch cannot use it ({cause}): {fix} (docs/gpu.md, "
            "'A GPU torch cannot use'), or set CUDA_VISIBLE_DEVICES= to train on the CPU")


def check_gpu_usable() -> None:
    """Stop before anything is written when a GPU is present but torch would silently train on the CPU."""
    problem = unusable_gpu(nvidia_driver_version(), torch.version.cuda, torch.cuda.is_available(),
                           os.environ.get("CUDA_VISIBLE_DEVICES"))
    if problem is not None:
        raise UserError(problem)


def collective_timeout(timeout_s: int, env: dict[str, str] | None = None) -> int:
    """dist.timeout_s, where 0 means: 1800 s under torchrun, 600 s under a launcher without an elastic agent.

    torchrun's agent stops every rank within seconds when one dies, so the timeout only ends true hangs;
    under srun the survivors of a dead rank wait in a collective until it expires (docs/gpu.md).
    """
    env = dict(os.environ) if env is None else env
    if timeout_s > 0:
        return timeout_s
    return 1800 if "TORCHELASTIC_RUN_ID" in env else 600


def nccl_watchdog_env(env: dict[str, str]) -> dict[str, str]:
    """The NCCL watchdog settings the app runs with (the user's own values stand).

    Under NCCL a rank whose peer died waits inside a CUDA kernel, not in Python: only the watchdog ends it.
    ASYNC_ERROR_HANDLING=3 makes the watchdog end the process once a collective exceeds dist.timeout_s;
    monitoring ends it too if the watchdog itself hangs (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 480 s).
    """
    defaults = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    return {name: env.get(name, value) for name, value in defaults.items()}


def init_distributed(backend: str = "auto", timeout_s: int = 0, rendezvous_timeout_s: int = 300) -> DistInfo:
    """Join the process group (if launched with several processes) and pick this rank's device."""
    rank, world, local_rank, local_world = read_launch_env()
    if not torch.cuda.is_available():
        check_gpu_usable()
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("dist.backend=nccl needs CUDA GPUs and this process sees none; use dist.backend=auto "
                        "(gloo on CPU)")
    if torch.cuda.is_available():
        device = torch.device("cuda", cuda_device_index(dict(os.environ), torch.cuda.device_count()))
        capability, built = torch.cuda.get_device_capability(device), torch.cuda.get_arch_list()
        if not gpu_supported(capability, built):
            raise UserError(f"{torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}) is not supported by "
                            f"this torch build (CUDA {torch.version.cuda}, compiled for {' '.join(built)}); install a "
                            "build compiled for it (docs/gpu.md, 'Which torch wheel')")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" not in os.environ:
            raise UserError("MASTER_ADDR/MASTER_PORT are not set: launch with torchrun, or export them for srun")
        timeout = datetime.timedelta(seconds=collective_timeout(timeout_s))
        if backend == "nccl":  # a timed-out or failed collective ends the process instead of hanging it
            os.environ.update(nccl_watchdog_env(dict(os.environ)))
            log.info("NCCL watchdog: a collective waiting over %d s (dist.timeout_s) ends this process "
                     "(TORCH_NCCL_ASYNC_ERROR_HANDLING=%s)", timeout.total_seconds(),
                     os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"])
        store = meet_processes(rank, world, rendezvous_timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, world, local_rank, local_world, device)


def launch_vars() -> str:
    """The environment variables that made this a multi-process launch, as NAME=value."""
    names = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT")
    return " ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ)


def meet_processes(rank: int, world: int, timeout_s: int) -> dist.Store:
    """Meet the other processes at MASTER_ADDR:MASTER_PORT, giving up after timeout_s with one line."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')}"
    log.info("rank %d of %d: waiting up to %d s for all processes to join at %s (dist.rendezvous_timeout_s)",
             rank, world, timeout_s, where)
    try:
        return rendezvous_store(rank, world, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as err:  # DistStoreError / DistNetworkError (timeouts, refused connections)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"the {world} processes did not meet at {where} within {timeout_s} s ({first}); this process "
                        f"was started as rank {rank} of {world} by {launch_vars()}: start every rank (torchrun, "
                        "srun), or unset those variables to train in one process", before_group=True) from None


def rendezvous_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The env:// store, with a key prefix per torchrun restart.

    torchrun's workers share the agent's store, which outlives a restart: without the prefix a
    restarted rank can read the gloo/NCCL address a dead rank published, and fail to connect
    (docs/reliability.md).
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def cleanup() -> None:
    """Leave the process group cleanly (avoids shutdown warnings and hangs)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns the tensor for chaining."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's `value` (one all-reduce of one number on `device`, which NCCL needs)."""
    if not dist.is_initialized():
        return value
    tensor = torch.full((1,), value, dtype=torch.int32, device=device)  # a fill, not a host-to-device copy
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (train.batch_size=auto: the batch every rank can hold)."""
    return -max_over_ranks(-value, device)


class LaggedMax:
    """The largest of every rank's value, asked at each call and answered one call later: the all-reduce and its copy
    to the host are queued behind the work already queued, and the host waits only for them, so a loop that asks
    once per batch (a validation's stop flag) never leaves the device idle waiting for the host. Every rank must
    call it equally often (a collective)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asked: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # the previous call's, on its way

    def __call__(self, value: int) -> int:
        """Ask with this rank's `value`; the previous call's answer (0 at the first call)."""
        flag = torch.full((1,), value, dtype=torch.int32, device=self.device)  # a fill, not a host-to-device copy
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        copied = None
        if self.device.type == "cuda":  # into pinned memory (non_blocking), marked done by an event
            flag, copied = flag.to("cpu", non_blocking=True), torch.cuda.Event()
            copied.record()
        answered, self.asked = self.asked, (flag, copied)
        if answered is None:
            return 0
        if answered[1] is not None:
            answered[1].synchronize()
        return int(answered[0].item())


def step_flags_over_ranks(nonfinite: torch.Tensor, stop_signal: int) -> tuple[bool, int]:
    """Any rank's inf/NaN flag and largest stop signal: one all-reduce (MAX) of one tensor, one read on the host.

    The signal is made on the device by a fill (not copied from the host); both values come back packed in one
    number, so a step waits for the device once.
    """
    signal = torch.full((), stop_signal, dtype=torch.int32, device=nonfinite.device)
    flags = torch.stack([nonfinite.to(torch.int32), signal])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    packed = int((flags[0] * 256 + flags[1]).item())  # signal numbers are below 256
    return packed >= 256, packed % 256


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's tensors with rank `src`'s, in place: one broadcast per dtype and device (the tensors
    flattened into one buffer), not one per tensor, since each call is a latency-bound collective."""
    if not dist.is_initialized():
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in by_kind.values():
        if len(group) == 1 and group[0].is_contiguous():
            dist.broadcast(group[0], src=src)
            continue
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=src)
        torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in group]),
                                                                           group)])


def gather_rows(local: torch.Tensor) -> torch.Tensor | None:
    """Every rank's rows (dim 0) of `local`, concatenated in rank order, on rank 0; None on the others. Tensors padded
    to the longest rank's, so nothing is pickled and only rank 0 receives the data (all_gather_object sent every
    rank's arrays, pickled, to every rank: ~10 GB per rank per epoch at 10k classes x 125k images)."""
    if not dist.is_initialized():
        return local
    counts = rows_per_rank(local)
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[:len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(len(counts))] if is_main() else None
    dist.gather(padded, parts, dst=0)
    return torch.cat([part[:n] for part, n in zip(parts, counts)]) if parts is not None else None


def gather_rows_to_host(local: torch.Tensor, block_rows: int) -> torch.Tensor | None:
    """gather_rows into rank 0's host memory, `block_rows` rows of each rank at a time: rank 0's device holds one
    block of every rank, never the whole set (multi-label validation at 125k images x 9.6k classes: 20 GB of
    probabilities, which gather_rows would put on rank 0's GPU). A CPU tensor on rank 0, None on the others."""
    if not dist.is_initialized():
        return local.cpu()
    counts, main = rows_per_rank(local), is_main()
    whole = torch.empty((sum(counts), *local.shape[1:]), dtype=local.dtype) if main else None
    firsts = [sum(counts[:rank]) for rank in range(len(counts))]
    for start in range(0, max(counts), block_rows):
        mine = local[start:start + block_rows]
        padded = local.new_zeros((min(block_rows, max(counts) - start), *local.shape[1:]))
        padded[:len(mine)] = mine
        parts = [torch.empty_like(padded) for _ in counts] if main else None
        dist.gather(padded, parts, dst=0)
        if parts is not None:
            arrived = torch.cat(parts).cpu()  # one copy to the host per block
            for rank, first in enumerate(firsts):
                rows = min(max(counts[rank] - start, 0), len(padded))
                whole[first + start:first + start + rows] = arrived[rank * len(padded):rank * len(padded) + rows]
    return whole


def rows_per_rank(local: torch.Tensor) -> list[int]:
    """Every rank's row count of `local` (one all-reduce)."""
    sizes = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=local.device)
    sizes[dist.get_rank()] = len(local)
    dist.all_reduce(sizes)
    return sizes.tolist()


def rank0_decides(decide: Callable[[], T]) -> T:
    """Rank 0 runs decide(); every rank returns its result, or raises the UserError it raised (reported once).

    The one way the app checks something on rank 0 only (a folder, a file, a write) and lets every rank act
    on the answer. Also a barrier: no rank runs ahead of the decision.
    """
    answer: tuple[Any, str | None] = (None, None)
    if is_main():
        try:
            answer = (decide(), None)
        except UserError as err:
            answer = (None, str(err))
    result, problem = broadcast_object(answer)
    if problem is not None:
        raise UserError(problem, all_ranks=True)
    return result


def main_first(run: Callable[[], T]) -> T:
    """Rank 0 runs run() first (a download into a shared cache), the other ranks after it succeeded (they find
    its work done: no N simultaneous downloads); a UserError of rank 0's is every rank's, reported once."""
    result, problem = None, None
    if is_main():
        try:
            result = run()
        except UserError as err:
            problem = str(err)
    problem = broadcast_object(problem)  # also the barrier the others wait at
    if problem is not None:
        raise UserError(problem, all_ranks=True)
    return result if is_main() else run()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s Python object, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """One object from each rank, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def local_main_first(local_rank: int) -> Iterator[None]:
    """Local rank 0 runs the block first (e.g. to build a cache); the others wait, then run it."""
    if local_rank != 0:
        barrier()
    yield
    if local_rank == 0:
        barrier()


def is_fsdp(model: nn.Module) -> bool:
    """The one test for "is this model sharded": FSDP2 shards its parameters (its state dicts then hold DTensors)."""
    from torch.distributed.fsdp import FSDPModule  # here, not at the top: seconds of start-up a run without it skips

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights and put its shards back in the module. FSDP2 keeps the root unit
    gathered after a forward (for the backward it expects), and a gathered unit is not gathered again: an EMA,
    whose shards change between its no-grad validations, would validate its root's stale weights the next time."""
    from torch.distributed.fsdp import FSDPModule  # (as is_fsdp)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def rank_local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors no collective keeps equal across ranks: buffers (BatchNorm's running statistics), not sharded
    ones. Parameters are equal already (DDP all-reduces their gradients; an EMA of them follows) or sharded."""
    from torch.distributed.tensor import DTensor

    return [t for t in model.buffers() if not isinstance(t, DTensor)]


def replicated_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The state a sharded model keeps whole on every rank (buffers such as BatchNorm's running statistics)."""
    from torch.distributed.tensor import DTensor

    return [t for t in model.state_dict().values() if not isinstance(t, DTensor)]
