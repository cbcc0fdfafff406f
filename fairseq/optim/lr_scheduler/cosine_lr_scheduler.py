"""--lr-scheduler cosine: linear warmup, then cosine cycles (SGDR, https://arxiv.org/abs/1608.03983)."""

import math
from dataclasses import dataclass

from fairseq.dataclass.configs import opt
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler


@dataclass
class CosineLRScheduleConfig:
    warmup_updates: int = opt(0, "warm the learning rate up linearly over the first N updates")
    warmup_init_lr: float = opt(-1.0, "learning rate at update 0 (negative: --min-lr)")
    min_lr: float = opt(0.0, "lowest learning rate of the first cycle (--lr is the highest)")
    t_mult: float = opt(1.0, "factor by which each cycle is longer than the previous one")
    lr_period_updates: float = opt(-1.0, "updates in the first cycle (default: --max-update minus warmup)")
    lr_shrink: float = opt(0.1, "factor applied to both --lr and --min-lr at each new cycle")


@register_lr_scheduler("cosine", dataclass=CosineLRScheduleConfig)
class CosineLRSchedule(FairseqLRScheduler):
    """Warmup from --warmup-init-lr to --lr over W updates; then, with c = n - W, cycle i of length
    t_i = period * t_mult**i, position t_curr in it and s = lr_shrink**i:
    lr = min_lr*s + 0.5 * (lr*s - min_lr*s) * (1 + cos(pi * t_curr / t_i))."""

    def __init__(self, cfg, optimizer, lrs, max_update):
        super().__init__(cfg, optimizer, lrs, max_update)
        self.max_lr = self._single_lr("cosine")
        # As upstream: a --min-lr above --lr is lowered to it (equal values give a constant rate).
        self.min_lr = min(cfg.min_lr, self.max_lr)
        if cfg.warmup_updates < 0:
            raise ValueError(f"--warmup-updates {cfg.warmup_updates} is negative; pass 0 or more")
        self.period = cfg.lr_period_updates
        if self.period <= 0:
            self.period = max_update - cfg.warmup_updates
            if self.period <= 0:
                raise ValueError(
                    f"cosine needs the cycle length: pass --lr-period-updates N, or --max-update larger than "
                    f"--warmup-updates (got --max-update {max_update}, --warmup-updates {cfg.warmup_updates})"
                )
        if cfg.t_mult <= 0:
            raise ValueError(f"--t-mult {cfg.t_mult} must be positive (1 for cycles of equal length)")
        warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else self.min_lr
        self._start_linear_warmup(cfg.warmup_updates, warmup_init_lr, self.max_lr)

    def _lr_for_update(self, num_updates):
        self.lr = self._warmup_lr(num_updates)
        if self.lr is None:
            since_warmup = num_updates - self.warmup_updates
            t_mult, period = self.cfg.t_mult, self.period
            if t_mult != 1:
                # Cycle lengths form a geometric series; invert its partial sum to find the cycle index.
                cycle = math.floor(math.log(1 - since_warmup / period * (1 - t_mult), t_mult))
                cycle_length = t_mult**cycle * period
                position = since_warmup - (1 - t_mult**cycle) / (1 - t_mult) * period
            else:
                cycle = math.floor(since_warmup / period)
                cycle_length = period
                position = since_warmup - period * cycle
            shrink = self.cfg.lr_shrink**cycle
            low, high = self.min_lr * shrink, self.max_lr * shrink
            self.lr = low + 0.5 * (high - low) * (1 + math.cos(math.pi * position / cycle_length))
        self.set_lr(self.lr)
        return self.lr
