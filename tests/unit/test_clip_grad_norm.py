"""clip_grad_norm_ (fairseq.distributed.parallelize) on FSDP2's sharded gradients of a one-rank mesh: the norm
and the clipping are those of the full gradients, and no collective is launched over a group of one rank (it
would change nothing, at a launch per update). The two-rank case is in tests/distributed/test_fsdp_parallelize.py."""

import torch
import torch.distributed as dist
from torch import nn

from fairseq.distributed.parallelize import clip_grad_norm_


def _sharded_model_with_gradients():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    plain = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    plain.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 6)
    for m in (model, plain):
        (m(x) ** 2).sum().mul(10.0).backward()
    return model, plain


def test_norm_and_clipping_on_a_one_rank_mesh_launch_no_collective(one_rank_group, monkeypatch):
    model, plain = _sharded_model_with_gradients()
    launched = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        launched.append(kwargs.get("group"))
        return real_all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    norm = clip_grad_norm_(list(model.parameters()), 1.0)
    assert launched == []
    assert expected > 1.0  # the clipping below is exercised
    torch.testing.assert_close(norm, expected)
    for sharded, full in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(sharded.grad.full_tensor(), full.grad)
