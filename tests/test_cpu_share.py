"""Threads that fit the CPU the process really has (issue 52 item 1): the cgroup quota read from a fake tree (the
reader takes its root and /proc/self/cgroup as arguments), a user's OMP_NUM_THREADS winning, and OpenMP's idle
threads sleeping instead of spinning unless the user said how they wait."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core.startup import (OPENMP_WAITING, CpuShare, cgroup_cpu_limit, openmp_waiting, openmp_waits_passively,
                          own_cpus, starved_workers, this_process_cpus, tune_cpu_process, user_threads)
from tests.helpers import TINY, run_script, script_env


def fake_tree(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup mount root holding `files` (relative path -> text) and a /proc/self/cgroup with `membership`."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self-cgroup").write_text(membership)
    return root, tmp_path / "self-cgroup"


@pytest.mark.parametrize("membership, files, expected", [
    ("0::/\n", {"cpu.max": "400000 100000\n"}, 4.0),  # v2 in a container: docker --cpus=4
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # v2, no quota
    ("0::/kubepods/pod1/c1\n", {"kubepods/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "250000 100000\n",
                                "kubepods/pod1/c1/cpu.max": "max 100000\n"}, 2.5),  # the pod's limit, above the container
    ("0::/job\n", {"job/cpu.max": "50000 100000\n"}, 0.5),  # below one core
    ("4:cpu,cpuacct:/slurm/job7\n", {"cpu,cpuacct/slurm/job7/cpu.cfs_quota_us": "300000\n",
                                     "cpu,cpuacct/slurm/job7/cpu.cfs_period_us": "100000\n"}, 3.0),  # v1
    ("2:cpuacct:/\n1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1 none
    ("0::/\n", {}, None),  # nothing readable: no quota
])
def test_the_cgroup_quota_is_read_in_both_formats(tmp_path, membership, files, expected):
    root, proc = fake_tree(tmp_path, membership, files)
    assert cgroup_cpu_limit(root, proc) == expected
    cores = len(os.sched_getaffinity(0))
    assert CpuShare(cores, expected, 1).usable == (cores if expected is None else min(cores, expected))


def test_a_quota_below_one_core_still_gets_one_thread(tmp_path):
    root, proc = fake_tree(tmp_path, "0::/\n", {"cpu.max": "20000 100000\n"})
    quota = cgroup_cpu_limit(root, proc)
    assert CpuShare(8, quota, 1).usable == 0.2
    assert CpuShare(8, quota, 1).share == 1 and CpuShare(8, quota, 4).share == 1


@pytest.mark.parametrize("cpus, processes, workers, expected", [
    (8, 1, 0, 8), (8, 1, 2, 6), (8, 2, 1, 3), (2, 1, 1, 1), (2, 1, 2, 1), (2.5, 1, 0, 2)])
def test_the_threads_are_the_share_less_the_loader_workers(monkeypatch, cpus, processes, workers, expected):
    """Each loader worker is a process that needs a core of its own: the training threads get the rest."""
    from core import startup

    monkeypatch.setattr(startup, "this_process_cpus", lambda per_node: CpuShare(8, cpus, per_node))
    assert startup.compute_threads(processes, workers) == expected


TORCHRUN_8 = {"RANK": "3", "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"}
SRUN_8 = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "10"}


@pytest.mark.parametrize("cores, node, env, own", [
    (10, 80, SRUN_8, True),  # srun --ntasks-per-node=8 --cpus-per-task=10: Slurm bound this task to 10 CPUs
    (80, 80, SRUN_8, False),  # srun --cpu-bind=none: the node's CPUs, shared by its 8 tasks
    (40, 80, SRUN_8, False),  # half a shared node, not bound per task: 8 masks of 40 cannot be apart on 80 CPUs
    (80, 80, TORCHRUN_8, False),  # torchrun: its 8 processes share the mask they inherited
    (10, 80, {**SRUN_8, **TORCHRUN_8}, False),  # torchrun inside one srun task of 10 CPUs: its 8 processes share them
    (16, 256, TORCHRUN_8, False),  # docker --cpuset-cpus=0-15 with torchrun: the container's 16, shared
    (16, 256, {}, False),  # one process
])
def test_slurms_own_cpus_per_task_are_not_divided_again(cores, node, env, own):
    """Issue 62 item 2: under srun --cpus-per-task=10 the mask is already this task's 10 CPUs; dividing it by the
    node's 8 processes gave 1 CPU (1 thread, and input advice about 1 core)."""
    assert own_cpus(cores, node, 8, env) is own
    assert CpuShare(cores, None, 1 if own else 8).share == (cores if own else max(1, cores // 8))


def test_the_share_follows_slurms_binding_in_this_process(monkeypatch):
    """this_process_cpus reads the real mask, the node's CPUs and the environment: a Slurm task whose mask is a
    part of the node keeps it whole; the same mask under torchrun is divided."""
    from core import startup

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(startup.os, "cpu_count", lambda: 8 * cores)  # the node holds 8 masks like this one
    monkeypatch.setattr(startup, "cgroup_cpu_limit", lambda: None)
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert this_process_cpus(8) == CpuShare(cores, None, 1) and startup.cpu_share(8) == cores
    monkeypatch.setenv("RANK", "3")  # torchrun's processes under one srun task
    assert this_process_cpus(8) == CpuShare(cores, None, 8) and startup.cpu_share(8) == max(1, cores // 8)


@pytest.mark.parametrize("cpus, workers, env, warned", [
    (CpuShare(64, 16.0, 8), 8, {}, "the cgroup CPU quota of 16"),  # Kubernetes limits.cpu=16 for 8 GPUs x 8 workers
    (CpuShare(64, 72.0, 8), 8, {}, None),  # 9 CPUs per process: 8 workers and itself
    (CpuShare(10, None, 1), 10, SRUN_8, "Slurm's --cpus-per-task=10"),  # each task's own 10 CPUs, 10 workers + 1
    (CpuShare(10, None, 1), 9, SRUN_8, None),
    (CpuShare(2, None, 1), 4, {}, None),  # the machine's own cores: no limit to name (the input advice speaks)
    (CpuShare(8, 16.0, 1), 8, {}, None),  # a quota above the mask does not limit
])
def test_workers_a_cpu_limit_cannot_feed_are_warned_about(cpus, workers, env, warned):
    """Issue 62 item 7: 8 workers per GPU under a Kubernetes or Slurm limit below 8 x (workers + 1) CPUs throttle
    the training processes too; the start-up warning names the limit and the worker count that fits."""
    line = starved_workers(cpus, workers, env)
    assert (line is None) == (warned is None), line
    if warned:
        assert warned in line and f"data.num_workers={workers}" in line and "\n" not in line
        assert f"set data.num_workers={max(0, cpus.share - 1)}" in line
CPUS = os.cpu_count()


@pytest.mark.parametrize("env, expected", [
    ({"OMP_NUM_THREADS": str(CPUS)}, CPUS),
    ({"OMP_NUM_THREADS": "1"}, 1),  # a user's 1, outside torchrun
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, None),  # torchrun's own default: the app's share
    ({"OMP_NUM_THREADS": str(CPUS), "TORCHELASTIC_RUN_ID": "x"}, CPUS),
    ({"OMP_NUM_THREADS": "0"}, None), ({"OMP_NUM_THREADS": "many"}, None), ({}, None),
])
def test_a_users_omp_num_threads_wins(env, expected):
    assert user_threads(env) == expected
    threads = torch.get_num_threads()
    try:
        chosen = tune_cpu_process(2, env)
        assert torch.get_num_threads() == (expected or 2)
        assert ("as set" in chosen) == (expected is not None)
    finally:
        torch.set_num_threads(threads)


def test_more_threads_than_the_machine_has_cpus_is_one_line():
    """OMP_NUM_THREADS=100000 made torch.set_num_threads(100000) and the first parallel op a segfault (exit 139);
    refused before torch takes it, and the threads stay as they were."""
    from core.errors import UserError

    threads = torch.get_num_threads()
    try:
        with pytest.raises(UserError, match=f"^OMP_NUM_THREADS=100000 asks for more threads than this machine has CPUs "
                                            f"\\({CPUS}\\); set it to at most {CPUS}, or unset it"):
            tune_cpu_process(1, {"OMP_NUM_THREADS": "100000"})
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)  # before any op: set to 100000, the next parallel op would crash the suite


@pytest.mark.parametrize("user, read", [
    ({}, "GOMP_SPINCOUNT = '0'"),  # passive: libgomp's default spins 300000 turns first
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "OMP_WAIT_POLICY = 'ACTIVE'"),  # the user's, kept
])
@pytest.mark.slow  # a train.py process each (the choice itself: test_a_users_openmp_waiting_is_left_alone_and_named)
def test_train_py_sets_the_waiting_before_torch_loads_openmp_and_the_users_wins(user, read, tmp_path):
    """libgomp reads its environment once, when loaded: OMP_DISPLAY_ENV makes every copy loaded (torch's and any
    other library's) print what it read, so a setting made after the load would show here as libgomp's default.
    A dry run loads torch (--help no longer does)."""
    env = {k: v for k, v in script_env(OMP_DISPLAY_ENV="verbose", **user).items()
           if k not in OPENMP_WAITING or k in user}
    shown = run_script("train.py", *TINY, f"output_dir={tmp_path / 'run'}", "--dry-run", env=env).stderr
    loaded = shown.count("OPENMP DISPLAY ENVIRONMENT BEGIN")
    assert loaded >= 1 and shown.count(read) == loaded, shown[-3000:]


@pytest.mark.parametrize("env, set_here, line", [
    ({}, True, None),
    ({"OMP_WAIT_POLICY": "active"}, False, "OMP_WAIT_POLICY=active, as set"),
    ({"GOMP_SPINCOUNT": "10000"}, False, "GOMP_SPINCOUNT=10000, as set"),  # the user tuned the spinning: kept alone
])
def test_a_users_openmp_waiting_is_left_alone_and_named(env, set_here, line):
    given = dict(env)
    assert openmp_waits_passively(env) == set_here
    assert env == (given if not set_here else {"OMP_WAIT_POLICY": "PASSIVE"})
    assert line is None or openmp_waiting(env) == line
