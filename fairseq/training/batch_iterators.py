"""The trainer's batch iterators over the task's datasets: the training split's, one per epoch, and one per
--valid-subset. fairseq-train and upstream's `Trainer.get_train_iterator` build them here."""

from typing import List, Tuple

from fairseq.distributed import utils as dist_utils


def trainer_iterator(
    cfg,
    task,
    trainer,
    epoch: int,
    combine: bool = False,
    load_dataset: bool = True,
    data_selector=None,
    shard: bool = True,
    disable_iterator_cache: bool = False,
):
    """The training batch iterator for `epoch` (shards of `DATA` rotate by epoch).

    `combine`: read `train`, `train1`, ... as one split; `load_dataset=False` keeps the split already loaded;
    `data_selector` goes to the task's `load_dataset` (upstream's argument, for tasks that take it); `shard`:
    this data-parallel rank's share of the batches (else all of them). Raises ValueError (one line: the cause
    and the fix) when no training batch is left, or when a validation subset has none: an epoch without
    batches would be followed by the next one, forever. The batch list is the same on every rank (it is built
    before sharding), so every rank raises here together.
    """
    if load_dataset:
        extra = {"combine": True} if combine else {}  # plug-in tasks written without `combine` keep working
        if data_selector is not None:
            extra["data_selector"] = data_selector
        task.load_dataset(cfg.dataset.train_subset, epoch=epoch, for_training=True, **extra)
    epoch_itr = task.get_batch_iterator(
        dataset=task.dataset(cfg.dataset.train_subset),
        max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size,
        # --max-tokens is applied (and named in messages) by get_batch_iterator itself.
        max_positions=trainer.max_positions,
        ignore_invalid_inputs=True,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=dist_utils.get_data_parallel_world_size() if shard else 1,
        shard_id=dist_utils.get_data_parallel_rank() if shard else 0,
        num_workers=cfg.dataset.num_workers,
        epoch=epoch,
        pin_memory=trainer.device.type == "cuda",
        data_buffer_size=cfg.dataset.data_buffer_size,
        **({"disable_iterator_cache": True} if disable_iterator_cache else {}),
    )
    if len(epoch_itr) == 0 or _mostly_skipped(epoch_itr):  # len: batches per rank (0 iff none at all)
        raise ValueError(task.no_batches_message(cfg.dataset.train_subset, epoch_itr, "training"))
    if not cfg.dataset.disable_validation:  # cheap after the first time: the valid iterators are cached
        valid_iterators(cfg, task, trainer)
    return epoch_itr


def _mostly_skipped(epoch_itr) -> bool:
    report = getattr(epoch_itr, "size_report", None)  # a plug-in task's iterator may have none
    return report is not None and report.mostly_dropped


def valid_iterators(cfg, task, trainer) -> List[Tuple[str, object]]:
    """(subset, batch iterator) for each --valid-subset (loaded by the caller).

    Every subset must yield a batch: a validation of nothing has no loss to report, to pick checkpoint_best by
    or to stop early on, so a subset without one is a ValueError naming the cause (checked before training
    starts, by `trainer_iterator`). Every rank has as many validation batches (the iterator pads shards)."""
    subsets = []
    for subset in cfg.dataset.valid_subset.split(","):
        batches = task.get_batch_iterator(
            dataset=task.dataset(subset),
            max_tokens=cfg.dataset.max_tokens_valid or cfg.dataset.max_tokens,
            max_sentences=cfg.dataset.batch_size_valid or cfg.dataset.batch_size,
            max_positions=trainer.max_positions,
            ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
            seed=cfg.common.seed,
            num_shards=dist_utils.get_data_parallel_world_size(),
            shard_id=dist_utils.get_data_parallel_rank(),
            num_workers=cfg.dataset.num_workers,
            epoch=1,
            pin_memory=trainer.device.type == "cuda",
            data_buffer_size=cfg.dataset.data_buffer_size,
        )
        if len(batches.frozen_batches) == 0 or _mostly_skipped(batches):  # the same on every rank (before sharding)
            token_flag = "--max-tokens-valid" if cfg.dataset.max_tokens_valid else "--max-tokens"
            raise ValueError(task.no_batches_message(subset, batches, "validation", token_flag))
        subsets.append((subset, batches))
    return subsets
