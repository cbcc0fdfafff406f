"""Dropout under tensor parallelism as Megatron-LM draws it: one random stream per TP rank where activations
are split across the TP group, the shared stream where they are replicated.

Inside a decoder layer of transformer_lm's plan every activation is split (attention dropout on this rank's
heads, activation dropout on its FFN columns, residual dropouts on its part of the sequence): with one shared
stream the ranks would draw the same mask pattern for different slices (correlated masks). Outside the layers
(embedding dropout, anything after the last layer) activations are replicated, and the masks must be the same
on every TP rank, or the replicated parameters would get different gradients and drift apart.

So each decoder layer's forward runs on a stream of its own rank: a forward pre-hook draws one seed from the
shared CPU stream (the same draw on every TP rank, so the shared stream advances identically), keeps the shared
generator states (CPU, and the current accelerator device's), and seeds this rank's stream from (that seed,
the TP rank); the forward post-hook puts the shared states back.

Nothing is saved in checkpoints: the trainer reseeds the shared stream at every update (--seed + num_updates,
fairseq.training.trainer), and each layer's stream is a function of that seed, the layer's place in the update
and the TP rank, so a resumed run draws the masks an uninterrupted one draws (what saving and restoring the
streams with the checkpoint would guarantee; tests/distributed/test_tensor_parallel_dropout.py holds it).
"""

from typing import List, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh  # imported by torch itself: free

from fairseq.distributed.fsdp import transformer_layers

__all__ = ["apply_dropout_streams"]

# Shared-stream seeds are drawn below this, so that seed + TP rank stays a valid 64-bit seed.
_SEED_BOUND = 2**62


class _RankStream:
    """The hooks around one decoder layer (kept alive by them)."""

    def __init__(self, tp_rank: int, device_type: str):
        self.tp_rank = tp_rank
        # The accelerator whose generator dropout draws from on this rank (None on the CPU).
        self.device = torch.get_device_module(device_type) if device_type != "cpu" else None
        self.shared: Optional[List[torch.Tensor]] = None

    def enter(self, module: nn.Module, args) -> None:
        if not module.training:  # no dropout: nothing to draw
            return
        # From the shared CPU stream (named: a default device set elsewhere must not move the draw), the same
        # value on every TP rank.
        seed = int(torch.randint(_SEED_BOUND, (), generator=torch.default_generator, device="cpu"))
        self.shared = [torch.get_rng_state()]
        if self.device is not None:
            self.shared.append(self.device.get_rng_state())
        rank_seed = seed + self.tp_rank
        torch.default_generator.manual_seed(rank_seed)
        if self.device is not None:
            self.device.manual_seed(rank_seed)  # the current device only

    def leave(self, module: nn.Module, args, output) -> None:
        if self.shared is None:
            return
        torch.set_rng_state(self.shared[0])
        if self.device is not None:
            self.device.set_rng_state(self.shared[1])
        self.shared = None


def apply_dropout_streams(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Run each decoder layer's forward on this TP rank's random stream (see the module docstring), in place;
    after tensor parallelism, activation checkpointing and compile, before FSDP.

    The hooks go on each element of `transformer_layers(model)` as it is then: the outermost module, a
    CheckpointWrapper under --checkpoint-activations. torch.utils.checkpoint keeps the random state it finds
    when the wrapped forward starts (this rank's, seeded here) and restores it for the recomputation in
    backward, so the recomputed masks are the forward's, and these hooks run once per forward. A compiled
    forward (--compile) draws its seeds from the same global generators, so swapping them covers it too.
    FSDP2's hooks on the same modules draw nothing."""
    tp_rank = tp_mesh.get_local_rank()
    for layer in transformer_layers(model):
        stream = _RankStream(tp_rank, tp_mesh.device_type)
        layer.register_forward_pre_hook(stream.enter)
        # always_call: a forward that raises still gives the shared stream back
        layer.register_forward_hook(stream.leave, always_call=True)
    return model
