"""Process-wide settings the entry points make, explicitly: nothing here runs as an import side effect.

train.py and evaluate.py call `import_timm_without_wandb()` before their other imports and
`tune_cpu_process()` once they know their device.

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

log = logging.getLogger(__name__)


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


def tune_cpu_process(threads: int) -> None:
    """A CPU process computes with `threads` threads (torchrun would force one) and keeps freed memory."""
    import torch

    torch.set_num_threads(threads)
    keep_freed_memory()


def training_kernels(device_type: str) -> None:
    """On CUDA, cuDNN picks each convolution's fastest algorithm by timing it at its first call (cudnn.benchmark):
    train.py and benchmark.py both set it here, so benchmark.py times the algorithms a run uses."""
    if device_type == "cuda":
        import torch

        torch.backends.cudnn.benchmark = True


def cpu_share(processes_per_node: int) -> int:
    """This process's share of the cores it may run on."""
    return max(1, len(os.sched_getaffinity(0)) // processes_per_node)


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
