"""fairseq.models.ema.EMA (--store-ema) against upstream's documented behaviour: the decay rule, start update,
update frequency, the fp32 copy, seeding, reverse, the checkpoint state; and, on a one-rank FSDP2 model, an
EMA held as DTensors sharded like the parameters that equals the unsharded one."""

import copy
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch.distributed.tensor import DTensor

from fairseq.models.ema import EMA


@dataclass
class EMAConfig:  # the fields upstream's EMA reads (a plain object, as upstream's own tests pass)
    ema_decay: float = 0.99
    ema_start_update: int = 0
    ema_fp32: bool = False
    ema_seed_model: Optional[str] = None
    ema_update_freq: int = 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.layer(x))


def sgd_step(model, seed=0):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 8).to(next(model.parameters()).dtype)).float().square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def expected(prev, new, decay):
    return {k: decay * prev[k] + (1 - decay) * new[k] for k in new}


def assert_state_close(a, b, rtol=1e-6, atol=1e-7):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=rtol, atol=atol), k


def test_step_follows_the_decay_rule_and_reverse_loads_it():
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    ema = EMA(model, EMAConfig())
    assert ema.get_model() is ema.model and ema.get_decay() == 0.99 and len(ema.fp32_params) == 0
    sgd_step(model)
    ema.step(model)
    assert_state_close(ema.get_model().state_dict(), expected(before, model.state_dict(), 0.99))
    assert all(not p.requires_grad for p in ema.get_model().parameters())
    target = ema.reverse(Net())
    assert_state_close(target.state_dict(), ema.get_model().state_dict(), rtol=0, atol=0)


def test_start_update_and_update_freq():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, EMAConfig(ema_start_update=2))
    sgd_step(model)
    ema.step(model, updates=1)  # before the start: a copy
    assert ema.get_decay() == 0
    assert_state_close(ema.get_model().state_dict(), model.state_dict(), rtol=0, atol=0)
    prev = copy.deepcopy(ema.get_model().state_dict())
    sgd_step(model, seed=1)
    ema.step(model, updates=2)
    assert ema.get_decay() == 0.99
    assert_state_close(ema.get_model().state_dict(), expected(prev, model.state_dict(), 0.99))

    class Counting(EMA):
        calls = 0

        def _step_internal(self, new_model, updates=None):
            Counting.calls += 1
            super()._step_internal(new_model, updates)

    every3 = Counting(model, EMAConfig(ema_update_freq=3))
    for _ in range(7):
        every3.step(model)
    assert Counting.calls == 2


def test_fp32_copy_averages_in_fp32():
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    before = copy.deepcopy(model.state_dict())
    ema = EMA(model, EMAConfig(ema_fp32=True, ema_decay=0.9))
    assert set(ema.fp32_params) == set(model.state_dict()) and ema.fp32_params["head.bias"].dtype == torch.float32
    sgd_step(model)
    ema.step(model)
    for key, param in model.state_dict().items():
        in_fp32 = 0.9 * before[key].float() + (1 - 0.9) * param.float()
        assert torch.allclose(ema.fp32_params[key], in_fp32, rtol=1e-6, atol=1e-7)  # fp32 arithmetic
        assert torch.equal(ema.get_model().state_dict()[key], ema.fp32_params[key].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="ema_fp32"):
        EMA(model, EMAConfig()).build_fp32_params()


def test_tied_weights_average_once_skip_keys_copy_and_the_copy_runs_its_own_weights():
    torch.manual_seed(0)
    model = Net()
    model.head.weight = torch.nn.Parameter(model.layer.weight[:4, :4].clone())
    tied = torch.nn.Linear(4, 4)
    model.extra = tied
    model.extra2 = torch.nn.Module()
    model.extra2.weight = tied.weight  # one parameter under two names
    model.forward_of_original = model.forward
    model.forward = lambda x: model.head(model.layer(x))  # an instance forward bound to the original (as compile's)
    before = copy.deepcopy(model.state_dict())
    ema = EMA(model, EMAConfig(ema_decay=0.5), skip_keys={"layer.bias"})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.step(model)
    state = ema.get_model().state_dict()
    assert torch.allclose(state["extra.weight"], 0.5 * before["extra.weight"] + 0.5 * model.extra.weight)
    assert torch.equal(state["layer.bias"], model.layer.bias)
    x = torch.randn(2, 8)
    assert "forward" not in ema.get_model().__dict__  # dropped: it would have run the original's weights
    assert not torch.allclose(ema.get_model()(x), model(x))


def test_checkpoint_state_and_resume_rule():
    torch.manual_seed(0)
    model = Net()
    ema = EMA(model, EMAConfig(ema_fp32=True))
    sgd_step(model)
    ema.step(model)
    saved = ema.full_state_dict()
    assert set(saved) == {"ema", "ema_fp32_params"} and all(not t.is_shared() for t in saved["ema"].values())
    resumed = EMA(Net(), EMAConfig(ema_fp32=True))
    resumed.load_checkpoint_state(saved, model.state_dict())
    assert_state_close(resumed.get_model().state_dict(), ema.get_model().state_dict(), rtol=0, atol=0)
    assert_state_close(resumed.fp32_params, ema.fp32_params, rtol=0, atol=0)
    fresh = EMA(Net(), EMAConfig())
    fresh.load_checkpoint_state({}, model.state_dict())  # no EMA saved: it restarts from the weights
    assert_state_close(fresh.get_model().state_dict(), model.state_dict(), rtol=0, atol=0)


def test_seed_model_and_load_ema_from_checkpoint(tmp_path):
    from fairseq.checkpoint_utils import load_ema_from_checkpoint, torch_persistent_save

    torch.manual_seed(0)
    source = Net()
    path = str(tmp_path / "with_ema.pt")
    torch_persistent_save({"model": Net().state_dict(), "extra_state": {"ema": source.state_dict()}}, path)
    assert_state_close(load_ema_from_checkpoint(path)["model"], source.state_dict(), rtol=0, atol=0)
    seeded = EMA(Net(), EMAConfig(ema_seed_model=path))
    assert_state_close(seeded.get_model().state_dict(), source.state_dict(), rtol=0, atol=0)
    torch_persistent_save({"model": Net().state_dict(), "extra_state": {}}, str(tmp_path / "plain.pt"))
    with pytest.raises(ValueError, match="holds no EMA weights.*--store-ema"):
        load_ema_from_checkpoint(str(tmp_path / "plain.pt"))


def test_ema_of_an_fsdp2_model_is_sharded_like_its_parameters(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = Net()
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (1,))
    for module in (sharded.layer, sharded.head, sharded):
        fully_shard(module, mesh=mesh)
    ema_plain, ema_sharded = EMA(plain, EMAConfig(ema_decay=0.7)), EMA(sharded, EMAConfig(ema_decay=0.7))
    assert ema_sharded.model is None and all(isinstance(v, DTensor) for v in ema_sharded.state_dict()["ema"].values())
    for step in range(3):
        sgd_step(plain, seed=step)
        sgd_step(sharded, seed=step)
        ema_plain.step(plain, step + 1)
        ema_sharded.step(sharded, step + 1)
    full = ema_sharded.full_state_dict()["ema"]
    assert_state_close(full, ema_plain.get_model().state_dict(), rtol=1e-6, atol=1e-7)
    assert type(ema_sharded.get_model()) is Net  # a plain copy with the gathered EMA (2 ranks: tests/distributed)
    assert_state_close(ema_sharded.get_model().state_dict(), full, rtol=0, atol=0)
    for key, shard in ema_sharded.state_dict()["ema"].items():  # each shard is the parameter's placement
        assert shard.placements == sharded.state_dict()[key].placements
    restored = EMA(sharded, EMAConfig(ema_decay=0.7))
    restored.load_checkpoint_state({"ema": full}, {})  # full tensors of a single-file checkpoint into shards
    assert_state_close(restored.full_state_dict()["ema"], full, rtol=0, atol=0)
    target = ema_sharded.reverse(Net())  # into an unsharded model: gathered
    assert_state_close(target.state_dict(), full, rtol=0, atol=0)
