"""fairseq.checkpoint.staging on the CPU: host copies that training cannot change, buffers kept across saves and
re-allocated only when a shape changes, tied weights staged once, plain values copied, and (2 gloo processes,
FSDP2) a single-file stage gathered to rank 0 equal to torch's full state dict, a sharded stage of DTensors whose
shards live in host memory. The CUDA parts (pinned buffers, the side stream, the optimizer step that waits for
the copies) are in tests/gpu/test_checkpoint_staging_gpu.py."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist

from fairseq.checkpoint.staging import HostStaging
from fairseq.runtime.env import get_free_port
from tests.train_fixtures import spawn_ranks


def trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer)
    return model, optimizer


def step(model, optimizer):
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()


def state_of(model, optimizer):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": [1, {"i": 2}]}


def test_kept_buffers_are_reused_follow_no_update_and_are_reallocated_when_a_shape_changes():
    model, optimizer = trained()
    staging = HostStaging(keep=True, pin=True)  # pin is ignored without CUDA
    first = staging.stage(state_of(model, optimizer), gather=True)
    weight = model.weight.detach().clone()
    host = first.state["model"]["weight"]
    assert torch.equal(host, weight) and host.data_ptr() != model.weight.data_ptr()
    assert first.times.allocate > 0 and first.ready is None and first.copy_seconds() is None
    buffers = host.data_ptr(), first.state["optimizer"]["state"][0]["exp_avg"].data_ptr()
    bias = first.state["model"]["bias"].data_ptr()
    step(model, optimizer)  # training goes on: the staged copy keeps the state it was taken from
    assert torch.equal(host, weight) and first.state["optimizer"]["state"][0]["step"].item() == 1
    second = staging.stage(state_of(model, optimizer), gather=True)
    assert (
        second.state["model"]["weight"].data_ptr(),
        second.state["optimizer"]["state"][0]["exp_avg"].data_ptr(),
    ) == buffers
    assert second.times.allocate == 0  # nothing allocated for the same shapes
    assert torch.equal(second.state["model"]["weight"], model.weight) and second.state["epoch"] == [1, {"i": 2}]
    assert second.state["optimizer"]["state"][0]["step"].item() == 2
    grown = {"model": {"weight": torch.zeros(5, 8), "bias": model.bias.detach()}}
    third = staging.stage(grown, gather=True)
    assert (
        third.state["model"]["weight"].shape == (5, 8)
        and torch.equal(third.state["model"]["weight"], grown["model"]["weight"])
        and third.times.allocate > 0
    )
    assert third.state["model"]["bias"].data_ptr() == bias  # same place, same shape: the same buffer
    staging.close()


def test_one_off_buffers_copy_only_what_is_not_already_in_host_memory_and_keep_nothing():
    model, optimizer = trained()
    staging = HostStaging(keep=False, pin=False)
    staged = staging.stage(state_of(model, optimizer), gather=True)
    assert staged.state["model"]["weight"].data_ptr() == model.weight.data_ptr()  # written before training goes on
    assert staged.state["optimizer"]["param_groups"] is not optimizer.state_dict()["param_groups"]
    assert not staging._buffers


def test_tied_weights_are_staged_once_and_plain_values_are_copies():
    shared = torch.arange(6.0).view(2, 3)
    groups = [{"lr": 0.1, "betas": (0.9, 0.98), "params": ["a", "b"]}]
    state = {"model": {"embed": shared, "output": shared.detach()}, "groups": groups}
    staged = HostStaging(keep=True, pin=False).stage(state, gather=False).state
    assert staged["model"]["embed"] is staged["model"]["output"]  # one buffer for the tied weight
    assert staged["groups"] == groups and staged["groups"][0] is not groups[0]
    groups[0]["lr"] = 0.5  # the scheduler changes its group after the save: the staged copy does not follow
    assert staged["groups"][0]["lr"] == 0.1 and staged["groups"][0]["betas"] == (0.9, 0.98)


def test_staged_buffers_save_and_load_like_ordinary_tensors(tmp_path):
    model, optimizer = trained()
    staged = HostStaging(keep=True, pin=False).stage(state_of(model, optimizer), gather=True).state
    torch.save(staged, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(loaded["model"]["weight"], model.weight) and loaded["epoch"] == [1, {"i": 2}]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg_sq"], optimizer.state[model.weight]["exp_avg_sq"])


# ----------------------------------------------------------------------------- FSDP2, 2 gloo processes

WORLD = 2


def run(rank, port, out_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    result = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5))  # 7 rows: uneven shards
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(3, 6)).sum().backward()
        optimizer.step()
        sharded_model, sharded_optim = get_state_dict(model, optimizer)
        staging = HostStaging(keep=True, pin=False)
        single = staging.stage({"model": sharded_model, "optim": sharded_optim}, gather=True).state
        full_model, full_optim = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save(
                {"staged": single, "torch": {"model": full_model, "optim": full_optim}},
                os.path.join(out_dir, "single.pt"),
            )
        else:
            result["single_on_other_rank"] = single
        shards = HostStaging(keep=True, pin=False).stage({"model": sharded_model}, gather=False).state["model"]
        weight = shards["0.weight"]
        result["sharded"] = (
            isinstance(weight, DTensor),
            weight.placements == sharded_model["0.weight"].placements,
            torch.equal(weight.to_local(), sharded_model["0.weight"].to_local()),
            weight.to_local().data_ptr() != sharded_model["0.weight"].to_local().data_ptr(),
            tuple(weight.shape),
        )
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("staging_fsdp")
    spawn_ranks(run, WORLD, get_free_port(), str(out))
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in results:
        assert "error" not in r, r.get("error")
    return results, torch.load(out / "single.pt", weights_only=False)


def assert_equal_nested(a, b, where=""):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_equal_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_single_file_stage_is_torchs_full_state_dict_on_rank_0_and_nothing_elsewhere(fsdp_results):
    results, single = fsdp_results
    assert_equal_nested(single["staged"], single["torch"])
    assert single["staged"]["model"]["0.weight"].shape == (7, 6)
    assert results[1]["single_on_other_rank"] is None


def test_a_sharded_stage_keeps_dtensors_whose_shards_are_host_copies(fsdp_results):
    results, _ = fsdp_results
    for r in results:
        assert r["sharded"] == (True, True, True, True, (7, 6))
