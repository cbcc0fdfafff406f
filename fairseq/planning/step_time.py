"""Time of one training step per GPU: compute (fairseq/planning/compute_model.py) plus the communication that does
not hide behind it (fairseq/planning/communication_model.py), layer by layer. An estimate for ranking layouts,
not a measurement (docs/parallelism.md says what was measured).

How collectives overlap compute here, as FSDP2 and the tensor-parallel styles schedule them:

- FSDP2's collectives run on their own streams: while layer i computes, the next layer's all-gather (forward:
  i + 1; backward: i - 1, unless --no-reshard-after-forward kept it) and, in backward, the previous layer's
  reduce-scatter and HSDP all-reduce are in flight. Per layer, what exceeds the layer's compute is exposed.
  The first layer's and the root's all-gathers wait in front of the step, the last reduce-scatters after it.
- Tensor-parallel collectives sit between a layer's matmuls, on the compute's critical path: all exposed. While
  they run, an FSDP transfer over the same links (a shard group inside one node) does not progress, so only a
  layer's compute hides FSDP traffic then; over the network it also hides behind the NVLink collectives.
- DDP all-reduces its buckets during backward: exposed beyond the backward's compute.

Not modeled: latency (rings of hundreds of ranks pay it per collective, which favours HSDP's smaller rings and
fewer, larger messages), contention between the ranks of a node for the network, and the optimizer step.
"""

from dataclasses import dataclass

from fairseq.planning import compute_model
from fairseq.planning import memory_model as mm
from fairseq.planning.communication_model import layer_gathers, step_transfers
from fairseq.planning.hardware import Hardware


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds per step
    exposed: float  # communication not hidden behind compute
    communication: float  # every collective's time, as if none overlapped

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def step_time(shape: mm.ModelShape, setup: mm.TrainingSetup, hardware: Hardware, gpus_per_node: int = 8) -> StepTime:
    x = step_transfers(shape, setup, gpus_per_node)
    hw, u, layers = hardware, setup.update_freq, shape.num_layers
    forward = compute_model.layer_forward_seconds(shape, setup, hw.achieved_tflops)
    recompute = forward if setup.checkpoint_activations else 0.0
    tp_forward, tp_backward = x.tp_forward.seconds(hw), x.tp_backward.seconds(hw)
    tp_recompute = tp_forward if setup.checkpoint_activations else 0.0
    gather, reduce, replica = x.layer_gather.seconds(hw), x.layer_reduce.seconds(hw), x.layer_replica.seconds(hw)
    backward_gather = gather if layer_gathers(setup) == 2 else 0.0

    # What one layer's FSDP traffic can hide behind: its compute, and its TP collectives when they use other links.
    shares_links = not x.layer_gather.crosses_nodes
    forward_window = forward + (0.0 if shares_links else tp_forward)
    backward_window = recompute + 2 * forward + (0.0 if shares_links else tp_recompute + tp_backward)
    root = compute_model.root_seconds(shape, setup, hw.achieved_tflops)
    exposed = layers * (tp_forward + tp_recompute + tp_backward) + x.tp_root.seconds(hw)
    exposed += x.root_gather.seconds(hw) + x.root_reduce.seconds(hw) + x.root_replica.seconds(hw)
    if layers:
        # forward: layer 0's all-gather waits, each layer hides the next one's
        exposed += gather + (layers - 1) * max(0.0, gather - forward_window)
        # backward: the top layer's all-gather behind the loss's backward, then each layer hides the next
        # all-gather and the previous reduce-scatter; layer 0's reduce-scatter waits at the end
        exposed += max(0.0, backward_gather - root)
        if layers > 1:
            exposed += max(0.0, backward_gather - backward_window)
            exposed += (layers - 2) * max(0.0, backward_gather + reduce + replica - backward_window)
            exposed += max(0.0, reduce + replica - backward_window)
        exposed += reduce + replica
    per_batch_compute = layers * (forward + recompute + 2 * forward) + root
    # DDP all-reduces once per update, during the last micro-batch's backward
    exposed = u * exposed + max(0.0, x.ddp.seconds(hw) - layers * 2 * forward)

    gathers = layers * layer_gathers(setup) * x.layer_gather.seconds(hw) + x.root_gather.seconds(hw)
    reduces = layers * (reduce + replica) + x.root_reduce.seconds(hw) + x.root_replica.seconds(hw)
    tp = layers * (tp_forward + tp_recompute + tp_backward) + x.tp_root.seconds(hw)
    communication = u * (gathers + reduces + tp) + x.ddp.seconds(hw)
    return StepTime(compute=u * per_batch_compute, exposed=exposed, communication=communication)
