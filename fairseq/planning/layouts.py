"""`--recommend-layout`: every tensor-parallel x FSDP / HSDP layout of a GPU count at one global batch, each with
the largest micro-batch that fits, its memory per GPU and its estimated step time (fairseq/planning/step_time.py),
fastest first (docs/parallelism.md shows the table and what the estimate leaves out).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, List, Optional

from fairseq.planning import communication_model as cm
from fairseq.planning import memory_model as mm
from fairseq.planning.hardware import Hardware
from fairseq.planning.step_time import StepTime, step_time

# Layouts whose estimated step times are within this fraction of the fastest are treated as equal (the estimate
# cannot tell them apart: HSDP moves as many bytes per GPU as FSDP over all ranks, and its gains, smaller rings
# and fewer ranks per failure, are not modeled); among those, the one that needs the least memory comes first.
STEP_TIME_TIE_FRACTION = 0.02


@dataclass(frozen=True)
class Candidate:
    setup: mm.TrainingSetup
    plan: mm.MemoryPlan
    traffic: List[cm.Collective]
    time: StepTime

    @property
    def inter_node_bytes(self) -> int:
        return sum(item.bytes for item in self.traffic if item.crosses_nodes)


def _powers_of_two_dividing(n: int, limit: int) -> Iterator[int]:
    k = 1
    while k <= min(n, limit):
        if n % k == 0:
            yield k
        k *= 2


def candidate_layouts(
    shape: mm.ModelShape, setup: mm.TrainingSetup, hardware: Hardware, gpus_per_node: int = 8
) -> List[Candidate]:
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
            base = dataclasses.replace(
                setup,
                tensor_parallel=tp,
                shard_group=0 if shard == dp else shard,
                fully_sharded=True,
                tp_plan_on_one_rank=False,
            )
            best = _largest_micro_batch(shape, base, per_rank, hardware.memory_gib)
            if best is None:
                continue
            candidate = dataclasses.replace(base, batch_size=best, update_freq=per_rank // best)
            found.append(
                Candidate(
                    candidate,
                    mm.plan(shape, candidate),
                    cm.step_traffic(shape, candidate, gpus_per_node),
                    step_time(shape, candidate, hardware, gpus_per_node),
                )
            )
    if not found:
        return []
    fastest = min(c.time.total for c in found)

    def rank(c: Candidate):
        tied = c.time.total <= fastest * (1 + STEP_TIME_TIE_FRACTION)
        return (not tied, 0.0 if tied else round(c.time.total, 3), c.plan.required_bytes)

    return sorted(found, key=rank)


def _divisors(n: int) -> List[int]:
    """The divisors of `n`, largest first (found up to its square root: a large batch costs no long loop)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small}, reverse=True)


def _largest_micro_batch(shape, setup, per_rank: int, gpu_memory_gib: float) -> Optional[int]:
    for batch in _divisors(per_rank):
        if mm.plan(shape, dataclasses.replace(setup, batch_size=batch, update_freq=per_rank // batch)).fits(
            gpu_memory_gib
        ):
            return batch
    return None
