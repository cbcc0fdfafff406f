"""Mixed precision: which dtype computes, autocast, and fp16 dynamic loss scaling.

Parameters stay fp32 in the optimizer. Without FSDP, `--bf16`/`--fp16` run the forward under autocast;
under FSDP2 the sharding policy casts parameters instead (see fairseq.distributed.parallelize), and
autocast is not used. fp16 needs loss scaling; its overflow check is the one host synchronization per
update that fp16 training pays (the step must know whether to skip).
"""

import contextlib
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def compute_dtype(common_cfg) -> torch.dtype:
    if common_cfg.fp16:
        return torch.float16
    if common_cfg.bf16:
        return torch.bfloat16
    return torch.float32


class DynamicLossScaler:
    """fairseq's dynamic loss scaling: halve on overflow, double after `scale_window` clean updates."""

    def __init__(self, init_scale=2.0**7, scale_window=2000, tolerance=0.0, threshold=None, min_loss_scale=1e-4):
        self.loss_scale = float(init_scale)
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self.min_loss_scale = min_loss_scale
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0

    def update(self, overflow: bool) -> bool:
        """Record one update's outcome; returns True when the update must be skipped."""
        if overflow:
            previous_scale = self.loss_scale
            iters_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            if self._overflows_since_rescale / float(iters_since_rescale) >= self.tolerance:
                self.loss_scale /= 2.0
                if self.threshold is not None:  # upstream's threshold is a floor
                    self.loss_scale = max(self.loss_scale, self.threshold)
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale <= self.min_loss_scale:
                self.loss_scale = previous_scale
                raise FloatingPointError(
                    f"minimum loss scale reached ({self.min_loss_scale}): the loss is probably diverging; "
                    "lower --lr, raise --warmup-updates, or train with --bf16 instead of --fp16"
                )
        elif (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= 2.0
            self._last_rescale_iter = self._iter
        self._iter += 1
        return overflow

    def state_dict(self):
        return {
            "loss_scale": self.loss_scale,
            "iter": self._iter,
            "last_overflow_iter": self._last_overflow_iter,
            "last_rescale_iter": self._last_rescale_iter,
            "overflows_since_rescale": self._overflows_since_rescale,
        }

    def load_state_dict(self, state):
        self.loss_scale = state["loss_scale"]
        self._iter = state["iter"]
        self._last_overflow_iter = state["last_overflow_iter"]
        self._last_rescale_iter = state["last_rescale_iter"]
        self._overflows_since_rescale = state["overflows_since_rescale"]


class Precision:
    """Everything the train step needs to know about the numeric format."""

    def __init__(
        self, common_cfg, device: torch.device, sharded: bool, data_parallel_size: int = 1, update_freq: int = 1
    ):
        self.dtype = compute_dtype(common_cfg)
        if self.dtype == torch.float16 and device.type != "cuda":
            raise ValueError("--fp16 needs a CUDA device; on CPU train in fp32 or with --bf16")
        self.device_type = device.type
        # FSDP2 casts parameters itself; autocast would only add casts around every op.
        self.use_autocast = self.dtype != torch.float32 and not sharded
        self.scaler: Optional[DynamicLossScaler] = None
        if self.dtype == torch.float16:
            window = common_cfg.fp16_scale_window
            if window is None:  # upstream's default: 2**14 updates across all replicas and micro-batches
                window = max(int(2**14 / data_parallel_size / update_freq), 1)
            self.scaler = DynamicLossScaler(
                init_scale=common_cfg.fp16_init_scale,
                scale_window=window,
                tolerance=common_cfg.fp16_scale_tolerance,
                threshold=common_cfg.threshold_loss_scale,
                min_loss_scale=common_cfg.min_loss_scale,
            )

    def autocast(self):
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.loss_scale if self.scaler is not None else loss

    def state_dict(self):
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state):
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
