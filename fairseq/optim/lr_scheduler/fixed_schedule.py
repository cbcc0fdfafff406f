"""--lr-scheduler fixed: one learning rate per epoch from --lr, optional annealing and linear warmup."""

from dataclasses import dataclass
from typing import Optional

from fairseq.dataclass.configs import opt
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler


@dataclass
class FixedLRScheduleConfig:
    force_anneal: Optional[int] = opt(None, "from this epoch on, multiply the learning rate by --lr-shrink every epoch")
    lr_shrink: float = opt(0.1, "shrink factor for annealing: lr_new = lr * lr_shrink")
    warmup_updates: int = opt(0, "warm the learning rate up linearly over the first N updates")


@register_lr_scheduler("fixed", dataclass=FixedLRScheduleConfig)
class FixedLRSchedule(FairseqLRScheduler):
    """Epoch e (from 1) uses --lr's e-th value (the last one once the list runs out); from epoch
    --force-anneal on, the last value times lr_shrink ** (e + 1 - force_anneal). During the first
    --warmup-updates updates the rate is scaled by (num_updates + 1) / warmup_updates."""

    def __init__(self, cfg, optimizer, lrs, max_update):
        super().__init__(cfg, optimizer, lrs, max_update)
        if cfg.warmup_updates < 0:
            raise ValueError(f"--warmup-updates {cfg.warmup_updates} is negative; pass 0 or more")
        self.lr = self.lrs[0]

    def state_dict(self):
        return {"best": self.best, "lr": self.lr}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "lr" in state_dict:
            self.lr = state_dict["lr"]

    def lr_of_epoch(self, epoch: int) -> float:
        force_anneal = self.cfg.force_anneal
        if force_anneal is None or epoch < force_anneal:
            return self.lrs[min(max(epoch - 1, 0), len(self.lrs) - 1)]
        return self.lrs[-1] * self.cfg.lr_shrink ** (epoch + 1 - force_anneal)

    def _begin_epoch(self, epoch):
        self.lr = self.lr_of_epoch(epoch)

    def _lr_for_update(self, num_updates):
        warmup = self.cfg.warmup_updates
        if warmup > 0 and num_updates < warmup:
            self.set_lr((num_updates + 1) / float(warmup) * self.lr)
        else:
            self.set_lr(self.lr)
        return self.get_lr()
