"""Communication per GPU per training step, and layouts ranked by it (`python -m fairseq.planning.plan_memory
--recommend-layout`; docs/parallelism.md explains the numbers and what was not measured).

Byte counts are those of the ring algorithms NCCL uses for large messages: an all-gather or a reduce-scatter
of a buffer of B bytes over g ranks moves (g - 1) / g * B bytes into (and out of) each rank, an all-reduce
twice that. Per step means per optimizer update: every micro-batch of --update-freq repeats the per-batch
collectives (FSDP2 reduce-scatters after each one, as upstream's fully_sharded does).

Where each collective runs follows fairseq.distributed.mesh: a TP group is `tp` consecutive ranks, an FSDP
shard group `shard` ranks spaced `tp` apart (spanning shard * tp consecutive ranks), a replica group spaced
shard * tp apart. A group whose ranks span more than one node crosses the network; time estimates divide
each group's bytes by the per-GPU bandwidth of the link it uses and add them up (no overlap with compute,
no latency): an upper bound on exposed communication, for comparing layouts, not a measurement.
"""

import dataclasses
from dataclasses import dataclass
from typing import Iterator, List, Optional

from fairseq.planning import memory_model as mm

# Per-GPU bandwidths (GB/s, 1e9 bytes) the estimates assume; not measured here (no multi-node machine).
# NVLink inside a node: NCCL reaches about 230 GB/s bus bandwidth on 8 x A100 NVLink 3 for large all-reduces;
# 150 leaves room for the smaller per-layer messages. Across nodes: one 200 Gb/s HDR InfiniBand NIC per
# GPU (25 GB/s line rate), about 22 GB/s achieved.
INTRA_NODE_GBPS = 150.0
INTER_NODE_GBPS = 22.0
# OPT-175B's reported utilization (147 TFLOP/s per A100), for the compute time printed beside communication.
ACHIEVED_TFLOPS = 147.0
# Layouts whose estimated communication is within this fraction of the fastest are treated as equal.
COMMUNICATION_TIE_FRACTION = 0.05


@dataclass(frozen=True)
class Collective:
    what: str
    ranks: int
    crosses_nodes: bool
    bytes: int  # per GPU per step

    def seconds(self, intra_gbps: float = INTRA_NODE_GBPS, inter_gbps: float = INTER_NODE_GBPS) -> float:
        return self.bytes / ((inter_gbps if self.crosses_nodes else intra_gbps) * 1e9)


def _ring(ranks: int) -> float:
    return (ranks - 1) / ranks if ranks > 1 else 0.0


def step_traffic(shape: mm.ModelShape, setup: mm.TrainingSetup, gpus_per_node: int = 8) -> List[Collective]:
    """The collectives of one step, per GPU, for the layout of `setup` (tensor_parallel, shard_group)."""
    t, s, c, u = setup.tensor_parallel, setup.shard_ranks, setup.compute_bytes, setup.update_freq
    r = setup.data_parallel // s
    local = mm.local_shape(shape, t)
    layers = local.num_layers
    out = []
    if setup.fully_sharded or t > 1:
        fsdp_shard = s if setup.fully_sharded else 1  # replicated backend under TP: FSDP2 replicas, no shards
        layer = mm.sharded_numel(local.layer_param_shapes, fsdp_shard)
        root = mm.sharded_numel(local.root_param_shapes, fsdp_shard)
        gathers = (2 if setup.reshard_after_forward else 1) * layers * layer + root  # backward gathers again
        spans_node = fsdp_shard * t > gpus_per_node
        out.append(Collective(f"FSDP all-gather ({setup.dtype} parameters)", fsdp_shard, spans_node,
                              int(u * gathers * fsdp_shard * c * _ring(fsdp_shard))))
        out.append(Collective("FSDP reduce-scatter (fp32 gradients)", fsdp_shard, spans_node,
                              int(u * (layers * layer + root) * fsdp_shard * mm.REDUCE_BYTES * _ring(fsdp_shard))))
        replicas = r if setup.fully_sharded else setup.data_parallel
        out.append(Collective("replica all-reduce (fp32 gradient shards)", replicas, setup.gpus > gpus_per_node,
                              int(u * (layers * layer + root) * mm.REDUCE_BYTES * 2 * _ring(replicas))))
    else:  # DDP: one all-reduce of every gradient per update (the other micro-batches skip it)
        out.append(Collective("DDP all-reduce (fp32 gradients)", setup.gpus, setup.gpus > gpus_per_node,
                              int(shape.total_params * mm.GRAD_BYTES * 2 * _ring(setup.gpus))))
    if t > 1:
        # Per layer and micro-batch: q/k/v's and fc1's all-gathers and out_proj's and fc2's reduce-scatters of
        # [tokens, d] in forward, as many in backward, and the forward's again when checkpointing recomputes it;
        # around the layers: the embedding's all-reduce, the sequence split and gather, the output
        # projection's input-gradient all-reduce (6 units); loss_parallel's 3 all-reduces of one fp32 per token.
        unit = setup.tokens * shape.embed_dim * c * _ring(t)
        per_layer = 12 if setup.checkpoint_activations else 8
        loss = 3 * setup.tokens * 4 * 2 * _ring(t)
        out.append(Collective(f"TP activations ({setup.dtype})", t, t > gpus_per_node,
                              int(u * ((layers * per_layer + 6) * unit + loss))))
    return [item for item in out if item.bytes > 0]


def compute_seconds(shape: mm.ModelShape, setup: mm.TrainingSetup, tflops: float = ACHIEVED_TFLOPS) -> float:
    """6 FLOPs per parameter and token (8 with checkpointing's recomputed forward), at `tflops` per GPU."""
    tokens = setup.tokens * setup.update_freq * setup.data_parallel
    flops = (8 if setup.checkpoint_activations else 6) * shape.total_params * tokens
    return flops / (setup.gpus * tflops * 1e12)


@dataclass(frozen=True)
class Candidate:
    setup: mm.TrainingSetup
    plan: mm.MemoryPlan
    traffic: List[Collective]

    @property
    def communication_seconds(self) -> float:
        return sum(item.seconds() for item in self.traffic)

    @property
    def inter_node_bytes(self) -> int:
        return sum(item.bytes for item in self.traffic if item.crosses_nodes)


def _powers_of_two_dividing(n: int, limit: int) -> Iterator[int]:
    k = 1
    while k <= min(n, limit):
        if n % k == 0:
            yield k
        k *= 2


def candidate_layouts(shape: mm.ModelShape, setup: mm.TrainingSetup, gpu_memory_gib: float,
                      gpus_per_node: int = 8) -> List[Candidate]:
    """Every layout of setup.gpus GPUs (TP inside a node, in powers of two that divide the heads, FFN and
    vocabulary; any power-of-two shard group) at the global batch of `setup` (sequences per update), each with
    the largest micro-batch that fits and the --update-freq that keeps the batch; fitting ones, fastest first."""
    sequences = setup.batch_size * setup.update_freq * setup.data_parallel
    found = []
    for tp in _powers_of_two_dividing(setup.gpus, gpus_per_node):
        if shape.heads % tp or shape.ffn_dim % tp or shape.vocab_size % tp:
            continue
        dp = setup.gpus // tp
        if sequences % dp:
            continue
        per_rank = sequences // dp
        for shard in _powers_of_two_dividing(dp, dp):
            base = dataclasses.replace(setup, tensor_parallel=tp, shard_group=0 if shard == dp else shard,
                                       fully_sharded=True)
            best = _largest_micro_batch(shape, base, per_rank, gpu_memory_gib)
            if best is None:
                continue
            candidate = dataclasses.replace(base, batch_size=best, update_freq=per_rank // best)
            found.append(Candidate(candidate, mm.plan(shape, candidate), step_traffic(shape, candidate, gpus_per_node)))
    if not found:
        return []
    # Within a few percent the estimate cannot tell layouts apart (HSDP moves as many bytes per GPU as FSDP
    # over all ranks: its gain is in latency and ring size, which it does not model); among those, the one with
    # the most memory to spare comes first.
    fastest = min(c.communication_seconds for c in found)
    tied = lambda c: c.communication_seconds <= fastest * (1 + COMMUNICATION_TIE_FRACTION)  # noqa: E731
    return sorted(found, key=lambda c: (not tied(c), c.plan.required_bytes if tied(c) else c.communication_seconds))


def _largest_micro_batch(shape, setup, per_rank: int, gpu_memory_gib: float) -> Optional[int]:
    for batch in sorted((b for b in range(1, per_rank + 1) if per_rank % b == 0), reverse=True):
        if mm.plan(shape, dataclasses.replace(setup, batch_size=batch, update_freq=per_rank // batch)).fits(
                gpu_memory_gib):
            return batch
    return None
