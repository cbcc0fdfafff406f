"""Upstream's `fairseq.trainer` (the module `fairseq.trainer` is this one): `Trainer` is the core's
fairseq.training.trainer.Trainer plus upstream's methods that only Python scripts driving training as upstream's
train.py does call (`checkpoint_utils.load_checkpoint` / `save_checkpoint` go through them). fairseq-train uses
the core class. The core module's other names are reachable here too, as they were under this name."""

import logging
from typing import Any, Dict, Optional

from fairseq.checkpoint.manager import CheckpointManager, Resets, restore_saved_meters
from fairseq.checkpoint.paths import existing_checkpoint
from fairseq.logging import metrics
from fairseq.training import trainer as _core
from fairseq.training.batch_iterators import trainer_iterator

logger = logging.getLogger("fairseq.trainer")  # upstream's logger name, as the core trainer's


class UpstreamTrainerMethods:
    """Thin layers over fairseq.checkpoint.manager (the one restore) and fairseq.training.batch_iterators (the
    one iterator builder), mixed into upstream's Trainer."""

    @property
    def checkpoint_manager(self):
        """The CheckpointManager of this trainer's config that upstream's `checkpoint_utils.load_checkpoint` /
        `save_checkpoint` go through (it tracks the best validation value between them)."""
        if getattr(self, "_checkpoint_manager", None) is None:
            self._checkpoint_manager = CheckpointManager(self.cfg)
        return self._checkpoint_manager

    @property
    def checkpoint_suffix(self) -> str:
        """--checkpoint-suffix (a sharded checkpoint is one directory: no per-rank suffix)."""
        return self.cfg.checkpoint.checkpoint_suffix or ""

    def get_num_updates(self) -> int:
        return self.num_updates

    def lr_step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        """The scheduler's end-of-epoch step; returns the learning rate."""
        self.step_epoch_end(epoch, val_loss)
        return self.get_lr()

    def load_checkpoint(
        self,
        filename: str,
        reset_optimizer: bool = False,
        reset_lr_scheduler: bool = False,
        optimizer_overrides: Optional[Dict[str, Any]] = None,
        reset_meters: bool = False,
    ) -> Optional[Dict[str, Any]]:
        """Upstream's: load the checkpoint `filename` (a file or sharded directory) into model, optimizer and
        this trainer (the --reset-* semantics of fairseq-train) and, when it was written mid-epoch and
        `reset_meters` is off, the meters. Returns its extra_state ("train_iterator", "val_loss", "best", ...;
        the caller positions the iterator), or None when `filename` does not exist. `optimizer_overrides`
        ({"lr": ...}) update every parameter group of the loaded optimizer."""
        path = existing_checkpoint(filename)
        if path is None:
            logger.info(f"no existing checkpoint found {filename}")
            return None
        manager = self.checkpoint_manager
        saved = manager.restore(
            self,
            path,
            Resets(optimizer=reset_optimizer, lr_scheduler=reset_lr_scheduler, meters=reset_meters),
            optimizer_overrides,
        )
        if reset_optimizer or reset_meters:  # upstream's rule: a fine-tuning start does not inherit the best value
            manager.best = None
        restore_saved_meters(saved, metrics)  # (reset_meters: restore left them out)
        return saved.extra_state

    def get_train_iterator(
        self,
        epoch: int,
        combine: bool = True,
        load_dataset: bool = True,
        data_selector=None,
        shard_batch_itr: bool = True,
        disable_iterator_cache: bool = False,
    ):
        """Upstream's: the training batch iterator of `epoch` (fairseq.training.batch_iterators.trainer_iterator, as
        fairseq-train builds it; `combine` reads train, train1, ... as one split)."""
        return trainer_iterator(
            self.cfg,
            self.task,
            self,
            epoch,
            combine=combine,
            load_dataset=load_dataset,
            data_selector=data_selector,
            shard=shard_batch_itr,
            disable_iterator_cache=disable_iterator_cache,
        )


class Trainer(UpstreamTrainerMethods, _core.Trainer):
    __doc__ = _core.Trainer.__doc__


def __getattr__(name):
    return getattr(_core, name)  # select_device, move_to_device, check_finite, ...
