"""The one builder of training and validation log lines (train_inner, train, valid) and their key order.

An interval's summed statistics (from the train step), the criterion's loss keys, throughput and CUDA
memory go into the active aggregators here and nowhere else; `train_log_line`/`valid_log_line` return the
ordered record the progress bar prints. Upstream's `fairseq.metrics` stays the plug-in-facing API: a
criterion's `reduce_metrics` logs its loss keys there (default priority 10: first in the line, as upstream).

The order of a line is ORDER below, written once; upstream's line is loss, ppl, wps, ups, wpb, bsz,
num_updates, lr, gnorm, clip, loss_scale, train_wall, then this fork's save_blocked/save_wall (in lines whose
interval saved a checkpoint), tflops/mfu and memory keys, ema_decay (--store-ema), wall.
"""

from collections import OrderedDict
from typing import Dict, Optional

from fairseq.logging import metrics

# key -> priority: meters print in increasing priority (ties in the order they were first logged).
ORDER: Dict[str, int] = {
    "wps": 30,
    "ups": 40,
    "wpb": 50,
    "bsz": 60,
    "num_updates": 70,
    "lr": 80,
    "gnorm": 90,
    "clip": 100,
    "loss_scale": 110,
    "train_wall": 120,
    # seconds of checkpoint saves (fairseq.checkpoint.manager): training blocked, and the write from start to end
    "save_blocked": 122,
    "save_wall": 123,
    "tflops": 130,
    "mfu": 131,
    # CUDA memory (fairseq.logging.memory): gb_free is upstream's key and place; the others sit beside it
    "memory": 1500,
    "ema_decay": 10000,  # --store-ema: upstream's priority, after memory (wall is appended after everything)
}
WALL_PRIORITY = 790  # the run's wall clock meter; printed last (see _with_wall)
# Meters of one run's own work, left out when a resume restores the meters of a checkpoint written mid-epoch:
# the seconds of the saves before it are not this run's, and would show in its first log line.
RUN_ONLY_METERS = ("save_blocked", "save_wall")


def without_run_only_meters(state: Dict[str, list]) -> Dict[str, list]:
    """`metrics.state_dict()`'s {aggregator: [(priority, key, class, state), ...]} without RUN_ONLY_METERS."""
    return {
        name: [m for m in meters if not (isinstance(m, (list, tuple)) and len(m) > 1 and m[1] in RUN_ONLY_METERS)]
        for name, meters in state.items()
    }


def start_wall_clock() -> None:
    """The `wall` meter of the whole run (the "default" aggregator is never reset)."""
    metrics.log_start_time("wall", priority=WALL_PRIORITY, round=0)


def log_train_interval(trainer, sums: Dict[str, float], elapsed: float) -> None:
    """Log one interval's sums into the active aggregators (train_inner and train)."""
    updates = sums.get("updates", 0.0)
    trainer.criterion.reduce_metrics([sums])  # loss (base 2) and ppl, as the criterion defines them
    if elapsed > 0:
        # value/elapsed weighted by elapsed: the epoch line then shows total tokens / total time
        metrics.log_scalar("wps", sums.get("ntokens", 0.0) / elapsed, elapsed, priority=ORDER["wps"], round=1)
        metrics.log_scalar("ups", updates / elapsed, elapsed, priority=ORDER["ups"], round=2)
    if updates > 0:
        _per_batch(sums, updates)
        metrics.log_scalar("gnorm", sums.get("gnorm", 0.0) / updates, updates, priority=ORDER["gnorm"], round=3)
        if "clip" in sums:
            metrics.log_scalar("clip", 100.0 * sums["clip"] / updates, updates, priority=ORDER["clip"], round=1)
    metrics.log_scalar("num_updates", trainer.num_updates, weight=0, priority=ORDER["num_updates"])
    metrics.log_scalar("lr", trainer.get_lr(), weight=0, priority=ORDER["lr"])
    if trainer.precision.scaler is not None:
        metrics.log_scalar("loss_scale", trainer.precision.loss_scale, weight=0, priority=ORDER["loss_scale"], round=4)
    metrics.log_scalar_sum("train_wall", sums.get("train_wall", 0.0), priority=ORDER["train_wall"], round=0)
    if trainer.throughput is not None and elapsed > 0 and updates > 0:
        for key, value in trainer.throughput.interval_values(sums.get("ntokens", 0.0), elapsed).items():
            metrics.log_scalar(key, value, elapsed, priority=ORDER[key], round=1)  # time-weighted
    log_memory(trainer)
    ema = trainer.ema
    if ema is not None and updates > 0:
        # The decay the EMA used at the interval's last update (0 before --ema-start-update). Weight 0: every
        # line shows the latest value, as upstream's per-update log_scalar does.
        metrics.log_scalar("ema_decay", ema.get_decay(), weight=0, priority=ORDER["ema_decay"], round=5)


def log_checkpoint_times(blocked: Optional[float] = None, written: Optional[float] = None) -> None:
    """A save's seconds into the active aggregators, so into the next train_inner line and the epoch's train
    line (sums over the interval): `blocked`, how long training stopped for it (a wait for the write before it
    included); `written`, how long its write took from its start to its last rename, counted when the write
    completes (a background write: at the update that sees it done). Upstream logs neither."""
    if blocked is not None:
        metrics.log_scalar_sum("save_blocked", blocked, priority=ORDER["save_blocked"], round=2)
    if written is not None:
        metrics.log_scalar_sum("save_wall", written, priority=ORDER["save_wall"], round=2)


def log_valid(trainer, sums: Dict[str, float], elapsed: float) -> None:
    log_valid_sums(trainer.criterion, sums, elapsed)
    log_memory(trainer, start_next_interval=False)


def log_valid_sums(criterion, sums: Dict[str, float], elapsed: float) -> None:
    """A validation's summed statistics (with "batches", their count) over `elapsed` seconds: the criterion's
    loss keys, wps (tokens per second of the whole validation), wpb and bsz per batch (fairseq-train's valid
    line, fairseq-validate's)."""
    criterion.reduce_metrics([sums])
    if elapsed > 0:
        metrics.log_scalar("wps", sums.get("ntokens", 0.0) / elapsed, elapsed, priority=ORDER["wps"], round=1)
    batches = sums.get("batches", 0.0)
    if batches > 0:
        _per_batch(sums, batches)


def _per_batch(sums: Dict[str, float], count: float) -> None:
    metrics.log_scalar("wpb", sums.get("ntokens", 0.0) / count, count, priority=ORDER["wpb"], round=1)
    metrics.log_scalar("bsz", sums.get("nsentences", 0.0) / count, count, priority=ORDER["bsz"], round=1)


def log_memory(trainer, start_next_interval: bool = True) -> None:
    """CUDA memory over the interval (a collective: every rank calls it at the same boundary)."""
    if trainer.memory_stats.available:
        log_memory_stats(trainer.memory_stats.interval_stats(start_next_interval))


def log_memory_stats(stats: Dict[str, float]) -> None:
    """Log `CudaMemoryStats.interval_stats()` output into the active aggregators.

    Within one log interval every meter shows the interval's value; over an epoch ("train") peaks show
    the epoch's maximum, free memory its minimum, retries their sum and current values the latest.
    """
    priority = ORDER["memory"]
    for key, value in stats.items():
        if key.startswith("max_"):
            metrics.log_max(key, value, priority=priority, round=1)
        elif key in ("cuda_gb_free", "gb_free"):
            metrics.log_min(key, value, priority=priority, round=1)
        elif key == "cuda_alloc_retries":
            metrics.log_scalar_sum(key, value, priority=priority)
        else:
            metrics.log_scalar(key, value, weight=0, priority=priority, round=1)


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
