"""fairseq-validate: the criterion's loss of a trained model on --valid-subset splits (upstream's command).

    fairseq-validate data-bin --path checkpoints/checkpoint_best.pt --task language_modeling \
        --valid-subset valid,test --max-tokens 4096

prints, per subset, upstream's line `valid on 'valid' subset | loss 5.12 | ppl 34.7 | wps ... | wpb ... | bsz ...`
(loss in base 2, from the checkpoint's --criterion; wps the tokens per second of the whole subset, wpb and bsz
the tokens and sentences per batch of --max-tokens / --batch-size, as fairseq-train's valid line has them). The model and its task come from the checkpoint; the task flags given on the command line
and --model-overrides change the saved config (upstream's override rule). Batches are sharded over the
processes of a distributed launch and the sums all-reduced.
"""

import argparse
import ast
import contextlib
import logging
import time
from typing import Dict, List, Optional

import torch

from fairseq.frontend import options
from fairseq.checkpoint.inference import load_model_ensemble_and_task
from fairseq.data.batching import resolve_limit, resolve_max_positions
from fairseq.data.block_positions import check_blocks_fit
from fairseq.dataclass.flag_values import task_block_options
from fairseq.dataclass.batch_flags import check_batch_flags
from fairseq.distributed import utils as dist_utils
from fairseq.distributed.launch import call_main
from fairseq.logging import metrics, progress_bar
from fairseq.logging.log_line import log_valid_sums
from fairseq.logging.logging_outputs import LoggingOutputSums
from fairseq.training.precision import compute_dtype
from fairseq.registry import import_user_module
from fairseq.training.trainer import move_to_device
from fairseq_cli.console import run_console_script

logger = logging.getLogger("fairseq_cli.validate")


def main(cfg, override_args: Optional[argparse.Namespace] = None) -> Dict[str, Dict[str, float]]:
    """Validate; returns {subset: the printed statistics}. `cfg` is a FairseqConfig or the namespace of
    parse_args_and_arch; `override_args` holds the flags given on the command line (they override the
    checkpoint's saved config)."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_config(cfg)
    progress_bar.setup_logging(cfg.common.log_file)
    if cfg.common.user_dir:
        import_user_module(cfg.common.user_dir)
    check_batch_flags(cfg, required=True)
    if not cfg.common_eval.path:
        raise ValueError("no checkpoint given: pass --path CHECKPOINT.pt (or a sharded checkpoint directory)")
    device = (
        torch.device("cpu")
        if cfg.common.cpu or not torch.cuda.is_available()
        else torch.device("cuda", cfg.distributed_training.device_id)
    )
    overrides = _overrides(cfg, override_args)

    logger.info(f"loading model(s) from {cfg.common_eval.path}")
    models, saved_cfg, task = load_model_ensemble_and_task(
        [cfg.common_eval.path],
        arg_overrides=overrides,
        suffix=cfg.checkpoint.checkpoint_suffix,
        trust_legacy_checkpoint=cfg.common.trust_legacy_checkpoint,
    )
    model = models[0].to(device).eval()
    criterion = task.build_criterion(saved_cfg.criterion if saved_cfg.criterion is not None else cfg.criterion)
    criterion.to(device).eval()

    results = {}
    for subset in cfg.dataset.valid_subset.split(","):
        task.load_dataset(subset, combine=bool(cfg.dataset.combine_valid_subsets), epoch=1, task_cfg=saved_cfg.task)
        results[subset] = validate_subset(cfg, task, model, criterion, subset, device)
    return results


def _overrides(cfg, override_args: Optional[argparse.Namespace]) -> Dict:
    overrides = dict(vars(override_args)) if override_args is not None else {}
    try:
        model_overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    except (ValueError, SyntaxError):
        model_overrides = None
    if not isinstance(model_overrides, dict):
        raise ValueError(f"--model-overrides must be a Python dict literal, got {cfg.common_eval.model_overrides!r}")
    overrides.update(model_overrides)
    return overrides


@torch.no_grad()
def validate_subset(cfg, task, model, criterion, subset: str, device: torch.device) -> Dict[str, float]:
    """Run the criterion over `subset` (at most --max-valid-steps batches), print and return upstream's line.
    Blocks longer than the model are refused by eval-lm's rule (block_positions), naming the fix."""
    task_cfg = getattr(task, "cfg", None)
    if not cfg.dataset.skip_invalid_size_inputs_valid_test and task_block_options(task_cfg)[0] is not None:
        check_blocks_fit(
            task.dataset(subset).sizes, resolve_limit(task.max_positions(), model.max_positions()), subset, task_cfg
        )
    batches = task.get_batch_iterator(
        dataset=task.dataset(subset),
        max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=dist_utils.get_world_size(),
        shard_id=dist_utils.get_rank(),
        num_workers=cfg.dataset.num_workers,
        data_buffer_size=cfg.dataset.data_buffer_size,
    )
    if len(batches.frozen_batches) == 0:
        raise ValueError(task.no_batches_message(subset, batches, "validation"))
    itr = batches.next_epoch_itr(shuffle=False)
    progress = progress_bar.progress_bar(
        itr,
        log_format=cfg.common.log_format,
        log_interval=cfg.common.log_interval,
        prefix=f"valid on '{subset}' subset",
        default_log_format="simple" if cfg.common.no_progress_bar else "tqdm",
    )
    dtype = compute_dtype(cfg.common)
    sums, step, started = LoggingOutputSums(), 0, time.perf_counter()
    for step, sample in enumerate(progress):
        if cfg.dataset.max_valid_steps is not None and step >= cfg.dataset.max_valid_steps:
            break
        if not sample:  # a rank past the end of its shard: nothing to add
            continue
        sample = move_to_device(sample, device)
        with torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
            _, _, logging_output = task.valid_step(sample, model, criterion)
        sums.add({**logging_output, "batches": 1})
    totals = sums.reduce(all_reduce=True, device=device)  # every rank's tokens, over this rank's time
    with metrics.aggregate(new_root=True) as agg:
        log_valid_sums(criterion, totals, time.perf_counter() - started)
        stats = agg.get_smoothed_values()
    progress.print(stats, tag=subset, step=step)
    return dict(stats)


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_validation_parser()
    args = options.parse_args_and_arch(parser, argv)
    # Only the flags given on the command line override the checkpoint's config (upstream's rule).
    override_args = options.parse_args_and_arch(options.get_validation_parser(), argv, suppress_defaults=True)
    cfg = options.convert_namespace_to_config(args)
    try:
        check_batch_flags(cfg, required=True)
    except ValueError as e:
        parser.error(str(e))
    call_main(cfg, main, override_args=override_args)


def console_main() -> None:
    run_console_script("fairseq-validate", cli_main)


if __name__ == "__main__":
    console_main()
