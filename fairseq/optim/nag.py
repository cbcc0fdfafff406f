"""--optimizer nag: upstream fairseq's Nesterov accelerated gradient, with its flags and update rule.

Per parameter p with gradient g, momentum m, weight decay wd and learning rate lr (lr_old: the rate of the
previous step, so that a schedule changing lr rescales the buffer, lr_correct = lr / lr_old):

    p   <- p * (1 - lr * wd)                                   (when wd != 0)
    p   <- p + m**2 * lr_correct * buf - (1 + m) * lr * g
    buf <- m * lr_correct * buf - lr * g                       (buf starts at 0)

computed in fp32 (fp64 for fp64 parameters). `lr_old` lives in the parameter group, `momentum_buffer` in
the state, as upstream's.
"""

from dataclasses import dataclass
from typing import Iterable

import torch
from torch.optim.optimizer import Optimizer, required

from fairseq.dataclass.configs import opt
from fairseq.optim import register_optimizer


@dataclass
class NAGConfig:
    momentum: float = opt(0.99, "momentum factor")
    weight_decay: float = opt(0.0, "weight decay")


class NAG(Optimizer):
    def __init__(self, params, lr=required, momentum: float = 0.0, weight_decay: float = 0.0):
        defaults = dict(lr=lr, lr_old=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @property
    def supports_flat_params(self) -> bool:
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            weight_decay, momentum = group["weight_decay"], group["momentum"]
            lr = float(group["lr"])
            lr_old = float(group.get("lr_old", lr))
            # Upstream's guard: after a step at lr 0 (e.g. a state initialized with lr 0) the buffer is 0 anyway.
            lr_correct = lr / lr_old if lr_old > 0 else lr
            for p in group["params"]:
                if p.grad is None:
                    continue
                low_precision = p.dtype in (torch.float16, torch.bfloat16)
                p32 = p.float() if low_precision else p
                grad = p.grad.to(p32.dtype)  # (upstream casts to fp32 always, fp64 gradients too)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                else:
                    state["momentum_buffer"] = state["momentum_buffer"].to(grad)
                buf = state["momentum_buffer"]
                if weight_decay != 0:
                    p32.mul_(1 - lr * weight_decay)
                p32.add_(buf, alpha=momentum * momentum * lr_correct)
                p32.add_(grad, alpha=-(1 + momentum) * lr)
                buf.mul_(momentum * lr_correct).add_(grad, alpha=-lr)
                if low_precision:
                    p.copy_(p32)
            group["lr_old"] = lr
        return loss


@register_optimizer("nag", dataclass=NAGConfig)
class FairseqNAG:
    """Builds NAG from upstream's flags (--momentum, --weight-decay; the rate is the first --lr)."""

    @classmethod
    def build_optimizer(cls, cfg, params: Iterable, lr: float) -> torch.optim.Optimizer:
        if lr < 0:
            raise ValueError(f"--lr {lr} is negative; pass a learning rate >= 0")
        if not 0.0 <= cfg.momentum < 1.0:
            raise ValueError(f"--momentum {cfg.momentum} must be in [0, 1), e.g. 0.99")
        if cfg.weight_decay < 0:
            raise ValueError(f"--weight-decay {cfg.weight_decay} is negative; pass a value >= 0 such as 5e-06")
        params = list(params)
        if not params:
            raise ValueError("the optimizer got no parameters; does the model have trainable parameters?")
        return NAG(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
