"""A plain (single-process) copy of a module that FSDP2 sharded in place, for `EMA.get_model()`.

An FSDP2 module refuses copy.deepcopy, and a deep copy would keep what makes it distributed anyway: the
FSDP class swapped in, hooks that all-gather parameters, per-module FSDP state. This copies the module tree
without those: every module gets its original class back, hooks and attributes that belong to
torch.distributed or fairseq.distributed are left out, activation-checkpoint wrappers are replaced by the
module they wrap (which makes no difference to what forward computes), and each DTensor parameter or persistent
buffer becomes an uninitialized full-size tensor on the device of its local shard, for the caller to fill.
Everything else (configuration attributes, plain buffers, the model's own hooks) is deep-copied as usual.
"""

import copy
import functools
from itertools import chain
from typing import Dict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_DISTRIBUTED_MODULES = ("torch.distributed", "fairseq.distributed")
_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")  # set by fully_shard on every module
_COMPOSABLE_STATE = "__composable_api_state_key"  # prefix of the attributes holding FSDP's per-module state
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# Per-hook flags, keyed by the hook's id in the named dict: kept for the hooks kept.
_HOOK_FLAGS = {
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
}


def _defined_in_distributed(obj) -> bool:
    """Whether `obj` (a hook: function, bound method, partial, callable object) comes from distributed code."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    name = getattr(obj, "__module__", None) or type(obj).__module__ or ""
    return name.startswith(_DISTRIBUTED_MODULES)


def _original_class(module: nn.Module) -> type:
    cls = type(module)
    return cls.__mro__[cls._orig_cls_mro_index] if isinstance(module, FSDPModule) else cls


def _unwrapped(module: nn.Module) -> nn.Module:
    while isinstance(module, ActivationWrapper):
        module = module._checkpoint_wrapped_module
    return module


def _plain_attributes(module: nn.Module) -> Dict[str, object]:
    """`module.__dict__` without FSDP's state and flags, distributed hooks and distributed helper objects."""
    attributes = {}
    for key, value in module.__dict__.items():
        if key.startswith(_COMPOSABLE_STATE) or key in _FSDP_FLAGS or key in _HOOK_FLAGS:
            continue
        if key in _HOOKS:
            value = type(value)((i, hook) for i, hook in value.items() if not _defined_in_distributed(hook))
        elif not isinstance(value, (nn.Module, torch.Tensor, dict)) and _defined_in_distributed(type(value)):
            continue  # e.g. the --fsdp-sync-free hooks object
        attributes[key] = value
    for key, hooks in _HOOK_FLAGS.items():
        if key in module.__dict__:
            kept = attributes.get(hooks, {})
            attributes[key] = type(module.__dict__[key])((i, f) for i, f in module.__dict__[key].items() if i in kept)
    return attributes


def plain_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` as described in the module docstring. DTensor parameters and persistent buffers come
    back uninitialized (the caller fills them from a state dict); a non-persistent DTensor buffer is gathered
    (collective: every rank of its mesh must call this)."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
    memo: Dict[int, object] = {}
    modules = list(module.modules())
    for m in modules:  # the new objects first, so that references between modules resolve to the copies
        if not isinstance(m, ActivationWrapper):
            cls = _original_class(m)
            memo[id(m)] = cls.__new__(cls)
    for m in modules:
        if isinstance(m, ActivationWrapper):
            memo[id(m)] = memo[id(_unwrapped(m))]
    for tensor in chain(module.parameters(), module.buffers()):
        if isinstance(tensor, DTensor):
            if id(tensor) in persistent:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
            else:
                full = tensor.full_tensor().detach().clone()
            memo[id(tensor)] = nn.Parameter(full, requires_grad=False) if isinstance(tensor, nn.Parameter) else full
    for m in modules:
        if not isinstance(m, ActivationWrapper):
            memo[id(m)].__dict__.update(copy.deepcopy(_plain_attributes(m), memo))
    return memo[id(_unwrapped(module))]
