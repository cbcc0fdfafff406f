"""Upstream's `fairseq.optim.fp16_optimizer` names, mapped to what this fork's trainer does in fp16.

Upstream keeps fp16 weights with an fp32 master copy (`FP16Optimizer`) or updates fp16 weights in place
(`MemoryEfficientFP16Optimizer`). This fork keeps the weights in fp32 and runs forward and backward under
autocast (fairseq.training.precision), so the fp32 parameters are the master copy and the two differ in nothing. Both
classes here wrap the torch optimizer over those fp32 parameters and do what the trainer's fp16 update
(fairseq.training.train_step) does, in upstream's calls: the loss is multiplied by the dynamic loss scale
(`DynamicLossScaler`, upstream's rules), gradients are unscaled once and clipped to the global norm the trainer
uses, and an inf/nan norm lowers the scale and raises OverflowError (upstream's signal to skip the update). fp16
parameters are refused: autocast wants fp32 weights.

    optimizer = FP16Optimizer.build_optimizer(cfg, model.parameters())  # cfg: FairseqConfig
    optimizer.backward(loss)
    try:
        optimizer.clip_grad_norm(1.0)
        optimizer.step()
    except OverflowError:
        optimizer.zero_grad()
"""

import math
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from fairseq.dataclass.build import component_config
from fairseq.dataclass.configs import CommonConfig, OptimizationConfig
from fairseq.distributed.parallelize import clip_grad_norm_
from fairseq.optim import build_optimizer, set_lr
from fairseq.training.precision import DynamicLossScaler

__all__ = ["DynamicLossScaler", "FP16Optimizer", "MemoryEfficientFP16Optimizer"]


def _typed(group, dc):
    """A config group as dataclass `dc`: as given when it is one, else (upstream's tests pass partial DictConfigs,
    dicts or None) `dc` with the values it has and the defaults for the rest."""
    if isinstance(group, dc):
        return group
    if group is None:
        return dc()
    return component_config(dc, group if isinstance(group, Mapping) else vars(group))


def _loss_scaler(common: CommonConfig, data_parallel_size: int = 1, update_freq: int = 1) -> DynamicLossScaler:
    """The trainer's scaler for --fp16-init-scale, --fp16-scale-window (default: 2**14 updates over all
    replicas and micro-batches), --fp16-scale-tolerance, --threshold-loss-scale and --min-loss-scale."""
    window = common.fp16_scale_window
    if window is None:
        window = max(int(2**14 / data_parallel_size / update_freq), 1)
    return DynamicLossScaler(
        init_scale=common.fp16_init_scale,
        scale_window=window,
        tolerance=common.fp16_scale_tolerance,
        threshold=common.threshold_loss_scale,
        min_loss_scale=common.min_loss_scale,
    )


class _FP16OptimizerMixin:
    def __init__(self, cfg, params, fp32_optimizer, fp32_params=None, **kwargs):
        self.cfg = cfg
        self.fp32_optimizer = fp32_optimizer
        self.fp32_params = fp32_params if fp32_params is not None else self.params
        update_freq = _typed(cfg.optimization, OptimizationConfig).update_freq or [1]
        self.scaler = _loss_scaler(_typed(cfg.common, CommonConfig), update_freq=update_freq[0])
        self._grads_unscaled = True  # no scaled backward yet

    @classmethod
    def build_optimizer(cls, cfg, params, **kwargs):
        """The --optimizer of `cfg` (a FairseqConfig: its optimizer and optimization groups) over `params`."""
        params = [p for p in params if p.requires_grad]
        half = [p for p in params if p.dtype != torch.float32 and p.is_floating_point()]
        if half:
            raise ValueError(
                f"{cls.__name__}: this fork keeps parameters in fp32 and trains --fp16 under autocast; "
                f"got {half[0].dtype} parameters: build the model in fp32 (do not call .half())"
            )
        return cls(cfg, params, build_optimizer(cfg.optimizer, params, cfg.optimization), **kwargs)

    # ---- the wrapped optimizer
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.fp32_optimizer

    @property
    def params(self):
        return [p for group in self.fp32_optimizer.param_groups for p in group["params"]]

    @property
    def param_groups(self):
        return self.fp32_optimizer.param_groups

    def get_lr(self) -> float:
        return self.fp32_optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        set_lr(self.fp32_optimizer, lr)

    def state_dict(self) -> dict:
        state = self.fp32_optimizer.state_dict()
        state["loss_scale"] = self.scaler.loss_scale
        return state

    def load_state_dict(self, state_dict: dict, optimizer_overrides=None) -> None:
        state_dict = dict(state_dict)
        if "loss_scale" in state_dict:
            self.scaler.loss_scale = state_dict.pop("loss_scale")
        self.fp32_optimizer.load_state_dict(state_dict)

    # ---- the fp16 update
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the loss times the current loss scale (the gradients stay scaled until unscaled)."""
        (loss * self.scaler.loss_scale).backward()
        self._grads_unscaled = False

    def _unscale_grads(self, multiply_by: float = 1.0) -> None:
        factor = multiply_by if self._grads_unscaled else multiply_by / self.scaler.loss_scale
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
        self._grads_unscaled = True

    def multiply_grads(self, c: float) -> None:
        """Multiply the (unscaled) gradients by `c`."""
        self._unscale_grads(c)

    def clip_grad_norm(self, max_norm: float, aggregate_norm_fn: Optional[Callable] = None) -> torch.Tensor:
        """Unscale, clip to `max_norm` (0: measure only) and return the norm; on inf/nan the loss scale falls and
        OverflowError is raised (skip this update), FloatingPointError below --min-loss-scale."""
        self._unscale_grads()
        grad_norm = clip_grad_norm_(list(self.params), max_norm, aggregate_norm_fn=aggregate_norm_fn)
        if not math.isfinite(float(grad_norm)):
            self.scaler.update(overflow=True)
            raise OverflowError(f"setting loss scale to: {self.scaler.loss_scale}")
        return grad_norm

    def step(self, closure=None, groups=None) -> None:
        self._unscale_grads()
        self.fp32_optimizer.step(closure)
        self.scaler.update(overflow=False)

    def zero_grad(self) -> None:
        self.fp32_optimizer.zero_grad(set_to_none=True)
        self._grads_unscaled = True

    @property
    def supports_flat_params(self) -> bool:
        return False


class FP16Optimizer(_FP16OptimizerMixin):
    """Upstream's fp16 optimizer with fp32 master weights: here the fp32 parameters themselves."""


class MemoryEfficientFP16Optimizer(_FP16OptimizerMixin):
    """Upstream's fp16 optimizer without a master copy: here the same as FP16Optimizer (fp32 weights)."""
