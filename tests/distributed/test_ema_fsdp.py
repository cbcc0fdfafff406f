"""--store-ema under FSDP2 on 2 real processes (gloo, CPU): each rank holds and updates only its shards of the
EMA (half of every weight), the gathered EMA equals one process's unsharded EMA, and the shards round-trip
through a sharded (DCP) checkpoint's extra groups.

Exactness: the EMA update is element-wise (ema * decay + weight * (1 - decay)), so a shard's values are
computed by the same fp32 operations as the same elements of the whole tensor: bitwise equal."""

import gc
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from fairseq.runtime.env import get_free_port
from tests.train_fixtures import spawn_ranks

WORLD = 2
STEPS = 3
DECAY = 0.6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def perturb_(model, step):
    """A deterministic 'update' of every weight, the same on every rank and in the unsharded copy."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(0.9).add_(0.01 * (step + 1) * (len(name) % 5 + 1))


def run(rank, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fairseq.checkpoint import sharded
    from fairseq.models.ema import EMA
    from fairseq.dataclass.configs import EMAConfig

    result = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,))
        cfg = EMAConfig(store_ema=True, ema_decay=DECAY)
        torch.manual_seed(0)
        plain = Net()
        model = Net()
        model.load_state_dict(plain.state_dict())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ema, ema_plain = EMA(model, cfg), EMA(plain, cfg)
        for step in range(STEPS):
            perturb_(model, step)
            perturb_(plain, step)
            ema.step(model, step + 1)
            ema_plain.step(plain, step + 1)
        shards = ema.state_dict()["ema"]
        result["local_numel"] = {k: v.to_local().numel() for k, v in shards.items()}
        result["full_numel"] = {k: v.numel() for k, v in shards.items()}
        full = ema.full_state_dict()["ema"]
        result["max_diff"] = max((full[k] - ema_plain.get_model().state_dict()[k]).abs().max().item() for k in full)

        path = os.path.join(out_dir, "ckpt")
        write = sharded.sharded_write(path, {"model": model.state_dict(), **ema.state_dict()}, {"cfg": {}})
        write.bytes()
        write.publish()
        fresh = EMA(model, cfg)  # starts from the (perturbed) weights: different from the saved EMA
        loaded = sharded.load_sharded(path, model.state_dict(), extra_shards=fresh.state_dict())
        fresh.load_checkpoint_state(loaded["extra_state"], loaded["model"])
        again = fresh.full_state_dict()["ema"]
        result["roundtrip_diff"] = max((again[k] - full[k]).abs().max().item() for k in full)
    except Exception:  # reported by the test
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        # both ranks leave together: a rank that tore gloo down while its peer still used the connection once
        # aborted the other ("terminate called without an active exception", SIGABRT) in CI
        dist.barrier()
        gc.collect()  # cycles holding the group go before it (as the launcher does)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ema_fsdp")
    spawn_ranks(run, WORLD, get_free_port(), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_each_rank_holds_half_of_every_ema_weight(results):
    for r in results:
        assert "error" not in r, r.get("error")
        for key, full in r["full_numel"].items():
            assert r["local_numel"][key] == full // WORLD, key  # every dim 0 here is even


def test_gathered_ema_equals_the_unsharded_ema_and_round_trips(results):
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["max_diff"] == 0.0
        assert r["roundtrip_diff"] == 0.0
