"""The training loop of fairseq-train, as a library: start-up (checks, save directory, task, model, criterion,
trainer, resume), then epochs of updates with the validate / save / stop decisions, and preemption.

`train(cfg)` runs on one process what fairseq-train runs on each rank (`fairseq_cli.train.main` is the same
call plus the log file and --user-dir); a Python caller may hand it its own task, model or criterion. For
several processes, launch it as fairseq-train does: `fairseq.distributed.launch.call_main(cfg, main)`.
`train_epoch`, `validate_and_save` and `validate` are its steps. Its log lines keep the logger name
"fairseq_cli.train" that fairseq-train's lines always had.
"""

import logging
import math
import time
from typing import List, Optional, Tuple

import torch

from fairseq import registry
from fairseq.checkpoint.manager import CheckpointManager
from fairseq.checkpoint.vocabulary import check_bpe_files
from fairseq.criterions import build_criterion
from fairseq.data.data_utils import raise_if_valid_subsets_unintentionally_ignored
from fairseq.dataclass.notices import announce_compat_options
from fairseq.distributed import utils as dist_utils
from fairseq.distributed.launch import process_group_timeout
from fairseq.distributed.parallelize import build_model
from fairseq.distributed.tensor_parallel_checks import check_tensor_parallel_dictionary
from fairseq.logging import metrics, progress_bar
from fairseq.logging.log_line import log_train_interval, log_valid, start_wall_clock, train_log_line, valid_log_line
from fairseq.logging.profiler import nvtx_profiling
from fairseq.models.fairseq_model import model_config_line
from fairseq.training.batch_iterators import trainer_iterator, valid_iterators
from fairseq.training.preemption import REQUEUE_FAILED, REQUEUED, Preempted, PreemptionWatcher, requeue_after_preemption
from fairseq.training.trainer import Trainer
from fairseq.data.iterators import GroupedIterator

logger = logging.getLogger("fairseq_cli.train")

__all__ = ["REQUEUED", "REQUEUE_FAILED", "check_input_files", "train", "train_epoch", "validate", "validate_and_save"]


def check_input_files(cfg) -> None:
    """The start-up checks that read files, after validate(cfg) (which reads none) and before anything is
    trained or saved: the dictionary's size against --model-parallel-size, the --bpe files the checkpoints
    will carry. fairseq-train and fairseq-hydra-train run them before spawning, fairseq_cli.train.main for an
    in-process caller."""
    check_tensor_parallel_dictionary(cfg)
    check_bpe_files(cfg.bpe)


def train(cfg, task=None, model=None, criterion=None) -> Optional[str]:
    """Train as fairseq-train does on this process (a single process, or one rank of a launched job); returns
    None when done, REQUEUED (or REQUEUE_FAILED) when a preemption signal stopped training after saving
    checkpoint_last. `task`, `model`, `criterion`: built from `cfg` when not given.
    `cfg` is taken as checked: its front end ran validate(cfg) and check_input_files(cfg) once per job
    (fairseq_cli.train.main runs them for an in-process caller)."""
    # Installed first: a preemption signal during start-up must not kill the job without a requeue.
    preemption = PreemptionWatcher(timeout=process_group_timeout(cfg.distributed_training))
    checkpoints = CheckpointManager(cfg)
    try:
        with nvtx_profiling(cfg.common.profile):
            trainer, task = _start(cfg, checkpoints, task, model, criterion)
            return _run(cfg, trainer, task, checkpoints, preemption)
    finally:
        checkpoints.close()
        preemption.restore()


def _start(cfg, checkpoints, task, model, criterion):
    """Checks, save directory, task, model, criterion and the trainer: everything before the first epoch."""
    if not dist_utils.is_master():
        logging.getLogger().setLevel(logging.WARNING)  # one log, from rank 0
    announce_compat_options(**vars(cfg))
    checkpoints.open_save_dir()  # before any data is read or model built: a bad --save-dir fails now
    metrics.reset()
    torch.manual_seed(cfg.common.seed)

    if task is None:
        task = registry.TASK_REGISTRY.get(cfg.task._name).setup_task(cfg.task)
    checkpoints.carry_vocabulary(task)  # every checkpoint carries the dictionary's fingerprint and --bpe files
    if not cfg.dataset.disable_validation:
        raise_if_valid_subsets_unintentionally_ignored(cfg)
        for subset in cfg.dataset.valid_subset.split(","):  # --combine-valid-subsets: valid, valid1, ... as one
            task.load_dataset(subset, combine=bool(cfg.dataset.combine_valid_subsets), epoch=1)
    model = build_model(cfg, task) if model is None else model
    criterion = build_criterion(cfg.criterion, task, cfg.optimization) if criterion is None else criterion
    logger.info(
        f"task: {type(task).__name__}, model: {type(model).__name__} ({cfg.model._name}), "
        f"criterion: {type(criterion).__name__}"
    )
    notice = getattr(type(model), "config_notice", lambda _: "")(cfg.model)
    if notice:
        logger.info(notice)
    logger.info(model_config_line(model, cfg.model))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        f"num. model params: {num_params:,} (num. trained: "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,})"
    )

    trainer = Trainer(cfg, task, model, criterion)
    logger.info(
        f"training on {dist_utils.get_world_size()} device(s) ({trainer.device.type}); "
        f"max tokens per device = {cfg.dataset.max_tokens} and max sentences per device = "
        f"{cfg.dataset.batch_size}"
    )
    return trainer, task


def _run(cfg, trainer, task, checkpoints, preemption) -> Optional[str]:
    """Resume, then epochs until --max-epoch / --max-update / --stop-min-lr / early stop, or a preemption."""
    resumed = checkpoints.resume(trainer, lambda epoch: trainer_iterator(cfg, task, trainer, epoch))
    epoch_itr = resumed.epoch_itr
    if resumed.at_epoch_end:  # the step an uninterrupted run took after writing that checkpoint
        trainer.step_epoch_end(epoch_itr.epoch - 1, resumed.val_loss)

    max_epoch = cfg.optimization.max_epoch or math.inf
    start = time.time()
    start_wall_clock()
    try:
        while epoch_itr.next_epoch_idx <= max_epoch:
            # An epoch boundary (and the end of start-up): a signal that came while the next epoch's data was
            # loaded stops here, not after its first update. The second call reads the all-reduce the first
            # one started, so a flag raised on any rank before this point is seen now; both calls return the
            # same on every rank, so every rank makes as many calls.
            if preemption.should_stop() or preemption.should_stop():
                checkpoints.save_last(trainer, epoch_itr, metrics_state=metrics.state_dict())
                raise Preempted()
            if trainer.get_lr() <= cfg.optimization.stop_min_lr:
                logger.info(
                    f"stopping training because the learning rate {trainer.get_lr()} fell to "
                    f"--stop-min-lr {cfg.optimization.stop_min_lr}"
                )
                break
            valid_losses, should_stop = train_epoch(cfg, trainer, task, epoch_itr, checkpoints, preemption)
            if should_stop:
                break
            trainer.step_epoch_end(epoch_itr.epoch, valid_losses[0])
            epoch_itr = trainer_iterator(cfg, task, trainer, epoch_itr.next_epoch_idx)
        preemption.drain()
        checkpoints.wait_for_write("at the end of training")  # the last checkpoint is whole before we say done
        if trainer.profiler is not None:
            trainer.profiler.finish()  # training ended inside the profiled range: write what was recorded
    except Preempted:
        logger.warning(f"preempted: saved checkpoint_last at update {trainer.num_updates}")
        requeued = requeue_after_preemption() if dist_utils.is_master() else None
        # Every rank ends as rank 0's requeue went; like the barrier it replaces, this waits for rank 0.
        return REQUEUED if dist_utils.broadcast_from_master(requeued) else REQUEUE_FAILED
    logger.info(f"done training in {time.time() - start:.1f} seconds")
    return None


def _progress(cfg, itr, epoch=None, prefix=None):
    master = dist_utils.is_master()
    return progress_bar.progress_bar(
        itr,
        log_format=cfg.common.log_format,
        log_interval=cfg.common.log_interval,
        epoch=epoch,
        prefix=prefix,
        default_log_format="simple" if cfg.common.no_progress_bar else "tqdm",
        tensorboard_logdir=cfg.common.tensorboard_logdir if master else None,
        wandb_project=cfg.common.wandb_project if master else None,
    )


def train_epoch(cfg, trainer, task, epoch_itr, checkpoints, preemption) -> Tuple[List[Optional[float]], bool]:
    """One epoch of updates (or until a stop decision); returns (the last validation losses, should stop)."""
    epoch = epoch_itr.next_epoch_idx
    itr = epoch_itr.next_epoch_itr(shuffle=epoch > cfg.dataset.curriculum)
    freqs = cfg.optimization.update_freq
    update_freq = freqs[epoch - 1] if epoch <= len(freqs) else freqs[-1]
    itr = GroupedIterator(itr, update_freq)
    progress = _progress(cfg, itr, epoch=epoch_itr.epoch)
    trainer.begin_epoch(epoch_itr.epoch)
    valid_losses, should_stop = [None], False
    interval_start = time.perf_counter()
    profiler = trainer.profiler
    with metrics.aggregate("train"), metrics.aggregate("train_inner"):
        for samples in progress:
            updates_before = trainer.num_updates
            if profiler is not None:
                profiler.before_update(updates_before + 1)
            trainer.train_step(samples, epoch_itr)
            checkpoints.poll_write()  # a background write that failed stops training here, at the next update
            num_updates = trainer.num_updates
            if profiler is not None:
                profiler.after_update(num_updates)
            stepped = num_updates != updates_before  # False when fp16 overflow skipped the update
            end_of_epoch = not itr.has_next()
            if not (stepped or end_of_epoch):
                continue
            at_log = (stepped and num_updates % cfg.common.log_interval == 0) or end_of_epoch
            if at_log and num_updates > 0:
                now = time.perf_counter()
                log_train_interval(trainer, trainer.read_train_stats(), now - interval_start)
                interval_start = now
                if num_updates % cfg.common.log_interval == 0:
                    progress.log(train_log_line("train_inner", trainer), tag="train_inner", step=num_updates)
                    metrics.reset_meters("train_inner")
            valid_losses, should_stop = validate_and_save(
                cfg, trainer, task, epoch_itr, checkpoints, end_of_epoch, preemption
            )
            if should_stop:
                break
            if preemption.should_stop():
                checkpoints.save_last(trainer, epoch_itr, metrics_state=metrics.state_dict())
                raise Preempted()
        if trainer.train_stats:  # a stop mid-interval: fold what is left into the epoch line
            log_train_interval(trainer, trainer.read_train_stats(), time.perf_counter() - interval_start)
    progress.print(train_log_line("train", trainer), tag="train", step=trainer.num_updates)
    metrics.reset_meters("train")
    metrics.reset_meters("train_inner")
    return valid_losses, should_stop


def _should_stop(cfg, trainer) -> bool:
    """--max-update reached, or --stop-time-hours passed (on any rank: every rank stops at the same update)."""
    num_updates = trainer.num_updates
    max_update = cfg.optimization.max_update or math.inf
    should_stop = False
    if num_updates >= max_update:
        should_stop = True
        logger.info(f"stopping training: num_updates {num_updates} >= max_update {max_update}")
    if cfg.optimization.stop_time_hours > 0:
        # Ranks must stop at the same update: take the largest clock (one small all-reduce, only with this flag).
        clock = torch.tensor(trainer.cumulative_training_time() / 3600, dtype=torch.float64, device=trainer.device)
        hours = dist_utils.all_reduce_max(clock).item()
        if hours > cfg.optimization.stop_time_hours:
            should_stop = True
            logger.info(f"stopping training: {hours:.2f} h >= --stop-time-hours {cfg.optimization.stop_time_hours}")
    return should_stop


def validate_and_save(cfg, trainer, task, epoch_itr, checkpoints, end_of_epoch: bool, preemption=None):
    """After an update: stop, validate and save as the flags say; returns (validation losses, should stop)."""
    num_updates = trainer.num_updates
    should_stop = _should_stop(cfg, trainer)
    ck, ds = cfg.checkpoint, cfg.dataset
    do_save = (
        (end_of_epoch and epoch_itr.epoch % ck.save_interval == 0)
        or should_stop
        or (
            ck.save_interval_updates > 0
            and num_updates > 0
            and num_updates % ck.save_interval_updates == 0
            and num_updates >= ds.validate_after_updates
        )
    )
    do_validate = (
        (
            (not end_of_epoch and do_save)
            or (end_of_epoch and epoch_itr.epoch % ds.validate_interval == 0)
            or should_stop
            or (
                ds.validate_interval_updates > 0 and num_updates > 0 and num_updates % ds.validate_interval_updates == 0
            )
        )
        and not ds.disable_validation
        and num_updates >= ds.validate_after_updates
    )
    valid_losses = [None]
    if do_validate:
        valid_losses = validate(cfg, trainer, task, epoch_itr, checkpoints, preemption)
    should_stop |= checkpoints.should_stop_early(valid_losses[0])
    if do_save or should_stop:
        checkpoints.save(trainer, epoch_itr, valid_losses[0], end_of_epoch, metrics_state=metrics.state_dict())
    return valid_losses, should_stop


def validate(cfg, trainer, task, epoch_itr, checkpoints, preemption=None) -> List[Optional[float]]:
    """The validation loss on each --valid-subset (fairseq.training.batch_iterators.valid_iterators: each must yield a
    batch). With `preemption`, a stop signal is honoured at every validation batch: checkpoint_last is saved
    and Preempted raised. Every rank has as many validation batches (the iterator pads shards), so all ranks
    pass the same boundaries.
    """
    subsets = valid_iterators(cfg, task, trainer)
    trainer.begin_valid_epoch(epoch_itr.epoch)
    if cfg.dataset.fixed_validation_seed is not None:  # the next update re-seeds from its update count
        torch.manual_seed(cfg.dataset.fixed_validation_seed)
    valid_losses = []
    for subset, batches in subsets:
        itr = batches.next_epoch_itr(shuffle=False)
        progress = _progress(cfg, itr, epoch=epoch_itr.epoch, prefix=f"valid on '{subset}' subset")
        start = time.perf_counter()
        done, stopped = 0, False  # batches validated; whether a stop signal was agreed on
        with metrics.aggregate(new_root=True) as agg:
            for i, sample in enumerate(progress):
                if cfg.dataset.max_valid_steps is not None and i >= cfg.dataset.max_valid_steps:
                    break
                trainer.valid_step(sample, batches)
                done = i + 1
                if preemption is not None and preemption.should_stop():
                    stopped = True
                    break
            if done and not stopped:
                log_valid(trainer, trainer.read_valid_stats(), time.perf_counter() - start)
                stats = valid_log_line(agg, trainer, cfg.checkpoint, checkpoints.best)
        if stopped:
            # The interrupted validation is not redone on resume (the data position is after the last update).
            logger.warning(f"stopping validation on '{subset}' after {done} of {len(itr)} batches for preemption")
            checkpoints.save_last(trainer, epoch_itr, metrics_state=metrics.state_dict())
            raise Preempted()
        if not done:  # --max-valid-steps 0: no loss to report (rather than a NaN one)
            logger.warning(
                f"validation on '{subset}' ran no batch (--max-valid-steps "
                f"{cfg.dataset.max_valid_steps}): no valid loss"
            )
            valid_losses.append(None)
            continue
        progress.print(stats, tag=subset, step=trainer.num_updates)
        valid_losses.append(stats.get(cfg.checkpoint.best_checkpoint_metric))
    return valid_losses
