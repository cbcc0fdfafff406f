"""The layout of a training job over its ranks, and the device mesh built from it once.

Three dimensions, outermost first (docs/parallelism.md):

- `dp_replicate`: groups of ranks that hold the same shards (hybrid sharding, HSDP: gradients are
  reduce-scattered inside a group, then all-reduced across groups);
- `dp_shard`: the ranks FSDP2 shards the model over (`--fsdp-shard-group-size`, default: every data-parallel
  rank);
- `tp`: tensor parallelism (`--model-parallel-size`): each layer's matrices split over these ranks.

Tensor parallelism is innermost: rank = (replica * shard_size + shard) * tp + tp_rank, so one TP group is
`tp` consecutive ranks. torchrun and SLURM number ranks node by node, so with `tp` dividing the GPUs of a
node every TP group stays inside one node (its per-layer activation traffic on NVLink) and only FSDP's
traffic crosses nodes; with HSDP the shard groups can be kept inside a few nodes too.

`ParallelLayout.from_config` checks the flags against the world size (one-line ValueErrors, raised before any
process group exists: `fairseq.distributed.launch.call_main` calls it as soon as the world size is known).
`init_parallel_mesh` builds the DeviceMesh for a layout (once per layout and process group) and remembers it:
`current_mesh()` is what the data-parallel helpers of `fairseq.distributed.utils` read.
"""

import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)

REPLICATED_BACKENDS = ("pytorch_ddp", "c10d", "no_c10d", "legacy_ddp")


@dataclass(frozen=True)
class ParallelLayout:
    """How many ranks along each mesh dimension; `world` is their product."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ranks that see different batches."""
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.tp

    def model_parallel_rank(self, rank: int) -> int:
        return rank % self.tp

    def describe(self) -> str:
        """'TP 2 x FSDP 2', 'HSDP 2 x 2', 'FSDP 4', 'TP 2 x HSDP 2 x 2', '1 process'."""
        parts = []
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.replicate > 1 and self.shard > 1:
            parts.append(f"HSDP {self.replicate} x {self.shard}")
        elif self.replicate > 1:
            parts.append(f"{self.replicate} replicas")
        elif self.shard > 1:
            parts.append(f"FSDP {self.shard}")
        return " x ".join(parts) if parts else "1 process"

    @classmethod
    def from_config(cls, cfg_distributed, world_size: int) -> "ParallelLayout":
        """`from_flags` of the distributed_training group (or any object with its field names)."""
        return cls.from_flags(
            world_size,
            cfg_distributed.model_parallel_size,
            cfg_distributed.fsdp_shard_group_size,
            cfg_distributed.ddp_backend,
        )

    @classmethod
    def from_flags(
        cls,
        world_size: int,
        model_parallel_size: int = 1,
        fsdp_shard_group_size: int = 0,
        ddp_backend: str = "fully_sharded",
    ) -> "ParallelLayout":
        """The layout the flags ask for on `world_size` ranks; ValueError (the flag, the value to use) if none.

        Under a replicated --ddp-backend (pytorch_ddp, c10d) with tensor parallelism the data-parallel ranks
        are FSDP2 replicas that shard nothing (see parallelize.py); without tensor parallelism that backend
        does not use the mesh at all.
        """
        check_layout_flags(model_parallel_size, fsdp_shard_group_size, ddp_backend)
        tp = model_parallel_size
        if world_size % tp != 0:
            raise ValueError(
                f"--model-parallel-size {tp} does not divide the world size {world_size}: use a world size that "
                f"is a multiple of {tp}, or --model-parallel-size {_largest_divisor_up_to(world_size, tp)}"
            )
        dp = world_size // tp
        group = fsdp_shard_group_size
        if ddp_backend != "fully_sharded":
            return cls(replicate=dp, shard=1, tp=tp)
        if group == 0:
            return cls(replicate=1, shard=dp, tp=tp)
        if dp % group != 0:
            raise ValueError(
                f"--fsdp-shard-group-size {group} does not divide the {dp} data-parallel ranks (world size "
                f"{world_size} / --model-parallel-size {tp}): use --fsdp-shard-group-size "
                f"{_largest_divisor_up_to(dp, group)}, or 0 to shard over all {dp}"
            )
        return cls(replicate=dp // group, shard=group, tp=tp)


def check_layout_flags(model_parallel_size: int, fsdp_shard_group_size: int, ddp_backend: str) -> None:
    """The checks that need no world size (run by validate(cfg) before anything starts)."""
    if model_parallel_size < 1:
        raise ValueError(f"--model-parallel-size must be at least 1 (got {model_parallel_size})")
    group = fsdp_shard_group_size
    if group < 0:
        raise ValueError(f"--fsdp-shard-group-size must be 0 (all data-parallel ranks) or positive (got {group})")
    if group > 0 and ddp_backend != "fully_sharded":
        raise ValueError(f"--fsdp-shard-group-size needs --ddp-backend fully_sharded (got --ddp-backend {ddp_backend})")


def _largest_divisor_up_to(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


# ------------------------------------------------------------------------------------------------ the mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# Set to 1: keep a tp dimension of one rank and apply the tensor-parallel plan on it (--model-parallel-size 1
# otherwise applies none). The same code path as TP N, so one GPU can measure and test it (docs/parallelism.md).
TP_MESH_OF_ONE = "FAIRSEQ_TP_MESH_OF_ONE"


def has_tp_dim(layout: ParallelLayout) -> bool:
    """Whether the mesh of `layout` has a tp dimension, i.e. the model is split by its tensor-parallel plan."""
    return layout.tp > 1 or os.environ.get(TP_MESH_OF_ONE) == "1"


@dataclass
class ParallelMesh:
    """A layout and its DeviceMesh. Dimensions of size 1 are left out, except `dp_shard` (FSDP2 needs a
    mesh to shard over, even of one rank)."""

    layout: ParallelLayout
    mesh: DeviceMesh
    default_group: Optional[dist.ProcessGroup] = None  # the process group the mesh was built over
    _dp_group: Optional[dist.ProcessGroup] = None

    @property
    def dims(self) -> Tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names)

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return self.mesh["tp"] if "tp" in self.dims else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What fully_shard takes: 1-D (shard) or, with replicas, 2-D (replicate, shard): HSDP."""
        if "dp_replicate" in self.dims:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that see different batches and share this rank's TP position: per-batch statistics
        (token counts, losses) are summed over it. None (the default group) without tensor parallelism."""
        return self._dp_group

    def _make_data_parallel_group(self) -> None:
        # Collective (every rank creates the group together): done once, when the mesh is built.
        if self.layout.tp == 1:
            self._dp_group = None
        elif "dp_replicate" in self.dims:
            self._dp_group = self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        else:
            self._dp_group = self.mesh["dp_shard"].get_group()


_current: Optional[ParallelMesh] = None


def init_parallel_mesh(layout: ParallelLayout, device_type: str) -> ParallelMesh:
    """The mesh of `layout` over the default process group, built on the first call for this layout and
    group and returned again after. With no process group (a single process under fully_sharded, which FSDP2
    still needs one for) a one-rank group is created on an in-memory store."""
    global _current
    if not dist.is_initialized():
        if layout.world != 1:
            raise RuntimeError(f"a {layout.describe()} layout needs {layout.world} ranks, but no process group exists")
        logger.info("fully_sharded on a single process: creating a one-rank process group for FSDP2")
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != layout.world:
        raise RuntimeError(
            f"the {layout.describe()} layout has {layout.world} ranks, the process group {dist.get_world_size()}"
        )
    group = dist.distributed_c10d._get_default_group()
    if (
        _current is not None
        and _current.layout == layout
        and _current.mesh.device_type == device_type
        and _current.default_group is group
        and ("tp" in _current.dims) == has_tp_dim(layout)
    ):
        return _current
    sizes = {"dp_replicate": layout.replicate, "dp_shard": layout.shard, "tp": layout.tp}
    names = tuple(
        name for name in MESH_DIMS if sizes[name] > 1 or name == "dp_shard" or (name == "tp" and has_tp_dim(layout))
    )
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    _current = ParallelMesh(layout, mesh, default_group=group)
    _current._make_data_parallel_group()
    if layout.world > 1:
        logger.info(f"device mesh: {layout.describe()} ({' x '.join(f'{n} {sizes[n]}' for n in names)})")
    return _current


def forget_parallel_mesh() -> None:
    """No mesh for this run (a replicated --ddp-backend without tensor parallelism): the data-parallel helpers
    then count every rank, whatever an earlier run in this process built."""
    global _current
    _current = None


def current_mesh() -> Optional[ParallelMesh]:
    """The mesh the last `init_parallel_mesh` built, if it belongs to the current default process group."""
    if _current is None or not dist.is_initialized():
        return None
    if _current.default_group is not dist.distributed_c10d._get_default_group():
        return None
    return _current
