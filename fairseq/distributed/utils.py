"""Small collective helpers that also work in a plain single process (no process group: world size 1)."""

import argparse

import torch
import torch.distributed as dist

from fairseq.runtime.env import get_free_port
from fairseq.distributed.mesh import current_mesh
from fairseq.dataclass.build import convert_namespace_to_config

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_master",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_free_port",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_master",
]


def is_distributed() -> bool:
    """True once a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


# Upstream's names for a rank's place in a tensor-parallel job. They read the mesh the trainer built
# (fairseq.distributed.mesh); before one exists every rank is a data-parallel rank.


def _layout():
    mesh = current_mesh()
    return mesh.layout if mesh is not None else None


def get_data_parallel_world_size() -> int:
    """Ranks that see different batches: the world size divided by --model-parallel-size."""
    layout = _layout()
    return layout.dp if layout is not None else get_world_size()


def get_data_parallel_rank() -> int:
    """Which share of the data this rank reads (the ranks of one tensor-parallel group read the same)."""
    layout = _layout()
    return layout.data_parallel_rank(get_rank()) if layout is not None else get_rank()


def get_model_parallel_world_size() -> int:
    layout = _layout()
    return layout.tp if layout is not None else 1


def get_model_parallel_rank() -> int:
    layout = _layout()
    return layout.model_parallel_rank(get_rank()) if layout is not None else 0


def get_data_parallel_group():
    """The process group over which per-batch sums (tokens, losses) are taken; None means the default group."""
    mesh = current_mesh()
    return mesh.data_parallel_group if mesh is not None else None


def is_master() -> bool:
    """Rank 0: the process that writes logs and full checkpoints."""
    return get_rank() == 0


def barrier(group=None) -> None:
    """Every rank (of `group`, default all) reaches this point before any goes on."""
    if get_world_size() > 1:
        dist.barrier(group=group)


def broadcast_from_master(obj, group=None):
    """Rank 0's `obj` (a small picklable value) on every rank (of `group`, which holds rank 0): one decision all
    ranks must share."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_reduce(tensor: torch.Tensor, op) -> torch.Tensor:
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place; returns it for chaining."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of `tensor` over all ranks, in place; returns it for chaining."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def call_main(cfg, main, **kwargs):
    """Upstream's `distributed_utils.call_main(cfg, main)`: run `main(cfg, **kwargs)` in every process of the
    launch (spawned, torchrun or SLURM; see fairseq.distributed.launch) and return rank 0's result. `cfg` is
    a FairseqConfig or the argparse namespace of `options.parse_args_and_arch`."""
    # the launcher (torch.multiprocessing, torch.distributed.elastic: ~60 ms) only for this entry point
    from fairseq.distributed.launch import call_main as launch  # deferred: startup

    if isinstance(cfg, argparse.Namespace):
        cfg = convert_namespace_to_config(cfg)
    return launch(cfg, main, **kwargs)
