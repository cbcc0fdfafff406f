"""What a checkpoint holds for the Stateful parts of training, and how each part gets it back on resume: the
saved states read out of upstream's layout (`saved_state`), the --reset-* flags (`Resets`),
--optimizer-overrides, the meters (restored only mid-epoch) and the data position re-expressed for another world
size. fairseq.checkpoint.manager composes checkpoints and restores them through these."""

import ast
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

from fairseq.distributed.utils import get_rank
from fairseq.logging.log_line import without_run_only_meters

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.5 s to import: only where a checkpoint needs it
    from torch.distributed.checkpoint.stateful import Stateful

# fairseq-train resumed itself before resume moved to fairseq.checkpoint: the warning about another world size
# is still logged under fairseq-train's name.
_train_logger = logging.getLogger("fairseq_cli.train")


@dataclass
class SavedState:
    """The states a checkpoint holds for the Stateful parts of training (None: not in the file, or reset by a
    --reset-* flag)."""

    trainer: Optional[Dict[str, Any]] = None
    train_iterator: Optional[Dict[str, Any]] = None
    data_parallel_size: Optional[int] = None  # the world size whose data position train_iterator is
    metrics: Optional[Dict[str, Any]] = None
    best: Optional[float] = None
    val_loss: Optional[float] = None  # the validation value the checkpoint was written with
    extra_state: Optional[Dict[str, Any]] = None  # the file's extra_state as read (upstream's Trainer API returns it)


@dataclass(frozen=True)
class Resets:
    """Which saved states a restore leaves out (the --reset-* flags; upstream's Trainer.load_checkpoint arguments)."""

    optimizer: bool = False  # also the update count and the schedule (upstream: fine-tuning starts at update 0)
    lr_scheduler: bool = False
    meters: bool = False
    dataloader: bool = False

    @classmethod
    def from_config(cls, ckpt_cfg) -> "Resets":
        return cls(
            optimizer=ckpt_cfg.reset_optimizer,
            lr_scheduler=ckpt_cfg.reset_lr_scheduler,
            meters=ckpt_cfg.reset_meters,
            dataloader=ckpt_cfg.reset_dataloader,
        )


def saved_state(state: Dict[str, Any]) -> SavedState:
    """The parts' states in a checkpoint's `state` (upstream's layout)."""
    extra = state.get("extra_state") or {}
    return SavedState(
        trainer=_saved_trainer_state(state, extra),
        train_iterator=extra.get("train_iterator"),
        data_parallel_size=extra.get("data_parallel_size"),
        metrics=extra.get("metrics"),
        best=extra.get("best"),
        val_loss=extra.get("val_loss"),
        extra_state=extra,
    )


def written_at_epoch_end(train_iterator: Optional[Dict[str, Any]], val_loss: Optional[float]) -> bool:
    """Whether the checkpoint with this data position was written at an epoch's end (the iterator at the next
    epoch's start, with that end's validation value): the epoch-end scheduler step `step(epoch - 1, val_loss)`
    is still to be taken after loading it. save_last, at an epoch start, writes no val_loss."""
    return (
        bool(train_iterator)
        and train_iterator.get("iterations_in_epoch", 0) == 0
        and train_iterator["epoch"] > 1
        and val_loss is not None
    )


def parse_optimizer_overrides(text) -> Dict[str, Any]:
    """--optimizer-overrides: a Python dict literal (or a dict) of optimizer parameter-group values."""
    if isinstance(text, dict):
        return text
    try:
        overrides = ast.literal_eval(text or "{}")
    except (ValueError, SyntaxError):
        overrides = None
    if not isinstance(overrides, dict):
        raise ValueError(
            f"--optimizer-overrides {text!r}: expected a Python dict literal such as \"{{'weight_decay': 0.1}}\""
        )
    if "lr" in overrides:  # the scheduler sets every group's lr again at once (upstream loses it the same way)
        raise ValueError(
            f"--optimizer-overrides {text!r}: 'lr' would be replaced by the learning-rate scheduler at "
            "the next update; change the learning rate with --lr and --reset-lr-scheduler instead"
        )
    return overrides


def apply_optimizer_overrides(optimizer, overrides: Dict[str, Any]) -> None:
    """Set --optimizer-overrides' values in every parameter group of the restored `optimizer`."""
    known = sorted(k for k in optimizer.param_groups[0] if k != "params")
    unknown = sorted(set(overrides) - set(known))
    if unknown:  # a misspelt key would be added to every group and read by nothing
        raise ValueError(
            f"--optimizer-overrides: {', '.join(unknown)} is not an option of the optimizer's "
            f"parameter groups ({', '.join(known)})"
        )
    for group in optimizer.param_groups:
        group.update(overrides)


def restore_saved_meters(saved: SavedState, meters: "Stateful") -> bool:
    """Give `meters` their saved state when the checkpoint was written mid-epoch (at an epoch boundary the saved
    meters belong to the finished epoch, and the new one starts afresh, as upstream); True when restored."""
    position = saved.train_iterator
    restore = bool(position and position.get("iterations_in_epoch", 0) > 0 and saved.metrics)
    if restore:  # the saves' seconds are counted afresh (log_line.RUN_ONLY_METERS)
        meters.load_state_dict(without_run_only_meters(saved.metrics))
    return restore


def _saved_trainer_state(state: Dict[str, Any], extra: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """extra_state.trainer; from a file without it, what upstream's places hold (optimizer_history[-1]'s
    num_updates and lr_scheduler_state, extra_state.previous_training_time)."""
    if "trainer" in extra:
        return extra["trainer"]
    history = state.get("optimizer_history") or [{}]
    last = history[-1] if isinstance(history[-1], dict) else {}
    places = (
        ("num_updates", last, "num_updates"),
        ("lr_scheduler", last, "lr_scheduler_state"),
        ("train_time", extra, "previous_training_time"),
    )
    found = {key: where[name] for key, where, name in places if name in where}
    return found or None


def iterator_state_for_world_size(state: Dict[str, Any], saved_world: Optional[int], world_size: int) -> dict:
    """The data position `state` saved by `saved_world` ranks (None: by this world size), re-expressed for
    `world_size`: ranks take batches round-robin, so N ranks that each consumed k batches consumed N*k batches
    of the epoch together."""
    state = dict(state)
    saved_world = world_size if saved_world is None else saved_world
    if state.get("streaming") is not None:  # --task streaming_language_modeling: a global sample index
        if saved_world != world_size:
            _train_logger.warning(
                f"resuming a checkpoint saved by {saved_world} ranks on {world_size}: the streaming "
                f"data continues its global sequence at sample {state['streaming']['sample']:,}"
            )
        return state
    if saved_world != world_size:
        consumed = state["iterations_in_epoch"] * saved_world
        state["iterations_in_epoch"] = consumed // world_size
        left = consumed % world_size
        skipped = f" ({left} batch(es) of this epoch are skipped)" if left else ""
        if get_rank() == 0:  # one line for the job (a warning: every rank would print it)
            _train_logger.warning(
                f"resuming a checkpoint saved by {saved_world} ranks on {world_size}: continuing after batch "
                f"{consumed} of the epoch. Keep --batch-size/--max-tokens x --update-freq x ranks the same to keep "
                f"the same global batch{skipped}"
            )
    return state
