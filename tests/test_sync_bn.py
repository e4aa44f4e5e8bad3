"""AllReduceBatchNorm over real multi-process gloo groups equals BatchNorm over the global batch."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import run_ranks
from models.sync_bn import (
    AllReduceBatchNorm,
    AllReduceBatchNormAct,
    convert_sync_batchnorm,
    convert_to_allreduce_bn,
)

# Differences against the reference come only from float32 reduction order (per-rank moments
# combined across ranks), so 1e-5 is tight enough to catch any wrong formula. bf16 inputs are
# compared against the float32 reference with bf16 resolution.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
STEPS = 2  # two steps, so running stats (and momentum=None averaging) are checked past the first


@dataclass(frozen=True)
class Scenario:
    name: str
    world: int
    shape: tuple[int, ...]  # global batch shape; dim 0 is split into `splits` across ranks
    splits: tuple[int, ...]
    momentum: float | None = 0.1
    channels_last: bool = False
    ddp: bool = False  # wrap in DDP: parameter grads are then averaged over ranks
    dtype: torch.dtype = torch.float32
    affine: bool = True


SCENARIOS = (
    Scenario("even_2d", 2, (12, 4, 5, 5), (6, 6)),
    Scenario("uneven_1d_cumulative", 2, (12, 4, 7), (9, 3), momentum=None),
    Scenario("ddp_2d", 2, (12, 4, 5, 5), (7, 5), ddp=True),
    Scenario("bf16_2d", 2, (12, 4, 5, 5), (6, 6), dtype=torch.bfloat16),
    Scenario("uneven_channels_last", 3, (12, 4, 5, 5), (5, 4, 3), channels_last=True),
    Scenario("uneven_cumulative_no_affine", 3, (12, 4, 5, 5), (2, 4, 6), momentum=None, affine=False),
)


def _inputs(sc: Scenario) -> dict[str, Tensor]:
    """Deterministic global batches, loss weights and affine params, identical in every process."""
    gen = torch.Generator().manual_seed(1234)
    channels = sc.shape[1]
    return {
        "x": torch.randn((STEPS, *sc.shape), generator=gen) * 2.0 + 3.0,
        "loss_w": torch.randn((STEPS, *sc.shape), generator=gen),
        "weight": torch.rand(channels, generator=gen) + 0.5,
        "bias": torch.randn(channels, generator=gen),
    }


def _init_bn(bn: _BatchNorm, data: dict[str, Tensor]) -> None:
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(data["weight"])
            bn.bias.copy_(data["bias"])


def _prepare(x: Tensor, sc: Scenario) -> Tensor:
    x = x.to(sc.dtype)
    if sc.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def _run(bn: nn.Module, sc: Scenario, data: dict[str, Tensor], rows: slice) -> dict[str, Tensor]:
    """Forward + backward of a loss depending on every output, for STEPS batches."""
    ys, grads = [], []
    for step in range(STEPS):
        x = _prepare(data["x"][step, rows], sc)
        y = bn(x)
        (y.float() * data["loss_w"][step, rows]).sum().backward()
        assert y.dtype == sc.dtype and x.grad is not None and x.grad.dtype == sc.dtype
        if sc.channels_last:
            assert y.is_contiguous(memory_format=torch.channels_last)
        ys.append(y.detach().float())
        grads.append(x.grad.float())
    module = bn.module if isinstance(bn, DistributedDataParallel) else bn
    out = {"y": torch.stack(ys), "grad_x": torch.stack(grads)}
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        out[key] = getattr(module, key).clone()
    if sc.affine:
        out["grad_weight"] = module.weight.grad.clone()
        out["grad_bias"] = module.bias.grad.clone()
    return out


def _rank_result(sc: Scenario, rank: int) -> dict[str, Tensor]:
    """This rank's results for its slice of the global batch."""
    data = _inputs(sc)
    bn: nn.Module = AllReduceBatchNorm(sc.shape[1], momentum=sc.momentum, affine=sc.affine)
    _init_bn(bn, data)
    if sc.ddp:
        bn = DistributedDataParallel(bn)
    start = sum(sc.splits[:rank])
    return _run(bn, sc, data, slice(start, start + sc.splits[rank]))


def _all_scenarios(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    """This rank's results for every scenario and stability case of this world size (one spawn per world size)."""
    results = {sc.name: _rank_result(sc, rank) for sc in SCENARIOS if sc.world == world}
    for name, (y, grad_x) in _stable_cases(rank, world).items():
        results[f"stable-{world}-{name}"] = {"y": y, "grad_x": grad_x}
    return results


# Stability: a channel whose mean is large next to its std (mean/std 14 occurs in a trained ResNet-18) must come
# out as accurate as fp32 nn.BatchNorm on the same data; E[x^2]-E[x]^2 in float32 loses it from mean/std ~30.
RATIOS = (0.0, 30.0, 300.0, 1000.0, 3000.0)
STABLE_SPLITS = {2: (3, 7), 3: (5, 1, 4)}  # uneven per-rank batches; the global batch is 10
STABLE_SHAPES = {"2d": (4, 5, 5), "3d": (3, 3, 4, 2)}  # per-sample (C, *spatial) for BatchNorm2d / BatchNorm3d


def _stable_inputs(ratio: float, shape: str) -> tuple[Tensor, Tensor]:
    """A global fp32 batch with per-channel mean = ratio x std, and loss weights, identical in every process."""
    gen = torch.Generator().manual_seed(int(ratio) + len(shape))
    dims = STABLE_SHAPES[shape]
    std = torch.rand(dims[0], generator=gen) + 0.5
    channel = (1, -1, *[1] * (len(dims) - 1))
    x = torch.randn((10, *dims), generator=gen) * std.view(channel) + (ratio * std).view(channel)
    return x, torch.randn((10, *dims), generator=gen)


def _bn_output_and_grad(bn: nn.Module, x: Tensor, loss_w: Tensor) -> tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * loss_w).sum().backward()
    return y.detach(), x.grad


def _stable_cases(rank: int, world: int) -> dict[str, tuple[Tensor, Tensor]]:
    """This rank's output and input grad for its uneven slice of every (ratio, shape) case."""
    splits = STABLE_SPLITS[world]
    rows = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
    out = {}
    for shape in STABLE_SHAPES:
        for ratio in RATIOS:
            x, loss_w = _stable_inputs(ratio, shape)
            bn = AllReduceBatchNorm(x.shape[1])
            out[f"{shape}-{ratio:g}"] = _bn_output_and_grad(bn, x[rows], loss_w[rows])
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Tensor]]]:
    """Run every scenario once per world size in real gloo process groups; collect each rank's results."""
    out_dir = tmp_path_factory.mktemp("sync_bn")
    results: dict[str, list[dict[str, Tensor]]] = {}
    for world in sorted({sc.world for sc in SCENARIOS} | set(STABLE_SPLITS)):
        for per_rank in run_ranks(_all_scenarios, world, out_dir):
            for name, result in per_rank.items():
                results.setdefault(name, []).append(result)
    return results


def _reference(sc: Scenario) -> dict[str, Tensor]:
    """Plain torch BatchNorm on the whole concatenated batch, in float32."""
    data = _inputs(sc)
    bn_cls = nn.BatchNorm1d if len(sc.shape) == 3 else nn.BatchNorm2d
    bn = bn_cls(sc.shape[1], momentum=sc.momentum, affine=sc.affine)
    _init_bn(bn, data)
    return _run(bn, Scenario("ref", 1, sc.shape, sc.splits, sc.momentum, affine=sc.affine), data, slice(None))


@pytest.mark.slow
@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: f"world{sc.world}-{sc.name}")
def test_matches_global_batchnorm(sc: Scenario, rank_results: dict[str, list[dict[str, Tensor]]]) -> None:
    ranks = rank_results[sc.name]
    ref = _reference(sc)
    tol = {"rtol": TOL[sc.dtype], "atol": TOL[sc.dtype]}
    for key in ("y", "grad_x"):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks], dim=1), ref[key], **tol)
    for r in ranks:
        torch.testing.assert_close(r["running_mean"], ref["running_mean"], **tol)
        torch.testing.assert_close(r["running_var"], ref["running_var"], **tol)
        assert r["num_batches_tracked"].item() == STEPS
    if sc.affine:
        for key in ("grad_weight", "grad_bias"):
            if sc.ddp:  # DDP averaged the local grads: mean over ranks == global grad / world
                for r in ranks:
                    torch.testing.assert_close(r[key] * sc.world, ref[key], **tol)
            else:  # the loss is a sum over ranks, so the global grad is the sum of local grads
                torch.testing.assert_close(sum(r[key] for r in ranks), ref[key], **tol)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(STABLE_SPLITS))
def test_large_mean_channels_as_accurate_as_fp32_batchnorm(
    world: int, rank_results: dict[str, list[dict[str, Tensor]]]
) -> None:
    """Against float64 BatchNorm over the concatenated batch, within 10x of fp32 nn.BatchNorm's own error."""
    worse = []
    for shape in STABLE_SHAPES:
        bn_cls = nn.BatchNorm2d if shape == "2d" else nn.BatchNorm3d
        for ratio in RATIOS:
            x, loss_w = _stable_inputs(ratio, shape)
            exact = _bn_output_and_grad(bn_cls(x.shape[1]).double(), x.double(), loss_w.double())
            fp32 = _bn_output_and_grad(bn_cls(x.shape[1]), x, loss_w)
            ranks = rank_results[f"stable-{world}-{shape}-{ratio:g}"]
            for i, key in enumerate(("y", "grad_x")):
                ours = torch.cat([r[key] for r in ranks]).double()
                err, fp32_err = (ours - exact[i]).abs().max().item(), (fp32[i].double() - exact[i]).abs().max().item()
                if err > 10 * fp32_err:
                    worse.append(f"{shape} mean/std {ratio:g} {key}: {err:.2g} vs fp32 BatchNorm {fp32_err:.2g}")
    assert not worse, "; ".join(worse)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_single_process_equals_batchnorm_exactly(momentum: float | None) -> None:
    assert not dist.is_initialized()
    sc = Scenario("single", 1, (6, 3, 4, 4), (6,), momentum=momentum)
    data = _inputs(sc)
    results = []
    for bn in (AllReduceBatchNorm(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)):
        _init_bn(bn, data)
        results.append(_run(bn, sc, data, slice(None)))
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


def test_timm_model_conversion_keeps_acts_and_outputs() -> None:
    import timm  # imported here so the spawned ranks, which import this file, skip its ~2 s import
    from timm.layers import BatchNormAct2d

    model = timm.create_model("mobilenetv3_small_050", num_classes=3)
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, _BatchNorm):  # non-trivial stats so a dropped buffer would show
            module.running_mean.copy_(torch.randn(module.num_features, generator=gen) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=gen) + 0.5)
    acts = {name: (m.act, m.drop) for name, m in model.named_modules() if isinstance(m, BatchNormAct2d)}
    assert acts and {type(act) for act, _ in acts.values()} > {nn.Identity}
    x = torch.randn(2, 3, 64, 64, generator=gen)
    train_model = copy.deepcopy(model).train()
    train_converted = convert_to_allreduce_bn(copy.deepcopy(train_model))
    model.eval()
    with torch.no_grad():
        expected_eval = model(x)
        expected_train = train_model(x)
    converted = convert_to_allreduce_bn(model)

    bns = {name: m for name, m in converted.named_modules() if isinstance(m, _BatchNorm)}
    assert all(isinstance(m, AllReduceBatchNorm) for m in bns.values())
    assert {name for name, m in bns.items() if isinstance(m, AllReduceBatchNormAct)} == set(acts)
    for name, (act, drop) in acts.items():
        assert bns[name].act is act and bns[name].drop is drop and not bns[name].training
    assert all(m.training for m in train_converted.modules() if isinstance(m, _BatchNorm))
    with torch.no_grad():
        torch.testing.assert_close(converted(x), expected_eval, rtol=0, atol=0)
        torch.testing.assert_close(train_converted(x), expected_train, rtol=0, atol=0)


def test_conversion_replaces_root_and_copies_state() -> None:
    bn = nn.BatchNorm1d(5, eps=1e-3, momentum=None, affine=True).eval()
    bn.num_batches_tracked.fill_(7)
    converted = convert_sync_batchnorm(bn, torch.device("cpu"))
    assert type(converted) is AllReduceBatchNorm
    assert (converted.eps, converted.momentum, converted.affine, converted.track_running_stats) == (
        1e-3, None, True, True,
    )
    assert converted.weight is bn.weight and converted.bias is bn.bias
    assert converted.running_mean is bn.running_mean and converted.running_var is bn.running_var
    assert converted.num_batches_tracked.item() == 7 and not converted.training
    seq = convert_to_allreduce_bn(nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, affine=False)))
    assert type(seq[1]) is AllReduceBatchNorm and seq[1].weight is None
