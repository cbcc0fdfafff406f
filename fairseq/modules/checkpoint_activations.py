"""Upstream's `fairseq.modules.checkpoint_activations`: activation checkpointing of any module.

    layer = checkpoint_wrapper(layer, offload_to_cpu=False)

The module's forward then keeps only its inputs and recomputes its activations in backward (with
`offload_to_cpu`, the kept inputs wait in pinned CPU memory). The module itself is returned, its parameter
names unchanged; the checkpointing is the trainer's (`checkpointed` / `checkpointed_offloaded`, with which
`fairseq.distributed.parallelize` wraps each decoder layer for --checkpoint-activations), applied here to one
module. `unwrap_checkpoint` undoes it.
"""

import types

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint


def _pack_to_cpu(tensor: torch.Tensor):
    if tensor.device.type == "cpu":
        return tensor
    packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    # Non-blocking into pinned memory: the copy is ordered on the stream, and the CPU never reads it.
    packed.copy_(tensor, non_blocking=True)
    return tensor.device, packed


def _unpack_from_cpu(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


def checkpointed(module: nn.Module, *args, **kwargs):
    return checkpoint(module, *args, use_reentrant=False, **kwargs)


def checkpointed_offloaded(module: nn.Module, *args, **kwargs):
    # Non-reentrant checkpoint saves the layer's inputs through the saved-tensor hooks in effect around
    # it and nothing else (the layer's own activations are recomputed), so these hooks move exactly the
    # layer-boundary activations to CPU and bring them back for the recomputation in backward.
    with saved_tensors_hooks(_pack_to_cpu, _unpack_from_cpu):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)


def _checkpointed_forward(self, *args, **kwargs):
    run = checkpointed_offloaded if self._checkpoint_offload_to_cpu else checkpointed
    return run(self.precheckpoint_forward, *args, **kwargs)


def checkpoint_wrapper(m: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Checkpoint `m`'s activations (see the module docstring); returns `m`."""
    if hasattr(m, "precheckpoint_forward"):
        raise ValueError(f"checkpoint_wrapper: {type(m).__name__} is already checkpointed")
    m.precheckpoint_forward = m.forward
    m._checkpoint_offload_to_cpu = offload_to_cpu
    # A method bound to the module (not a closure over it), so that copy.deepcopy binds the copy's own.
    m.forward = types.MethodType(_checkpointed_forward, m)
    return m


def unwrap_checkpoint(m: nn.Module) -> nn.Module:
    """Undo checkpoint_wrapper on `m` and its submodules; returns `m`."""
    for module in m.modules():
        if "precheckpoint_forward" in module.__dict__:
            original = module.__dict__.pop("precheckpoint_forward")
            del module._checkpoint_offload_to_cpu
            if getattr(original, "__func__", None) is type(module).forward:
                del module.__dict__["forward"]  # the class's forward again
            else:
                module.forward = original
    return m
