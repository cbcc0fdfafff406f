"""An exponential moving average (EMA) of a model's weights, with upstream fairseq's class and methods.

After every update the trainer calls `ema.step(model, num_updates)`: every floating-point entry of the model's
state dict moves as `ema = decay * ema + (1 - decay) * weight` (decay 0, a plain copy, before
--ema-start-update), every --ema-update-freq updates; integer buffers and `skip_keys` are copied, `version`
entries are left alone. Checkpoints keep it in `extra_state["ema"]` (and `extra_state["ema_fp32_params"]` with
--ema-fp32), upstream's keys.

Where it lives: for an unsharded model, a deep copy of the model whose weights are the average (`get_model()`,
upstream's layout). For an FSDP2-sharded model (whose parameters are DTensors, and which cannot be deep-copied),
a dict of DTensors sharded exactly as the parameters: each rank keeps and updates only its shards, so the EMA
costs the same per-rank memory as the weights; `state_dict()` returns them for a sharded (DCP) checkpoint and
`full_state_dict()` gathers them (collectively) for a single-file one; `get_model()` gathers them into a plain
copy of the model on every rank (fairseq.distributed.plain_copy).
"""

import copy
import logging
import types
from typing import Dict, Optional

import torch

# DTensors are recognized without importing torch.distributed.tensor (~1 s, paid by every process that runs
# validate(cfg), which imports this module): see fairseq.runtime.dtensor.
from fairseq.runtime.dtensor import is_dtensor
from fairseq.checkpoint.inference import load_ema_from_checkpoint

logger = logging.getLogger("fairseq.models.ema.ema")  # upstream's logger name: log lines read as its


def check_ema_config(store_ema: bool, ema_decay: float, ema_update_freq: int) -> None:
    """The --ema-* checks that need nothing but the flags (run by validate(cfg))."""
    if not store_ema:
        return
    if not 0.0 <= ema_decay <= 1.0:
        raise ValueError(f"--ema-decay must lie in [0, 1], got {ema_decay}")
    if ema_update_freq < 1:
        raise ValueError(f"--ema-update-freq must be at least 1, got {ema_update_freq}")


def build_ema(model, cfg, device=None, skip_keys=None) -> "EMA":
    """Upstream's factory (the trainer's)."""
    return EMA(model, cfg, device=device, skip_keys=skip_keys)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (a DTensor sharded like `target`, or the full tensor) into `target`, in place."""
    if is_dtensor(target):
        if not is_dtensor(value):  # a full tensor, e.g. from a single-file checkpoint: take our shard
            from torch.distributed.tensor import distribute_tensor  # deferred: startup (~1 s to import)

            value = distribute_tensor(
                value.to(_local(target).device), target.device_mesh, target.placements, src_data_rank=None
            )
        _local(target).copy_(_local(value))
    else:
        target.copy_(value.full_tensor() if is_dtensor(value) else value)


def _is_sharded(state: Dict[str, torch.Tensor]) -> bool:
    return any(is_dtensor(v) for v in state.values())


def _without_patched_forwards(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy keeps instance-level `forward` overrides that still point at the original module (e.g. the
    function torch.compile put there): drop those, so the copy runs its own weights. Methods bound to the
    module itself (fairseq.modules.checkpoint_activations) are copied correctly and kept."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and not (isinstance(forward, types.MethodType) and forward.__self__ is module):
            del module.__dict__["forward"]
    return model


class EMA:
    """EMA of `model`'s weights. `config` has upstream's EMAConfig fields (ema_decay, ema_start_update,
    ema_update_freq, ema_fp32, ema_seed_model); `device` moves an unsharded copy there; `skip_keys` are state
    dict keys copied instead of averaged."""

    def __init__(self, model: torch.nn.Module, config, device=None, skip_keys=None):
        self.config = config
        self.decay = config.ema_decay
        self.skip_keys = set(skip_keys or ())
        self.fp32_params: Dict[str, torch.Tensor] = {}
        self.update_freq_counter = 0
        state = model.state_dict()
        self.sharded = _is_sharded(state)
        if self.sharded:
            self.model = None
            self._shadow = {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}
            self._sharded_model = model  # the module tree get_model() copies (its weights are not used)
            self._gathered_model: Optional[torch.nn.Module] = None
        else:
            self.model = _without_patched_forwards(copy.deepcopy(model))
            self.model.requires_grad_(False)
            if device is not None:
                self.model = self.model.to(device=device)
        seed = config.ema_seed_model
        if seed is not None:
            self.restore(load_ema_from_checkpoint(seed)["model"], strict=True)
            logger.info(f"EMA seeded from the EMA weights of {seed} (--ema-seed-model)")
        if config.ema_fp32:
            self.build_fp32_params()

    # ---- upstream's accessors
    def get_model(self) -> torch.nn.Module:
        """The EMA as a model. Unsharded: the averaged copy itself (upstream's). FSDP2-sharded: a plain,
        unsharded copy of the model (its own classes, no FSDP hooks, no checkpoint wrappers, no
        requires_grad) holding the averaged weights gathered to full tensors on this rank's device. Gathering
        is collective (every rank must call get_model() together); the copy is made once and refilled on each
        call, so it shows the average as of the last call, and it holds a full copy of the weights on every
        rank from the first call on. Its forward runs on each rank alone."""
        if not self.sharded:
            return self.model
        if self._gathered_model is None:
            self._gathered_model = self._plain_model()
        targets = self._gathered_model.state_dict()
        missing = [k for k in self._shadow if k not in targets]
        if missing:
            raise RuntimeError(f"EMA.get_model(): the copy of the model has no entry {missing[0]} of the EMA")
        for key, value in self._shadow.items():  # one weight at a time: no second full copy in flight
            _copy_into(targets[key], value)
        return self._gathered_model

    def _plain_model(self) -> torch.nn.Module:
        """get_model()'s unsharded copy of the sharded model, its weights not yet filled."""
        tensor_parallel = [
            k for k, v in self._shadow.items() if is_dtensor(v) and "tp" in (v.device_mesh.mesh_dim_names or ())
        ]
        if tensor_parallel:  # "tp": fairseq.distributed.mesh's tensor-parallel dimension
            raise RuntimeError(
                f"EMA.get_model(): the model is split by tensor parallelism (e.g. {tensor_parallel[0]}), whose "
                "layers are changed to compute a part of the attention heads, so an unsharded copy would not "
                "run; use EMA.full_state_dict() (the gathered weights) or EMA.reverse(model) instead"
            )
        from fairseq.distributed.plain_copy import plain_copy  # deferred: startup (torch.distributed.fsdp: ~2 s)

        model = _without_patched_forwards(plain_copy(self._sharded_model))
        model.requires_grad_(False)
        return model

    def _state(self) -> Dict[str, torch.Tensor]:
        """The EMA weights by state-dict key (for an unsharded model: views of the copy's parameters)."""
        return self._shadow if self.sharded else self.model.state_dict()

    def get_decay(self) -> float:
        return self.decay

    def _set_decay(self, decay: float) -> None:
        self.decay = decay

    def build_fp32_params(self, state_dict: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """(Re)fill the fp32 copy of the EMA from `state_dict` (default: the EMA itself); --ema-fp32 only."""
        if not self.config.ema_fp32:
            raise RuntimeError("build_fp32_params needs ema_fp32=True (--ema-fp32)")
        source = state_dict if state_dict is not None else self._state()
        for key, value in source.items():
            if key in self.fp32_params:
                _copy_into(self.fp32_params[key], value)
            elif self.sharded and not is_dtensor(value) and key in self._shadow:
                self.fp32_params[key] = self._shadow[key].detach().float().clone()
                _copy_into(self.fp32_params[key], value)
            else:
                value = value.detach()
                self.fp32_params[key] = value.float().clone() if torch.is_floating_point(value) else value.clone()

    def restore(
        self, state_dict: Dict[str, torch.Tensor], build_fp32_params: bool = False, strict: bool = False
    ) -> None:
        """Load EMA weights (full tensors, or DTensors sharded like ours) into the EMA."""
        if self.sharded:
            missing = set(self._shadow) - set(state_dict)
            if strict and missing:
                raise KeyError(f"EMA state lacks {len(missing)} weights, e.g. {sorted(missing)[0]}")
            for key, value in state_dict.items():
                if key in self._shadow:
                    _copy_into(self._shadow[key], value)
        else:
            self.model.load_state_dict(state_dict, strict=strict)
        if build_fp32_params:
            self.build_fp32_params(state_dict)

    # ---- updates
    def step(self, new_model: torch.nn.Module, updates: Optional[int] = None) -> None:
        """One update from `new_model`'s weights, every ema_update_freq calls; `updates` (the update count)
        makes the decay 0 before ema_start_update."""
        if updates is not None:
            self._set_decay(0 if updates < self.config.ema_start_update else self.config.ema_decay)
        if self.config.ema_update_freq > 1:
            self.update_freq_counter += 1
            if self.update_freq_counter >= self.config.ema_update_freq:
                self._step_internal(new_model, updates)
                self.update_freq_counter = 0
        else:
            self._step_internal(new_model, updates)

    @torch.no_grad()
    def _step_internal(self, new_model: torch.nn.Module, updates: Optional[int] = None) -> None:
        fp32 = self.config.ema_fp32
        averaged_state = self.fp32_params if fp32 else self._state()
        averaged, weights, seen = [], [], set()
        for key, param in new_model.state_dict().items():
            if not torch.is_tensor(param) or "version" in key:  # upstream never decays a model.version buffer
                continue
            ema_param = averaged_state.get(key)
            if ema_param is None:  # a weight the EMA has not seen: it starts from the weight
                ema_param = averaged_state[key] = param.detach().float().clone() if fp32 else param.detach().clone()
            if ema_param.shape != param.shape:
                raise ValueError(
                    f"EMA weight {key} has shape {tuple(ema_param.shape)} but the model's has {tuple(param.shape)}"
                )
            local = _local(ema_param)
            if (local.data_ptr(), local.shape) in seen:  # a tied weight under a second name: average it once
                continue
            seen.add((local.data_ptr(), local.shape))
            if key in self.skip_keys or not torch.is_floating_point(ema_param):
                local.copy_(_local(param))
            else:
                averaged.append(local)
                weights.append(_local(param).to(ema_param.dtype))
        if averaged:  # the same arithmetic as upstream: ema *= decay; ema += (1 - decay) * weight
            torch._foreach_mul_(averaged, self.decay)
            torch._foreach_add_(averaged, weights, alpha=1 - self.decay)
        if fp32:
            state = self._state()
            for key, value in self.fp32_params.items():
                if key in state:
                    _local(state[key]).copy_(_local(value))

    def reverse(self, model: torch.nn.Module) -> torch.nn.Module:
        """Load the EMA weights into `model` (e.g. for evaluation); returns it."""
        state = dict(self._state())
        state.pop("_ema", None)
        target_sharded = _is_sharded(model.state_dict())
        if self.sharded and not target_sharded:
            state = self.full_state_dict()["ema"]
        model.load_state_dict(state, strict=False)
        return model

    # ---- checkpoint state (upstream's keys in extra_state)
    def state_dict(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """{"ema": weights[, "ema_fp32_params": fp32 copy]} as held (DTensors when sharded: for DCP)."""
        state = {"ema": dict(self._state())}
        if self.config.ema_fp32:
            state["ema_fp32_params"] = dict(self.fp32_params)
        return state

    def full_state_dict(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """state_dict() with full CPU tensors; collective when sharded (every rank must call it)."""
        return {
            group: {k: (v.full_tensor() if is_dtensor(v) else v).detach().cpu() for k, v in tensors.items()}
            for group, tensors in self.state_dict().items()
        }

    def load_checkpoint_state(self, extra_state: Dict, model_state: Dict[str, torch.Tensor]) -> None:
        """Upstream's resume rule: the checkpoint's EMA when it has one, else the EMA restarts from the
        checkpoint's model weights."""
        if extra_state.get("ema") is None:
            logger.warning(
                "--store-ema: the checkpoint has no EMA (extra_state['ema']); the EMA starts from its model weights"
            )
            self.restore(model_state, build_fp32_params=self.config.ema_fp32)
            return
        logger.info("loading the EMA from the checkpoint")
        self.restore(extra_state["ema"], build_fp32_params=False)
        if self.config.ema_fp32:
            self.build_fp32_params(extra_state.get("ema_fp32_params"))
