"""Process-wide settings the entry points make, explicitly: nothing here runs as an import side effect.

train.py and benchmark.py call `openmp_waits_passively()` before anything imports torch; the entry points call
`import_timm_without_wandb()` before their other imports and `tune_cpu_process()` once they know their device.

keep_freed_memory: Keep freed activation memory in the process instead of handing it back to the OS after every op.

glibc's malloc serves blocks above its mmap threshold (128 KB, raised dynamically up to 32 MB) with fresh
mmap calls and unmaps them on free, and trims the heap top above 128 KB. A CPU forward/backward pass
allocates and frees tens of MB per layer, so every step page-faults its whole working set back in
(docs/benchmarks.md, "Host memory", has the page-fault counts and the speed-up).
PyTorch's performance tuning guide recommends jemalloc or TCMalloc for this; raising glibc's two
thresholds with `mallopt` gets the same reuse without a preloaded library.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

from core.errors import UserError

log = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup file systems are mounted
MEMBERSHIP = Path("/proc/self/cgroup")  # this process's cgroups


OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user's own say in how libgomp's idle threads wait
passive_set_here = False  # whether openmp_waits_passively set OMP_WAIT_POLICY in this process (for the log line)


def openmp_waits_passively(env: MutableMapping[str, str] | None = None) -> bool:
    """OMP_WAIT_POLICY=PASSIVE in `env` (this process's environment, or a child's) unless the user set how OpenMP
    threads wait; True if set. torch's libgomp reads its environment once, when loaded: the entry points call this
    before importing torch, and once torch is loaded this process's own environment is left as it is.

    By default libgomp's idle threads spin (300,000 turns) before they sleep, burning the cores busy co-tenants
    and the loader workers need; passive threads sleep at once. The waiting policy changes no result, only speed
    (docs/benchmarks.md, section 17, has the measurements quiet and beside busy loops)."""
    global passive_set_here
    env = os.environ if env is None else env
    if any(name in env for name in OPENMP_WAITING) or (env is os.environ and "torch" in sys.modules):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    passive_set_here = env is os.environ
    return True


def openmp_waiting(env: Mapping[str, str] | None = None) -> str:
    """How OpenMP's idle threads wait and who chose it, for the start-up line."""
    env = os.environ if env is None else env
    if passive_set_here and env is os.environ:
        return "passively (OMP_WAIT_POLICY=PASSIVE, set by the app; set OMP_WAIT_POLICY or GOMP_SPINCOUNT for another)"
    given = [f"{name}={env[name]}" for name in OPENMP_WAITING if name in env]
    return f"{', '.join(given)}, as set" if given else "libgomp's default (spinning, then sleeping)"


def import_timm_without_wandb() -> None:
    """Import timm with wandb hidden: `import timm` imports wandb eagerly (timm/utils/summary.py, for a helper
    this app does not use), which would load wandb into every run even with logging.wandb=false.

    A None entry in sys.modules makes `import wandb` raise ImportError, which timm catches; the entry
    is removed right after, so engine/tracking.py can import wandb when tracking is on.
    """
    if "timm" in sys.modules or "wandb" in sys.modules:
        return
    sys.modules["wandb"] = None
    try:
        import timm  # noqa: F401
    finally:
        del sys.modules["wandb"]


def tune_cpu_process(threads: int, env: dict[str, str] | None = None) -> str:
    """A CPU process computes with `threads` threads (torchrun would force one), unless the user set
    OMP_NUM_THREADS, which wins, and keeps freed memory; returns what it chose and why, for the log."""
    import torch

    user = user_threads(os.environ if env is None else env)
    if user is not None and user > (os.cpu_count() or 1):  # torch.set_num_threads(100000): a segfault at the first op
        raise UserError(f"OMP_NUM_THREADS={user} asks for more threads than this machine has CPUs "
                        f"({os.cpu_count()}); set it to at most {os.cpu_count()}, or unset it to let the app use "
                        "its share of the CPUs")
    if user is not None:
        torch.set_num_threads(user)
        chosen = f"{user} thread(s) per process (OMP_NUM_THREADS={user}, as set)"
    else:
        torch.set_num_threads(threads)
        chosen = f"{threads} thread(s) per process"
    keep_freed_memory()
    return chosen


def user_threads(env: dict[str, str] | os._Environ) -> int | None:
    """OMP_NUM_THREADS as the user set it, or None: unset, not a positive number, or torchrun's own 1 (torchrun sets
    OMP_NUM_THREADS=1 for several processes per node when the user did not, and a worker cannot tell them apart)."""
    text = env.get("OMP_NUM_THREADS", "").strip()
    if not text.isdigit() or int(text) < 1:
        return None
    if text == "1" and "TORCHELASTIC_RUN_ID" in env:
        return None
    return int(text)


def training_kernels(device_type: str, tf32: bool) -> None:
    """On CUDA, cuDNN picks each convolution's fastest algorithm by timing it at its first call (cudnn.benchmark),
    and fp32 matmuls and convolutions use TF32 when training's precision says so (engine/precision.tf32_for):
    train.py and benchmark.py both set them here, so benchmark.py times the kernels a run uses."""
    if device_type == "cuda":
        import torch

        torch.backends.cudnn.benchmark = True
        use_tf32(tf32)


def use_tf32(on: bool) -> None:
    """fp32 matmuls (cuBLAS) and convolutions (cuDNN) on TF32 Tensor Cores, or in full fp32. The per-backend flags,
    not torch.set_float32_matmul_precision, which would also let oneDNN's CPU matmuls round."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def cpu_share(processes_per_node: int) -> int:
    """This process's share of the CPUs it may use: the cores of its affinity mask, capped by its cgroup's CPU quota
    (a container's limit, which the affinity mask does not show), divided among the processes that share them."""
    return this_process_cpus(processes_per_node).share


@dataclass(frozen=True)
class CpuShare:
    """The CPUs a process may use and how many processes of its node share them."""

    cores: int  # in its affinity mask
    quota: float | None  # its cgroup's CPU quota (cpu.max), None: none
    sharing: int  # processes the mask and quota are divided among: 1 when Slurm bound this task to its own CPUs

    @property
    def usable(self) -> float:
        return min(self.cores, self.quota) if self.quota is not None else self.cores

    @property
    def share(self) -> int:
        return max(1, int(self.usable // self.sharing))


def this_process_cpus(processes_per_node: int) -> CpuShare:
    """CpuShare of this process: its affinity mask, the node's CPUs, its cgroup quota, its launcher's variables."""
    cores = len(os.sched_getaffinity(0))
    own = own_cpus(cores, os.cpu_count() or cores, processes_per_node, os.environ)
    return CpuShare(cores, cgroup_cpu_limit(), 1 if own else processes_per_node)


def own_cpus(cores: int, node_cores: int, processes_per_node: int, env: Mapping[str, str]) -> bool:
    """Whether this process's affinity mask of `cores` CPUs is its own, not its node's processes' to share: Slurm
    started it as one task of several (srun, not torchrun) and bound it to CPUs of its own (srun --cpus-per-task:
    10 of the node's 80 for each of 8 tasks). Dividing such a mask again would leave each task a fraction of what
    Slurm gave it. A mask covering the node, or one too large for the node's processes to hold apart, is shared."""
    slurm_task = "SLURM_PROCID" in env and "RANK" not in env
    return slurm_task and cores < node_cores and cores * processes_per_node <= node_cores


def default_workers(workers: int, given: bool, processes_per_node: int) -> tuple[int, str | None]:
    """data.num_workers as a run uses it, and the line that says why when it differs: a value the user gave (config
    file or command line) as given; the default capped at this process's share of the CPUs (more workers than
    cores only wait for each other, and torch warns that the DataLoader "might get slow or even freeze")."""
    share = cpu_share(processes_per_node)
    if given or workers <= share:
        return workers, None
    return share, (f"data.num_workers {share}: the default {workers}, capped at this process's {share} CPU(s) "
                   f"({processes_per_node} process(es) on this node); set data.num_workers to choose")


def compute_threads(processes_per_node: int, workers: int) -> int:
    """The threads a training process computes with: its share of the CPUs less one per loader worker, at least 1.
    Each worker is a process that decodes and augments on a core of its own: a thread beyond the cores left waits
    at every op's barrier for the one a worker took (docs/benchmarks.md, section 17: on 2 cores with 1 worker, 1
    thread trains as fast as 2 quiet and several times faster beside 2 busy co-tenants)."""
    return max(1, cpu_share(processes_per_node) - workers)


def threads_line(processes_per_node: int, workers: int) -> str:
    """The CPU threads this process computes with and why, for the run's start-up line."""
    import torch

    user = user_threads(os.environ)
    why = f"OMP_NUM_THREADS={user}, as set" if user is not None else "its share less its loader workers"
    return (f"{torch.get_num_threads()} thread(s) per process ({why}): "
            f"{cpu_budget(this_process_cpus(processes_per_node), processes_per_node, workers)}; "
            f"idle threads wait: {openmp_waiting()}")


def cpu_budget(cpus: CpuShare, processes_per_node: int, workers: int) -> str:
    """Why a process got its threads, for the start-up log: what it may use, shared by how many."""
    limit = f"a cgroup CPU quota of {cpus.quota:g}" if cpus.quota is not None else "no cgroup CPU quota"
    shared = (f"for {processes_per_node} process(es) on this node" if cpus.sharing > 1 or processes_per_node == 1
              else "this process's own (Slurm bound each task to CPUs of its own)")
    return (f"{cpus.usable:g} CPU(s) usable ({cpus.cores} core(s) in the affinity mask, {limit}) {shared}, each with "
            f"{workers} loader worker(s)")


def starved_workers(cpus: CpuShare, workers: int, env: Mapping[str, str]) -> str | None:
    """The start-up warning for loader workers a CPU limit cannot feed, or None. Under a cgroup quota (Kubernetes
    limits.cpu, docker --cpus) or Slurm's --cpus-per-task, workers beyond the share do not just wait for a core:
    the quota stops the whole group, the training process feeding the GPU included, for the rest of each period,
    and under Slurm's binding they take the training process's own cores. Each process needs its workers + 1."""
    need = workers + 1
    if cpus.usable / cpus.sharing >= need:
        return None
    if cpus.quota is not None and cpus.quota < cpus.cores:
        limit = f"the cgroup CPU quota of {cpus.quota:g} CPU(s) (cpu.max: Kubernetes limits.cpu, docker --cpus)"
    elif "SLURM_CPUS_PER_TASK" in env:
        limit = f"Slurm's --cpus-per-task={env['SLURM_CPUS_PER_TASK']} ({cpus.cores} core(s) in the affinity mask)"
    else:
        return None  # the machine's own cores: the run's input advice speaks if the input waits
    fits = max(0, int(cpus.usable // cpus.sharing) - 1)
    return (f"data.num_workers={workers} with {cpus.sharing} process(es) sharing {limit}: each process has "
            f"{cpus.usable / cpus.sharing:g} CPU(s) for its {workers} worker(s) + itself ({need}), so busy workers "
            f"throttle the training process too; set data.num_workers={fits} or raise the CPU limit to "
            f"{cpus.sharing * need} or more")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """The CPUs a cgroup quota lets this process use (Kubernetes limits.cpu, docker --cpus, Slurm's cgroups): the
    smallest quota / period on its cgroup's path, cgroup v2 (cpu.max: "QUOTA PERIOD", "max" = none) or v1
    (cpu.cfs_quota_us, -1 = none, over cpu.cfs_period_us). None: no quota, or nothing readable. `root` is where
    the cgroup file systems are mounted, `membership` this process's /proc/self/cgroup (tests pass a fake tree)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            limits += [v2_limit(folder) for folder in along(root, path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mount = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if mount is not None:
                limits += [v1_limit(folder) for folder in along(mount, path)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def along(mount: Path, path: str) -> list[Path]:
    """The folders from `mount` down to the cgroup `path` under it (a quota anywhere on the way applies)."""
    folders, folder = [mount], mount
    for part in [p for p in path.split("/") if p]:
        folder = folder / part
        folders.append(folder)
    return folders


def v2_limit(folder: Path) -> float | None:
    """cgroup v2 cpu.max: "QUOTA PERIOD" in microseconds; "max" is no quota."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def v1_limit(folder: Path) -> float | None:
    """cgroup v1 cpu.cfs_quota_us over cpu.cfs_period_us; a quota of -1 is none."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> constants
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from (and return to) the heap
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (and the workers it forks); True if done.

    Left alone when the user set malloc tuning or preloaded another allocator, or when libc is not glibc.
    """
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # mmap first: a raised trim threshold alone turns glibc's dynamic mmap threshold off and is slower.
    done = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    log.debug("glibc malloc thresholds raised to %d bytes: %s", KEEP_BYTES, done)
    return done


def sweep_run_id(env: dict[str, str] | None = None) -> str | None:
    """The W&B run a sweep agent launched this process for (the agent sets WANDB_SWEEP_ID and WANDB_RUN_ID in the
    environment of its command, torchrun passes them to every rank), else None."""
    env = os.environ if env is None else env
    return env.get("WANDB_RUN_ID") or None if env.get("WANDB_SWEEP_ID") else None
