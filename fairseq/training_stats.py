"""From an interval's summed statistics to upstream's log-line stats (train_inner, train, valid).

The meters' priorities give upstream's key order: loss, ppl, wps, ups, wpb, bsz, num_updates, lr, gnorm,
clip, loss_scale, train_wall, memory (gb_free ...), wall.
"""

from collections import OrderedDict
from typing import Dict, Optional

from fairseq.logging import metrics
from fairseq.logging.memory import log_memory_stats


def log_train_interval(trainer, sums: Dict[str, float], elapsed: float) -> None:
    """Log one interval's sums into the active aggregators (train_inner and train)."""
    updates = sums.get("updates", 0.0)
    trainer.criterion.reduce_metrics([sums])  # loss (base 2) and ppl, as the criterion defines them
    if elapsed > 0:
        # value/elapsed weighted by elapsed: the epoch line then shows total tokens / total time
        metrics.log_scalar("wps", sums.get("ntokens", 0.0) / elapsed, elapsed, priority=30, round=1)
        metrics.log_scalar("ups", updates / elapsed, elapsed, priority=40, round=2)
    if updates > 0:
        metrics.log_scalar("wpb", sums.get("ntokens", 0.0) / updates, updates, priority=50, round=1)
        metrics.log_scalar("bsz", sums.get("nsentences", 0.0) / updates, updates, priority=60, round=1)
        metrics.log_scalar("gnorm", sums.get("gnorm", 0.0) / updates, updates, priority=90, round=3)
        if "clip" in sums:
            metrics.log_scalar("clip", 100.0 * sums["clip"] / updates, updates, priority=100, round=1)
    metrics.log_scalar("num_updates", trainer.num_updates, weight=0, priority=70)
    metrics.log_scalar("lr", trainer.get_lr(), weight=0, priority=80)
    if trainer.precision.scaler is not None:
        metrics.log_scalar("loss_scale", trainer.precision.loss_scale, weight=0, priority=110, round=4)
    metrics.log_scalar_sum("train_wall", sums.get("train_wall", 0.0), priority=120, round=0)
    if trainer.throughput is not None and elapsed > 0 and updates > 0:
        trainer.throughput.log(sums.get("ntokens", 0.0), elapsed)
    log_memory(trainer)


def log_memory(trainer, start_next_interval: bool = True) -> None:
    """CUDA memory over the interval (a collective: every rank calls it at the same boundary)."""
    if trainer.memory_stats.available:
        log_memory_stats(trainer.memory_stats.interval_stats(start_next_interval))


def _with_wall(stats) -> Dict[str, object]:
    stats = OrderedDict(stats)
    wall = metrics.get_meter("default", "wall")
    if wall is not None:
        stats["wall"] = round(wall.elapsed_time, 0)
    return stats


def train_log_line(aggregator: str, trainer) -> Dict[str, object]:
    try:
        stats = metrics.get_smoothed_values(aggregator)
    except KeyError:
        stats = {}
    return _with_wall(stats)


def log_valid(trainer, sums: Dict[str, float], elapsed: float) -> None:
    trainer.criterion.reduce_metrics([sums])
    if elapsed > 0:
        metrics.log_scalar("wps", sums.get("ntokens", 0.0) / elapsed, elapsed, priority=30, round=1)
    batches = sums.get("batches", 0.0)
    if batches > 0:
        metrics.log_scalar("wpb", sums.get("ntokens", 0.0) / batches, batches, priority=50, round=1)
        metrics.log_scalar("bsz", sums.get("nsentences", 0.0) / batches, batches, priority=60, round=1)
    log_memory(trainer, start_next_interval=False)


def valid_log_line(agg, trainer, ckpt_cfg, best: Optional[float]) -> Dict[str, object]:
    stats = OrderedDict(agg.get_smoothed_values())
    stats["num_updates"] = trainer.num_updates
    metric = ckpt_cfg.best_checkpoint_metric
    if metric in stats:
        value = stats[metric]
        if best is not None:
            value = max(value, best) if ckpt_cfg.maximize_best_checkpoint_metric else min(value, best)
        stats[f"best_{metric}"] = value
    return stats
