"""Save and restore training checkpoints: which names to write, what goes in them, and how to resume.

A checkpoint is composed here, and only here, from the states of the Stateful parts of training (each one's
`state_dict()` read once): the trainer (update count, scheduler, loss scaler, training time), the epoch batch
iterator (data position) and the meters (fairseq.logging.metrics), beside model, optimizer and this manager's
best validation value. `CheckpointManager.resume` gives each part its state back (what each part's state is in
a file, and how it is given back: fairseq.checkpoint.resume_state).

Layout of a single-file checkpoint (upstream's keys, plain containers only):
  cfg, criterion, optimizer_history [{criterion_name, optimizer_name, lr_scheduler_state, num_updates}],
  task_state, extra_state {train_iterator, val_loss, best, metrics, previous_training_time, trainer,
  data_parallel_size[, ema, ema_fp32_params]}, model, last_optimizer_state; and the fork's vocabulary (the
  dictionary's fingerprint and the --bpe files: fairseq.checkpoint.vocabulary).
task_state is the task's state_dict() (empty for the built-in tasks), given back to the task on resume.
extra_state.trainer is the trainer's state. optimizer_history[-1]'s lr_scheduler_state and num_updates and
extra_state.previous_training_time are upstream's places for parts of it: written for upstream's tools, read
only from files without extra_state.trainer. A sharded checkpoint has the same keys: model and optimizer in
DCP shards, the others in its metadata.pt.
"""

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from fairseq.checkpoint import sharded
from fairseq.checkpoint.io import CheckpointError, CorruptCheckpointError, NotACheckpointError, load_checkpoint_file
from fairseq.checkpoint.fit import check_architecture, check_same_model_options, model_state_for_checking
from fairseq.checkpoint.legacy import is_legacy_checkpoint, upgrade_legacy_checkpoint
from fairseq.checkpoint.paths import (
    checkpoint_stems,
    enters_kept_best,
    existing_checkpoint,
    intact_checkpoints,
    newer_than_last,
    prune_checkpoints,
    resolve_restore_path,
)
from fairseq.checkpoint.resume_state import (
    Resets,
    SavedState,
    apply_optimizer_overrides,
    iterator_state_for_world_size,
    parse_optimizer_overrides,
    restore_saved_meters,
    saved_state,
    written_at_epoch_end,
)
from fairseq.checkpoint.vocabulary import KEY as VOCABULARY_KEY, carried, check_dictionary, make_record
from fairseq.checkpoint.save_dir import SaveDirLock, check_writable, remove_stale_temporaries
from fairseq.checkpoint.saving import sharded_checkpoint_write, single_file_checkpoint_write
from fairseq.checkpoint.writer import AsyncMode, CheckpointWriter, Write, wait_advice
from fairseq.dataclass.utils import config_to_dict
from fairseq.distributed.utils import barrier, broadcast_from_master, get_data_parallel_world_size, get_rank
from fairseq.distributed.launch import process_group_timeout
from fairseq.logging import metrics
from fairseq.logging.log_line import log_checkpoint_times

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.5 s to import: only where a checkpoint needs it
    from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What training continues with: the epoch iterator at the checkpoint's data position, whether the meters
    were restored (only from a checkpoint written mid-epoch), and the best validation value so far."""

    epoch_itr: Any
    meters_restored: bool = False
    best: Optional[float] = None
    # Written at an epoch's end (the iterator at the next epoch's start, with that end's validation value): so
    # before the trainer's epoch-end scheduler step, which follows validation and saving; the caller takes it.
    at_epoch_end: bool = False
    val_loss: Optional[float] = None


class CheckpointManager:
    def __init__(self, cfg):
        self.cfg = cfg
        self.ckpt_cfg = cfg.checkpoint
        self.sharded = cfg.distributed_training.use_sharded_state  # validate(cfg) checked it needs fully_sharded
        self.best: Optional[float] = None
        self._patience_best: Optional[float] = None
        self._validations_without_improvement = 0
        self._lock: Optional[SaveDirLock] = None
        self._vocabulary: Optional[Dict[str, Any]] = None  # vocabulary.make_record, read once per run
        # --write-checkpoints-asynchronously: saves write in the background (fairseq.checkpoint.writer)
        self.writer = CheckpointWriter(
            AsyncMode.for_run(self.ckpt_cfg.write_checkpoints_asynchronously, cuda=not cfg.common.cpu),
            timeout=process_group_timeout(cfg.distributed_training),
        )
        self._previous_save: Optional[Tuple[int, float]] = None  # (update, time) of the last save: for the advice
        self._advised = False

    def carry_vocabulary(self, task) -> None:
        """Read what every checkpoint of this run carries about its text (the dictionary's fingerprint, the
        --bpe files), once, at start-up."""
        self._vocabulary = make_record(getattr(task, "source_dictionary", None), self.cfg.bpe)

    def open_save_dir(self) -> None:
        """Start-up, on every rank: lock --save-dir against a second run and remove temporaries of killed saves
        (rank 0), then check that it is writable where this rank will write (rank 0; every rank with sharded state).
        With --no-save nothing is checked (a preemption save may then still fail, with a one-line error)."""
        if self.ckpt_cfg.no_save:
            return
        save_dir = self.ckpt_cfg.save_dir
        if get_rank() == 0:
            lock = SaveDirLock(save_dir)
            lock.acquire()
            self._lock = lock
            remove_stale_temporaries(save_dir)  # before the probe: on a full disk they may hold the space
        if self.sharded:
            barrier()  # every rank probes after the clean-up
        if get_rank() == 0 or self.sharded:
            check_writable(save_dir)

    def close(self) -> None:
        """End of the run, also after an error: wait for a background write in flight (its error is logged),
        then release the --save-dir lock (the end of the process releases it too)."""
        self.writer.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def with_checkpoint_config(self, ckpt_cfg) -> "CheckpointManager":
        """This run's manager writing under other checkpoint options (upstream's `checkpoint_utils.save_checkpoint(
        cfg, trainer, ...)` with a cfg of its own): their save dir, names, intervals and retention; the run's
        config, vocabulary and best value at the time (the caller copies `best` back). It neither locks nor
        releases a --save-dir."""
        view = copy.copy(self)
        view.ckpt_cfg = ckpt_cfg
        view._lock = None
        return view

    def _is_better(self, a: float, b: float, ties: bool = False) -> bool:
        if ties and a == b:
            return True
        return a > b if self.ckpt_cfg.maximize_best_checkpoint_metric else a < b

    def should_stop_early(self, valid_loss: Optional[float]) -> bool:
        """--patience: True after that many validations in a row without improvement."""
        patience = self.ckpt_cfg.patience
        if valid_loss is None or patience <= 0:
            return False
        if self._patience_best is None or self._is_better(valid_loss, self._patience_best):
            self._patience_best, self._validations_without_improvement = valid_loss, 0
            return False
        self._validations_without_improvement += 1
        if self._validations_without_improvement >= patience:
            logger.info(f"early stop since valid performance hasn't improved for the last {patience} runs")
            return True
        return False

    # ------------------------------------------------------------------ save
    def save(
        self, trainer, epoch_itr, val_loss: Optional[float], end_of_epoch: bool, metrics_state: Optional[dict] = None
    ) -> List[str]:
        """Write the checkpoints due at this point; every rank must call this (state gathering is collective).
        With --write-checkpoints-asynchronously the files are written in the background: the paths returned
        are complete once `wait_for_write` returns."""
        is_best = val_loss is not None and (self.best is None or self._is_better(val_loss, self.best, ties=True))
        if is_best:  # tracked even with --no-save: the valid lines report best_loss
            self.best = val_loss
        if self.ckpt_cfg.no_save:
            return []
        started = time.perf_counter()
        written = self.wait_for_write("before the next save")  # the listing below must see its names and retention
        # Rank 0's listing decides: on node-local disks other ranks see other directories, and every rank
        # must write the same stems.
        among_kept_best = False
        if self.ckpt_cfg.keep_best_checkpoints > 0 and val_loss is not None:  # the same on every rank
            among_kept_best = broadcast_from_master(
                enters_kept_best(self.ckpt_cfg, self.ckpt_cfg.save_dir, val_loss) if get_rank() == 0 else None
            )
        stems = checkpoint_stems(
            self.ckpt_cfg, epoch_itr.epoch, trainer.num_updates, end_of_epoch, is_best, val_loss, among_kept_best
        )
        if stems:
            self._advise_interval(written, trainer.num_updates, started)
        return self._write(stems, trainer, epoch_itr, val_loss, metrics_state, started)

    def save_last(self, trainer, epoch_itr, metrics_state: Optional[dict] = None) -> List[str]:
        """checkpoint_last only (preemption): even with --no-save or --no-last-checkpoints, since the
        restarted job needs it to continue. After the write in flight, written before returning."""
        started = time.perf_counter()
        self.wait_for_write("before the preemption checkpoint")
        return self._write(
            [f"checkpoint_last{self.ckpt_cfg.checkpoint_suffix}"],
            trainer,
            epoch_itr,
            None,
            metrics_state,
            started,
            now=True,
        )

    def poll_write(self) -> None:
        """At every update: a background write that completed is counted in the log line (save_wall); the error
        of one that failed is raised here, the one line a synchronous save would have raised."""
        log_checkpoint_times(written=self.writer.poll())

    def wait_for_write(self, before: str = "at the end of training") -> Optional[float]:
        """Wait for the background write in flight (logged with how long, `before` saying what waits); raises
        its error; returns its seconds (None when none was in flight)."""
        written = self.writer.wait(before)
        log_checkpoint_times(written=written)
        return written

    def _advise_interval(self, written: Optional[float], update: int, started: float) -> None:
        """Once per run: a save that had to wait for the previous write warns with that write's time and an
        interval that would not wait."""
        previous, self._previous_save = self._previous_save, (update, started)
        if self._advised or previous is None or written is None or self.writer.waited <= 0:
            return
        self._advised = True
        logger.warning(
            wait_advice(
                written,
                update - previous[0],
                started - previous[1],
                interval_flag=self.ckpt_cfg.save_interval_updates > 0,
            )
        )

    def _write(
        self, stems, trainer, epoch_itr, val_loss, metrics_state, started: float, now: bool = False
    ) -> List[str]:
        """Write `stems`: the state is staged now, the files are written by the writer (now, or in its thread;
        `now`: in the loop whatever the mode); `started`: when this save began (what training is blocked for is
        measured from there)."""
        if not stems:
            return []
        waited = time.perf_counter() - started
        trainer.check_weights_finite()
        save_dir = self.ckpt_cfg.save_dir
        os.makedirs(save_dir, exist_ok=True)
        begun = time.perf_counter()
        state = copy.deepcopy(self._compose(trainer, epoch_itr, val_loss, metrics_state))  # plain values
        composed = time.perf_counter() - started - waited
        with_optimizer = not self.ckpt_cfg.no_save_optimizer_state
        if self.sharded:
            paths = [os.path.join(save_dir, s) for s in stems]
            staged, write = sharded_checkpoint_write(self.writer, paths, trainer, state, with_optimizer)
        else:
            paths = [os.path.join(save_dir, s + ".pt") for s in stems]
            staged, write = single_file_checkpoint_write(self.writer, paths, trainer, state, with_optimizer)
        what = f"{paths[0]} (epoch {epoch_itr.epoch} @ {trainer.num_updates} updates, score {val_loss})"

        def publish():  # the names and the retention act only on a write that completed
            write.publish()
            if get_rank() == 0:
                for removed in prune_checkpoints(self.ckpt_cfg, save_dir):
                    logger.info(f"removed old checkpoint {removed}")
                copied = staged.copy_seconds()
                copy_note = "" if copied is None else f"; device-to-host copy {copied:.2f} s"
                logger.info(
                    f"saved checkpoint {what} (writing took {time.perf_counter() - begun:.2f} seconds{copy_note})"
                )

        written = self.writer.run(Write(write.bytes, publish), paths[0], begun, now=now)
        blocked = time.perf_counter() - started
        if written is None:
            phases = {"wait": waited, "compose": composed, **staged.times.as_dict()}
            logger.info(
                f"writing checkpoint {what} in the background; training was blocked {blocked:.2f} seconds "
                f"({', '.join(f'{name} {seconds:.2f}' for name, seconds in phases.items())})"
            )
        else:
            barrier()
        # A background write's time is counted when it completes (poll_write); 0 now keeps the meters the same
        # in either mode (the checkpoints hold them).
        log_checkpoint_times(blocked=blocked, written=written or 0.0)
        return paths

    def _compose(self, trainer, epoch_itr, val_loss, metrics_state) -> Dict[str, Any]:
        """Upstream's layout (the writer adds model and optimizer) from the parts' states."""
        trainer_state = trainer.state_dict()
        names = trainer.component_names
        return {
            "cfg": config_to_dict(self.cfg),
            "criterion": {},
            "optimizer_history": [
                {
                    "criterion_name": names["criterion"],
                    "optimizer_name": names["optimizer"],
                    # upstream's places for two of the trainer's values (extra_state.trainer), for upstream's tools
                    "lr_scheduler_state": copy.deepcopy(trainer_state["lr_scheduler"]),
                    "num_updates": trainer_state["num_updates"],
                }
            ],
            "task_state": trainer.task.state_dict(),
            "extra_state": {
                "train_iterator": epoch_itr.state_dict(),
                "val_loss": val_loss,
                "best": self.best,
                "metrics": metrics_state or {},
                "previous_training_time": trainer_state["train_time"],
                "trainer": trainer_state,
                "data_parallel_size": trainer.data_parallel_size,
            },
            VOCABULARY_KEY: self._vocabulary_of(trainer),  # the fork's: after upstream's keys
        }

    def _vocabulary_of(self, trainer) -> Dict[str, Any]:
        if self._vocabulary is None:  # upstream's save_checkpoint(cfg.checkpoint, trainer, ...) path
            self.carry_vocabulary(getattr(trainer, "task", None))
        return self._vocabulary

    # ------------------------------------------------------------------ resume
    def resume(self, trainer, make_iterator: Callable[[int], Any], meters: "Stateful" = metrics) -> Resumed:
        """Continue from --restore-file (default checkpoint_last), else start from --finetune-from-model's
        weights or from scratch.

        Restores model, optimizer, the trainer's state and the best validation value (as the --reset-* flags
        allow), builds the iterator of the saved epoch with `make_iterator(epoch)` and puts it at the saved data
        position (re-expressed for this world size), and restores `meters` when the checkpoint was written
        mid-epoch: at an epoch boundary the saved meters belong to the finished epoch, and the new one starts
        afresh (upstream)."""
        saved = self._restore(trainer) or SavedState()
        position = saved.train_iterator
        epoch_itr = make_iterator(1 if position is None else position["epoch"])
        if position is not None:
            epoch_itr.load_state_dict(
                iterator_state_for_world_size(position, saved.data_parallel_size, get_data_parallel_world_size())
            )
        restore_meters = restore_saved_meters(saved, meters)
        at_epoch_end = written_at_epoch_end(position, saved.val_loss)
        return Resumed(
            epoch_itr,
            meters_restored=restore_meters,
            best=self.best,
            at_epoch_end=at_epoch_end,
            val_loss=saved.val_loss,
        )

    def _restore(self, trainer) -> Optional[SavedState]:
        """Load the checkpoint to resume into model, optimizer and trainer (or --finetune-from-model's weights
        into the model); returns the states left for the other parts, None for a fresh start."""
        ck = self.ckpt_cfg
        choice = choose_restore(ck)
        if choice.finetune:
            self._load_weights_only(trainer, choice.path)
            return None
        path = existing_checkpoint(choice.path)
        if path is None:
            return None
        if ck.finetune_from_model:
            logger.info(f"found {path}: resuming it and ignoring --finetune-from-model")
        return self.restore(trainer, path, choice.resets, parse_optimizer_overrides(ck.optimizer_overrides))

    def restore(
        self, trainer, path: str, resets: Resets, optimizer_overrides: Optional[Dict[str, Any]] = None
    ) -> SavedState:
        """Load the checkpoint `path` (an existing file or sharded directory) into model, optimizer and trainer,
        leaving out what `resets` names, then sets `optimizer_overrides` (--optimizer-overrides, e.g.
        {"weight_decay": ...}) in every parameter group of the restored optimizer; returns the states left for the other
        parts (the iterator position, the meters) and sets the best validation value. fairseq-train's resume
        and upstream's `Trainer.load_checkpoint` both come here."""
        logger.info(f"loading checkpoint {path}")
        try:
            state = self.read(path, trainer, resuming=True, load_optimizer=not resets.optimizer)
        except (CorruptCheckpointError, NotACheckpointError) as err:
            raise type(err)(f"{err}. {self._alternatives(path)}") from None
        optim_state = None if resets.optimizer else state.get("last_optimizer_state")
        if optim_state is None and not resets.optimizer:
            raise CheckpointError(f"{path} has no optimizer state; pass --reset-optimizer to start a new one")
        try:
            trainer.load_model_and_optimizer_state(state["model"], optim_state, full=not os.path.isdir(path))
        except (RuntimeError, KeyError) as err:
            if optim_state is None or "optimizer state" not in str(err):
                raise
            # Same parameter names and shapes (checked above) but other parameters to optimize: a tying flag
            # such as --share-decoder-input-output-embed differs from the checkpoint's.
            raise CheckpointError(
                f"{path}: its optimizer state does not fit the model's parameters ({str(err).splitlines()[0]}); "
                "the model flags differ from the checkpoint's (e.g. --share-decoder-input-output-embed): resume "
                "with the same flags, or pass --reset-optimizer to keep the weights and start a new optimizer"
            ) from err
        if optimizer_overrides and optim_state is not None:
            apply_optimizer_overrides(trainer.optimizer, optimizer_overrides)
        # after the weights: without a saved EMA, it restarts from them (upstream's rule)
        trainer.load_ema_state(state.get("extra_state") or {}, state["model"])
        if state.get("task_state"):  # the task's own state (none for the built-in tasks)
            trainer.task.load_state_dict(state["task_state"])
        saved = saved_state(state)
        if saved.trainer is not None:
            # As upstream, --reset-optimizer also restarts the update count and the schedule (fine-tuning).
            reset = {"num_updates", "lr_scheduler"} if resets.optimizer else set()
            if resets.lr_scheduler:
                reset.add("lr_scheduler")
            trainer.load_state_dict({k: v for k, v in saved.trainer.items() if k not in reset})
        self.best = saved.best
        if resets.dataloader:
            saved.train_iterator = None
        if resets.meters:
            saved.metrics = None
        logger.info(f"loaded checkpoint {path} ({trainer.num_updates} updates)")
        return saved

    def _alternatives(self, damaged: str) -> str:
        intact = intact_checkpoints(self.ckpt_cfg.save_dir, exclude=damaged)
        if not intact:
            return f"No other intact checkpoint is in {self.ckpt_cfg.save_dir}: start again with another --save-dir"
        names = [os.path.basename(p) for p in intact[:5]]
        more = f" and {len(intact) - 5} more" if len(intact) > 5 else ""
        return (
            f"Intact checkpoints in {self.ckpt_cfg.save_dir}, the most trained first: {', '.join(names)}{more}; "
            f"resume from one with --restore-file {names[0]}"
        )

    def read(self, path: str, trainer, resuming: bool = False, load_optimizer: Optional[bool] = None) -> Dict[str, Any]:
        """Read a checkpoint file or sharded directory and check it fits the model (`resuming`: and that the
        model options are the checkpoint's). `load_optimizer` (default: not --reset-optimizer): whether a
        sharded directory's optimizer shards are read."""
        trust_legacy = self.cfg.common.trust_legacy_checkpoint
        if load_optimizer is None:
            load_optimizer = not self.ckpt_cfg.reset_optimizer
        if os.path.isdir(path):
            model_state, optim_state = trainer.model_and_optimizer_state(full=False)
            state = sharded.load_sharded(
                path,
                model_state,
                optim_state if load_optimizer else None,
                trust_legacy=trust_legacy,
                extra_shards=trainer.ema.state_dict() if trainer.ema is not None else None,
            )
        else:
            state = load_checkpoint_file(path, trust_legacy=trust_legacy)
            if is_legacy_checkpoint(state):
                state = upgrade_legacy_checkpoint(state)
        if resuming:
            check_same_model_options(path, state, self.cfg)
        check_architecture(path, state, model_state_for_checking(trainer.model))
        check_dictionary(path, carried(state), getattr(trainer.task, "source_dictionary", None))
        return state

    def _load_weights_only(self, trainer, path: str):
        found = existing_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"--finetune-from-model {path}: no such checkpoint")
        state = self.read(found, trainer)
        trainer.load_model_and_optimizer_state(state["model"], None, full=not os.path.isdir(found))
        trainer.load_ema_state(state.get("extra_state") or {}, state["model"])
        logger.info(f"loaded model weights from {found} (--finetune-from-model)")


@dataclass(frozen=True)
class RestoreChoice:
    """What a run continues from: `path` (a checkpoint that may not exist yet on a first launch) with the
    `resets` to apply; `finetune`: --finetune-from-model's checkpoint on a first launch (only its weights count)."""

    path: str
    resets: Resets
    finetune: bool = False


def choose_restore(ck, first_launch: Optional[bool] = None) -> RestoreChoice:
    """The one resume rule of fairseq-train and upstream's `checkpoint_utils.load_checkpoint`: --restore-file
    (default save_dir/checkpoint_last{suffix}.pt), which must exist unless it is the default. For the default,
    an intact checkpoint of the run that stores more progress than checkpoint_last (or one there without a
    checkpoint_last, unless --no-last-checkpoints) is resumed instead, saying which and why (paths.newer_than_last:
    a save killed before its copy to checkpoint_last was renamed). Otherwise, on a first launch (no
    checkpoint_last yet; `first_launch` given: the caller probed) --finetune-from-model's checkpoint with
    everything but the weights reset. Collective: rank 0's listing decides."""
    path = resolve_restore_path(ck)
    if ck.restore_file != "checkpoint_last.pt":
        if existing_checkpoint(path) is None:
            raise missing_restore_file(ck.restore_file, path)
        return RestoreChoice(path, Resets.from_config(ck))
    last = existing_checkpoint(path)
    newer = None
    if get_rank() == 0 and (last is not None or not ck.no_last_checkpoints):
        newer = newer_than_last(ck.save_dir, ck.checkpoint_suffix, last)
        if newer is not None:
            logger.info(f"{newer[1]}: resuming from it")
    newer = broadcast_from_master(newer)
    if newer is not None:
        return RestoreChoice(newer[0], Resets.from_config(ck))
    if first_launch is None:
        first_launch = last is None
    if ck.finetune_from_model and first_launch:
        return RestoreChoice(ck.finetune_from_model, Resets(True, True, True, True), finetune=True)
    return RestoreChoice(path, Resets.from_config(ck))


def missing_restore_file(restore_file: str, looked_for: str) -> FileNotFoundError:
    """The error for a --restore-file that names no checkpoint (a fresh start would silently drop it)."""
    return FileNotFoundError(
        f"--restore-file {restore_file}: no such checkpoint (looked for {looked_for}); check "
        "the path or drop the flag to start from scratch"
    )
