"""--lr-scheduler polynomial_decay: linear warmup, then polynomial decay to --end-learning-rate."""

from dataclasses import dataclass
from typing import Optional

from fairseq.dataclass.configs import opt
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler


@dataclass
class PolynomialDecayLRScheduleConfig:
    warmup_updates: int = opt(0, "warm the learning rate up linearly over the first N updates")
    force_anneal: Optional[int] = opt(None, "from this epoch on, keep the current learning rate as the peak")
    end_learning_rate: float = opt(0.0, "learning rate to decay to")
    zero_lr_warmup_steps: int = opt(0, "updates run at learning rate 0 before the warmup (to fill EMAs)")
    power: float = opt(1.0, "decay exponent (1: linear)")
    total_num_update: Optional[float] = opt(None, "updates over which to decay (default: --max-update)")


@register_lr_scheduler("polynomial_decay", dataclass=PolynomialDecayLRScheduleConfig)
class PolynomialDecayLRSchedule(FairseqLRScheduler):
    """With Z = --zero-lr-warmup-steps, W = --warmup-updates, T = --total-num-update, E = --end-learning-rate:
    lr = 0 for n <= Z; lr * (n - Z) / W for n <= Z + W (so update 0 runs at lr 0, as upstream);
    E for n >= T; otherwise (lr - E) * (1 - (n - Z - W) / (T - Z - W)) ** power + E."""

    def __init__(self, cfg, optimizer, lrs, max_update):
        super().__init__(cfg, optimizer, lrs, max_update)
        if cfg.warmup_updates < 0 or cfg.zero_lr_warmup_steps < 0:
            raise ValueError(
                f"--warmup-updates {cfg.warmup_updates} / --zero-lr-warmup-steps {cfg.zero_lr_warmup_steps}: "
                "pass 0 or more"
            )
        total = cfg.total_num_update if cfg.total_num_update is not None else max_update
        if not total or total <= 0:
            raise ValueError(
                "polynomial_decay needs the number of updates to decay over: pass --total-num-update N "
                "or --max-update N (N > 0)"
            )
        self.total_num_update = total
        self.lr = self.lrs[0]
        # Upstream's initial rate; the builder's step_update(0) then sets update 0's rate.
        self.set_lr(self.lr / cfg.warmup_updates if cfg.warmup_updates > 0 else self.lr)

    def lr_of_epoch(self, epoch: int) -> float:
        # Upstream indexes --lr by the epoch number itself here (fixed uses epoch - 1); kept as is.
        force_anneal = self.cfg.force_anneal
        if force_anneal is None or epoch < force_anneal:
            return self.lrs[min(epoch, len(self.lrs) - 1)]
        return self.get_lr()

    def _begin_epoch(self, epoch):
        self.lr = self.lr_of_epoch(epoch)

    def _lr_for_update(self, num_updates):
        zero_steps = self.cfg.zero_lr_warmup_steps
        warmup = self.cfg.warmup_updates
        if zero_steps > 0 and num_updates <= zero_steps:
            lr = 0.0
        elif warmup > 0 and num_updates <= warmup + zero_steps:
            lr = (num_updates - zero_steps) / float(warmup) * self.lr
        elif num_updates >= self.total_num_update:
            lr = self.cfg.end_learning_rate
        else:
            decay_start = warmup + zero_steps
            remaining = 1 - (num_updates - decay_start) / (self.total_num_update - decay_start)
            lr = (self.lr - self.cfg.end_learning_rate) * remaining**self.cfg.power + self.cfg.end_learning_rate
        self.set_lr(lr)
        return self.get_lr()
