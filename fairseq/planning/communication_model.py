"""Communication per GPU: each collective of a training step, its bytes, its ranks and whether it crosses nodes
(`python -m fairseq.planning.plan_memory`; docs/parallelism.md explains the numbers and what was not measured).

Byte counts are those of the ring algorithms NCCL uses for large messages: an all-gather or a reduce-scatter
of a buffer of B bytes over g ranks moves (g - 1) / g * B bytes into (and out of) each rank, an all-reduce
twice that. Per step means per optimizer update: every micro-batch of --update-freq repeats the per-batch
collectives (FSDP2 reduce-scatters after each one, as upstream's fully_sharded does).

Where each collective runs follows fairseq.distributed.mesh: a TP group is `tp` consecutive ranks, an FSDP
shard group `shard` ranks spaced `tp` apart (spanning shard * tp consecutive ranks), a replica group spaced
shard * tp apart. A group whose ranks span more than one node crosses the network; a transfer takes its bytes
over the per-GPU bandwidth of the link it uses (fairseq/planning/hardware.py), without latency. How much of
it hides behind compute is fairseq/planning/step_time.py's.
"""

from dataclasses import dataclass
from typing import List

from fairseq.planning import memory_model as mm
from fairseq.planning.hardware import Hardware


@dataclass(frozen=True)
class Collective:
    what: str
    ranks: int
    crosses_nodes: bool
    bytes: int  # per GPU per step

    def seconds(self, hardware: Hardware) -> float:
        return self.bytes / (hardware.inter_node_gbps if self.crosses_nodes else hardware.intra_node_gbps) / 1e9


@dataclass(frozen=True)
class Transfer:
    """One occurrence of a collective: its buffer (`raw` bytes) and the share of it each rank moves."""

    ranks: int
    crosses_nodes: bool
    raw: int
    factor: float  # (g - 1) / g for all-gather and reduce-scatter, twice that for all-reduce

    def seconds(self, hardware: Hardware, times: float = 1.0) -> float:
        link = hardware.inter_node_gbps if self.crosses_nodes else hardware.intra_node_gbps
        return times * self.raw * self.factor / (link * 1e9)

    def collective(self, what: str, times: int) -> Collective:
        return Collective(what, self.ranks, self.crosses_nodes, int(times * self.raw * self.factor))


def _ring(ranks: int) -> float:
    return (ranks - 1) / ranks if ranks > 1 else 0.0


@dataclass(frozen=True)
class StepTransfers:
    """Every collective of a step, per occurrence: per layer and micro-batch (`layer_*`; FSDP gathers a layer
    twice with resharding, once without), per micro-batch around the layers (`root_*`), per update (`ddp`)."""

    layer_gather: Transfer  # FSDP all-gather of one layer's parameters
    layer_reduce: Transfer  # FSDP reduce-scatter of its fp32 gradients
    layer_replica: Transfer  # HSDP all-reduce of its gradient shards across replicas
    tp_forward: Transfer  # a forward's (or recomputation's) activation collectives of one layer
    tp_backward: Transfer
    root_gather: Transfer
    root_reduce: Transfer
    root_replica: Transfer
    tp_root: Transfer  # around the layers: embedding, sequence split and gather, output projection, loss
    ddp: Transfer  # replicated backend without tensor parallelism: one all-reduce of every gradient


def float8_activation_gathers(setup: mm.TrainingSetup) -> bool:
    """Tensorwise float8 under tensor parallelism all-gathers the layers' activations in float8: the inputs of
    q/k/v and fc1 in forward (PrepareFloat8ModuleInput, Float8ColwiseParallel cast before the gather) and the
    gradients of out_proj's and fc2's outputs in backward (Float8RowwiseParallel casts them before the gather
    that mirrors the forward's reduce-scatter); the reduce-scatters stay in the compute dtype (torchao/float8/
    float8_tensor_parallel.py). The rowwise recipes use the plain styles: everything in the compute dtype."""
    return setup.float8_tensorwise and setup.tensor_parallel > 1


def step_transfers(shape: mm.ModelShape, setup: mm.TrainingSetup, gpus_per_node: int = 8) -> StepTransfers:
    t, s, c = setup.tensor_parallel, setup.shard_ranks, setup.compute_bytes
    local = mm.local_shape(shape, t)
    sharded = setup.fully_sharded or t > 1  # replicated backend under TP: FSDP2 replicas, no shards
    shard = s if setup.fully_sharded else 1
    replicas = setup.data_parallel // shard
    fsdp_crosses = shard * t > gpus_per_node
    replica_crosses = setup.gpus > gpus_per_node
    layer = mm.sharded_numel(local.layer_param_shapes, shard) if sharded else 0
    root = mm.sharded_numel(local.root_param_shapes, shard) if sharded else 0
    gathered = mm.gathered_layer_bytes(local, setup) if sharded else 0
    # Tensor parallelism, per layer and pass: two all-gathers of [tokens, d] (of q/k/v's and fc1's inputs in
    # forward, of out_proj's and fc2's output gradients in backward) and two reduce-scatters.
    gather_bytes = mm.FLOAT8_BYTES if float8_activation_gathers(setup) else c
    tp_pass = 2 * setup.tokens * shape.embed_dim * (gather_bytes + c) if t > 1 else 0
    # Around the layers, in the compute dtype: the embedding's all-reduce, the sequence split and gather, the
    # output projection's input-gradient all-reduce (6 units of [tokens, d]); loss_parallel's 3 all-reduces
    # of one fp32 per token (twice an all-gather's bytes: counted as 2 x 4 bytes).
    tp_root = (6 * setup.tokens * shape.embed_dim * c + 3 * setup.tokens * 4 * 2) if t > 1 else 0
    ddp = shape.total_params * mm.GRAD_BYTES if not sharded else 0
    return StepTransfers(
        layer_gather=Transfer(shard, fsdp_crosses, gathered, _ring(shard)),
        layer_reduce=Transfer(shard, fsdp_crosses, layer * shard * mm.REDUCE_BYTES, _ring(shard)),
        layer_replica=Transfer(replicas, replica_crosses, layer * mm.REDUCE_BYTES, 2 * _ring(replicas)),
        tp_forward=Transfer(t, t > gpus_per_node, tp_pass, _ring(t)),
        tp_backward=Transfer(t, t > gpus_per_node, tp_pass, _ring(t)),
        root_gather=Transfer(shard, fsdp_crosses, root * shard * c, _ring(shard)),
        root_reduce=Transfer(shard, fsdp_crosses, root * shard * mm.REDUCE_BYTES, _ring(shard)),
        root_replica=Transfer(replicas, replica_crosses, root * mm.REDUCE_BYTES, 2 * _ring(replicas)),
        tp_root=Transfer(t, t > gpus_per_node, tp_root, _ring(t)),
        ddp=Transfer(setup.gpus, replica_crosses, ddp, 2 * _ring(setup.gpus)),
    )


def layer_gathers(setup: mm.TrainingSetup) -> int:
    """FSDP all-gathers of each layer per micro-batch: forward, and backward again unless the forward kept it."""
    return 2 if setup.reshard_after_forward else 1


def tp_passes(setup: mm.TrainingSetup) -> int:
    """Tensor-parallel passes per layer and micro-batch: forward, backward and the recomputed forward."""
    return 3 if setup.checkpoint_activations else 2


def step_traffic(shape: mm.ModelShape, setup: mm.TrainingSetup, gpus_per_node: int = 8) -> List[Collective]:
    """The collectives of one step, per GPU, for the layout of `setup` (tensor_parallel, shard_group)."""
    x = step_transfers(shape, setup, gpus_per_node)
    u, layers = setup.update_freq, shape.num_layers
    float8_weights = setup.float8_all_gather and any(shape.float8_params(setup.tensor_parallel))
    gather_what = f"float8 weights, {setup.dtype} others" if float8_weights else f"{setup.dtype} parameters"
    tp_what = f"float8 all-gathers, {setup.dtype} reduce-scatters" if float8_activation_gathers(setup) else setup.dtype

    def total(per_layer: Transfer, per_layer_count: int, root: Transfer, what: str) -> Collective:
        raw = u * (per_layer_count * layers * per_layer.raw + root.raw)
        return Collective(what, per_layer.ranks, per_layer.crosses_nodes, int(raw * per_layer.factor))

    out = [
        total(x.layer_gather, layer_gathers(setup), x.root_gather, f"FSDP all-gather ({gather_what})"),
        total(x.layer_reduce, 1, x.root_reduce, "FSDP reduce-scatter (fp32 gradients)"),
        total(x.layer_replica, 1, x.root_replica, "replica all-reduce (fp32 gradient shards)"),
        x.ddp.collective("DDP all-reduce (fp32 gradients)", 1),  # the other micro-batches skip it
        total(x.tp_forward, tp_passes(setup), x.tp_root, f"TP activations ({tp_what})"),
    ]
    return [item for item in out if item.bytes > 0]
