"""fairseq.checkpoint.staging on CUDA: pinned buffers allocated once and reused, device-to-host copies on a side
stream that `stage` only queues (the host is not blocked), the next optimizer step held back until they are done
(the staged values are those before the step, exactly), a one-rank FSDP2 state staged for a single file without a
second copy on the GPU, and fairseq-train's single-file and sharded asynchronous checkpoints close to synchronous
ones."""

import os
import subprocess
import sys

import pytest
import torch

from fairseq.checkpoint.staging import HostStaging

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20


def big_model(rows=4096, cols=8192):  # 128 MiB of fp32 weights: copies that take milliseconds
    torch.manual_seed(0)
    model = torch.nn.Linear(cols, rows, bias=False).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, cols, device="cuda")).sum().backward()
    optimizer.step()
    return model, optimizer


def test_pinned_buffers_are_reused_and_stage_only_queues_the_copies():
    model, optimizer = big_model()
    staging = HostStaging(keep=True, pin=True)
    first = staging.stage({"model": model.state_dict(), "optim": optimizer.state_dict()}, gather=True)
    first.wait()
    host = first.state["model"]["weight"]
    assert host.is_pinned() and not host.is_cuda and torch.equal(host, model.weight.detach().cpu())
    torch.cuda.synchronize()
    second = staging.stage({"model": model.state_dict(), "optim": optimizer.state_dict()}, gather=True)
    queued = not second.ready.query()  # 384 MiB at PCIe speed: still copying when stage returns
    second.wait()
    assert queued and second.times.allocate == 0
    assert second.state["model"]["weight"].data_ptr() == host.data_ptr()
    assert 0 < second.copy_seconds() < 5
    staging.close()


def test_the_next_optimizer_step_waits_for_the_copies_and_the_staged_values_are_those_before_it():
    model, optimizer = big_model()
    model(torch.randn(2, 8192, device="cuda")).sum().backward()
    before = {"weight": model.weight.detach().clone(), "exp_avg": optimizer.state[model.weight]["exp_avg"].clone()}
    staging = HostStaging(keep=True, pin=True)
    staged = staging.stage({"model": model.state_dict(), "optim": optimizer.state_dict()}, gather=True)
    staged.hold_back(optimizer)
    optimizer.step()  # queued right behind the copies: without the hold-back it would race them
    staged.wait()
    assert torch.equal(staged.state["model"]["weight"], before["weight"].cpu())
    assert torch.equal(staged.state["optim"]["state"][0]["exp_avg"], before["exp_avg"].cpu())
    assert not torch.equal(model.weight.detach().cpu(), before["weight"].cpu())  # the step did happen
    assert not optimizer._optimizer_step_pre_hooks  # the hook removed itself
    staging.close()


def test_a_one_rank_fsdp_state_is_staged_for_a_single_file_without_a_second_copy_on_the_gpu(tmp_path):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fairseq.runtime.env import get_free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model, optimizer = big_model()
        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
        model(torch.randn(2, 8192, device="cuda")).sum().backward()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        optimizer.step()
        model_state, optim_state = get_state_dict(model, optimizer)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        staged = HostStaging(keep=True, pin=True).stage({"model": model_state, "optim": optim_state}, gather=True)
        staged.wait()
        assert torch.cuda.max_memory_allocated() - base < 8 * MIB  # no gathered copy of the 384 MiB state
        assert staged.times.gather == 0 and staged.state["model"]["weight"].shape == (4096, 8192)
        assert torch.equal(staged.state["model"]["weight"], model.weight.to_local().detach().cpu())
    finally:
        dist.destroy_process_group()


def train(save_dir, *extra):
    cmd = [
        sys.executable,
        "-m",
        "fairseq_cli.train",
        "--task",
        "dummy_lm",
        "--dict-size",
        "1000",
        "--tokens-per-sample",
        "128",
        "--batch-size",
        "4",
        "--arch",
        "transformer_lm_gpt",
        "--decoder-layers",
        "2",
        "--decoder-embed-dim",
        "128",
        "--decoder-ffn-embed-dim",
        "512",
        "--decoder-attention-heads",
        "4",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--disable-validation",
        "--save-dir",
        str(save_dir),
        "--num-workers",
        "0",
        "--max-update",
        "6",
        "--save-interval-updates",
        "2",
        "--seed",
        "3",
        "--ddp-backend",
        "fully_sharded",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("layout", [[], ["--use-sharded-state"]], ids=["single_file", "sharded"])
def test_asynchronous_checkpoints_on_cuda_equal_synchronous_ones(tmp_path, layout):
    from fairseq.checkpoint.inference import read_checkpoint_state

    train(tmp_path / "sync", *layout)
    log = train(tmp_path / "async", *layout, "--write-checkpoints-asynchronously")
    assert "in the background; training was blocked" in log and "device-to-host copy" in log
    for name in ("checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"):
        suffix = "" if layout else ".pt"
        a = read_checkpoint_state(str(tmp_path / "sync" / (name + suffix)))["model"]
        b = read_checkpoint_state(str(tmp_path / "async" / (name + suffix)))["model"]
        # Two GPU runs need not be bitwise equal (atomics in the embedding's backward): close, where a copy that
        # raced an optimizer step or read an unwritten buffer would be off by a whole update (lr 1e-3) or more.
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a), name
