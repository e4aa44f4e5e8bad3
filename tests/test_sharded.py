"""Sharded checkpoints (engine/checkpoint/sharded.py): real gloo groups, real FSDP2 sharding, real folders on disk.

engine.checkpoint.resume, engine.checkpoint.weights and core.config_load (which import timm) are imported inside the tests that use
them: every spawned rank imports this module, and timm would cost each several seconds.

A folder written by 2 ranks of an FSDP2-sharded model loads on 3 ranks and on 1 (DCP reshards), a DDP
model's folder loads into a plain one, a save killed mid-write leaves the previous folder whole, and a
folder that is not a whole checkpoint (or whose index would run code) is one line.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from core.errors import UserError
from core.files import save_atomic
from engine.checkpoint import formats, sharded
from engine.checkpoint.formats import read_checkpoint
from tests.helpers import REPO, free_port, run_ranks, script_env


class Net(nn.Module):
    """Blocks of odd widths (13 rows shard unevenly over 2 and 3 ranks), LayerNorm, a head: fully_shard per block."""

    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                    for _ in range(3))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model (seeded), wrapped as `kind` (plain, ddp, fsdp: per block, then the root), and its AdamW."""
    torch.manual_seed(seed)
    model = Net()
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    wrapped = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.01, weight_decay=0.05)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Whole model and optimizer state on every rank (a collective), for comparison."""
    model = getattr(model, "module", model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.detach().clone() for k, v in model_sd.items()},
            "optimizer": {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in optim_sd["state"].items()},
            "param_groups": optim_sd["param_groups"]}


def train_and_save(kind: str, rank: int, folder: Path) -> dict:
    """Three AdamW steps on rank-dependent data, then a sharded save; the whole state as it was saved."""
    model, optimizer = build(kind, seed=0)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 13)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    sharded.save(folder, model, optimizer, {"epoch": 1, "global_step": 3, "rng": []})
    return full_state(model, optimizer)


def load_fresh(kind: str, folder: Path) -> dict:
    """Another seed's model, then the folder loaded into it; its whole state before (`fresh`) and after loading."""
    model, optimizer = build(kind, seed=1)
    fresh = full_state(model, optimizer)
    sharded.load(folder, model, optimizer, read_checkpoint(folder)["optimizer_rest"])
    return {**full_state(model, optimizer), "fresh": fresh}


def save_both_then_load(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: an FSDP2 model saved to fsdp.dcp, a DDP model to ddp.dcp; then fsdp.dcp loaded into a DDP model."""
    saved = {kind: train_and_save(kind, rank, Path(tmp) / f"{kind}.dcp") for kind in ("fsdp", "ddp")}
    return {**saved, "fsdp.dcp into ddp": load_fresh("ddp", Path(tmp) / "fsdp.dcp")}


def save_where_rank_1_sees_another_folder(rank: int, world: int, tmp: str) -> dict:
    """2 ranks save last.dcp (a relative path) from one working directory, then again with rank 1 in another one:
    its shards land in a folder rank 0 cannot see, as on a node-local output_dir. What each rank found."""
    from core.errors import UserError

    os.chdir(tmp)
    os.makedirs("run", exist_ok=True)  # the run's folder (train.py's lock makes it; a save never does)
    model, optimizer = build("fsdp", seed=0)
    folder = Path("run/last.dcp")
    sharded.save(folder, model, optimizer, {"epoch": 1, "global_step": 3, "rng": []})
    if rank == 1:
        os.makedirs("elsewhere/run", exist_ok=True)
        os.chdir("elsewhere")
    try:
        sharded.save(folder, model, optimizer, {"epoch": 2, "global_step": 6, "rng": []})
        error = None
    except UserError as err:
        error = str(err)
    left = sorted(p.name for p in Path("run").iterdir())  # in this rank's view
    return {"error": error, "left": left}


@pytest.mark.slow
def test_a_sharded_save_missing_a_ranks_shards_is_never_swapped_in(tmp_path):
    """Rank 1 writing its shards where rank 0 cannot see them (another working directory for a relative output_dir,
    as a node-local disk would): the save is refused on both ranks with one line naming rank 1, the previous
    last.dcp stays whole, and rank 1's stray temp folder is removed (it was kept on its disk at every save)."""
    results = run_ranks(save_where_rank_1_sees_another_folder, 2, tmp_path, str(tmp_path))
    for result in results:
        assert result["error"].startswith("cannot write checkpoint run/last.dcp: the shards of rank(s) 1 (__1_0.distcp)")
        assert "\n" not in result["error"]
    assert results[0]["left"] == ["last.dcp"] and results[1]["left"] == []
    assert read_checkpoint(tmp_path / "run/last.dcp")["global_step"] == 3  # the previous folder, whole


def test_a_new_folder_missing_a_shard_file_is_refused_before_the_swap(tmp_path):
    """The shard check before the swap, in one process on real files (the 2-rank test above is slow): a new folder
    whose index names a shard file that is not in it (another node's view) is refused in one line, removed, and the
    previous last.dcp stays whole; without the check finish() swapped it in."""
    from core.files import temp_name

    model, optimizer = build("plain", seed=0)
    folder = tmp_path / "last.dcp"
    sharded.save(folder, model, optimizer, {"epoch": 1, "global_step": 3, "rng": []})
    tmp = temp_name(folder)  # the new folder as every rank left it: the index and the shards, no train_state.pth
    shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns(formats.PLAIN, "*.distcp"))
    assert (tmp / ".metadata").is_file()
    with pytest.raises(UserError, match=r"^cannot write checkpoint .*last.dcp: the shards of rank\(s\) 0 "
                                        r"\(__0_0.distcp\) are not in rank 0's view of it"):
        sharded.finish(folder, tmp, {"epoch": 2, "global_step": 6, "rng": []})
    assert not tmp.exists() and read_checkpoint(folder)["global_step"] == 3


def load_both(rank: int, world: int, kind: str, tmp: str) -> dict:
    return {f"{name}.dcp into {kind}": load_fresh(kind, Path(tmp) / f"{name}.dcp") for name in ("fsdp", "ddp")}


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference over every model and optimizer tensor (keys must match)."""
    assert a["model"].keys() == b["model"].keys() and a["optimizer"].keys() == b["optimizer"].keys()
    diffs = [(a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]]
    for fqn in a["optimizer"]:
        assert a["optimizer"][fqn].keys() == b["optimizer"][fqn].keys()
        diffs += [(a["optimizer"][fqn][k] - b["optimizer"][fqn][k]).abs().max().item() for k in a["optimizer"][fqn]]
    return max(diffs)


@pytest.mark.slow
def test_folders_of_2_ranks_load_on_1_2_and_3_ranks_exactly(tmp_path):
    """FSDP2 (per block + root) and DDP folders written by 2 ranks, loaded into FSDP2 on 3 ranks, DDP on 2 and a
    plain model in 1 process: model and optimizer state bitwise the saved ones (DCP reshards on load)."""
    first = run_ranks(save_both_then_load, 2, tmp_path, str(tmp_path))
    saved = {"fsdp": first[0]["fsdp"], "ddp": first[0]["ddp"]}
    assert sorted(p.name for p in (tmp_path / "fsdp.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pth"]  # each rank wrote its own shards
    diffs = {}
    for result in [*first, *run_ranks(load_both, 3, tmp_path, "fsdp", str(tmp_path)),
                   *run_ranks(load_both, 1, tmp_path, "plain", str(tmp_path))]:
        for key, state in result.items():
            if " into " in key:
                source = saved[key.split(".")[0]]
                assert max_diff(source, state["fresh"]) > 0  # loading had something to change
                diffs[key] = max(diffs.get(key, 0.0), max_diff(source, state))
                assert state["param_groups"] == source["param_groups"]
    print(f"max diff per load (over ranks): {diffs}")
    assert len(diffs) == 5 and all(diff == 0.0 for diff in diffs.values())
    whole = read_checkpoint(tmp_path / "fsdp.dcp")["model"]  # one process, no group: what evaluate.py reads
    assert all(torch.equal(whole[k], saved["fsdp"]["model"][k]) for k in saved["fsdp"]["model"])


def single_save(folder: Path, value: float, step: int) -> None:
    """A one-process save of a model whose every weight is `value`."""
    model, optimizer = build("plain", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    sharded.save(folder, model, optimizer, {"epoch": 0, "global_step": step, "rng": []})


def test_an_optimizer_saved_before_its_first_step_is_left_unstepped(tmp_path):
    """DCP's get_optimizer_state_dict makes missing state with a zero step: that would count as Adam's first."""
    model, optimizer = build("plain", seed=0)
    sharded.save(tmp_path / "last.dcp", model, optimizer, {"global_step": 0})
    assert not optimizer.state
    fresh, fresh_optimizer = build("plain", seed=1)
    folder = tmp_path / "last.dcp"
    sharded.load(folder, fresh, fresh_optimizer, read_checkpoint(folder)["optimizer_rest"])
    assert not fresh_optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_a_folder_the_app_did_not_write_is_never_replaced(tmp_path):
    folder = tmp_path / "last.dcp"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"^.*last.dcp is a folder \(notes.txt\), not a sharded checkpoint train.py "
                                        r"wrote; it was left as it is: move it away or choose another output_dir$"):
        single_save(folder, 1.0, 1)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and [p.name for p in tmp_path.iterdir()] == ["last.dcp"]


def test_model_init_from_and_inference_read_a_folder_whole(tmp_path):
    from engine.checkpoint.weights import read_pretrained

    single_save(tmp_path / "last.dcp", 0.5, 4)
    weights = read_pretrained(tmp_path / "last.dcp").state_dict
    assert weights.keys() == Net().state_dict().keys() and all(bool((w == 0.5).all()) for w in weights.values()
                                                               if w.is_floating_point() and w.dim() == 2)


def test_a_folder_that_is_not_a_whole_checkpoint_is_one_line(tmp_path):
    folder = tmp_path / "last.dcp"
    folder.mkdir()
    with pytest.raises(UserError, match=r"^checkpoint .*last.dcp is not a whole sharded checkpoint \(no .metadata, "
                                        r"train_state.pth\): train.py swaps in only finished folders, .*; give a "
                                        r"whole one"):
        read_checkpoint(folder)
    single_save(tmp_path / "good.dcp", 1.0, 1)
    (tmp_path / "good.dcp" / "__0_0.distcp").write_bytes(b"cut")  # a shard cut short
    with pytest.raises(UserError, match=r"^checkpoint .*good.dcp cannot be read \(.*\); it is damaged or truncated$"):
        read_checkpoint(tmp_path / "good.dcp")


def test_a_file_named_dcp_is_read_as_a_file(tmp_path):
    """Only a folder is a sharded checkpoint: a .pth file renamed *.dcp loads as one, and a file that is not a
    checkpoint is named as such (both were 'does not exist')."""
    save_atomic({"model": {"w": torch.arange(3.0)}}, tmp_path / "model.dcp")
    assert torch.equal(read_checkpoint(tmp_path / "model.dcp")["model"]["w"], torch.arange(3.0))
    (tmp_path / "notes.dcp").write_text("my notes\n")
    with pytest.raises(UserError, match=r"^checkpoint .*notes.dcp is not a checkpoint: torch.save files start"):
        read_checkpoint(tmp_path / "notes.dcp")
    with pytest.raises(UserError, match=r"^checkpoint .*gone.dcp does not exist; check the path$"):
        read_checkpoint(tmp_path / "gone.dcp")


def test_resume_of_a_run_whose_last_dcp_is_not_whole_names_it_and_the_way_out(tmp_path):
    from engine.checkpoint.resume import Resume, decide_resume

    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "last.dcp").mkdir()  # e.g. made by hand, or copied without its files
    with pytest.raises(UserError) as caught:
        Resume.open(decide_resume("auto", tmp_path), auto=True)
    assert str(caught.value) == (f"checkpoint {tmp_path}/last.dcp is not a whole sharded checkpoint (no .metadata, "
                                 "train_state.pth): train.py swaps in only finished folders, so it was cut short or "
                                 "made by something else; give a whole one (a last.dcp or .pth file train.py wrote); "
                                 "no other readable checkpoint (last.pth, last.dcp, best.pth, epoch_NNNN.pth) is left "
                                 "to continue from: choose another output_dir to start over")


def test_epoch_files_with_sharded_checkpoints_are_refused_in_one_line():
    from core.config_load import load_config

    with pytest.raises(UserError, match=r"^config key 'train.keep_last_k' is 2, but with train.ckpt_format=sharded "
                                        r"only last.dcp is kept .*; set train.keep_last_k=0, or "
                                        r"train.ckpt_format=file$"):
        load_config(None, ["train.ckpt_format=sharded", "train.keep_last_k=2"])


def test_resume_auto_takes_the_newer_of_last_pth_and_last_dcp(tmp_path):
    """A run that switched train.ckpt_format leaves both kinds: resume=auto continues the one written last."""
    from engine.checkpoint.resume import decide_resume

    save_atomic({"global_step": 3}, tmp_path / "last.pth")
    single_save(tmp_path / "last.dcp", 1.0, 5)
    os.utime(tmp_path / "last.pth", (1, 1))
    assert decide_resume("auto", tmp_path) == str(tmp_path / "last.dcp")
    os.utime(tmp_path / "last.pth")  # now
    os.utime(tmp_path / "last.dcp" / "train_state.pth", (1, 1))
    assert decide_resume("auto", tmp_path) == str(tmp_path / "last.pth")


@pytest.mark.parametrize("damaged", ["last.dcp", "last.pth"])
def test_a_damaged_newer_last_checkpoint_names_the_older_one_and_best_pth(damaged, tmp_path):
    """Both last.pth and last.dcp (a switched train.ckpt_format), the newer one damaged: the way out is the older
    one and best.pth, newest first (it was 'no readable epoch_NNNN.pth is left ...: start over')."""
    from engine.checkpoint.resume import Resume, decide_resume

    save_atomic({"global_step": 3}, tmp_path / "last.pth")
    save_atomic({"global_step": 2}, tmp_path / "best.pth")
    single_save(tmp_path / "last.dcp", 1.0, 5)
    older = "last.pth" if damaged == "last.dcp" else "last.dcp"
    os.utime(tmp_path / "last.dcp" / "train_state.pth" if older == "last.dcp" else tmp_path / "last.pth", (1, 1))
    if damaged == "last.dcp":
        (tmp_path / "last.dcp" / "__0_0.distcp").write_bytes(b"cut")
    else:
        (tmp_path / "last.pth").write_bytes((tmp_path / "last.pth").read_bytes()[:100])
    with pytest.raises(UserError) as caught:
        Resume.open(decide_resume("auto", tmp_path), auto=True)
    steps = {"last.pth": 3, "last.dcp": 5}
    assert str(caught.value).startswith(f"checkpoint {tmp_path}/{damaged} cannot be read")
    assert str(caught.value).endswith(
        f"; to continue from another checkpoint of this run: resume={tmp_path}/{older} (global step {steps[older]}), "
        f"resume={tmp_path}/best.pth (global step 2); or choose another output_dir to start over")


def test_an_index_that_would_run_code_is_refused_and_the_code_does_not_run(tmp_path):
    folder, marker = tmp_path / "last.dcp", tmp_path / "ran"
    single_save(folder, 1.0, 1)

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(AttributeError):  # DCP's own reader runs the payload (then trips over its result)
        FileSystemReader(folder).read_metadata()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UserError, match=r"^checkpoint .*last.dcp was refused: its .metadata holds objects that are "
                                        r"not plain data .*pathlib.*; only load files you trust$"):
        read_checkpoint(folder)
    assert not marker.exists()


def test_an_index_pointing_outside_its_folder_is_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    folder = tmp_path / "last.dcp"
    single_save(folder, 1.0, 1)
    metadata = formats.read_metadata(folder)
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../../secret.bin", info.offset, info.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=r"its .metadata points at files that are not its own shards "
                                        r"\(../../secret.bin\); only load files you trust$"):
        read_checkpoint(folder)


SAVING = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[2])
    from engine.checkpoint import sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 4M parameters: 48 MB with AdamW's state
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    for step in range(1, 1000):  # save after save, each with every weight = step
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        sharded.save(Path(sys.argv[1]), model, optimizer, {"epoch": 0, "global_step": step, "rng": []})
        print(step, flush=True)
""")


@pytest.mark.slow
def test_a_rank_killed_while_writing_its_shards_leaves_the_previous_folder_whole(tmp_path):
    """2 FSDP ranks save in a loop; rank 1 is SIGKILLed once its shard file of a new save exists in the temp folder."""
    from engine.checkpoint.resume import decide_resume

    folder, port = tmp_path / "last.dcp", free_port()
    (tmp_path / ".last.dcp.keep").mkdir()  # a user's folder with a similar name: never ours
    procs = [subprocess.Popen([sys.executable, "-c", SAVING, str(folder), str(REPO)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env=script_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank in range(2)]
    try:
        assert procs[0].stdout.readline().strip() == "1"  # the first folder is in place
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".last.dcp.*.tmp/__1_*.distcp")):  # rank 1 is writing a later save's shards
            assert procs[1].poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
        procs[1].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=300)  # its collective fails: it must stop without swapping in the cut-short folder
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode != 0
    left = [p.name for p in tmp_path.glob(".last.dcp.*.tmp")]
    assert left, "the kill should leave the temp folder it cut short"
    assert decide_resume("auto", tmp_path) == str(folder)  # resume=auto picks the previous folder, not the temp
    kept = read_checkpoint(folder)
    step = kept["global_step"]
    print(f"killed during the save after global step {step}; left behind: {left}")
    assert step >= 1 and all(bool((t == step).all()) for t in kept["model"].values())  # one whole save, not a mix
    model, optimizer = build_wide()
    sharded.load(folder, model, optimizer, kept["optimizer_rest"])  # resumes on 1 process
    assert all(bool((p == step).all()) for p in model.parameters())
    sharded.save(folder, model, optimizer, {"epoch": 0, "global_step": step + 1, "rng": []})
    assert not list(tmp_path.glob(".last.dcp.*.tmp")) and (tmp_path / ".last.dcp.keep").is_dir()
    assert read_checkpoint(folder)["global_step"] == step + 1


def build_wide() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The killed test's model, unsharded, in one process."""
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters())


def test_a_save_killed_between_its_two_renames_is_put_back(tmp_path):
    """The state a kill between "old aside" and "new in" leaves (made here by hand): resume=auto reads the folder
    set aside, and the next save puts it back before replacing it."""
    from engine.checkpoint.resume import decide_resume

    folder = tmp_path / "last.dcp"
    single_save(folder, 2.0, 7)
    aside = tmp_path / f".last.dcp.{os.getpid()}.0a1b2c3d.old"
    os.rename(folder, aside)
    assert decide_resume("auto", tmp_path) == str(aside) and not folder.exists()  # reading renames nothing
    assert read_checkpoint(aside)["global_step"] == 7
    single_save(folder, 3.0, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"] and read_checkpoint(folder)["global_step"] == 8


def test_a_model_with_nan_is_not_saved_and_the_message_says_what_is_on_disk(tmp_path):
    from core.dist import DistInfo
    from engine.checkpoint.saver import Checkpointer
    from engine.state import TrainState

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model,
                                optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
                                scaler=None, config={}, class_names=["a", "b"], sharded=True)
    model[1].running_mean.fill_(float("nan"))
    with pytest.raises(UserError, match=r"inf/NaN values \(1.running_mean\) at global step 2; no checkpoint was "
                                        r"written"):
        checkpointer.save(TrainState(global_step=2))
    assert not list(tmp_path.iterdir())
    model[1].running_mean.fill_(0.0)
    checkpointer.save(TrainState(global_step=3))
    model[1].running_mean.fill_(float("nan"))
    with pytest.raises(UserError, match=f"{tmp_path}/last.dcp keeps the last good state \\(global step 3\\)"):
        checkpointer.save(TrainState(global_step=4))
    assert read_checkpoint(tmp_path / "last.dcp")["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"]


def broken_entry_size(metadata):
    """The first entry's size as a list (DCP's is a torch.Size)."""
    entry = next(iter(metadata.state_dict_metadata.values()))
    entry.size = list(entry.size)
    return metadata


def broken_shard_offset(metadata):
    """Every shard's byte offset as a string."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo(info.relative_path, str(info.offset), info.length)
    return metadata


WRONG_FIELDS = {  # a real index with one field of another type: what DCP would meet with an AttributeError or worse
    "entries as a list": (lambda m: dataclasses.replace(m, state_dict_metadata=list(m.state_dict_metadata.items())),
                          "state_dict_metadata is a list, not a mapping of names"),
    "shard places as a list": (lambda m: dataclasses.replace(m, storage_data=list(m.storage_data.values())),
                               "storage_data is a list, not a mapping"),
    "a size as a list": (broken_entry_size, "the entry model.conv1.0.weight is not a tensor's size, dtype and chunks"),
    "a shard offset as a string": (broken_shard_offset, "storage_data holds MetadataIndex: _StorageInfo, not a "
                                                        "shard's place"),
}


@pytest.mark.parametrize("name", WRONG_FIELDS)
def test_an_index_with_fields_of_the_wrong_type_is_one_line(name, tiny_sharded_run, tmp_path, capsys):
    """Issue 41 item 7: a list where a mapping belongs was an AttributeError from evaluate.py and from resume."""
    import evaluate
    import train
    from core.cli import report_errors
    from tests.helpers import TINY

    run = Path(shutil.copytree(tiny_sharded_run, tmp_path / "run"))
    folder = run / "last.dcp"
    breaking, wrong = WRONG_FIELDS[name]
    (folder / ".metadata").write_bytes(pickle.dumps(breaking(formats.read_metadata(folder))))
    expected = f"checkpoint {folder} cannot be read (.metadata: {wrong}); it is damaged or not a checkpoint"
    with pytest.raises(UserError) as caught:
        read_checkpoint(folder)
    assert str(caught.value) == expected
    if name != "entries as a list":  # the entry points, once: they share the reader
        return
    assert report_errors(evaluate.main, [str(folder), "--output-dir", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"error: {expected}", err
    assert report_errors(train.main, [*TINY, "train.ckpt_format=sharded", "train.epochs=2", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"error: {expected}; "), err
