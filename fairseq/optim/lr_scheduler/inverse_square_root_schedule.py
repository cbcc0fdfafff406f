"""--lr-scheduler inverse_sqrt: linear warmup, then decay with the inverse square root of the update."""

from dataclasses import dataclass

from fairseq.dataclass.configs import opt
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler


@dataclass
class InverseSquareRootLRScheduleConfig:
    warmup_updates: int = opt(4000, "warm the learning rate up linearly over the first N updates")
    warmup_init_lr: float = opt(-1.0, "learning rate at update 0 (negative: 0, or --lr without warmup)")


@register_lr_scheduler("inverse_sqrt", dataclass=InverseSquareRootLRScheduleConfig)
class InverseSquareRootSchedule(FairseqLRScheduler):
    """Before --warmup-updates W: lr = warmup_init_lr + n * (lr - warmup_init_lr) / W.
    From W on: lr = lr * sqrt(W) / sqrt(n), so the two meet at n = W."""

    def __init__(self, cfg, optimizer, lrs, max_update):
        super().__init__(cfg, optimizer, lrs, max_update)
        peak_lr = self._single_lr("inverse_sqrt")
        warmup = cfg.warmup_updates
        if warmup <= 0:
            # Upstream divides by zero here; the decay factor lr * sqrt(W) would also pin the rate at 0.
            raise ValueError(
                f"--warmup-updates {warmup}: inverse_sqrt needs at least 1 warmup update "
                "(its decay is anchored at the end of warmup); pass --warmup-updates N with N >= 1"
            )
        self.decay_factor = peak_lr * warmup**0.5
        self._start_linear_warmup(warmup, cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else 0.0, peak_lr)

    def _lr_for_update(self, num_updates):
        self.lr = self._warmup_lr(num_updates)
        if self.lr is None:
            self.lr = self.decay_factor * num_updates**-0.5
        self.set_lr(self.lr)
        return self.lr
