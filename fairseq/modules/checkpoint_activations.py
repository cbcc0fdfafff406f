"""Upstream's `fairseq.modules.checkpoint_activations`: activation checkpointing of any module.

    layer = checkpoint_wrapper(layer, offload_to_cpu=False)

The module's forward then keeps only its inputs and recomputes its activations in backward (with
`offload_to_cpu`, the kept inputs wait in pinned CPU memory). The module itself is returned, its parameter
names unchanged; the checkpointing is the trainer's (`fairseq.distributed.parallelize`, --checkpoint-activations,
which wraps each decoder layer), applied here to one module. `unwrap_checkpoint` undoes it.
"""

import types

import torch.nn as nn

from fairseq.distributed.parallelize import _checkpointed, _checkpointed_offloaded


def _checkpointed_forward(self, *args, **kwargs):
    run = _checkpointed_offloaded if self._checkpoint_offload_to_cpu else _checkpointed
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
