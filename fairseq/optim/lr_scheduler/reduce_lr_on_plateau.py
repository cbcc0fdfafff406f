"""--lr-scheduler reduce_lr_on_plateau: multiply the learning rate by --lr-shrink when the validation metric
stops improving (upstream's schedule, built on torch.optim.lr_scheduler.ReduceLROnPlateau as upstream's is).

At the end of every epoch the trainer passes the epoch's validation value (--best-checkpoint-metric, "loss" by
default; larger is better with --maximize-best-checkpoint-metric). A value better than the best so far by more
than --lr-threshold (relative) resets the count of bad epochs; after more than --lr-patience bad epochs in a
row the rate is shrunk. An optional linear warmup runs from --warmup-init-lr (default 0 with warmup, else
--lr) to --lr over the first --warmup-updates updates (lr = init + n * (lr - init) / W for n <= W); epochs
that end during warmup leave the rate alone, as upstream's do.
"""

from dataclasses import dataclass

import torch

from fairseq.dataclass.configs import II, opt
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler


@dataclass
class ReduceLROnPlateauLRScheduleConfig:
    lr_shrink: float = opt(0.1, "shrink factor for annealing, lr_new = lr * lr_shrink")
    lr_threshold: float = opt(1e-4, "threshold for measuring the new optimum, to only focus on significant changes")
    lr_patience: int = opt(0, "number of epochs with no improvement after which learning rate will be reduced")
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    warmup_init_lr: float = opt(-1.0, "initial learning rate during warmup phase; default is --lr")
    maximize_best_checkpoint_metric: bool = II("checkpoint.maximize_best_checkpoint_metric", False)


@register_lr_scheduler("reduce_lr_on_plateau", dataclass=ReduceLROnPlateauLRScheduleConfig)
class ReduceLROnPlateauLRSchedule(FairseqLRScheduler):
    def __init__(self, cfg, optimizer, lrs, max_update):
        super().__init__(cfg, optimizer, lrs, max_update)
        if len(self.lrs) > 1:
            raise ValueError(
                f"--lr {','.join(map(str, self.lrs))}: reduce_lr_on_plateau takes one learning rate; "
                "pass one value, or use --lr-scheduler fixed for a learning rate per epoch"
            )
        if not 0.0 < cfg.lr_shrink < 1.0:
            raise ValueError(f"--lr-shrink {cfg.lr_shrink} must be in (0, 1), e.g. 0.5")
        if cfg.lr_patience < 0:
            raise ValueError(f"--lr-patience {cfg.lr_patience} is negative; pass 0 or more epochs")
        if cfg.warmup_updates < 0:
            raise ValueError(f"--warmup-updates {cfg.warmup_updates} is negative; pass 0 or more")
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer,
            patience=cfg.lr_patience,
            factor=cfg.lr_shrink,
            threshold=cfg.lr_threshold,
            mode="max" if cfg.maximize_best_checkpoint_metric else "min",
        )
        peak_lr = self.lrs[0]
        self.warmup_updates = cfg.warmup_updates
        if cfg.warmup_init_lr >= 0:
            self.warmup_init_lr = cfg.warmup_init_lr
        else:
            self.warmup_init_lr = 0.0 if self.warmup_updates > 0 else peak_lr
        self.lr_step = (peak_lr - self.warmup_init_lr) / self.warmup_updates if self.warmup_updates > 0 else 0.0
        self.warmup_end = self.warmup_updates <= 0
        self.set_lr(peak_lr if self.warmup_end else self.warmup_init_lr)

    @property
    def lr_scheduler(self):
        """Upstream's attribute name for the torch scheduler."""
        return self.plateau

    def state_dict(self) -> dict:
        """Upstream's keys (`best`, `last_epoch`) plus what an exact resume needs besides: the bad-epoch and
        cooldown counts and the current rate."""
        return {
            "best": self.plateau.best,
            "last_epoch": self.plateau.last_epoch,
            "num_bad_epochs": self.plateau.num_bad_epochs,
            "cooldown_counter": self.plateau.cooldown_counter,
            "lr": self.get_lr(),
        }

    def load_state_dict(self, state_dict: dict):
        """Also an upstream state (`best`, optionally `last_epoch`)."""
        self.plateau.best = state_dict["best"]
        if "last_epoch" in state_dict:
            self.plateau.last_epoch = state_dict["last_epoch"]
        for key in ("num_bad_epochs", "cooldown_counter"):
            if key in state_dict:
                setattr(self.plateau, key, state_dict[key])
        if "lr" in state_dict:
            self.set_lr(state_dict["lr"])

    def step(self, epoch: int, val_loss=None) -> float:
        """End of `epoch`: a validation value (once warmup is over) may shrink the rate."""
        if val_loss is not None and self.warmup_end:
            self.plateau.step(float(val_loss))
        else:
            self.plateau.last_epoch = epoch
        return self.step_update(self.num_updates)

    def _lr_for_update(self, num_updates: int) -> float:
        if self.warmup_updates > 0:
            if num_updates <= self.warmup_updates:
                self.set_lr(self.warmup_init_lr + num_updates * self.lr_step)
            else:
                self.warmup_end = True
        return self.get_lr()
