"""Base class of the learning-rate schedulers: the interface the trainer calls."""

from typing import List, Optional

from fairseq.optim import get_lr, set_lr


class FairseqLRScheduler:
    """Sets the learning rate of a torch optimizer as training advances.

    The trainer calls `step_begin_epoch(epoch)` when an epoch starts (epochs count from 1), `step(epoch,
    val_loss)` when it ends, and `step_update(num_updates)` after every update. Each sets and returns the
    learning rate for the next update. Upstream's trainer follows the two epoch calls with
    `step_update(num_updates)`, because the update count is what most schedules follow; here the epoch
    calls do that themselves with the last count seen, so callers get upstream's rates either way.

    Subclasses take (cfg, optimizer, lrs, max_update): their config dataclass, the optimizer, the --lr list
    and --max-update, and implement `_lr_for_update(num_updates)` (set the rate and return it) and, when
    the epoch matters, `_begin_epoch(epoch)`.
    """

    def __init__(self, cfg, optimizer, lrs: List[float], max_update: int):
        self.cfg = cfg
        self.optimizer = optimizer
        self.lrs = list(lrs)
        self.max_update = max_update
        self.num_updates = 0  # the last count given to step_update
        self.best: Optional[float] = None  # lowest validation loss seen, saved in checkpoints as upstream

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict):
        self.best = state_dict.get("best")

    def get_lr(self) -> float:
        return get_lr(self.optimizer)

    def set_lr(self, lr: float):
        set_lr(self.optimizer, lr)

    def step_begin_epoch(self, epoch: int) -> float:
        self._begin_epoch(epoch)
        return self.step_update(self.num_updates)

    def step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        if val_loss is not None:
            self.best = val_loss if self.best is None else min(self.best, val_loss)
        return self.step_update(self.num_updates)

    def step_update(self, num_updates: int) -> float:
        self.num_updates = num_updates
        return self._lr_for_update(num_updates)

    def _begin_epoch(self, epoch: int):
        """Epoch-start hook of schedules that follow epochs."""

    def _lr_for_update(self, num_updates: int) -> float:
        return self.get_lr()

    def _start_linear_warmup(self, warmup_updates: int, warmup_init_lr: float, peak_lr: float) -> None:
        """A linear warm-up from `warmup_init_lr` (the rate set now) to `peak_lr` over `warmup_updates` updates,
        in upstream's attributes (warmup_updates, warmup_init_lr, lr_step, lr); `_warmup_lr` reads it."""
        self.warmup_updates = warmup_updates
        self.warmup_init_lr = warmup_init_lr
        # (upstream's cosine keeps lr_step 1 without warm-up; no update reads it then)
        self.lr_step = (peak_lr - warmup_init_lr) / warmup_updates if warmup_updates > 0 else 1
        self.lr = warmup_init_lr
        self.set_lr(self.lr)

    def _warmup_lr(self, num_updates: int) -> Optional[float]:
        """The warm-up's rate after `num_updates` updates, None once it is over."""
        if num_updates < self.warmup_updates:
            return self.warmup_init_lr + num_updates * self.lr_step
        return None

    def _single_lr(self, scheduler_name: str) -> float:
        if len(self.lrs) > 1:
            raise ValueError(
                f"--lr {','.join(map(str, self.lrs))}: {scheduler_name} takes one learning rate; "
                "pass one value, or use --lr-scheduler fixed for a learning rate per epoch"
            )
        return self.lrs[0]
